# dflash-trt: `make run` (the main job) and `make test` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# OpenMP threads that busy-wait stall badly when anything else shares the 2 cores.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: run test bench setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: 2.13.0 is a local CPU wheel; any other torch would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# A real Triton server for the tests and `dflash-trt serve`: the tritonserver binary of the
	# nvidia-pytriton wheel, without its dependencies (it pins numpy<2); its Python-backend stub
	# gets numpy<2 from a side env (.venv/triton-stub), see dflash_trt/bundle/triton_server.py.
	$(BIN)/pip install -q --no-deps nvidia-pytriton==0.7.0
	$(BIN)/dflash-trt serve --make-stub-env
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m dflash_trt.main_job

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m dflash_trt.bench_all --out .bench

clean:
	rm -rf $(VENV) .bench engines/*/
