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
{{- with include "volume-gate.managementCsi" .ctx }}{{ $_ := set $annotations "checksum/profile" (include "volume-gate.profileData" $.ctx | sha256sum) }}{{ end -}}
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

{{/* The built-in profile the chart installs for (platform.profile), checked
once, and checked against a `base` the profile value names: the webhook
configurations and RBAC follow platform.profile, so the two must agree. */}}
{{- define "volume-gate.platform" -}}
{{- $name := .Values.platform.profile | default "cozystack" -}}
{{- if not (has $name (list "cozystack" "cluster-api")) }}{{ fail (printf "platform.profile %q: use cozystack (a Cozystack tenant's HelmRelease) or cluster-api (a Cluster API Cluster opted in by the label volumes.cozystack.io/protected: \"true\")" $name) }}{{ end -}}
{{- $base := (include "volume-gate.profileFields" . | fromYaml).base -}}
{{- if and $base (ne (toString $base) $name) }}{{ fail (printf "profile names base: %v but platform.profile is %q: the webhook configurations and RBAC follow platform.profile; set platform.profile=%v (and leave base out of profile)" $base $name $base) }}{{ end -}}
{{ $name }}
{{- end }}

{{/* The profile value's fields, as a YAML mapping (empty when none). */}}
{{- define "volume-gate.profileFields" -}}
{{- $p := .Values.profile -}}
{{- if $p -}}
{{- $fields := $p -}}
{{- if kindIs "string" $p }}{{ $fields = fromYaml $p }}{{ end -}}
{{- if or (not (kindIs "map" $fields)) (hasKey $fields "Error") }}{{ fail (printf "profile is not a YAML mapping of profile fields (README, Configuration): %v" (get $fields "Error")) }}{{ end -}}
{{ toYaml $fields }}
{{- end -}}
{{- end }}

{{/* The profile file both roles and the uninstall hook read (--profile),
empty when none ships (Cozystack's built-in profile): the profile value as
given, or, for platform.profile cluster-api, `base: cluster-api` with the
value's fields over it. */}}
{{- define "volume-gate.profileData" -}}
{{- $platform := include "volume-gate.platform" . -}}
{{- $p := .Values.profile -}}
{{- if eq $platform "cluster-api" -}}
{{- $fields := include "volume-gate.clusterApiFields" . | fromYaml | default dict -}}
{{ toYaml (set $fields "base" "cluster-api") }}
{{- else if $p -}}
{{- if kindIs "string" $p }}{{ $p }}{{ else }}{{ toYaml $p }}{{ end -}}
{{- end -}}
{{- end }}

{{/* The usernames that replace a parent whole, for the custody webhook's
condition: platform.parentReplacers (Cozystack; checked with the other
platform identities), or the profile's writers.parentReplacers (cluster-api:
none unless the profile names them). Each is written into a CEL string
literal, so a quote is refused. */}}
{{- define "volume-gate.parentReplacers" -}}
{{- if eq (include "volume-gate.platform" .) "cluster-api" -}}
{{- $r := dig "writers" "parentReplacers" list (include "volume-gate.profileFields" . | fromYaml | default dict) -}}
{{- range $r }}
{{- if or (not (kindIs "string" .)) (ne . (trim .)) (eq . "") }}{{ fail (printf "profile writers.parentReplacers: %v is not a username (system:serviceaccount:<namespace>:<name>)" .) }}{{ end -}}
{{- if contains "'" . }}{{ fail (printf "profile writers.parentReplacers: %q: a username with a quote cannot be written into a webhook condition" .) }}{{ end -}}
{{- end -}}
{{ toYaml $r }}
{{- else -}}
{{- $_ := include "volume-gate.releaseControllers" . -}}
{{ toYaml .Values.platform.parentReplacers }}
{{- end -}}
{{- end }}

