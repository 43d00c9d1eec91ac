# The CPU smoke-test image of the chart's --gpu none rollout: Triton (the chart's stock
# tritonserver:26.07-trtllm-python-py3, its tritonserver and Python backend) with dflash-trt installed,
# which the bundle's dflash_reference model (triton/dflash_reference/1/model.py) imports. The stock image
# alone cannot start that model ("No module named 'dflash_trt'"). engines.json `cpu_reference` names this
# image; the chart runs it for a bundle built with --gpu none (or deploy --gpu none). From the repository root:
#   docker build -f deploy/triton-cpu.Dockerfile -t REGISTRY/dflash-trt-triton-cpu:0.1.0 .
#   docker push REGISTRY/dflash-trt-triton-cpu:0.1.0
#   dflash-trt deploy --bundle B --image REGISTRY/dflash-trt-triton-cpu:0.1.0
# (kind / minikube: build it as dflash-trt-triton-cpu:0.1.0, the chart's default, and load it into the cluster.)
# The image's own torch (a CUDA build, which also runs on CPU) stays: pyproject admits torch 2.4 - 2.14.1, so
# pip keeps it rather than fetching another. Pin BASE by digest for a reproducible build.
ARG BASE=nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3
FROM ${BASE}
LABEL dflash-trt.role=cpu-reference
COPY pyproject.toml setup.py MANIFEST.in README.md /src/dflash-trt/
COPY dflash_trt /src/dflash-trt/dflash_trt
COPY deploy /src/dflash-trt/deploy
# [serve]: tritonclient for `dflash-trt serve` clients; the model itself needs only the base dependencies
RUN python3 -m pip install --no-cache-dir "/src/dflash-trt[serve]" \
 && rm -rf /src/dflash-trt \
 && python3 -c "import dflash_trt.runtime.pair, dflash_trt.stacks.tritonserver, torch, transformers; \
print('dflash-trt', dflash_trt.__file__, 'torch', torch.__version__)" \
 && command -v tritonserver && dflash-trt --help >/dev/null
