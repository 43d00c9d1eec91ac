"""Known (target, drafter) pairs, carried as data so that planning and config emission work
without downloading weights. The HF `config.json` of each target lives in preset_configs/*.json
(byte copies; provenance in preset_configs/SOURCES.md)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.paths import dflash_home
from dflash_trt.presets.embedded import embedded_drafter_path, ensure_embedded_target


@dataclass(frozen=True)
class Preset:
    name: str
    hf_id: str                 # the target on the Hugging Face hub
    drafter_hf_id: str | None  # its published DFlash drafter (None: ours, embedded)
    config_file: str           # presets/<file>: the target's config.json
    drafter_config_file: str | None = None

    def config(self) -> dict:
        return json.loads(resources.files("dflash_trt.presets.configs").joinpath(self.config_file).read_text())

    def drafter_config(self) -> dict | None:
        if self.drafter_config_file is None:
            return None
        return json.loads(resources.files("dflash_trt.presets.configs").joinpath(self.drafter_config_file).read_text())


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("gpt-oss-120b", "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", "gpt-oss-120b.json"),
    Preset("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "gpt-oss-20b.json"),
    Preset("qwen3-8b", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3-8b.json",
           "qwen3-8b-dflash-b16.json"),
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
           "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "llama-3.1-8b-instruct.json"),
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", None, "smollm2-135m.json"),
]}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise DFlashError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def find_local_snapshot(hf_id: str) -> Path | None:
    """A model already on disk: $DFLASH_TRT_HOME/models/<org>--<name>, or the local Hugging Face
    hub cache (models--org--name/snapshots/<rev>). No network access."""
    mine = dflash_home() / "models" / hf_id.replace("/", "--")
    if (mine / "config.json").exists():
        return mine
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
    snaps = hub / f"models--{hf_id.replace('/', '--')}" / "snapshots"
    if snaps.is_dir():
        for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            if (snap / "config.json").exists():
                return snap
    return None


def resolve_target(spec: str | None) -> Path:
    """--target: a folder, or a preset name found locally; None = the embedded default."""
    if spec is None or spec == "smollm2-135m":
        return ensure_embedded_target()
    if Path(spec).exists():
        return Path(spec)
    if spec not in PRESETS:
        raise DFlashError(f"--target {spec!r}: no such folder and not a preset ({', '.join(sorted(PRESETS))})")
    p = PRESETS[spec]
    found = find_local_snapshot(p.hf_id)
    if found is None:
        raise DFlashError(f"preset {spec}: weights of {p.hf_id} not found locally; fetch them on a machine with hub "
                          f"access: `huggingface-cli download {p.hf_id}` (or place them in {dflash_home() / 'models'})")
    return found


def resolve_drafter(spec: str | None, target_spec: str | None = None) -> Path:
    """--drafter: a folder; None = the preset's drafter (ours for the embedded default)."""
    if spec is not None:
        if not Path(spec).exists():
            raise DFlashError(f"--drafter {spec}: no such folder")
        return Path(spec)
    if target_spec is None or target_spec == "smollm2-135m":
        return embedded_drafter_path()
    if target_spec in PRESETS and PRESETS[target_spec].drafter_hf_id:
        hf_id = PRESETS[target_spec].drafter_hf_id
        found = find_local_snapshot(hf_id)
        if found is None:
            raise DFlashError(f"drafter {hf_id} not found locally; `huggingface-cli download {hf_id}`")
        return found
    raise DFlashError("--drafter is required when --target is a folder")
