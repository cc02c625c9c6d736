{{/* What every webhook of the gate shares: review version, no side
effects, its failure policy, the timeout, and where the API server calls
it (the Service; the CA from certificates.caBundle in secret mode, from
cert-manager's cainjector otherwise). (dict "ctx" $ "path" "/validate"|"/mutate"
"failurePolicy" "Fail"|"Ignore"). */}}
{{- define "volume-gate.webhookHead" -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: {{ .failurePolicy }}
matchPolicy: Equivalent
timeoutSeconds: {{ int .ctx.Values.webhook.timeoutSeconds }}
clientConfig:
  service:
    name: volume-gate-webhook
    namespace: {{ .ctx.Release.Namespace }}
    path: {{ .path }}
    port: 443
  {{- if eq (include "volume-gate.certMode" .ctx) "secret" }}
  caBundle: {{ .ctx.Values.certificates.caBundle }}
  {{- end }}
{{- end }}

{{/* The parents' conditions on DELETE and CREATE, the same for every
platform: a DELETE of a parent not in custody (one in custody is always
allowed: the finalizer holds it), a CREATE that carries record annotations. */}}
{{- define "volume-gate.parentDeleteAndCreate" -}}
- name: delete-without-custody
  expression: >-
    request.operation != 'DELETE' ||
    !('volumes.cozystack.io/release' in oldObject.metadata.?finalizers.orValue([]))
- name: create-with-record
  expression: >-
    request.operation != 'CREATE' ||
    object.metadata.?annotations.orValue({}).exists(k, k.startsWith('volumes.cozystack.io/'))
{{- end }}

{{/* CEL: an UPDATE that removes the custody finalizer (adding it, as the
worker's backfill does, needs no judge). */}}
{{- define "volume-gate.cel.custodyRemoved" -}}
(('volumes.cozystack.io/release' in oldObject.metadata.?finalizers.orValue([])) &&
!('volumes.cozystack.io/release' in object.metadata.?finalizers.orValue([])))
{{- end }}

{{/* CEL: an UPDATE that adds, changes or removes a record annotation. */}}
{{- define "volume-gate.cel.recordChanged" -}}
object.metadata.?annotations.orValue({}).exists(k, k.startsWith('volumes.cozystack.io/') &&
object.metadata.?annotations[?k] != oldObject.metadata.?annotations[?k]) ||
oldObject.metadata.?annotations.orValue({}).exists(k, k.startsWith('volumes.cozystack.io/') &&
object.metadata.?annotations[?k] != oldObject.metadata.?annotations[?k])
{{- end }}

{{/* The machines' conditions (Cluster API's cluster-name label, and
spec.clusterName, its own immutable link), the same for every platform: an
UPDATE matches when the old or the new object has either, and is sent only
when it changes one. */}}
{{- define "volume-gate.machineConditions" -}}
- name: of-a-cluster
  expression: >-
    [object, oldObject].exists(o, o != null &&
    ('cluster.x-k8s.io/cluster-name' in o.metadata.?labels.orValue({}) ||
    o.spec.?clusterName.orValue('') != ''))
- name: delete-or-cluster-name-change
  expression: >-
    request.operation == 'DELETE' ||
    object.metadata.?labels[?'cluster.x-k8s.io/cluster-name'] != oldObject.metadata.?labels[?'cluster.x-k8s.io/cluster-name'] ||
    object.spec.?clusterName != oldObject.spec.?clusterName
{{- end }}

{{/* The custody webhook's condition, the same for every platform: writes
that lack the finalizer, change the override, or are a replacer's that
drop what the gate keeps (the record, and its mirror under the "visible"
prefix where the platform has one). (dict "ctx" $ "visible" PREFIX). */}}
{{- define "volume-gate.custodyCondition" -}}
- name: custody-missing-override-changed-or-replaced
  expression: >-
    (request.operation == 'UPDATE' &&
    request.userInfo.username in {{ include "volume-gate.celList" (include "volume-gate.parentReplacers" .ctx | fromYamlArray) }} &&
    ((('volumes.cozystack.io/release' in oldObject.metadata.?finalizers.orValue([])) &&
    !('volumes.cozystack.io/release' in object.metadata.?finalizers.orValue([]))) ||
    oldObject.metadata.?annotations.orValue({}).exists(k,
    {{ with .visible }}(k.startsWith('volumes.cozystack.io/') || k.startsWith('{{ . }}volumes.cozystack.io/')){{ else }}k.startsWith('volumes.cozystack.io/'){{ end }} &&
    !(k in object.metadata.?annotations.orValue({}))))) ||
    (!('volumes.cozystack.io/release' in object.metadata.?finalizers.orValue([])) &&
    (request.operation == 'CREATE' || !('volumes.cozystack.io/release' in oldObject.metadata.?finalizers.orValue([])))) ||
    (request.operation == 'UPDATE' &&
    object.metadata.?annotations[?'volumes.cozystack.io/override'] != oldObject.metadata.?annotations[?'volumes.cozystack.io/override']) ||
    (request.operation == 'CREATE' && has(object.metadata.annotations) && 'volumes.cozystack.io/override' in object.metadata.annotations)
{{- end }}
