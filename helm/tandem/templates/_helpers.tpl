{{/*
Names and labels. The TandemDeployment is named after the release (fullname);
the operator names everything it creates from it (<td>-router, <td>-prefill,
<td>-kvstore-master ...) and labels its pods with `tandem.dev/deployment: <td>`
and `app.kubernetes.io/component` (operators/manifests.py): the selectors below
use those two labels. Kept to 40 characters so the operator's longest names
(<td>-kvstore-client plus pod suffixes) stay within Kubernetes' limits.
*/}}
{{- define "tandem.fullname" -}}
{{- if hasKey . "modelFullname" -}}
{{- .modelFullname -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of an object the chart renders; call with (dict "root" $ "component" "x"). */}}
{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .root.Release.Name | quote }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service | quote }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/component: {{ .component | quote }}
helm.sh/chart: {{ include "tandem.chart" .root | quote }}
tandem.dev/deployment: {{ include "tandem.fullname" .root | quote }}
{{- end -}}

{{/* Selector of the pods of one component the operator runs; (dict "root" $ "component" "x"). */}}
{{- define "tandem.operandSelector" -}}
tandem.dev/deployment: {{ include "tandem.fullname" .root | quote }}
app.kubernetes.io/component: {{ .component | quote }}
{{- end -}}

{{/* Selector of the chart's own operator pods. */}}
{{- define "tandem.operatorSelector" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* repository:tag, the tag defaulting to the chart's appVersion; (dict "root" $ "image" .Values.images.x). */}}
{{- define "tandem.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "tandem.apiKeysSecret" -}}
{{- if .Values.router.apiKeys.existingSecret -}}
{{- .Values.router.apiKeys.existingSecret -}}
{{- else if .Values.router.apiKeys.keys -}}
{{- printf "%s-api-keys" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* A monitor's interval and scrapeTimeout: the component's, else the global ones. */}}
{{- define "tandem.scrape" -}}
interval: {{ default .root.Values.monitoring.interval .component.interval }}
scrapeTimeout: {{ default .root.Values.monitoring.scrapeTimeout .component.scrapeTimeout }}
{{- end -}}

{{/*
One engine pool of the TandemDeployment's spec; (dict "root" $ "role" "prefill" "pool" .Values.prefill).
The pool's values are the CRD's pool (values.schema.json is generated from it)
and pass through as they are, less empty lists, maps and strings; the chart adds rdma
(rdma.enabled) and, with it, the RDMA env and resources, and podGroup (podGroups.type).
*/}}
{{- define "tandem.pool" -}}
{{- $rdma := .root.Values.rdma -}}
{{- $pool := dict -}}
{{- range $key, $value := .pool }}
{{- if eq $key "probes" }}
{{- $given := dict }}
{{- range $probe, $fields := $value }}
{{- if $fields }}
{{- $_ := set $given $probe $fields }}
{{- end }}
{{- end }}
{{- $value = $given }}
{{- end }}
{{- if not (and (or (kindIs "slice" $value) (kindIs "map" $value) (kindIs "string" $value)) (empty $value)) }}
{{- $_ := set $pool $key $value }}
{{- end }}
{{- end }}
{{- $_ := set $pool "rdma" $rdma.enabled }}
{{- if .root.Values.podGroups.type }}
{{- $_ := set $pool "podGroup" (printf "%s-%s" (include "tandem.fullname" .root) .role) }}
{{- end }}
{{- if $rdma.enabled }}
{{- with concat (default (list) .pool.env) $rdma.env }}
{{- $_ := set $pool "env" . }}
{{- end }}
{{- $resources := deepCopy (default (dict) .pool.resources) }}
{{- $_ := set $resources "requests" (merge (deepCopy $rdma.resources) (default (dict) $resources.requests)) }}
{{- $_ := set $resources "limits" (merge (deepCopy $rdma.resources) (default (dict) $resources.limits)) }}
{{- $_ := set $pool "resources" $resources }}
{{- end }}
{{- toYaml $pool }}
{{- end -}}

{{/* The Secret holding the router-engine mTLS files: the user's, else the one cert-manager issues. */}}
{{- define "tandem.grpcTlsSecret" -}}
{{- default (printf "%s-grpc-tls" (include "tandem.fullname" .)) .Values.grpcTls.existingSecret -}}
{{- end -}}

{{/* The DNS name the engines' certificate carries and the routers check. */}}
{{- define "tandem.grpcTlsServerName" -}}
{{- default (printf "%s-engine" (include "tandem.fullname" .)) .Values.grpcTls.serverName -}}
{{- end -}}

{{/* The Secret holding the Hugging Face token: the user's, the chart's, or none. */}}
{{- define "tandem.hfTokenSecret" -}}
{{- if .Values.model.hfToken.existingSecret -}}
{{- .Values.model.hfToken.existingSecret -}}
{{- else if .Values.model.hfToken.token -}}
{{- printf "%s-hf-token" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The claim an hf:// model is downloaded into: the user's, the chart's, or none. */}}
{{- define "tandem.modelCache" -}}
{{- if .Values.model.cache.existingClaim -}}
{{- .Values.model.cache.existingClaim -}}
{{- else if .Values.model.cache.create -}}
{{- printf "%s-model-cache" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
The models this release serves, each a TandemDeployment: the first from these
values, then one per extraModels entry, whose values are the release's with
the entry merged over them (maps key by key, lists replaced). Each model is a
root like `$` (Values, Release, Chart, Files, Capabilities, Template) whose
fullname is <fullname>-<name> for an entry. A template returns only text, so
this fills `models` of the dict it is given: (dict "root" $).
*/}}
{{- define "tandem.models" -}}
{{- $root := .root -}}
{{- $fullname := include "tandem.fullname" $root -}}
{{- $models := list $root -}}
{{- if and $root.Values.extraModels (not $root.Values.redis.managed) }}
{{- fail "extraModels need redis.managed: the routers of two models would share the external Redis's keys (their sessions and loads)" }}
{{- end }}
{{- range $entry := $root.Values.extraModels }}
{{- $name := printf "%s-%s" $fullname $entry.name }}
{{- if gt (len $name) 40 }}
{{- fail (printf "extraModels %s: the TandemDeployment's name %s is longer than 40 characters (the operator names its objects after it): shorten the name or the release's" $entry.name $name) }}
{{- end }}
{{- $values := mergeOverwrite (deepCopy $root.Values) (deepCopy (omit $entry "name")) }}
{{- /* An entry's model.path replaces the release's source, not only its path. */}}
{{- if hasKey (default dict $entry.model) "path" }}
{{- $_ := set $values.model "source" "" }}
{{- end }}
{{- /* Two store clients on one node must not share the disk tier's folder. */}}
{{- if not (dig "kvStore" "disk" "hostPath" "" $entry) }}
{{- $_ := set $values.kvStore.disk "hostPath" (printf "%s-%s" $root.Values.kvStore.disk.hostPath $entry.name) }}
{{- end }}
{{- /* Nor may two Ingresses claim one host: an entry's Ingress is its own. */}}
{{- if not (dig "router" "ingress" "" $entry) }}
{{- $_ := set $values.router.ingress "enabled" false }}
{{- end }}
{{- $model := dict "Values" $values "Release" $root.Release "Chart" $root.Chart "Files" $root.Files "Capabilities" $root.Capabilities "Template" $root.Template "modelFullname" $name }}
{{- $models = append $models $model }}
{{- end }}
{{- $_ := set . "models" $models -}}
{{- end -}}
