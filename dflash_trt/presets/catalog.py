"""Known (target, drafter) pairs, carried as data so that planning and config emission work
without downloading weights. The HF `config.json` of each target lives in presets/configs/*.json
(byte copies; provenance, and that of each pinned revision, in presets/configs/SOURCES.md).
Where a checkpoint's files are found or fetched: presets/hub.py."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.presets.embedded import embedded_drafter_path, ensure_embedded_target
from dflash_trt.presets.hub import is_hub_id, resolve_hub_id


@dataclass(frozen=True)
class Preset:
    name: str
    hf_id: str                 # the target on the Hugging Face hub
    drafter_hf_id: str | None  # its published DFlash drafter (None: ours, embedded)
    config_file: str           # presets/<file>: the target's config.json
    drafter_config_file: str | None = None
    revision: str | None = None           # the target's pinned hub commit (None: main)
    drafter_revision: str | None = None   # the drafter's (None: main; no published commit id found)

    def config(self) -> dict:
        return json.loads(resources.files("dflash_trt.presets.configs").joinpath(self.config_file).read_text())

    def drafter_config(self) -> dict | None:
        if self.drafter_config_file is None:
            return None
        return json.loads(resources.files("dflash_trt.presets.configs").joinpath(self.drafter_config_file).read_text())


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("gpt-oss-120b", "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", "gpt-oss-120b.json",
           revision="b5c939de8f754692c1647ca79fbf85e8c1e70f8a"),
    Preset("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "gpt-oss-20b.json",
           revision="6cee5e81ee83917806bbde320786a8fb61efebee"),
    Preset("qwen3-8b", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3-8b.json",
           "qwen3-8b-dflash-b16.json", revision="b968826d9c46dd6066d109eabc6255188de91218",
           drafter_revision="9b41424b7109f9c5413454f481b09a82b85333f4"),
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
           "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "llama-3.1-8b-instruct.json",
           revision="0e9e39f249a16976918f6564b8830bc894c89659",
           drafter_revision="d3af30def9601abdd10810aba220d692f0e803f0"),
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", None, "smollm2-135m.json",
           revision="4dc8c839ca5df567aa4f5c36798705eac8f35f0e"),
]}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise DFlashError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def resolve_target(spec: str | None) -> Path:
    """--target: a folder, a preset name or a hub id (`org/name`); None = the embedded default.
    Presets and hub ids are looked up, and fetched, as presets/hub.py says."""
    if spec is None or spec == "smollm2-135m":
        return ensure_embedded_target()
    if Path(spec).exists():
        return Path(spec)
    if spec in PRESETS:
        return resolve_hub_id(PRESETS[spec].hf_id, PRESETS[spec].revision, "target")
    if is_hub_id(spec):
        return resolve_hub_id(spec, None, "target")
    raise DFlashError(f"--target {spec!r}: no such folder, not a preset ({', '.join(sorted(PRESETS))}) "
                      "and not a hub id (org/name)")


def resolve_drafter(spec: str | None, target_spec: str | None = None) -> Path:
    """--drafter: a folder or a hub id; None = the preset's drafter (ours for the embedded default)."""
    if spec is not None:
        if Path(spec).exists():
            return Path(spec)
        if is_hub_id(spec):
            return resolve_hub_id(spec, None, "drafter")
        raise DFlashError(f"--drafter {spec}: no such folder and not a hub id (org/name)")
    if target_spec is None or target_spec == "smollm2-135m":
        return embedded_drafter_path()
    if target_spec in PRESETS and PRESETS[target_spec].drafter_hf_id:
        p = PRESETS[target_spec]
        return resolve_hub_id(p.drafter_hf_id, p.drafter_revision, "drafter")
    raise DFlashError("--drafter is required when --target is a folder or a hub id")
