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
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.paths import dflash_home
from dflash_trt.presets.embedded import EMBEDDED_ACCEPTANCE, embedded_drafter_path, ensure_embedded_target
from dflash_trt.presets.hub import HubMissing, download_command, download_config, find_config, is_hub_id, resolve_hub_id

# Marks a drafter dict as published figures (presets/configs/SOURCES.md), not a config.json: the
# planner reads only its shapes from it (deploy/planner.drafter_shape).
FIGURES_KEY = "published_figures"


def drafter_figures(source: str, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                    head_dim: int, vocab: int, block: int, target_layer_ids: list[int], target_layers: int,
                    sliding: int = 0, window: int | None = None, mask_token_id: int | None = None) -> dict:
    """A z-lab drafter's shapes as a config-shaped dict, where only its published figures are
    known: `sliding` leading sliding-window layers of `window` tokens, the rest full attention;
    `mask_token_id` only where a source gives it (the planner does not use it)."""
    d = {FIGURES_KEY: source, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
         "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": intermediate,
         "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
         "vocab_size": vocab, "block_size": block, "num_target_layers": target_layers,
         "layer_types": ["sliding_attention"] * sliding + ["full_attention"] * (layers - sliding),
         "dflash_config": {"target_layer_ids": list(target_layer_ids)}}
    if sliding:
        d.update(sliding_window=window, use_sliding_window=True)
    if mask_token_id is not None:
        d["dflash_config"]["mask_token_id"] = mask_token_id
    return d


@dataclass(frozen=True)
class Preset:
    name: str
    hf_id: str                 # the target on the Hugging Face hub
    drafter_hf_id: str | None  # its published DFlash drafter (None: ours, embedded)
    config_file: str           # presets/<file>: the target's config.json
    drafter_config_file: str | None = None
    revision: str | None = None           # the target's pinned hub commit (None: main)
    drafter_revision: str | None = None   # the drafter's (None: main; no published commit id found)
    block_size: int | None = None         # the drafter's trained block size (None: not published)
    # the drafter's published figures where its config.json is not shipped (drafter_figures());
    # None with neither: the planner plans the target alone
    drafter_shapes: dict | None = None
    # what the drafter accepts (plan --speed, build --draft-schedule auto): its published mean acceptance length
    # (tau, bonus token included; the source), or a file of this package measured by `dflash-trt bench` with the
    # acceptance per draft position (plan/speed.py resolve_acceptance reads it); neither: --tau is needed
    published_tau: tuple[float, str] | None = None
    acceptance_file: str | None = None

    def config(self) -> dict:
        return json.loads(resources.files("dflash_trt.presets.configs").joinpath(self.config_file).read_text())

    def drafter_config(self) -> dict | None:
        if self.drafter_config_file is None:
            return None
        return json.loads(resources.files("dflash_trt.presets.configs").joinpath(self.drafter_config_file).read_text())

    def drafter_plan_config(self) -> dict | None:
        """What the planner sizes the drafter from: its config.json, else its published figures."""
        return self.drafter_config() or (dict(self.drafter_shapes) if self.drafter_shapes else None)


