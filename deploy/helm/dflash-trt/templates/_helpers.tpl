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

{{/* Servers --------------------------------------------------------------------------- */}}

{{/* engines.json (beside Chart.yaml): the engines' facts, the same file dflash_trt/engines.py reads. */}}
{{- define "dflash-trt.engines" -}}
{{- .Files.Get "engines.json" }}
{{- end }}

{{/* The server.stack row of engines.json: its stack, image, engine version, endpoints. */}}
{{- define "dflash-trt.server" -}}
{{- $e := include "dflash-trt.engines" . | fromJson }}
{{- toJson (get $e.servers .Values.server.stack) }}
{{- end }}

{{/* "true" for a Triton pod that serves only the bundle's dflash_reference model (our own CPU
     runtime; no engine with DFlash is involved). */}}
{{- define "dflash-trt.referenceOnly" -}}
{{- $v := .Values }}
{{- if and (eq $v.server.stack "triton") $v.bundle.models (eq (len (without $v.bundle.models "dflash_reference")) 0) }}true{{ end }}
{{- end }}

{{/* The image of single-node pods as JSON {repository, tag, digest, engineVersion, from}: image.*
     when image.repository is set, else the server's image in engines.json (the CPU reference image
     for a Triton pod serving only dflash_reference). */}}
{{- define "dflash-trt.serverImage" -}}
{{- $v := .Values }}
{{- $e := include "dflash-trt.engines" . | fromJson }}
{{- if $v.image.repository }}
{{- toJson (dict "repository" $v.image.repository "tag" $v.image.tag "digest" $v.image.digest "engineVersion" $v.image.engineVersion "from" "image") }}
{{- else if include "dflash-trt.referenceOnly" . }}
{{- $i := $e.cpu_reference.image }}
{{- toJson (dict "repository" $i.repository "tag" $i.tag "digest" $i.digest "engineVersion" "" "from" "engines.json cpu_reference") }}
{{- else }}
{{- $s := get $e.servers $v.server.stack }}
{{- toJson (dict "repository" $s.image.repository "tag" $s.image.tag "digest" $s.image.digest "engineVersion" $s.engine_version "from" (printf "engines.json servers.%s" $v.server.stack)) }}
{{- end }}
{{- end }}

{{/* A PEP 440 engine version (1.4.0rc4) as a SemVer one (1.4.0-rc.4) for semverCompare. */}}
{{- define "dflash-trt.semver" -}}
{{- regexReplaceAll "^([0-9]+\\.[0-9]+\\.[0-9]+)(rc|a|b)([0-9]+)$" . "${1}-${2}.${3}" }}
{{- end }}

