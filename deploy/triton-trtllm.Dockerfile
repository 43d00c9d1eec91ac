# Triton Inference Server with a DFlash-capable TensorRT-LLM, for the chart's server.stack triton.
# NVIDIA publishes none: every tritonserver:<YY.MM>-trtllm-python-py3 image up to 26.07 carries
# TensorRT-LLM <= 1.2.1 (triton-inference-server/server docs/introduction/compatibility.md @
# 0f963c9a8c69), and DFlash entered TensorRT-LLM in the 1.3.0rc series (engines.json). This image
# keeps 26.07's tritonserver and Python backend and replaces its TensorRT-LLM Python package (what
# the bundle's tensorrt_llm model, TensorRT-LLM's llmapi model, imports) with TRTLLM_VERSION.
# The build fails unless the installed package has DFlashDecodingConfig with the FA4 drafter path.
#   docker build -f deploy/triton-trtllm.Dockerfile -t REGISTRY/dflash-trt-triton:26.07-trtllm1.4.0rc4 .
#   docker push REGISTRY/dflash-trt-triton:26.07-trtllm1.4.0rc4
#   dflash-trt deploy --bundle B --server triton --image REGISTRY/dflash-trt-triton:26.07-trtllm1.4.0rc4 \
#       --engine-version 1.4.0rc4
# Pin BASE by digest for a reproducible build (docker buildx imagetools inspect BASE).
ARG BASE=nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3
FROM ${BASE}
ARG TRTLLM_VERSION=1.4.0rc4
LABEL dflash-trt.engine=TensorRT-LLM dflash-trt.engine-version=${TRTLLM_VERSION}
RUN python3 -m pip install --no-cache-dir --extra-index-url https://pypi.nvidia.com "tensorrt_llm==${TRTLLM_VERSION}" \
 && python3 -c "import tensorrt_llm, sys; from tensorrt_llm.llmapi import DFlashDecodingConfig as D; \
assert tensorrt_llm.__version__ == sys.argv[1], tensorrt_llm.__version__; \
assert 'FA4' in str(D.model_fields['attention_backend'].annotation), 'no FA4 drafter attention backend'" "${TRTLLM_VERSION}" \
 && command -v tritonserver && command -v trtllm-llmapi-launch
