{{/* Names ------------------------------------------------------------------------------- */}}

{{- define "dflash-trt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dflash-trt.fullname" -}}
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

{{- define "dflash-trt.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dflash-trt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dflash-trt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dflash-trt.labels" -}}
helm.sh/chart: {{ include "dflash-trt.chart" . }}
{{ include "dflash-trt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference
{{- end }}

{{- define "dflash-trt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dflash-trt.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Topology ---------------------------------------------------------------------------- */}}

{{/* GPUs of one model instance: tp × pp. */}}
{{- define "dflash-trt.worldSize" -}}
{{- mul (int .Values.parallel.tp) (int .Values.parallel.pp) }}
{{- end }}

{{/* Deployment, StatefulSet or LeaderWorkerSet: workload.kind, or (auto) a LeaderWorkerSet when
     one instance needs more GPUs than one pod has. */}}
{{- define "dflash-trt.kind" -}}
{{- $kind := .Values.workload.kind }}
{{- if eq $kind "auto" }}
{{- if and (gt (int .Values.gpu.count) 0) (gt (int (include "dflash-trt.worldSize" .)) (int .Values.gpu.count)) }}LeaderWorkerSet{{ else }}Deployment{{ end }}
{{- else }}{{ $kind }}{{ end }}
{{- end }}

{{/* Pods per LeaderWorkerSet group. */}}
{{- define "dflash-trt.groupSize" -}}
{{- div (int (include "dflash-trt.worldSize" .)) (max 1 (int .Values.gpu.count)) }}
{{- end }}

{{/* The LeaderWorkerSet's name, never the client Service's: LWS uses its own name as the pods'
     subdomain and creates that headless Service (publishing not-ready pods) only if no Service of
     that name exists (CreateHeadlessServiceIfNotExists, kubernetes-sigs/lws
     pkg/utils/controller/controller_utils.go @ 060ab4d). Short enough that
     "<lws>-<group>-<worker>" stays a valid host name. */}}
{{- define "dflash-trt.lwsName" -}}
{{- printf "%s-lws" (include "dflash-trt.fullname" . | trunc 48 | trimSuffix "-") }}
{{- end }}

{{/* Checks the schema cannot express; each fails the render with the value to change. */}}
{{- define "dflash-trt.validate" -}}
{{- $v := .Values }}
{{- $world := int (include "dflash-trt.worldSize" .) }}
{{- $gpus := int $v.gpu.count }}
{{- $kind := include "dflash-trt.kind" . }}
{{- if hasKey $v "compile" }}
{{- fail "compile: removed — the chart compiles nothing at pod start: the serving path (TensorRT-LLM's PyTorch backend) loads the bundle's Hugging Face checkpoints; drop the compile block from your values (build any opt-in engines with dflash-trt build on a GPU machine)" }}
{{- end }}
{{- if gt (int $v.parallel.ep) (int $v.parallel.tp) }}
{{- fail (printf "parallel.ep %d must divide parallel.tp %d" (int $v.parallel.ep) (int $v.parallel.tp)) }}
{{- end }}
{{- if eq $gpus 0 }}
{{- if gt $world 1 }}
{{- fail (printf "gpu.count 0 (CPU-only) serves the reference model on one pod: set parallel.tp and parallel.pp to 1 (tp×pp is %d)" $world) }}
{{- end }}
{{- if eq $kind "LeaderWorkerSet" }}
{{- fail "workload.kind LeaderWorkerSet needs GPUs: gpu.count is 0" }}
{{- end }}
{{- if $v.rdma.enabled }}
{{- fail "rdma.enabled needs GPU pods: gpu.count is 0; set rdma.enabled false" }}
{{- end }}
{{- else if eq $kind "LeaderWorkerSet" }}
{{- if lt $world (mul 2 $gpus) }}
{{- fail (printf "a LeaderWorkerSet spans nodes: parallel.tp × parallel.pp (%d) must be at least twice gpu.count (%d); use workload.kind Deployment" $world $gpus) }}
{{- end }}
{{- $startup := mul (int $v.probes.startup.periodSeconds) (int $v.probes.startup.failureThreshold) }}
{{- if ge (int $v.multiNode.workerWaitSeconds) $startup }}
{{- fail (printf "multiNode.workerWaitSeconds %d must be shorter than the startup probe's allowance (probes.startup.periodSeconds × failureThreshold = %d s), or the probe kills the leader before it can say which worker is missing" (int $v.multiNode.workerWaitSeconds) $startup) }}
{{- end }}
{{- if not $v.multiNode.sshSecret }}
{{- fail "multiNode.sshSecret is required for a LeaderWorkerSet (the leader starts MPI ranks over ssh); see values.yaml" }}
{{- end }}
{{- if not $v.multiNode.image.repository }}
{{- fail "multiNode.image.repository is required for a LeaderWorkerSet: the stock Triton image has no sshd for MPI to start worker ranks through; build one from dflash_trt/deploy/multinode.Dockerfile and set multiNode.image (repository and tag or digest)" }}
{{- end }}
{{- if not (or $v.multiNode.image.tag $v.multiNode.image.digest) }}
{{- fail "multiNode.image needs a tag or a digest" }}
{{- end }}
{{- else if ne $world $gpus }}
{{- fail (printf "a %s pod holds one model instance: parallel.tp × parallel.pp (%d) must equal gpu.count (%d), or use workload.kind LeaderWorkerSet" $kind $world $gpus) }}
{{- end }}
{{- if not (or $v.image.tag $v.image.digest) }}
{{- fail "image needs a tag or a digest" }}
{{- end }}
{{- if and (eq $v.bundle.delivery "image") (not $v.bundle.image.repository) }}
{{- fail "bundle.delivery image needs bundle.image.repository" }}
{{- end }}
{{- if eq $v.bundle.delivery "pvc" }}
{{- if and (not $v.bundle.pvc.existingClaim) (not $v.bundle.pvc.create) }}
{{- fail "bundle.delivery pvc needs bundle.pvc.existingClaim or bundle.pvc.create" }}
{{- end }}
{{- if not $v.bundle.pvc.existingClaim }}
{{- $modes := $v.bundle.pvc.accessModes | default list }}
{{- $shared := or (has "ReadWriteMany" $modes) (has "ReadOnlyMany" $modes) }}
{{- $why := "" }}
{{- if eq $kind "LeaderWorkerSet" }}{{ $why = printf "a LeaderWorkerSet puts its %d pods on %d nodes" (int (include "dflash-trt.groupSize" .)) (int (include "dflash-trt.groupSize" .)) }}
{{- else if $v.autoscaling.enabled }}{{ $why = "the autoscaler adds pods on other nodes" }}
{{- else if gt (int $v.replicas) 1 }}{{ $why = printf "%d replicas land on different GPU nodes" (int $v.replicas) }}
{{- end }}
{{- if and $why (not $shared) }}
{{- fail (printf "bundle.pvc.accessModes %v attach the volume to one node, but %s (Multi-Attach error): set bundle.pvc.accessModes [ReadWriteMany] (or ReadOnlyMany) on a StorageClass that offers it, or use bundle.delivery image" $modes $why) }}
{{- end }}
{{- end }}
{{- end }}
{{- $grace := int $v.terminationGracePeriodSeconds }}
{{- $need := add (int $v.shutdown.drainSeconds) (int $v.shutdown.exitTimeoutSeconds) 10 }}
{{- if lt $grace $need }}
{{- fail (printf "terminationGracePeriodSeconds %d is shorter than shutdown.drainSeconds %d + shutdown.exitTimeoutSeconds %d + 10 s: raise it to %d or shorten the drain (Kubernetes kills the pod at the grace period)" $grace (int $v.shutdown.drainSeconds) (int $v.shutdown.exitTimeoutSeconds) $need) }}
{{- end }}
{{- if and $v.autoscaling.enabled (lt (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) }}
{{- fail (printf "autoscaling.maxReplicas %d is below autoscaling.minReplicas %d" (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) }}
{{- end }}
{{- end }}

{{/* Triton ------------------------------------------------------------------------------ */}}

{{- define "dflash-trt.modelRepository" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.bundle.mountPath) .Values.bundle.modelRepository }}
{{- end }}

{{/* tritonserver's arguments, shell-quoted, on one line. */}}
{{- define "dflash-trt.tritonArgs" -}}
{{- $args := list (printf "--model-repository=%s" (include "dflash-trt.modelRepository" .)) "--http-port=8000" "--grpc-port=8001" "--metrics-port=8002" (printf "--exit-timeout-secs=%d" (int .Values.shutdown.exitTimeoutSeconds)) }}
{{- if .Values.bundle.models }}
{{- $args = append $args "--model-control-mode=explicit" }}
{{- range .Values.bundle.models }}
{{- $args = append $args (printf "--load-model=%s" .) }}
{{- end }}
{{- end }}
{{- range .Values.triton.extraArgs }}
{{- $args = append $args . }}
{{- end }}
{{- range $i, $a := $args }}{{ if $i }} {{ end }}{{ squote $a }}{{ end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: repository@digest when pinned. */}}
{{- define "dflash-trt.imageRef" -}}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository .tag }}{{ end }}
{{- end }}

{{/* The serving image of a role: multiNode.image (with sshd) for LeaderWorkerSet pods. */}}
{{- define "dflash-trt.image" -}}
{{- if eq .role "single" }}{{ include "dflash-trt.imageRef" .root.Values.image }}{{ else }}{{ include "dflash-trt.imageRef" .root.Values.multiNode.image }}{{ end }}
{{- end }}

{{/* Every environment variable the chart sets in the serving containers, as a JSON list of
     {name, value}. The leader forwards each of them to every MPI rank (mpirun -x), so a rank on
     a worker sees what a container there would. */}}
{{- define "dflash-trt.env" -}}
{{- $v := .Values }}
{{- $env := list
  (dict "name" "BUNDLE_DIR" "value" $v.bundle.mountPath)
  (dict "name" "DFLASH_BUNDLE_ROOT" "value" $v.bundle.mountPath)
  (dict "name" "HOME" "value" "/tmp/home")
  (dict "name" "XDG_CACHE_HOME" "value" "/tmp/cache")
  (dict "name" "HF_HOME" "value" "/tmp/cache/huggingface")
  (dict "name" "TRITON_CACHE_DIR" "value" "/tmp/cache/triton")
  (dict "name" "TORCHINDUCTOR_CACHE_DIR" "value" "/tmp/cache/torchinductor")
  (dict "name" "TORCH_EXTENSIONS_DIR" "value" "/tmp/cache/torch_extensions") }}
{{- if eq (include "dflash-trt.kind" .) "LeaderWorkerSet" }}
{{- /* Open MPI 4 cuts host names at the first dot unless told not to; LWS names resolve only
       whole (NVIDIA's NIM chart and Dynamo set the same). */}}
{{- $env = append $env (dict "name" "OMPI_MCA_orte_keep_fqdn_hostnames" "value" "1") }}
{{- end }}
{{- with $v.nccl.socketIfname }}
{{- $env = append $env (dict "name" "NCCL_SOCKET_IFNAME" "value" .) }}
{{- end }}
{{- if $v.rdma.enabled }}
{{- $env = append $env (dict "name" "NCCL_IB_DISABLE" "value" "0") }}
{{- with $v.rdma.ibHca }}
{{- $env = append $env (dict "name" "NCCL_IB_HCA" "value" .) }}
{{- end }}
{{- end }}
{{- range $v.triton.env }}
{{- $env = append $env (dict "name" .name "value" .value) }}
{{- end }}
{{- toJson $env }}
{{- end }}

{{/* Pod pieces -------------------------------------------------------------------------- */}}

{{- define "dflash-trt.gpuResources" -}}
{{- $v := .Values }}
{{- $res := deepCopy (default dict $v.resources) }}
{{- $extra := dict }}
{{- if gt (int $v.gpu.count) 0 }}
{{- $_ := set $extra $v.gpu.resourceName (int $v.gpu.count) }}
{{- if $v.rdma.enabled }}
{{- range $name, $n := $v.rdma.resources }}
{{- $_ := set $extra $name (int $n) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $extra }}
{{- $_ := set $res "requests" (merge (deepCopy $extra) (default dict (get $res "requests"))) }}
{{- $_ := set $res "limits" (merge (deepCopy $extra) (default dict (get $res "limits"))) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* securityContext of the containers; IPC_LOCK added for RDMA (registered memory is pinned). */}}
{{- define "dflash-trt.securityContext" -}}
{{- $sc := deepCopy .Values.securityContext }}
{{- if .Values.rdma.enabled }}
{{- $caps := default dict (get $sc "capabilities") }}
{{- $_ := set $caps "add" (append (default list (get $caps "add")) "IPC_LOCK" | uniq) }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{- define "dflash-trt.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $aff := deepCopy (default dict .Values.affinity) }}
{{- if and (gt (int .Values.gpu.count) 0) (not (hasKey $aff "nodeAffinity")) }}
{{- $term := dict "matchExpressions" (list (dict "key" "nvidia.com/gpu.product" "operator" "In" "values" (list .Values.gpu.product))) }}
{{- $_ := set $aff "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" (list $term))) }}
{{- end }}
{{- with $aff }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tol := list }}
{{- if and (gt (int .Values.gpu.count) 0) .Values.gpu.tolerate }}
{{- $tol = append $tol (dict "key" .Values.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
{{- $tol = concat $tol .Values.tolerations }}
{{- with $tol }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The pod spec. Call with (dict "root" $ "role" "single"|"leader"|"worker"). */}}
{{- define "dflash-trt.podSpec" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $role := .role }}
{{- $fullname := include "dflash-trt.fullname" $root }}
{{- $multi := ne $role "single" }}
serviceAccountName: {{ include "dflash-trt.serviceAccountName" $root }}
automountServiceAccountToken: {{ $v.serviceAccount.automountToken }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- include "dflash-trt.scheduling" $root }}
{{- if eq $v.bundle.delivery "image" }}
initContainers:
  - name: bundle
    image: {{ printf "%s:%s" $v.bundle.image.repository $v.bundle.image.tag | quote }}
    imagePullPolicy: {{ $v.bundle.image.pullPolicy }}
    command: ["/bin/sh", "-c", {{ printf "cp -a %s/. /mnt/bundle/" (squote (trimSuffix "/" $v.bundle.image.path)) | quote }}]
    securityContext:
      {{- include "dflash-trt.securityContext" $root | nindent 6 }}
    volumeMounts:
      - name: bundle
        mountPath: /mnt/bundle
{{- end }}
containers:
  - name: {{ if eq $role "worker" }}worker{{ else }}triton{{ end }}
    image: {{ include "dflash-trt.image" . | quote }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/bin/sh", "/opt/dflash-trt/{{ if eq $role "single" }}serve{{ else }}{{ $role }}{{ end }}.sh"]
    env:
      {{- include "dflash-trt.env" $root | fromJsonArray | toYaml | nindent 6 }}
    {{- if ne $role "worker" }}
    ports:
      - name: http
        containerPort: 8000
        protocol: TCP
      - name: grpc
        containerPort: 8001
        protocol: TCP
      - name: metrics
        containerPort: 8002
        protocol: TCP
    startupProbe:
      httpGet:
        path: /v2/health/ready
        port: http
      {{- toYaml $v.probes.startup | nindent 6 }}
    livenessProbe:
      httpGet:
        path: /v2/health/live
        port: http
      {{- toYaml $v.probes.liveness | nindent 6 }}
    readinessProbe:
      httpGet:
        path: /v2/health/ready
        port: http
      {{- toYaml $v.probes.readiness | nindent 6 }}
    lifecycle:
      # Drain before SIGTERM: the pod has left the Service's endpoints; wait for its in-flight
      # requests (at most shutdown.drainSeconds), then Triton gets --exit-timeout-secs.
      preStop:
        exec:
          command: ["/bin/sh", "/opt/dflash-trt/drain.sh"]
    {{- else }}
    ports:
      - name: ssh
        containerPort: {{ $v.multiNode.sshPort }}
        protocol: TCP
    readinessProbe:
      tcpSocket:
        port: ssh
      periodSeconds: 10
    {{- end }}
    resources:
      {{- include "dflash-trt.gpuResources" $root | nindent 6 }}
    securityContext:
      {{- include "dflash-trt.securityContext" $root | nindent 6 }}
    volumeMounts:
      {{- include "dflash-trt.volumeMounts" (dict "root" $root "role" $role) | trim | nindent 6 }}
volumes:
  - name: bundle
    {{- if eq $v.bundle.delivery "image" }}
    emptyDir:
      sizeLimit: {{ $v.bundle.image.sizeLimit }}
    {{- else }}
    persistentVolumeClaim:
      claimName: {{ default (printf "%s-bundle" $fullname) $v.bundle.pvc.existingClaim }}
    {{- end }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.shmSize }}
  - name: tmp
    emptyDir:
      sizeLimit: {{ $v.tmpSize }}
  - name: scripts
    configMap:
      name: {{ $fullname }}-scripts
      defaultMode: 365  # 0555
  {{- if $multi }}
  - name: ssh
    secret:
      secretName: {{ $v.multiNode.sshSecret }}
      defaultMode: 288  # 0440
      # The leader needs only the private key (mpirun does not tree-spawn), a worker only the
      # public one.
      items:
        - key: {{ if eq $role "worker" }}authorized_keys{{ else }}id_ed25519{{ end }}
          path: {{ if eq $role "worker" }}authorized_keys{{ else }}id_ed25519{{ end }}
  {{- end }}
{{- end }}

{{- define "dflash-trt.volumeMounts" -}}
{{- $v := .root.Values }}
- name: bundle
  mountPath: {{ $v.bundle.mountPath }}
  {{- if and (eq $v.bundle.delivery "pvc") $v.bundle.pvc.subPath }}
  subPath: {{ $v.bundle.pvc.subPath }}
  {{- end }}
  readOnly: true
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
- name: scripts
  mountPath: /opt/dflash-trt
  readOnly: true
{{- if ne .role "single" }}
- name: ssh
  mountPath: /etc/dflash-trt/ssh
  readOnly: true
{{- end }}
{{- end }}