{{/* Refuse an image whose engine predates DFlash. Call with (dict "root" $ "image" <serverImage>
     "key" "image"|"multiNode.image"). A tritonserver:<tag>-trtllm-python-py3 image is checked at the
     TensorRT-LLM version Triton's compatibility matrix gives its tag, whatever it declares. */}}
{{- define "dflash-trt.checkEngine" -}}
{{- $e := include "dflash-trt.engines" .root | fromJson }}
{{- $srv := get $e.servers .root.Values.server.stack }}
{{- $stack := get $e.stacks $srv.stack }}
{{- $img := .image }}
{{- $ref := include "dflash-trt.imageRef" $img }}
{{- $version := $img.engineVersion }}
{{- $matrix := $e.triton_trtllm_images.tensorrt_llm_by_tag }}
{{- $fromMatrix := and (eq $srv.stack "trtllm") (hasSuffix "/tritonserver" $img.repository) (hasKey $matrix (toString $img.tag)) }}
{{- if $fromMatrix }}{{ $version = get $matrix (toString $img.tag) }}{{ end }}
{{- if not $img.repository }}
{{- fail (printf "server.stack %s: no published image carries tritonserver with a DFlash-capable TensorRT-LLM (Triton's compatibility matrix stops at 1.2.1; DFlash is in %s+): build %s and set %s.repository, %s.tag and %s.engineVersion" .root.Values.server.stack $stack.dflash_since $srv.build .key .key .key) }}
{{- end }}
{{- if not (or $img.tag $img.digest) }}
{{- fail (printf "%s needs a tag or a digest" .key) }}
{{- end }}
{{- if not $version }}
{{- fail (printf "%s %s: set %s.engineVersion, the %s version the image carries (the chart refuses one older than %s, the first with DFlash)" .key $ref .key $stack.engine $stack.dflash_since) }}
{{- end }}
{{- if not (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+((rc|a|b)[0-9]+)?$" $version) }}
{{- fail (printf "%s.engineVersion %q: expected MAJOR.MINOR.PATCH[rcN], e.g. %s" .key $version $srv.engine_version) }}
{{- end }}
{{- if not (semverCompare (printf ">=%s" (include "dflash-trt.semver" $stack.dflash_since)) (include "dflash-trt.semver" $version)) }}
{{- $instead := ternary (printf "build %s" $srv.build) (printf "use %s" (include "dflash-trt.imageRef" $srv.image)) (not $srv.image.repository) }}
{{- fail (printf "%s %s carries %s %s%s, which predates DFlash (first in %s; engines.json): decoding_type DFlash cannot load; %s (server.stack %s) or take an image of %s >= %s" .key $ref $stack.engine $version (ternary " (Triton's compatibility matrix)" "" $fromMatrix) $stack.dflash_since $instead .root.Values.server.stack $stack.engine $stack.dflash_since) }}
{{- end }}
{{- end }}

{{/* Checks the schema cannot express; each fails the render with the value to change. */}}
{{- define "dflash-trt.validate" -}}
{{- $v := .Values }}
{{- if and $v.capture.enabled (ne $v.server.stack "vllm") -}}
{{- fail (printf "capture.enabled: the capture middleware runs in vLLM's server (server.stack vllm), not %s" $v.server.stack) }}
{{- end -}}
{{- if and $v.capture.enabled (not $v.capture.existingClaim) -}}
{{- fail "capture.enabled: capture.existingClaim names no PVC: the captured requests need a volume that outlives the pod" }}
{{- end -}}
{{- $world := int (include "dflash-trt.worldSize" .) }}
{{- $gpus := int $v.gpu.count }}
{{- $kind := include "dflash-trt.kind" . }}
{{- $full := include "dflash-trt.fullname" . }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $full) }}
{{- fail (printf "resource name %q (from release %q, nameOverride, fullnameOverride): Kubernetes refuses it as a Service name, which must be a DNS-1035 label: lower-case letters, digits and '-', starting with a letter and ending with a letter or digit" $full .Release.Name) }}
{{- end }}
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
{{- fail "multiNode.image.repository is required for a LeaderWorkerSet: the stock images have no sshd for MPI to start worker ranks through; build one from deploy/multinode.Dockerfile (BASE = the server's image) and set multiNode.image (repository, tag or digest, engineVersion)" }}
{{- end }}
{{- if not (or $v.multiNode.image.tag $v.multiNode.image.digest) }}
{{- fail "multiNode.image needs a tag or a digest" }}
{{- end }}
{{- else if ne $world $gpus }}
{{- fail (printf "a %s pod holds one model instance: parallel.tp × parallel.pp (%d) must equal gpu.count (%d), or use workload.kind LeaderWorkerSet" $kind $world $gpus) }}
{{- end }}
{{- $e := include "dflash-trt.engines" . | fromJson }}
{{- $srv := get $e.servers $v.server.stack }}
{{- if not (include "dflash-trt.referenceOnly" .) }}
{{- if not (has $srv.stack $v.bundle.stacks) }}
{{- fail (printf "server.stack %s serves the bundle's %s, but bundle.stacks %v holds no %s config (manifest.json serving_stacks.served): choose a server.stack whose stack the bundle holds" $v.server.stack $srv.config $v.bundle.stacks $srv.stack) }}
{{- end }}
{{- if eq $kind "LeaderWorkerSet" }}
{{- if not (has $v.server.stack (list "trtllm-serve" "triton")) }}
{{- fail (printf "server.stack %s on a LeaderWorkerSet: the chart's multi-node launch is MPI (trtllm-llmapi-launch), which only trtllm-serve and triton run; serve %s within one node (parallel.tp × parallel.pp <= gpu.count)" $v.server.stack $v.server.stack) }}
{{- end }}
{{- include "dflash-trt.checkEngine" (dict "root" . "image" (dict "repository" $v.multiNode.image.repository "tag" $v.multiNode.image.tag "digest" $v.multiNode.image.digest "engineVersion" $v.multiNode.image.engineVersion) "key" "multiNode.image") }}
{{- else }}
{{- include "dflash-trt.checkEngine" (dict "root" . "image" (include "dflash-trt.serverImage" . | fromJson) "key" "image") }}
{{- end }}
{{- else if not (or (include "dflash-trt.serverImage" . | fromJson).tag (include "dflash-trt.serverImage" . | fromJson).digest) }}
{{- fail "image needs a tag or a digest" }}
{{- end }}
{{- if and (ne $v.server.stack "triton") $v.bundle.models }}
{{- fail (printf "bundle.models %v: Triton models, but server.stack is %s (which loads its bundle config); set server.stack triton or bundle.models []" $v.bundle.models $v.server.stack) }}
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

{{/* The serving command of a pod (prefix "" ) or of an MPI rank (prefix "trtllm-llmapi-launch "),
     one shell line. trtllm-serve, vLLM and SGLang run from the bundle root, where their configs'
     paths (target, drafter, configs/...) resolve; vLLM and SGLang run the argv of the bundle's
     configs/<stack>.json with the pod's host and port added. */}}
{{- define "dflash-trt.serverCommand" -}}
{{- $v := .root.Values }}
{{- $extra := "" }}
{{- range $v.server.extraArgs }}{{ $extra = printf "%s %s" $extra (squote .) }}{{ end }}
{{- $launch := "import json, os, sys; a = json.load(open(sys.argv[1]))[\"argv\"] + sys.argv[2:]; a[0] = sys.executable if a[0] in (\"python\", \"python3\") else a[0]; os.execvp(a[0], a)" }}
{{- if eq $v.server.stack "triton" -}}
exec {{ .prefix }}tritonserver {{ include "dflash-trt.tritonArgs" .root }}
{{- else if eq $v.server.stack "trtllm-serve" -}}
cd "$BUNDLE_DIR" && exec {{ .prefix }}trtllm-serve target --config configs/trtllm-serve.yaml --host 0.0.0.0 --port 8000{{ $extra }}
{{- else if eq $v.server.stack "vllm" -}}
cd "$BUNDLE_DIR" && exec python3 -c {{ squote $launch }} configs/vllm.json --host 0.0.0.0 --port 8000{{ if $v.capture.enabled }} --middleware dflash_trt_capture.CaptureMiddleware{{ end }}{{ $extra }}
{{- else -}}
cd "$BUNDLE_DIR" && exec python3 -c {{ squote $launch }} configs/sglang.json --host 0.0.0.0 --port 8000 --enable-metrics{{ $extra }}
{{- end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: repository@digest when pinned. */}}
{{- define "dflash-trt.imageRef" -}}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository .tag }}{{ end }}
{{- end }}

