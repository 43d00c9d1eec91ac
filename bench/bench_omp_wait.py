"""`dflash-trt bench` on a shared machine: OMP_WAIT_POLICY's effect beside one competing busy process.

Times `dflash-trt bench --limit 2 --max-new-tokens 32 --json` (the embedded pair, held-out prompts,
greedy; what issue 33 ran) in a fresh process per setting, while one `while True: pass` process
holds a core, and prints JSON: wall seconds, AR and DFlash tokens/s per setting.

Settings:
- default: neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT in the environment: dflash_trt/__init__.py
  `openmp_wait` chooses, PASSIVE beside the busy process (a short spin only on an otherwise idle host);
- libgomp_default: OMP_WAIT_POLICY="" (empty): kept by our setdefault, rejected by libgomp (it warns
  "Invalid value") which then runs its own default (spin, then sleep): what every command did
  before issue 33 with the variable unset;
- active (--with-active): OMP_WAIT_POLICY=ACTIVE, a user's own value (it wins over ours).

    python bench/bench_omp_wait.py [--with-active] [--timeout 900]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dflash_trt import OPENMP_WAIT_VARIABLES  # noqa: E402  (its own choice is filtered out of the children's env)
ARGV = ["bench", "--limit", "2", "--max-new-tokens", "32", "--json"]
SETTINGS = {"default": None, "libgomp_default": "", "active": "ACTIVE"}


def run(value: str | None, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARIABLES}
    if value is not None:
        env["OMP_WAIT_POLICY"] = value
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *ARGV], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"wall_s": round(time.perf_counter() - t0, 1), "timed_out": True}
    wall = time.perf_counter() - t0
    if p.returncode:
        return {"wall_s": round(wall, 1), "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    r = json.loads(p.stdout)
    return {"wall_s": round(wall, 1), "tokens_per_s_ar": r.get("tokens_per_s_ar"),
            "tokens_per_s_dflash": r.get("tokens_per_s_dflash"), "threads": r.get("threads"),
            "lossless": r.get("lossless")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--with-active", action="store_true", help="also time OMP_WAIT_POLICY=ACTIVE")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is stopped")
    a = ap.parse_args()
    names = [n for n in SETTINGS if a.with_active or n != "active"]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        out = {"command": "dflash-trt " + " ".join(ARGV), "competing": "1 busy process (python: while True: pass)",
               "cpus": os.cpu_count(), "settings": {}}
        for name in names:
            print(f"{name}: OMP_WAIT_POLICY={SETTINGS[name]!r}", file=sys.stderr, flush=True)
            out["settings"][name] = {"OMP_WAIT_POLICY": SETTINGS[name], **run(SETTINGS[name], a.timeout)}
    finally:
        busy.kill()
        busy.wait()
    s = out["settings"]
    if s["default"].get("tokens_per_s_ar") and s["libgomp_default"].get("wall_s"):
        out["libgomp_default_over_default_wall"] = round(s["libgomp_default"]["wall_s"] / s["default"]["wall_s"], 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
