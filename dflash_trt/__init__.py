"""dflash-trt: take a target LLM and its DFlash drafter to production on NVIDIA GPUs.

    from dflash_trt import load_pair, generate
    pair = load_pair("target_dir", "drafter_dir")
    print(generate(pair, "Write a haiku", max_new_tokens=64).text)
"""
import os
import time

__version__ = "0.1.0"

# How OpenMP threads wait between parallel regions, chosen before torch loads its OpenMP runtime (it reads the
# variables then): any `dflash_trt` import runs this first (only torch imported before it is out of reach); a
# user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. Measured on a 2-core Sapphire Rapids, the embedded pair in
# float32 (docs/decode-loop.md): idle, a short spin (GOMP_SPINCOUNT=10000) decodes at 24.2 (AR) / 26.8 (DFlash)
# tok/s against PASSIVE's 14.4 / 19.3 (a futex wake per op); beside one busy process, PASSIVE keeps 12.9 / 15.0
# and the short spin drops to 7.8 / 9.8 (libgomp's 300,000-spin default: 10x slower there, issue 33).
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_wait(loadavg: list[str], cpus: int) -> dict[str, str]:
    """The OpenMP wait settings for a host whose /proc/loadavg read `loadavg` (a few readings: its 4th field
    counts the runnable tasks, this one among them; the fewest counts, so that a process starting beside
    this one, as `| jq` does, is not taken for a busy neighbour)."""
    try:
        others = min(int(text.split()[3].split("/")[0]) for text in loadavg) - 1
    except (IndexError, ValueError):
        others = cpus   # unknown: assume a shared machine
    return {"GOMP_SPINCOUNT": "10000"} if 2 * others < cpus else {"OMP_WAIT_POLICY": "PASSIVE"}


def _read_loadavg(cpus: int, readings: int = 5, interval_s: float = 0.003) -> list[str]:
    """Up to `readings` /proc/loadavg texts 3 ms apart, stopping at the first that already shows a spare core
    (the fewest count decides, so later readings could not change the choice: no sleep on an idle host)."""
    out = []
    try:
        for _ in range(readings):
            with open("/proc/loadavg") as f:
                out.append(f.read())
            if "GOMP_SPINCOUNT" in openmp_wait(out[-1:], cpus):
                break
            time.sleep(interval_s)
    except OSError:
        return [""]
    return out


if not any(name in os.environ for name in OPENMP_WAIT_VARIABLES):
    _cpus = os.cpu_count() or 1
    os.environ.update(openmp_wait(_read_loadavg(_cpus), _cpus))


def __getattr__(name):  # lazy: `import dflash_trt` must not pull in torch
    if name in ("load_pair", "generate", "encode_prompt"):
        from dflash_trt.runtime import pair as api
        return getattr(api, name)
    raise AttributeError(name)
