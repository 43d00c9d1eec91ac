{{- define "train.fullname" -}}
{{- printf "%s-train" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "train.labels" -}}
app.kubernetes.io/name: dflash-trt-train
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "train.claim" -}}
{{- .Values.storage.existingClaim | default (printf "%s-data" (include "train.fullname" .)) -}}
{{- end -}}

{{- define "train.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{- define "train.ranksPerPod" -}}
{{- if gt (int .Values.gpu.count) 0 }}{{ int .Values.gpu.count }}{{ else }}{{ int .Values.cpuRanksPerPod }}{{ end -}}
{{- end -}}

{{/* Values that cannot run, refused with what to change. */}}
{{- define "train.validate" -}}
{{- $v := .Values -}}
{{- if and (gt (int $v.nodes) 1) (not (has "ReadWriteMany" $v.storage.accessModes)) -}}
{{- fail (printf "storage.accessModes %v: %d pods on %d nodes share one volume (every rank reads the feature shards the others wrote, rank 0 writes the checkpoints all resume from): use ReadWriteMany" $v.storage.accessModes (int $v.nodes) (int $v.nodes)) }}
{{- end -}}
{{- if and (eq (int $v.gpu.count) 0) (lt (int $v.cpuRanksPerPod) 1) -}}
{{- fail "gpu.count is 0 and cpuRanksPerPod is 0: a pod would start no rank; set one of them" }}
{{- end -}}
{{- $mount := trimSuffix "/" $v.storage.mountPath -}}
{{- range $k := list "target" "out" "featureCache" -}}
{{- $p := index $v.train $k -}}
{{- if not (hasPrefix (printf "%s/" $mount) $p) -}}
{{- fail (printf "train.%s %q lies outside storage.mountPath %s: a restarted pod would not find it" $k $p $mount) }}
{{- end -}}
{{- end -}}
{{- if $v.adapt.bundle -}}
{{- range $k := list "bundle" "traffic" "out" -}}
{{- $p := index $v.adapt $k -}}
{{- if not (hasPrefix (printf "%s/" $mount) $p) -}}
{{- fail (printf "adapt.%s %q lies outside storage.mountPath %s: the pods would not find it" $k $p $mount) }}
{{- end -}}
{{- end -}}
{{- else if and (not $v.train.data) (not $v.train.prompts) -}}
{{- fail "train.data and train.prompts are both empty: give train-drafter its data" }}
{{- end -}}
{{- if and $v.train.data $v.train.prompts -}}
{{- fail "train.data and train.prompts are both set: give exactly one" }}
{{- end -}}
{{- if and (not $v.image.digest) (not $v.image.tag) -}}
{{- fail "image needs a tag or a digest" }}
{{- end -}}
{{- if gt (int $v.rendezvous.maxRestarts) (int $v.backoffLimit) -}}
{{- fail (printf "rendezvous.maxRestarts %d exceeds backoffLimit %d: the Job would give up on a pod torchrun still restarts" (int $v.rendezvous.maxRestarts) (int $v.backoffLimit)) }}
{{- end -}}
{{- end -}}
