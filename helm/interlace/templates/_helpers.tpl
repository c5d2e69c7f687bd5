{{/* Names, labels and the derived parts (interlace configs, worker group sizes) of the chart. */}}

{{- define "interlace.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* At most 40 characters: KubeRay names Services and pods "<name>-head-svc", "<name>-<hash>-gpu-worker-...". */}}
{{- define "interlace.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "interlace.selectorLabels" -}}
app.kubernetes.io/name: {{ include "interlace.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "interlace.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "interlace.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "interlace.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "interlace.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "interlace.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "interlace.rayAuthSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "interlace.fullname" .)) -}}
{{- end -}}

{{- define "interlace.isURL" -}}
{{- if contains "://" . }}true{{ end -}}
{{- end -}}

{{/*
The ServeConfig the application receives as its Serve args: interlace.serve with the pod's
listening address and, when the tokens Secret is mounted, its file. cluster/helm_values.py builds
the same config from the same values (tests/test_helm.py compares them).
*/}}
{{- define "interlace.serveConfig" -}}
{{- $cfg := deepCopy (.Values.interlace.serve | default dict) -}}
{{- $_ := set $cfg "host" "0.0.0.0" -}}
{{- $_ := set $cfg "port" (int .Values.serve.port) -}}
{{- if .Values.apiTokens.existingSecret -}}
{{- $auth := deepCopy ($cfg.auth | default dict) -}}
{{- $_ := set $auth "tokens_file" (printf "%s/%s" (trimSuffix "/" .Values.apiTokens.mountPath) .Values.apiTokens.key) -}}
{{- $_ := set $cfg "auth" $auth -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* A sweep path as the pods see it: URLs and absolute paths as written, others under the volume. */}}
{{- define "interlace.sweepPath" -}}
{{- $p := .path -}}
{{- if or (include "interlace.isURL" $p) (hasPrefix "/" $p) -}}
{{- $p -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .base) (trimPrefix "./" $p) -}}
{{- end -}}
{{- end -}}

{{/* The SweepConfig the RayJob runs: sweep.config with its relative paths read from the volume. */}}
{{- define "interlace.sweepConfig" -}}
{{- $cfg := deepCopy .Values.sweep.config -}}
{{- $base := .Values.sweep.storage.mountPath -}}
{{- if kindIs "string" $cfg.output -}}
{{- $_ := set $cfg "output" (include "interlace.sweepPath" (dict "path" $cfg.output "base" $base)) -}}
{{- end -}}
{{- if and (kindIs "map" $cfg.input) (kindIs "slice" $cfg.input.paths) -}}
{{- $paths := list -}}
{{- range $cfg.input.paths -}}
{{- $paths = append $paths (include "interlace.sweepPath" (dict "path" . "base" $base)) -}}
{{- end -}}
{{- $_ := set $cfg.input "paths" $paths -}}
{{- end -}}
{{- if and (kindIs "map" $cfg.intervention) (kindIs "slice" $cfg.intervention.ops) -}}
{{- $ops := list -}}
{{- range $cfg.intervention.ops -}}
{{- $op := . -}}
{{- if and (kindIs "map" .) (kindIs "map" .value) (kindIs "string" .value.file) -}}
{{- $value := merge (dict "file" (include "interlace.sweepPath" (dict "path" .value.file "base" $base))) .value -}}
{{- $op = merge (dict "value" $value) . -}}
{{- end -}}
{{- $ops = append $ops $op -}}
{{- end -}}
{{- $_ := set $cfg.intervention "ops" $ops -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
Worker pods that `replicas` engine replicas of a ClusterConfig mapping need: a replica's
tensor_parallel_size x pipeline_parallel_size ranks share one pod where it holds them
(interlace.cluster.placement), and a pod of gpusPerWorker GPUs holds floor(gpusPerWorker /
(tensor_parallel_size x pipeline_parallel_size x num_gpus)) replicas. A replica larger than a pod
takes ceil(ranks / ranks per pod) pods of its own, its ranks packed onto them (the Serve app and
sweeps alike).
Arguments: dict "cluster" "replicas" "gpusPerWorker" "where" (the values path, for errors).
*/}}
{{- define "interlace.workerPods" -}}
{{- $c := .cluster -}}
{{- if not (kindIs "map" $c) -}}
{{- fail (printf "%s.cluster is %v: write the cluster's fields inline (model, replicas, resources...) so the chart can size the GPU workers" .where $c) -}}
{{- end -}}
{{- $model := $c.model -}}
{{- if not (kindIs "map" $model) -}}
{{- fail (printf "%s.cluster.model is %v: write the model's fields inline (name, source, tensor_parallel_size, pipeline_parallel_size) so the chart can size the GPU workers" .where $model) -}}
{{- end -}}
{{- $tp := $model.tensor_parallel_size | default 1 | float64 -}}
{{- $pp := $model.pipeline_parallel_size | default 1 | float64 -}}
{{- $gpus := (($c.resources | default dict).num_gpus) | default 0 | float64 -}}
{{- if le $gpus 0.0 -}}
{{- fail (printf "%s.cluster.resources.num_gpus is %v: every engine rank needs a GPU on the GPU workers; set num_gpus: 1" .where $gpus) -}}
{{- end -}}
{{- if and (ne $gpus (floor $gpus)) (or (gt (mulf $tp $pp) 1.0) (gt $gpus 1.0)) -}}
{{- fail (printf "%s.cluster.resources.num_gpus is %v with tensor_parallel_size x pipeline_parallel_size = %v: vLLM gives every rank a GPU of its own, so the ranks of one replica cannot share GPUs; use a whole number of GPUs per rank, or a fraction below 1 for one-rank replicas that share a GPU" .where $gpus (mulf $tp $pp)) -}}
{{- end -}}
{{- $perPod := .gpusPerWorker | float64 -}}
{{- $replica := mulf (mulf $tp $pp) $gpus -}}
{{- if gt $replica $perPod -}}
{{- $ranksPerPod := floor (divf $perPod $gpus) -}}
{{- if lt $ranksPerPod 1.0 -}}
{{- fail (printf "%s: one rank needs num_gpus = %v GPUs but workers.gpusPerWorker is %v; raise gpusPerWorker to at least %v" .where $gpus $perPod $gpus) -}}
{{- end -}}
{{- mul (.replicas | int) (ceil (divf (mulf $tp $pp) $ranksPerPod) | int) -}}
{{- else -}}
{{- $replicasPerPod := floor (divf $perPod $replica) -}}
{{- ceil (divf (.replicas | float64) $replicasPerPod) | int -}}
{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by every Ray pod. */}}
{{- define "interlace.podSpecCommon" -}}
serviceAccountName: {{ include "interlace.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
