{{/*
The Ray cluster of a RayService or a RayJob (RayClusterSpec, ray.io/v1): a CPU head and one GPU
worker group sized from an interlace ClusterConfig mapping.
Arguments: dict "root" $ "cluster" <ClusterConfig mapping> "autoscaling" <mapping or nil>
"component" "serve"|"sweep" "where" <values path, for errors>.
*/}}
{{- define "interlace.rayClusterSpec" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $w := $v.workers -}}
{{- $serve := eq .component "serve" -}}
{{- $fixed := ((.cluster | default dict).replicas) | default 1 -}}
{{- $min := $fixed -}}
{{- $max := $fixed -}}
{{- if .autoscaling -}}
{{- $min = .autoscaling.min_replicas | default 1 -}}
{{- $max = .autoscaling.max_replicas | default 1 -}}
{{- end -}}
{{- $args := dict "cluster" .cluster "gpusPerWorker" $w.gpusPerWorker "where" .where -}}
{{- $minPods := include "interlace.workerPods" (merge (dict "replicas" $min) $args) | int -}}
{{- $maxPods := include "interlace.workerPods" (merge (dict "replicas" $max) $args) | int -}}
{{- if not (kindIs "invalid" $w.replicas) -}}
{{- $minPods = int $w.replicas -}}
{{- $maxPods = int $w.replicas -}}
{{- end -}}
{{- $labels := merge (dict "app.kubernetes.io/component" .component) (include "interlace.selectorLabels" $root | fromYaml) -}}
{{- $sweepVolume := and (not $serve) (include "interlace.sweepVolumeClaim" $root) -}}
rayVersion: {{ $v.rayVersion | quote }}
authOptions:
  mode: {{ ternary "token" "disabled" $v.rayAuth.enabled }}
  {{- if $v.rayAuth.enabled }}
  secretName: {{ include "interlace.rayAuthSecretName" $root }}
  {{- end }}