{{/* The serving image of a role: multiNode.image (with sshd) for LeaderWorkerSet pods. */}}
{{- define "dflash-trt.image" -}}
{{- if eq .role "single" }}{{ include "dflash-trt.imageRef" (include "dflash-trt.serverImage" .root | fromJson) }}{{ else }}{{ include "dflash-trt.imageRef" .root.Values.multiNode.image }}{{ end }}
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
{{- if $v.capture.enabled }}
{{- /* the capture middleware (files/dflash_trt_capture.py, in the scripts ConfigMap) and its settings */}}
{{- $env = concat $env (list (dict "name" "PYTHONPATH" "value" "/opt/dflash-trt")
  (dict "name" "DFLASH_TRT_CAPTURE_DIR" "value" $v.capture.mountPath)
  (dict "name" "DFLASH_TRT_CAPTURE_FRACTION" "value" (toString $v.capture.fraction))
  (dict "name" "DFLASH_TRT_CAPTURE_MAX_BYTES" "value" (toString (int64 $v.capture.maxBytes)))
  (dict "name" "DFLASH_TRT_CAPTURE_KEEP" "value" (toString (int $v.capture.keep)))) }}
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
{{- $srv := include "dflash-trt.server" $root | fromJson }}
{{- $ep := $srv.endpoints }}
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
{{- $doctor := and $v.doctor.enabled (ne $role "worker") }}
{{- if and $doctor (not $v.doctor.image.repository) }}
{{- fail "doctor.enabled needs doctor.image.repository: an image with dflash-trt, a CUDA torch and triton (deploy/triton-cpu.Dockerfile built with --build-arg BASE=<the server's image>)" }}
{{- end }}
{{- if or $v.bundle.loader.enabled (eq $v.bundle.delivery "image") $doctor }}
initContainers:
{{- end }}
{{- if $v.bundle.loader.enabled }}
  # The bundle loader Job writes manifest.json last: wait for this version's copy to be complete.
  - name: wait-bundle
    image: {{ include "dflash-trt.image" . | quote }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/bin/sh", "-c", {{ printf "until [ -f %s/manifest.json ]; do echo waiting for the bundle loader to fill %s; sleep 10; done" $v.bundle.mountPath $v.bundle.pvc.subPath | quote }}]
    securityContext:
      {{- include "dflash-trt.securityContext" $root | nindent 6 }}
    volumeMounts:
      - name: bundle
        mountPath: {{ $v.bundle.mountPath }}
        subPath: {{ $v.bundle.pvc.subPath }}
        readOnly: true
{{- end }}
{{- if eq $v.bundle.delivery "image" }}
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
{{- if $doctor }}
  # the node check (`dflash-trt doctor`) on the GPUs the server will use, after the bundle is in place
  - name: doctor
    image: {{ printf "%s:%s" $v.doctor.image.repository (default "latest" $v.doctor.image.tag) | quote }}
    imagePullPolicy: {{ $v.doctor.image.pullPolicy }}
    command: {{ concat (list "dflash-trt" "doctor" "--bundle" $v.bundle.mountPath "--require-gpu") $v.doctor.args | toJson }}
    env:
      {{- include "dflash-trt.env" $root | fromJsonArray | toYaml | nindent 6 }}
    resources:
      {{- include "dflash-trt.gpuResources" $root | nindent 6 }}
    securityContext:
      {{- include "dflash-trt.securityContext" $root | nindent 6 }}
    volumeMounts:
      {{- include "dflash-trt.volumeMounts" (dict "root" $root "role" $role) | trim | nindent 6 }}
{{- end }}
containers:
  - name: {{ if eq $role "worker" }}worker{{ else }}{{ $v.server.stack }}{{ end }}
    image: {{ include "dflash-trt.image" . | quote }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/bin/sh", "/opt/dflash-trt/{{ if eq $role "single" }}serve{{ else }}{{ $role }}{{ end }}.sh"]
    env:
      {{- include "dflash-trt.env" $root | fromJsonArray | toYaml | nindent 6 }}
    {{- if ne $role "worker" }}
    # The server's own ports and health endpoints (engines.json servers.{{ $v.server.stack }}.endpoints).
    ports:
      {{- range $name, $port := $ep.ports }}
      - name: {{ $name }}
        containerPort: {{ $port }}
        protocol: TCP
      {{- end }}
    startupProbe:
      httpGet:
        path: {{ $ep.ready }}
        port: http
      {{- toYaml $v.probes.startup | nindent 6 }}
    {{- /* Triton: the models answer (files/triton_ready.py), not only the server: its ready
         endpoints stay 200 after a model's Python stub died (docs/serving-faults.md) */}}
    {{- $modelProbe := eq $v.server.stack "triton" }}
    livenessProbe:
      {{- if $modelProbe }}
      exec:
        command: ["python3", "/opt/dflash-trt/triton_ready.py"]
      {{- else }}
      httpGet:
        path: {{ $ep.live }}
        port: http
      {{- end }}
      {{- toYaml $v.probes.liveness | nindent 6 }}
    readinessProbe:
      {{- if $modelProbe }}
      exec:
        command: ["python3", "/opt/dflash-trt/triton_ready.py"]
      {{- else }}
      httpGet:
        path: {{ $ep.ready }}
        port: http
      {{- end }}
      {{- toYaml $v.probes.readiness | nindent 6 }}
    lifecycle:
      # Drain before SIGTERM: the pod has left the Service's endpoints; wait for its in-flight
      # requests (at most shutdown.drainSeconds), then the server gets SIGTERM (Triton: --exit-timeout-secs).
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
  {{- if $v.capture.enabled }}
  - name: capture
    persistentVolumeClaim:
      claimName: {{ $v.capture.existingClaim }}
  {{- end }}
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
{{- if $v.capture.enabled }}
- name: capture
  mountPath: {{ $v.capture.mountPath }}
{{- end }}
{{- if ne .role "single" }}
- name: ssh
  mountPath: /etc/dflash-trt/ssh
  readOnly: true
{{- end }}
{{- end }}

{{/* The bundle loader Job's labels: not the serving pods' selector (the Service never routes to it). */}}
{{- define "dflash-trt.loaderLabels" -}}
helm.sh/chart: {{ include "dflash-trt.chart" . }}
app.kubernetes.io/name: {{ include "dflash-trt.name" . }}-loader
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: bundle-loader
{{- end }}
