# The image of a multi-node (LeaderWorkerSet) group: the server's image plus OpenSSH. The leader's
# mpirun starts the ranks on the workers through ssh (trtllm-llmapi-launch per rank); the worker
# runs a non-root sshd on multiNode.sshPort (the chart's worker.sh). BASE is the single-node image
# of the server: TensorRT-LLM's release image for server.stack trtllm-serve (the default), or the
# image built from deploy/triton-trtllm.Dockerfile for server.stack triton. Build, push, and set
# multiNode.image (with multiNode.image.engineVersion, the TensorRT-LLM version of BASE):
#   docker build -f deploy/multinode.Dockerfile -t REGISTRY/dflash-trt-trtllm-mpi:1.4.0rc4 .
#   docker build -f deploy/multinode.Dockerfile --build-arg BASE=REGISTRY/dflash-trt-triton:26.07-trtllm1.4.0rc4 \
#       -t REGISTRY/dflash-trt-triton-mpi:1.4.0rc4 .
ARG BASE=nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server openssh-client \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*_key* \
 && test -x /usr/sbin/sshd && command -v ssh && command -v mpirun && command -v trtllm-llmapi-launch
