# The image of a multi-node (LeaderWorkerSet) group: TensorRT-LLM's Triton image plus OpenSSH.
# The leader's mpirun starts the ranks on the workers through ssh; the worker runs a non-root
# sshd on multiNode.sshPort (the chart's worker.sh). Build, push, and set multiNode.image:
#   docker build -f dflash_trt/deploy/multinode.Dockerfile -t REGISTRY/dflash-trt-triton:25.10 .
#   docker push REGISTRY/dflash-trt-triton:25.10
ARG BASE=nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server openssh-client \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*_key* \
 && test -x /usr/sbin/sshd && command -v ssh && command -v mpirun
