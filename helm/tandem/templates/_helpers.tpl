{{/*
Names and labels. The TandemDeployment is named after the release (fullname);
the operator names everything it creates from it (<td>-router, <td>-prefill,
<td>-kvstore-master ...) and labels its pods with `tandem.dev/deployment: <td>`
and `app.kubernetes.io/component` (operators/manifests.py): the selectors below
use those two labels. Kept to 40 characters so the operator's longest names
(<td>-kvstore-client plus pod suffixes) stay within Kubernetes' limits.
*/}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
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
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ include "tandem.chart" .root }}
tandem.dev/deployment: {{ include "tandem.fullname" .root }}
{{- end -}}

{{/* Selector of the pods of one component the operator runs; (dict "root" $ "component" "x"). */}}
{{- define "tandem.operandSelector" -}}
tandem.dev/deployment: {{ include "tandem.fullname" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Selector of the chart's own operator pods. */}}
{{- define "tandem.operatorSelector" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
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

{{/* One engine pool of the TandemDeployment's spec; (dict "root" $ "pool" .Values.prefill). */}}
{{- define "tandem.pool" -}}
{{- $pool := .pool -}}
{{- $rdma := .root.Values.rdma -}}
replicas: {{ $pool.replicas }}
minReplicas: {{ $pool.minReplicas }}
maxReplicas: {{ $pool.maxReplicas }}
gpusPerPod: {{ $pool.gpusPerPod }}
nodesPerReplica: {{ $pool.nodesPerReplica }}
parallelism:
  {{- toYaml $pool.parallelism | nindent 2 }}
shmSize: {{ $pool.shmSize }}
rdma: {{ $rdma.enabled }}
terminationGracePeriodSeconds: {{ $pool.terminationGracePeriodSeconds }}
{{- with $pool.engineArgs }}
engineArgs:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $env := $pool.env }}
{{- if $rdma.enabled }}
{{- $env = concat $pool.env $rdma.env }}
{{- end }}
{{- with $env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $resources := deepCopy $pool.resources }}
{{- if $rdma.enabled }}
{{- $_ := set $resources "requests" (merge (deepCopy $rdma.resources) (default (dict) $resources.requests)) }}
{{- $_ := set $resources "limits" (merge (deepCopy $rdma.resources) (default (dict) $resources.limits)) }}
{{- end }}
{{- with $resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $pool.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