enableInTreeAutoscaling: {{ ne $minPods $maxPods }}
{{- if ne $minPods $maxPods }}
autoscalerOptions:
  idleTimeoutSeconds: {{ $v.autoscaler.idleTimeoutSeconds }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  resources:
    {{- toYaml $v.autoscaler.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
{{- end }}
headGroupSpec:
  serviceType: ClusterIP
  enableIngress: false
  rayStartParams:
    dashboard-host: "0.0.0.0"
    metrics-export-port: "8080"
    {{- range $k, $val := $v.head.rayStartParams }}
    {{ $k }}: {{ $val | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- toYaml (merge (dict) $v.head.podLabels $labels) | nindent 8 }}
      {{- $annotations := deepCopy ($v.head.podAnnotations | default dict) }}
      {{- if and $serve $v.metrics.scrapeAnnotations }}
      {{- $_ := set $annotations "prometheus.io/scrape" "true" }}
      {{- $_ := set $annotations "prometheus.io/port" (toString $v.serve.port) }}
      {{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
      {{- end }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "interlace.podSpecCommon" $root | nindent 6 }}
      {{- with $v.head.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.head.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.head.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-head
          image: {{ include "interlace.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - {name: gcs-server, containerPort: 6379}
            - {name: dashboard, containerPort: 8265}
            - {name: client, containerPort: 10001}
            - {name: serve, containerPort: {{ $v.serve.port }}}
            - {name: metrics, containerPort: 8080}
          resources:
            {{- toYaml $v.head.resources | nindent 12 }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          {{- with include "interlace.containerEnv" (dict "root" $root "env" $v.head.env "serve" $serve) | trim }}
          {{- . | nindent 10 }}
          {{- end }}
          {{- with include "interlace.volumeMounts" (dict "root" $root "serve" $serve "head" true "sweepVolume" $sweepVolume) | trim }}
          volumeMounts:
            {{- . | nindent 12 }}
          {{- end }}
      {{- with include "interlace.volumes" (dict "root" $root "serve" $serve "head" true "sweepVolume" $sweepVolume) | trim }}
      volumes:
        {{- . | nindent 8 }}
      {{- end }}
workerGroupSpecs:
  - groupName: {{ $w.groupName }}
    replicas: {{ $minPods }}
    minReplicas: {{ $minPods }}
    maxReplicas: {{ $maxPods }}
    rayStartParams:
      num-gpus: {{ $w.gpusPerWorker | toString | quote }}
      metrics-export-port: "8080"
      {{- range $k, $val := $w.rayStartParams }}
      {{ $k }}: {{ $val | toString | quote }}
      {{- end }}
    template:
      metadata:
        labels:
          {{- toYaml (merge (dict) $w.podLabels $labels) | nindent 10 }}
        {{- with $w.podAnnotations }}
        annotations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      spec:
        {{- include "interlace.podSpecCommon" $root | nindent 8 }}
        {{- with $w.nodeSelector }}
        nodeSelector:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $w.tolerations }}
        tolerations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $w.affinity }}
        affinity:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "interlace.image" $root }}
            imagePullPolicy: {{ $v.image.pullPolicy }}
            ports:
              - {name: serve, containerPort: {{ $v.serve.port }}}
              - {name: metrics, containerPort: 8080}
            {{- $gpu := dict $w.gpuResource ($w.gpusPerWorker | toString) }}
            resources:
              requests:
                {{- toYaml (merge (dict) $gpu ($w.resources.requests | default dict)) | nindent 16 }}
              limits:
                {{- toYaml (merge (dict) $gpu ($w.resources.limits | default dict)) | nindent 16 }}
            securityContext:
              {{- toYaml $v.securityContext | nindent 14 }}
            {{- with include "interlace.containerEnv" (dict "root" $root "env" $w.env "serve" $serve) | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $serve }}
            {{- $port := int $v.serve.port }}
            {{- if $v.probes.liveness.enabled }}
            startupProbe:
              httpGet: {path: /healthz, port: {{ $port }}}
              {{- toYaml $v.probes.startup | nindent 14 }}
            livenessProbe:
              httpGet: {path: /healthz, port: {{ $port }}}
              {{- toYaml (omit $v.probes.liveness "enabled") | nindent 14 }}
            {{- end }}
            readinessProbe:
              httpGet: {path: /readyz, port: {{ $port }}}
              {{- toYaml $v.probes.readiness | nindent 14 }}
            {{- end }}
            volumeMounts:
              - {name: dshm, mountPath: /dev/shm}
              {{- with include "interlace.volumeMounts" (dict "root" $root "serve" $serve "head" false "sweepVolume" $sweepVolume) | trim }}
              {{- . | nindent 14 }}
              {{- end }}
        volumes:
          - name: dshm
            emptyDir: {medium: Memory, sizeLimit: {{ $w.shmSize }}}
          {{- with include "interlace.volumes" (dict "root" $root "serve" $serve "head" false "sweepVolume" $sweepVolume) | trim }}
          {{- . | nindent 10 }}
          {{- end }}
{{- end -}}

{{/* Environment of a Ray container: the values' env, and the object-store Secret for sweeps. */}}
{{- define "interlace.containerEnv" -}}
{{- $v := .root.Values -}}
{{- with .env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and (not .serve) $v.sweep.objectStoreSecret }}
envFrom:
  - secretRef: {name: {{ $v.sweep.objectStoreSecret }}}
{{- end }}
{{- end -}}

{{/* The PVC a sweep mounts ("" when its output and inputs need none). */}}
{{- define "interlace.sweepVolumeClaim" -}}
{{- $s := .Values.sweep -}}
{{- if $s.storage.pvc.existingClaim -}}
{{- $s.storage.pvc.existingClaim -}}
{{- else if and $s.storage.pvc.create (not (include "interlace.isURL" ($s.config.output | default "" | toString))) -}}
{{- printf "%s-sweeps" (include "interlace.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "interlace.volumeMounts" -}}
{{- $v := .root.Values -}}
{{- if and .serve $v.apiTokens.existingSecret }}
- {name: api-tokens, mountPath: {{ $v.apiTokens.mountPath }}, readOnly: true}
{{- end }}
{{- if and (not .serve) .head }}
- {name: sweep-config, mountPath: /etc/interlace/sweep, readOnly: true}
{{- end }}
{{- if .sweepVolume }}
- {name: sweep-data, mountPath: {{ $v.sweep.storage.mountPath }}}
{{- end }}
{{- with $v.workers.volumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "interlace.volumes" -}}
{{- $v := .root.Values -}}
{{- if and .serve $v.apiTokens.existingSecret }}
- name: api-tokens
  secret:
    secretName: {{ $v.apiTokens.existingSecret }}
    items: [{key: {{ $v.apiTokens.key }}, path: {{ $v.apiTokens.key }}}]
{{- end }}
{{- if and (not .serve) .head }}
- name: sweep-config
  configMap: {name: {{ include "interlace.fullname" .root }}-{{ $v.sweep.name }}}
{{- end }}
{{- if .sweepVolume }}
- name: sweep-data
  persistentVolumeClaim: {claimName: {{ .sweepVolume }}}
{{- end }}
{{- with $v.workers.volumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
