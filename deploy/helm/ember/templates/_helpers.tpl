{{/* The chart's names and labels, and the pieces the Deployment and the StatefulSet share. */}}

{{- define "ember.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ember.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "ember.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "ember.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ember.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ember.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ember.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ember.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ember.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "ember.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}

{{- define "ember.headlessName" -}}
{{- printf "%s-ranks" (include "ember.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The server's environment: the chart's own variables, then `settings` as EMBER_*, then extraEnv. */}}
{{- define "ember.env" -}}
- name: EMBER_HOSTNAME
  value: "0.0.0.0"
- name: EMBER_PORT
  value: "3000"
- name: EMBER_GRACEFUL_TERMINATION_TIMEOUT
  value: {{ .Values.gracefulTerminationTimeout | toString | quote }}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value }}
- name: EMBER_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "ember.apiKeySecret" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- range $name, $value := .Values.settings }}
{{- if not (or (kindIs "invalid" $value) (eq (toString $value) "")) }}
- name: {{ printf "EMBER_%s" (upper $name) }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "ember.resources" -}}
{{- $resources := deepCopy (default dict .Values.resources) -}}
{{- if gt (int .Values.gpu.count) 0 -}}
{{- $limits := default dict $resources.limits -}}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.gpu.count) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "ember.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ add (int .Values.gracefulTerminationTimeout) 15 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