# Source of the figures (presets/configs/SOURCES.md): the spec table built from the z-lab HF
# config.json files (search-index id 58668257119), head_dim from a second one (58740580347).
SPEC = "z-lab HF config.json spec table (58668257119); head_dim 128 / 64 (58740580347)"

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("gpt-oss-120b", "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", "gpt-oss-120b.json",
           revision="b5c939de8f754692c1647ca79fbf85e8c1e70f8a",
           drafter_revision="1278df34f0a7bd2c8588a27f49048aaa05c7db00", block_size=10,
           # block 10, SGLang on one H200, reasoning effort medium: HumanEval (coding, as NVIDIA's SPEED-Bench curve)
           published_tau=(4.4, "z-lab/gpt-oss-120b-DFlash model card: HumanEval, block 10, SGLang, 1 x H200 "
                               "(MBPP 4.6, MT-Bench 3.7, GSM8K 5.3, Math500 5.4)"),
           drafter_shapes=drafter_figures(SPEC + "; mask: llama.cpp fork test (63092383319)", layers=8, hidden=2880,
                                          intermediate=7680, heads=64, kv_heads=8, head_dim=64, vocab=201088, block=10,
                                          target_layer_ids=[1, 9, 17, 25, 33], target_layers=36,
                                          mask_token_id=200000)),
    Preset("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "gpt-oss-20b.json",
           revision="6cee5e81ee83917806bbde320786a8fb61efebee",
           drafter_revision="d53f6551543204c859e8bbaaddbd15d11b447af9", block_size=8,
           drafter_shapes=drafter_figures(SPEC, layers=8, hidden=2880, intermediate=7680, heads=64, kv_heads=8,
                                          head_dim=64, vocab=201088, block=8, target_layer_ids=[1, 6, 11, 16, 21],
                                          target_layers=24)),
    Preset("qwen3-8b", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3-8b.json",
           "qwen3-8b-dflash-b16.json", revision="b968826d9c46dd6066d109eabc6255188de91218",
           drafter_revision="9b41424b7109f9c5413454f481b09a82b85333f4", block_size=16),
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
           "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "llama-3.1-8b-instruct.json",
           revision="0e9e39f249a16976918f6564b8830bc894c89659",
           drafter_revision="d3af30def9601abdd10810aba220d692f0e803f0", block_size=10,
           # an SGLang decode log, "accept len: 6.10", one request: a weak source, said so
           published_tau=(6.1, "SGLang log of z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat, one request "
                               "(forums.developer.nvidia.com/t/359958)"),
           drafter_shapes=drafter_figures(SPEC, layers=5, hidden=4096, intermediate=12288, heads=32, kv_heads=8,
                                          head_dim=128, vocab=128256, block=10, target_layer_ids=[1, 8, 15, 22, 29],
                                          target_layers=32)),
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", None, "smollm2-135m.json",   # ours, embedded
           revision="4dc8c839ca5df567aa4f5c36798705eac8f35f0e", block_size=8, acceptance_file=EMBEDDED_ACCEPTANCE),
    # Qwen3.5 / 3.6 (vocab 248320; mask 248070 in several copies of these drafters' configs)
    Preset("qwen3.5-27b", "Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", "qwen3.5-27b.json",
           revision="fc05daec18b0a78c049392ed2e771dde82bdf654", block_size=16,
           drafter_shapes=drafter_figures(SPEC, layers=6, hidden=5120, intermediate=17408, heads=32, kv_heads=8,
                                          head_dim=128, vocab=248320, block=16, sliding=5, window=4096,
                                          target_layer_ids=[1, 10, 18, 27, 35, 44, 52, 61], target_layers=64)),
    Preset("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", "qwen3.5-35b-a3b.json",
           revision="59d61f3ce65a6d9863b86d2e96597125219dc754", block_size=16,
           drafter_shapes=drafter_figures(SPEC, layers=6, hidden=2048, intermediate=6144, heads=32, kv_heads=8,
                                          head_dim=128, vocab=248320, block=16, sliding=5, window=4096,
                                          target_layer_ids=[1, 6, 11, 16, 22, 27, 32, 37], target_layers=40)),
    Preset("qwen3.5-122b-a10b", "Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash",
           "qwen3.5-122b-a10b.json", block_size=16,
           drafter_shapes=drafter_figures(SPEC, layers=6, hidden=3072, intermediate=9216, heads=32, kv_heads=8,
                                          head_dim=128, vocab=248320, block=16, sliding=5, window=4096,
                                          target_layer_ids=[1, 7, 14, 20, 26, 32, 39, 45], target_layers=48)),
    # the drafter's shapes are not published in full (6 layers, hidden 4096, 8 target layers, 2.41 GiB):
    # planned as the target alone
    Preset("qwen3.5-397b-a17b", "Qwen/Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash",
           "qwen3.5-397b-a17b.json", block_size=16),
    # Qwen3.6: the configs are NVIDIA's NVFP4 checkpoints of Qwen/Qwen3.6-* (the drafters' targets)
    Preset("qwen3.6-27b", "nvidia/Qwen3.6-27B-NVFP4", "z-lab/Qwen3.6-27B-DFlash", "qwen3.6-27b-nvfp4.json",
           drafter_revision="0919688658996800f86b895034249700e9481106", block_size=16,
           drafter_shapes=drafter_figures(SPEC + "; mask: 61856208997", layers=5, hidden=5120, intermediate=17408,
                                          heads=32, kv_heads=8, head_dim=128, vocab=248320, block=16, sliding=4,
                                          window=2048, target_layer_ids=[1, 16, 31, 46, 61], target_layers=64,
                                          mask_token_id=248070)),
    Preset("qwen3.6-35b-a3b", "nvidia/Qwen3.6-35B-A3B-NVFP4", "z-lab/Qwen3.6-35B-A3B-DFlash",
           "qwen3.6-35b-a3b-nvfp4.json", block_size=16,
           drafter_shapes=drafter_figures(SPEC, layers=6, hidden=2048, intermediate=6144, heads=32, kv_heads=8,
                                          head_dim=128, vocab=248320, block=16, sliding=5, window=4096,
                                          target_layer_ids=[1, 6, 11, 16, 22, 27, 32, 37], target_layers=40)),
    # Gemma 4: 31B from NVIDIA's NVFP4 checkpoint of google/gemma-4-31B-it; 26B-A4B from the base
    # model's config (the drafter's target is the -it, same architecture)
    Preset("gemma-4-31b", "nvidia/Gemma-4-31B-IT-NVFP4", "z-lab/gemma-4-31B-it-DFlash", "gemma-4-31b-it-nvfp4.json",
           drafter_revision="eabd648301ce28583cc14757912e5e0f84e152e1", block_size=16,
           drafter_shapes=drafter_figures(SPEC, layers=5, hidden=5376, intermediate=10752, heads=64, kv_heads=8,
                                          head_dim=128, vocab=262144, block=16, sliding=4, window=2048,
                                          target_layer_ids=[1, 12, 23, 35, 46, 57], target_layers=60)),
    Preset("gemma-4-26b-a4b", "google/gemma-4-26B-A4B", "z-lab/gemma-4-26B-A4B-it-DFlash", "gemma-4-26b-a4b.json",
           drafter_revision="77d4202772dfe50b2396ec7bac9cfffc7b9e7057", block_size=16,
           drafter_shapes=drafter_figures(SPEC, layers=5, hidden=2816, intermediate=5632, heads=32, kv_heads=8,
                                          head_dim=128, vocab=262144, block=16, sliding=4, window=2048,
                                          target_layer_ids=[1, 6, 11, 17, 22, 27], target_layers=30)),
    # Kimi K2.x (DeepSeek-V3 layout)
    Preset("kimi-k2.5", "moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", "kimi-k2.5.json",
           revision="4d01dfe0332d63057c186e0b262165819efb6611",
           drafter_revision="e2db14df8337367b5eae8a6c206ea0d7d01a42a8", block_size=8,
           drafter_shapes=drafter_figures(SPEC + "; mask: vLLM Kimi DFlash test (68534717120)", layers=6, hidden=7168,
                                          intermediate=18432, heads=64, kv_heads=8, head_dim=128, vocab=163840,
                                          block=8, target_layer_ids=[1, 12, 24, 35, 47, 58], target_layers=61,
                                          mask_token_id=163838)),
    # the drafter is gated (config.json not readable anonymously): planned as the target alone
    Preset("kimi-k2.6", "nvidia/Kimi-K2.6-NVFP4", "z-lab/Kimi-K2.6-DFlash", "kimi-k2.6-nvfp4.json",
           drafter_revision="c1462ef46589f6ccb3eca424bffef94d72354ea9"),
    # GLM-5.1 (MLA + DSA indexer), MiniMax-M2.x: drafters gated or unpublished in figures
    Preset("glm-5.1", "zai-org/GLM-5.1-FP8", "z-lab/GLM-5.1-FP8-DFlash", "glm-5.1-fp8.json"),
    Preset("minimax-m2.5", "MiniMaxAI/MiniMax-M2.5", "z-lab/MiniMax-M2.5-DFlash", "minimax-m2.5.json"),
    Preset("minimax-m2.7", "MiniMaxAI/MiniMax-M2.7", "z-lab/MiniMax-M2.7-DFlash", "minimax-m2.7.json",
           revision="d494266a4affc0d2995ba1fa35c8481cbd84294b",
           drafter_revision="c36fb6e5ad86afc64ecc9824ab5a80d2ae640df3"),
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