{{/* platform.clusterApi.managementCsi, checked once, as YAML (empty when
not enabled): a management-side CSI controller, its identity and the
DataVolumes it makes (kubevirt-csi-driver's split deployment). Its names
and labels are written into webhook conditions and selectors, so only
name characters are allowed besides {tenant}. */}}
{{- define "volume-gate.managementCsi" -}}
{{- $m := dig "clusterApi" "managementCsi" dict .Values.platform -}}
{{- if $m.enabled -}}
{{- if ne (include "volume-gate.platform" .) "cluster-api" }}{{ fail "platform.clusterApi.managementCsi.enabled needs platform.profile=cluster-api (Cozystack's profile guards its KubeVirt CSI controller, R-kcsi-controller, already)" }}{{ end -}}
{{- range $what := list "controller" "identity" }}
{{- $n := toString (get $m $what) }}
{{- if not (regexMatch "^[a-z0-9.-]*\\{tenant\\}[a-z0-9.-]*$" $n) }}{{ fail (printf "platform.clusterApi.managementCsi.%s %q: a name with {tenant} once, standing for the Cluster's name (default %s), otherwise lowercase letters, digits, '-' and '.'" $what $n (ternary "{tenant}-kubevirt-csi-controller" "{tenant}-kubevirt-csi" (eq $what "controller"))) }}{{ end -}}
{{- end }}
{{- $labels := $m.infraClusterLabels | default (dict "csi-driver/cluster" "{tenant}") -}}
{{- $m = set (deepCopy $m) "infraClusterLabels" $labels -}}
{{- $named := false -}}
{{- range $k, $v := $labels }}
{{- if not (regexMatch "^([a-z0-9]([a-z0-9.-]*[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$" $k) }}{{ fail (printf "platform.clusterApi.managementCsi.infraClusterLabels: %q is not a label key" $k) }}{{ end -}}
{{- if not (regexMatch "^[A-Za-z0-9._-]*(\\{tenant\\})?[A-Za-z0-9._-]*$" (toString $v)) }}{{ fail (printf "platform.clusterApi.managementCsi.infraClusterLabels.%s %q: a label value, with {tenant} at most once" $k $v) }}{{ end -}}
{{- if contains "{tenant}" (toString $v) }}{{ $named = true }}{{ end -}}
{{- end }}
{{- if not $named }}{{ fail "platform.clusterApi.managementCsi.infraClusterLabels must name the Cluster: at least one label whose value contains {tenant} (the driver's --infra-cluster-labels, e.g. csi-driver/cluster: \"{tenant}\")" }}{{ end -}}
{{ toYaml $m }}
{{- end -}}
{{- end }}

{{/* The Cluster API profile's fields: the profile value's, and what
platform.clusterApi.managementCsi adds (its guarded entries, appended by
extraGuarded, and the infra layer of its DataVolumes). */}}
{{- define "volume-gate.clusterApiFields" -}}
{{- $fields := include "volume-gate.profileFields" . | fromYaml | default dict -}}
{{- with include "volume-gate.managementCsi" . | fromYaml }}
{{- if hasKey $fields "infra" }}{{ fail "profile names infra and platform.clusterApi.managementCsi is enabled: the management-side CSI controller's DataVolumes are the infra layer; leave infra out of profile (set its labels in platform.clusterApi.managementCsi.infraClusterLabels)" }}{{ end -}}
{{- $identity := "the identity the cluster's CSI controller frees disks with" -}}
{{- $extra := list
  (dict "role" "the cluster's CSI controller, which frees its volumes from the management cluster" "group" "apps" "kind" "Deployment" "name" .controller)
  (dict "role" $identity "group" "" "kind" "ServiceAccount" "name" .identity)
  (dict "role" $identity "group" "rbac.authorization.k8s.io" "kind" "Role" "name" .identity)
  (dict "role" $identity "group" "rbac.authorization.k8s.io" "kind" "RoleBinding" "name" .identity) -}}
{{- $_ := set $fields "extraGuarded" (concat ($fields.extraGuarded | default list) $extra) -}}
{{- $_ := set $fields "infra" (dict "group" "cdi.kubevirt.io" "version" "v1beta1" "kind" "DataVolume" "plural" "datavolumes" "labels" .infraClusterLabels) -}}
{{- end }}
{{- if $fields }}{{ toYaml $fields }}{{ end -}}
{{- end }}

{{/* CEL: oldObject's name fits `pattern` ({tenant} once): what is before
{tenant} starts it, what is after ends it. */}}
{{- define "volume-gate.cel.namedLike" -}}
{{- $parts := splitList "{tenant}" .pattern -}}
{{- $c := list -}}
{{- with index $parts 0 }}{{ $c = append $c (printf "oldObject.metadata.name.startsWith('%s')" .) }}{{ end -}}
{{- with index $parts 1 }}{{ $c = append $c (printf "oldObject.metadata.name.endsWith('%s')" .) }}{{ end -}}
{{- if $c }}({{ join " && " $c }}){{ else }}true{{ end -}}
{{- end }}
