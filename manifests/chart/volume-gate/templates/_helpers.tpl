{{/* The image: [registry/]repository:tag, pinned @digest when one is given. */}}
{{- define "volume-gate.image" -}}
{{- $i := .Values.image -}}
{{- if not $i.repository }}{{ fail "image.repository is empty: set it to the volume-gate image's repository (cozystack/volume-gate; the registry is image.registry)" }}{{ end -}}
{{- if not $i.tag }}{{ fail "image.tag is empty: set it to the volume-gate version (and image.digest to pin it)" }}{{ end -}}
{{- $name := $i.repository -}}
{{- with $i.registry }}{{ $name = printf "%s/%s" (trimSuffix "/" .) $i.repository }}{{ end -}}
{{- if $i.digest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" $i.digest) }}{{ fail (printf "image.digest %q is not sha256:<64 hex digits>" $i.digest) }}{{ end -}}
{{ $name }}:{{ $i.tag }}@{{ $i.digest }}
{{- else -}}
{{ $name }}:{{ $i.tag }}
{{- end -}}
{{- end }}

{{/* The labels a role's selectors match: never changed by a value (a
Deployment's selector cannot change on upgrade). (dict "component" C), C
empty for objects of no one role. */}}
{{- define "volume-gate.selectorLabels" -}}
app.kubernetes.io/name: volume-gate
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* Every object's labels: the selector labels and Helm's standard ones
(tests/chart.rs, RELEASE_LABELS). (dict "ctx" $ "component" C). */}}
{{- define "volume-gate.labels" -}}
{{ include "volume-gate.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* A role's Pod template metadata: its labels with `podLabels` (a
selector label refused), its annotations with `podAnnotations`.
(dict "ctx" $ "component" C "role" VALUES "name" "webhook"|"worker"). */}}
{{- define "volume-gate.podMetadata" -}}
{{- $labels := include "volume-gate.labels" . | fromYaml -}}
{{- $selector := include "volume-gate.selectorLabels" . | fromYaml -}}
{{- range $k, $v := .role.podLabels -}}
{{- if hasKey $selector $k }}{{ fail (printf "%s.podLabels: %q is a selector label of the %s's Pods (%s); a Deployment's selector cannot change on upgrade: use another key" $.name $k $.name (toJson $selector)) }}{{ end -}}
{{- $_ := set $labels $k (toString $v) -}}
{{- end -}}
{{- $annotations := dict -}}
{{- range $k, $v := .role.podAnnotations }}{{ $_ := set $annotations $k (toString $v) }}{{ end -}}
{{- if .ctx.Values.profile }}{{ $_ := set $annotations "checksum/profile" (toYaml .ctx.Values.profile | sha256sum) }}{{ end -}}
labels:
  {{- toYaml $labels | nindent 2 }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Where a Pod runs: image pull secrets, priority class, node selector,
tolerations, affinity (the role's, or else the default: spread over nodes,
when "spreadOver" names the component), topology spread constraints.
(dict "ctx" $ "role" VALUES "spreadOver" C "spread" BOOL). The uninstall
hook's Job takes the worker's values without the spread (one Pod). */}}
{{- define "volume-gate.placement" -}}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .role.affinity }}
affinity:
  {{- toYaml .role.affinity | nindent 2 }}
{{- else if .spreadOver }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "volume-gate.selectorLabels" (dict "component" .spreadOver) | nindent 14 }}
{{- end }}
{{- if and .spread .role.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml .role.topologySpreadConstraints | nindent 2 }}
{{- end }}
{{- end }}

{{/* A role's PodDisruptionBudget: at most one Pod evicted at a time, so a
drain always goes on (one Pod at a time); none for a single replica, where
any budget would block every drain. (dict "ctx" $ "component" C "replicas" N). */}}
{{- define "volume-gate.pdb" -}}
{{- if gt (int .replicas) 1 }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: volume-gate-{{ .component }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "volume-gate.labels" . | nindent 4 }}
spec:
  maxUnavailable: 1
  selector:
    matchLabels:
      {{- include "volume-gate.selectorLabels" . | nindent 6 }}
{{- end }}
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