@dataclass(frozen=True)
class Download:
    """A checkpoint a configs-only bundle still needs: its hub id, pinned revision and `hf download` line."""
    role: str                  # target | drafter
    hf_id: str | None          # None: a folder given without a hub id (the user knows where it comes from)
    revision: str | None
    command: str | None

    def to_dict(self) -> dict:
        return {"role": self.role, "hf_id": self.hf_id, "revision": self.revision, "command": self.command}


def missing_pair(target: str | None, drafter: str | None, first: HubMissing) -> DFlashError:
    """One line naming every download a build still needs, when the target (`first`) was not found:
    the drafter is looked up too, so the message names both `hf download` lines at once."""
    missing = [first]
    try:
        resolve_drafter(drafter, target)
    except HubMissing as e:
        missing.append(e)
    except DFlashError:
        pass
    return DFlashError(f"{' and '.join(m.what for m in missing)}: not here ("
                       + "; ".join(f"{m.what.split()[0]}: {m.looked}" for m in missing if m.looked)
                       + f") and {first.why}; on a machine with hub "
                       f"access run " + " and ".join(f"`{m.command}`" for m in missing)
                       + " (and point HF_HUB_CACHE at that cache); `dflash-trt build --configs-only` with the same "
                       "options writes every config, the plan and the rollout now")


