{{/* The image: repository:tag, pinned @digest when one is given. */}}
{{- define "volume-gate.image" -}}
{{- $i := .Values.image -}}
{{- if not $i.repository }}{{ fail "image.repository is empty: set it to the volume-gate image's repository" }}{{ end -}}
{{- if not $i.tag }}{{ fail "image.tag is empty: set it to the volume-gate version (and image.digest to pin it)" }}{{ end -}}
{{- if $i.digest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" $i.digest) }}{{ fail (printf "image.digest %q is not sha256:<64 hex digits>" $i.digest) }}{{ end -}}
{{ $i.repository }}:{{ $i.tag }}@{{ $i.digest }}
{{- else -}}
{{ $i.repository }}:{{ $i.tag }}
{{- end -}}
{{- end }}

{{/* The certificate mode, checked once. */}}
{{- define "volume-gate.certMode" -}}
{{- $m := .Values.certificates.mode -}}
{{- if not (has $m (list "cert-manager" "secret")) }}{{ fail (printf "certificates.mode %q: use cert-manager, or secret (with certificates.caBundle)" $m) }}{{ end -}}
{{ $m }}
{{- end }}

{{/* Where the profile is mounted, when there is one. */}}
{{- define "volume-gate.profilePath" -}}
/etc/volume-gate/profile/profile.yaml
{{- end }}

{{/* The release controller's usernames, checked once: the release-status
webhook sends every status write by anyone else, so an empty list would
refuse Flux its own status writes on every HelmRelease. */}}
{{- define "volume-gate.releaseControllers" -}}
{{- $c := .Values.platform.releaseControllers -}}
{{- if not $c }}{{ fail "platform.releaseControllers is empty: name the username Flux's helm-controller runs as (Cozystack: system:serviceaccount:cozy-fluxcd:flux), or every HelmRelease status write is refused" }}{{ end -}}
{{- range (concat $c .Values.platform.parentSourceWriters .Values.platform.parentReplacers) }}
{{- if or (not (kindIs "string" .)) (ne . (trim .)) (eq . "") }}{{ fail (printf "platform: %v is not a username (system:serviceaccount:<namespace>:<name>)" .) }}{{ end -}}
{{- if contains "'" . }}{{ fail (printf "platform: %q: a username with a quote cannot be written into a webhook condition" .) }}{{ end -}}
{{- end -}}
{{ toYaml $c }}
{{- end }}

{{/* A list of usernames as a CEL list literal. */}}
{{- define "volume-gate.celList" -}}
[{{ range $i, $u := . }}{{ if $i }}, {{ end }}'{{ $u }}'{{ end }}]
{{- end }}
