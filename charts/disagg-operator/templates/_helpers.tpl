{{/*
Chart name, truncated to the 63 characters of a DNS label.
*/}}
{{- define "disagg-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: "<release>-<chart name>", or the release name when it already contains the chart name.
*/}}
{{- define "disagg-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart label value: name-version.
*/}}
{{- define "disagg-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "disagg-operator.labels" -}}
helm.sh/chart: {{ include "disagg-operator.chart" . }}
{{ include "disagg-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: disagg
{{- end }}

{{/*
Selector labels.
*/}}
{{- define "disagg-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Name of the operator's ServiceAccount.
*/}}
{{- define "disagg-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
"true" when the replicas coordinate through kopf peering (more than one replica).
*/}}
{{- define "disagg-operator.peering" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{/*
Name of the (Cluster)KopfPeering object.
*/}}
{{- define "disagg-operator.peeringName" -}}
{{- default (include "disagg-operator.fullname" .) .Values.peering.name }}
{{- end }}

{{/*
Operator image reference.
*/}}
{{- define "disagg-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