def _staged_config(name: str, role: str, config: dict) -> Path:
    """$DFLASH_TRT_HOME/configs/<name>/<role>/config.json: a preset's shipped config as a folder (written once)."""
    dest = dflash_home() / "configs" / name.replace("/", "--") / role
    text = json.dumps(config, indent=2) + "\n"
    if (dest / "config.json").is_file() and (dest / "config.json").read_text() == text:
        return dest
    with atomic_output_dir(dest) as tmp:
        (tmp / "config.json").write_text(text)
    return dest


def resolve_config_pair(target: str | None, drafter: str | None) -> tuple[Path, Path, list[Download]]:
    """`build --configs-only`: (folder with the target's config.json, folder with the drafter's, the
    downloads the weights still need), before any weight exists here. A preset uses its shipped
    config (and its drafter's, or the drafter's published figures where they name mask_token_id);
    a hub id reads config.json from the cache or fetches that one file; a folder is taken as is."""
    def hub_dl(role, hf_id, rev):
        return Download(role, hf_id, rev, download_command(hf_id, rev or "main"))

    downloads: list[Download] = []
    if target is not None and Path(target).exists():
        tdir = Path(target)
        downloads.append(Download("target", None, None, None))
    elif target in PRESETS:
        p = PRESETS[target]
        tdir = find_config(p.hf_id, p.revision) or _staged_config(target, "target", p.config())
        downloads.append(hub_dl("target", p.hf_id, p.revision))
    elif target is not None and is_hub_id(target):
        try:
            tdir = download_config(target, None, "target")
        except HubMissing as e:   # name the drafter's config too, when it is missing as well
            missing = [e]
            if drafter is not None and not Path(drafter).exists() and is_hub_id(drafter):
                try:
                    download_config(drafter, None, "drafter")
                except HubMissing as e2:
                    missing.append(e2)
            raise DFlashError(f"{' and '.join(m.what for m in missing)}: no config.json here and {e.why}; on a "
                              "machine with hub access run " + " and ".join(f"`{m.command}`" for m in missing)
                              + " (and point HF_HUB_CACHE at that cache)") from None
        downloads.append(hub_dl("target", target, None))
    else:
        raise DFlashError(f"--target {target!r}: --configs-only takes a preset ({', '.join(sorted(PRESETS))}), a hub "
                          "id (org/name) or a folder with config.json")
    if drafter is not None and Path(drafter).exists():
        ddir = Path(drafter)
        downloads.append(Download("drafter", None, None, None))
    elif drafter is not None and is_hub_id(drafter):
        ddir = download_config(drafter, None, "drafter")
        downloads.append(hub_dl("drafter", drafter, None))
    elif drafter is None and target in PRESETS and PRESETS[target].drafter_hf_id:
        p = PRESETS[target]
        ddir = find_config(p.drafter_hf_id, p.drafter_revision)
        if ddir is None:
            cfg = p.drafter_config() or p.drafter_shapes
            if not cfg or "mask_token_id" not in cfg.get("dflash_config", {}):
                raise DFlashError(f"--configs-only: the config.json of {target}'s drafter {p.drafter_hf_id} is not "
                                  f"shipped (no published mask_token_id); run `hf download {p.drafter_hf_id}"
                                  + (f" --revision {p.drafter_revision}" if p.drafter_revision else "")
                                  + " config.json` and pass --drafter with its folder")
            ddir = _staged_config(target, "drafter", cfg)
        downloads.append(hub_dl("drafter", p.drafter_hf_id, p.drafter_revision))
    else:
        raise DFlashError("--configs-only: --drafter DIR|ORG/NAME is required when --target is not a preset with a "
                          "published drafter")
    for folder, role in ((tdir, "target"), (ddir, "drafter")):
        if not (Path(folder) / "config.json").is_file():
            raise DFlashError(f"{folder}: the {role} folder has no config.json")
    return Path(tdir).resolve(), Path(ddir).resolve(), downloads
