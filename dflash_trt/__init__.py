"""dflash-trt: take a target LLM and its DFlash drafter to production on NVIDIA GPUs.

    from dflash_trt import load_pair, generate
    pair = load_pair("target_dir", "drafter_dir")
    print(generate(pair, "Write a haiku", max_new_tokens=64).text)
"""
import os

__version__ = "0.1.0"

# Shared CPUs: OpenMP threads that spin while they wait for a busy core make every torch op 10-20x
# slower (issue 33: `dflash-trt bench`, 2 prompts x 32 tokens beside one busy process, 391 s without
# this and 42 s with it; bench/bench_omp_wait.py measures it); passive waiting costs nothing when the
# machine is idle. OpenMP reads the variable once, when torch loads its runtime, so it is set here:
# every `dflash-trt` command (cli.py imports this package first), the facade below and any
# `dflash_trt.<module>` import run this before torch can be imported through us. A user's own
# value wins (setdefault); only torch imported before dflash_trt is out of reach.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def __getattr__(name):  # lazy: `import dflash_trt` must not pull in torch
    if name in ("load_pair", "generate", "encode_prompt"):
        from dflash_trt.runtime import pair as api
        return getattr(api, name)
    raise AttributeError(name)
