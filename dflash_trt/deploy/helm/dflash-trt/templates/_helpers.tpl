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

{{/* Checks the schema cannot express; each fails the render with the value to change. */}}
{{- define "dflash-trt.validate" -}}
{{- $world := int (include "dflash-trt.worldSize" .) }}
{{- $gpus := int .Values.gpu.count }}
{{- $kind := include "dflash-trt.kind" . }}
{{- if gt (int .Values.parallel.ep) (int .Values.parallel.tp) }}
{{- fail (printf "parallel.ep %d must divide parallel.tp %d" (int .Values.parallel.ep) (int .Values.parallel.tp)) }}
{{- end }}
{{- if eq $gpus 0 }}
{{- if gt $world 1 }}
{{- fail (printf "gpu.count 0 (CPU-only) serves the reference model on one pod: set parallel.tp and parallel.pp to 1 (tp×pp is %d)" $world) }}
{{- end }}
{{- if eq $kind "LeaderWorkerSet" }}
{{- fail "workload.kind LeaderWorkerSet needs GPUs: gpu.count is 0" }}
{{- end }}
{{- if .Values.compile.enabled }}
{{- fail "compile.enabled needs a GPU node: gpu.count is 0" }}
{{- end }}
{{- else if eq $kind "LeaderWorkerSet" }}
{{- if lt $world (mul 2 $gpus) }}
{{- fail (printf "a LeaderWorkerSet spans nodes: parallel.tp × parallel.pp (%d) must be at least twice gpu.count (%d); use workload.kind Deployment" $world $gpus) }}
{{- end }}
{{- if not .Values.multiNode.sshSecret }}
{{- fail "multiNode.sshSecret is required for a LeaderWorkerSet (the leader starts MPI ranks over ssh); see values.yaml" }}
{{- end }}
{{- else if ne $world $gpus }}
{{- fail (printf "a %s pod holds one model instance: parallel.tp × parallel.pp (%d) must equal gpu.count (%d), or use workload.kind LeaderWorkerSet" $kind $world $gpus) }}
{{- end }}
{{- if and (eq .Values.bundle.delivery "image") (not .Values.bundle.image.repository) }}
{{- fail "bundle.delivery image needs bundle.image.repository" }}
{{- end }}
{{- if and (eq .Values.bundle.delivery "pvc") (not .Values.bundle.pvc.existingClaim) (not .Values.bundle.pvc.create) }}
{{- fail "bundle.delivery pvc needs bundle.pvc.existingClaim or bundle.pvc.create" }}
{{- end }}
{{- end }}

{{/* Triton ------------------------------------------------------------------------------ */}}

{{- define "dflash-trt.modelRepository" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.bundle.mountPath) .Values.bundle.modelRepository }}
{{- end }}

{{/* tritonserver's arguments, shell-quoted, on one line. */}}
{{- define "dflash-trt.tritonArgs" -}}
{{- $args := list (printf "--model-repository=%s" (include "dflash-trt.modelRepository" .)) "--http-port=8000" "--grpc-port=8001" "--metrics-port=8002" }}
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

{{- define "dflash-trt.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{/* Pod pieces -------------------------------------------------------------------------- */}}

{{- define "dflash-trt.gpuResources" -}}
{{- $res := deepCopy (default dict .Values.resources) }}
{{- if gt (int .Values.gpu.count) 0 }}
{{- $req := default dict (get $res "requests") }}
{{- $lim := default dict (get $res "limits") }}
{{- $_ := set $req .Values.gpu.resourceName (int .Values.gpu.count) }}
{{- $_ := set $lim .Values.gpu.resourceName (int .Values.gpu.count) }}
{{- $_ := set $res "requests" $req }}
{{- $_ := set $res "limits" $lim }}
{{- end }}
{{- toYaml $res }}
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
{{- if or (eq $v.bundle.delivery "image") (and $v.compile.enabled (ne $role "worker")) }}
initContainers:
  {{- if eq $v.bundle.delivery "image" }}
  - name: bundle
    image: {{ printf "%s:%s" $v.bundle.image.repository $v.bundle.image.tag | quote }}
    imagePullPolicy: {{ $v.bundle.image.pullPolicy }}
    command: ["/bin/sh", "-c", {{ printf "cp -a %s/. /mnt/bundle/" (squote (trimSuffix "/" $v.bundle.image.path)) | quote }}]
    securityContext:
      {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - name: bundle
        mountPath: /mnt/bundle
  {{- end }}
  {{- if and $v.compile.enabled (ne $role "worker") }}
  - name: compile
    image: {{ if $v.compile.image.repository }}{{ printf "%s:%s" $v.compile.image.repository $v.compile.image.tag | quote }}{{ else }}{{ include "dflash-trt.image" $root | quote }}{{ end }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/bin/sh", "/opt/dflash-trt/compile.sh"]
    env:
      - name: BUNDLE_DIR
        value: {{ $v.bundle.mountPath | quote }}
    resources:
      {{- $cres := deepCopy (default dict $v.compile.resources) }}
      {{- $_ := set $cres "requests" (merge (default dict (get $cres "requests")) (dict $v.gpu.resourceName (int $v.gpu.count))) }}
      {{- $_ := set $cres "limits" (merge (default dict (get $cres "limits")) (dict $v.gpu.resourceName (int $v.gpu.count))) }}
      {{- toYaml $cres | nindent 6 }}
    securityContext:
      {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      {{- include "dflash-trt.volumeMounts" (dict "root" $root "role" $role) | trim | nindent 6 }}
  {{- end }}
{{- end }}
containers:
  - name: {{ if eq $role "worker" }}worker{{ else }}triton{{ end }}
    image: {{ include "dflash-trt.image" $root | quote }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/bin/sh", "/opt/dflash-trt/{{ if eq $role "single" }}serve{{ else }}{{ $role }}{{ end }}.sh"]
    env:
      - name: BUNDLE_DIR
        value: {{ $v.bundle.mountPath | quote }}
      # The bundle's Triton models resolve their bundle-relative paths (model.yaml) from here.
      - name: DFLASH_BUNDLE_ROOT
        value: {{ $v.bundle.mountPath | quote }}
      {{- with $v.triton.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
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
      {{- toYaml $v.securityContext | nindent 6 }}
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
  - name: run
    emptyDir:
      sizeLimit: 1Mi
  - name: tmp
    emptyDir: {}
  - name: scripts
    configMap:
      name: {{ $fullname }}-scripts
      defaultMode: 365  # 0555
  {{- if $multi }}
  - name: ssh
    secret:
      secretName: {{ $v.multiNode.sshSecret }}
      defaultMode: 288  # 0440
  {{- end }}
{{- end }}

{{- define "dflash-trt.volumeMounts" -}}
{{- $v := .root.Values }}
- name: bundle
  mountPath: {{ $v.bundle.mountPath }}
  {{- if and (eq $v.bundle.delivery "pvc") $v.bundle.pvc.subPath }}
  subPath: {{ $v.bundle.pvc.subPath }}
  {{- end }}
- name: dshm
  mountPath: /dev/shm
- name: run
  mountPath: /run/dflash-trt
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
