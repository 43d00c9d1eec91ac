"""`check`: is this (target, drafter) pair consistent? The one validation layer for model folders:
config rules (models/config.py), the relations between the two configs, tensor shapes and dtypes
from the safetensors headers, and, with `scan=True`, a streaming scan for NaN / Inf weights.

`check_pair` lists every problem; `require_pair` / `require_target` raise the first one with the
same message, and are what every command that loads a model runs before any heavy work.
"""
from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader, nonfinite_tensors
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import (
    MAX_BLOCK,  # noqa: F401  (re-exported: the bound's historical home)
    DrafterConfig,
    decoder_config,
    drafter_config_problems,
    raise_first,
    target_config_problems,
)
from dflash_trt.models.draft_vocab import read_draft_vocab
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.shapes import expected_shape
from dflash_trt.models.target import SUPPORTED, build_target, stop_token_ids
from dflash_trt.models.weights import format_problems, quantized_weights, scale_tensors, weight_format

NONFINITE_NOTE = "non-finite weights"  # marks the scan's problems (build/generate --allow-nonfinite)


def _read_config(folder: Path, what: str, problems: list[str]) -> dict | None:
    if not folder.is_dir():
        problems.append(f"{folder}: the {what} is a file; expected a checkpoint folder (config.json + *.safetensors)"
                        if folder.exists() else f"{folder}: the {what} folder does not exist")
        return None
    try:
        return read_json(folder / "config.json")
    except DFlashError as e:
        problems.append(str(e))
        return None


def check_pair(target_dir: str | Path, drafter_dir: str | Path, scan: bool = False, allow_pickle: bool = False) -> dict:
    """Every problem found, each a line naming the field. Never raises for a bad pair. With
    scan=True, every floating-point weight of both checkpoints is read once (streaming) and
    NaN / Inf is reported per tensor (report["nonfinite"]). Pickle weights are refused unless
    allow_pickle (their headers are then read with torch.load(weights_only=True))."""
    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    problems: list[str] = []
    report = {"ok": False, "problems": problems, "target_layer_ids": None, "block_size": None, "mask_token_id": None}
    tcfg = _read_config(target_dir, "target", problems)
    if tcfg is not None:
        tprobs = target_config_problems(tcfg, str(target_dir / "config.json"))
        problems += tprobs
        if tprobs:
            tcfg = None
        else:
            problems += _check_target_tensors(target_dir, tcfg, allow_pickle)
            try:
                stop_token_ids(target_dir)   # generation_config.json: what generate stops on
            except DFlashError as e:
                problems.append(str(e))
    raw = _read_config(drafter_dir, "drafter", problems)
    dcfg = None
    if raw is not None:
        dpath = str(drafter_dir / "config.json")
        try:
            if raw.get("speculators_model_type") == "dflash":
                dcfg = DrafterConfig.from_dict(raw, dpath)
            else:
                dprobs = drafter_config_problems(raw, dpath)
                problems += dprobs
                dcfg = None if dprobs else DrafterConfig.from_dict(raw, dpath)
        except DFlashError as e:
            problems.append(str(e))
    if dcfg is not None:
        report.update(target_layer_ids=dcfg.target_layer_ids, block_size=dcfg.block_size,
                      mask_token_id=dcfg.mask_token_id)
        problems += _check_drafter_tensors(drafter_dir, dcfg, allow_pickle)
    if tcfg is not None:
        report["runtime_note"] = runtime_coverage(tcfg)
    if tcfg is not None and dcfg is not None:
        problems += _check_against_target(target_dir, decoder_config(tcfg), dcfg)
        try:   # the runtime drafts from it: generate refuses a bad one, so check does too
            read_draft_vocab(drafter_dir, decoder_config(tcfg)["vocab_size"])
        except DFlashError as e:
            problems.append(str(e))
    if scan:
        report["nonfinite"] = []
        for folder, ok in ((target_dir, tcfg is not None), (drafter_dir, dcfg is not None)):
            if ok:
                report["nonfinite"] += _scan(folder)
        problems += [f"{p} ({NONFINITE_NOTE})" for p in report["nonfinite"]]
    report["ok"] = not problems
    return report


def runtime_coverage(cfg: dict) -> str | None:
    """None when the CPU reference runtime runs this target's family; else the one line `check`
    and `build` print (the bundle is still built: quantize, convert and the serving configs work
    by config; generate / bench / the Triton reference model need the runtime)."""
    mt = decoder_config(cfg).get("model_type") or cfg.get("model_type")
    if mt in SUPPORTED or cfg.get("model_type") in SUPPORTED:   # (kimi_k25: its text_config says kimi_k2)
        return None
    return (f"note: the CPU reference runtime does not cover model_type {mt!r} (it runs {', '.join(SUPPORTED)}); "
            "the bundle's serving configs and quantized checkpoints do not need it, but generate, bench and the "
            "Triton reference model do")


def _check_against_target(target_dir: Path, t: dict, d: DrafterConfig) -> list[str]:
    p = []
    if t["hidden_size"] != d.hidden_size:
        p.append(f"hidden_size: drafter {d.hidden_size} != target {t['hidden_size']} (the drafter must match its target)")
    L = t["num_hidden_layers"]
    bad = [i for i in d.target_layer_ids if not 0 <= i < L]
    if bad:
        p.append(f"dflash_config.target_layer_ids {bad} out of range for a target with {L} layers (valid 0..{L - 1})")
    if d.num_target_layers is not None and d.num_target_layers != L:
        p.append(f"num_target_layers = {d.num_target_layers} but the target has num_hidden_layers = {L}")
    V = t["vocab_size"]
    if not 0 <= d.mask_token_id < V:
        p.append(f"dflash_config.mask_token_id = {d.mask_token_id} outside the target vocabulary (0..{V - 1})")
    if d.vocab_size != V:
        p.append(f"vocab_size: drafter {d.vocab_size} != target {V}")
    try:
        tok_len = _tokenizer_size(target_dir)
    except DFlashError as e:
        return p + [str(e)]
    if tok_len is not None and tok_len > V:
        p.append(f"tokenizer has {tok_len} tokens but target vocab_size is {V}")
    return p


def _tokenizer_size(folder: Path) -> int | None:
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    tok = read_json(path)
    model, added = tok.get("model"), tok.get("added_tokens") or []
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    ids += [a.get("id") for a in added if isinstance(a, dict)] if isinstance(added, list) else []
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else None


def _check_target_tensors(folder: Path, cfg: dict, allow_pickle: bool = False) -> list[str]:
    """Header shapes against config.json (models/shapes.expected_shape), before anything is
    allocated. A quantized target (a bundle's target/: models/weights.WEIGHT_FORMATS) is checked in
    its stored form, packed weights and their scales, as the runtime loads it."""
    try:
        with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
            metas = {k: r.meta(k) for k in r.keys()}
            files = {k: r.file_of(k) for k in r.keys()}
            quantized = quantized_weights(r)
            side = scale_tensors(r)
            implied = {k: want for k in quantized if (want := expected_shape(k, cfg)) is not None}
            p = format_problems(r, implied)
    except DFlashError as e:
        return [str(e)]
    for name, (_, got) in metas.items():
        want = expected_shape(name, cfg)
        if want is not None and name in quantized:
            want = quantized[name].stored_shape(tuple(want))
        if want is not None and tuple(got) != tuple(want):
            p.append(f"{files[name]}: tensor {name!r} has shape {list(got)} but {folder / 'config.json'} implies "
                     f"{list(want)}" + (f" ({quantized[name].name})" if name in quantized else ""))
    try:
        model = _runtime_model(cfg)
    except DFlashError as e:
        return p + [str(e).replace("config.json:", f"{folder / 'config.json'}:", 1)]
    if model is not None:
        # the names the runtime loads (load_target: MXFP4 *_blocks + *_scales become one dense
        # tensor; a family's state_name renames or skips, e.g. a multimodal wrapper's vision tower;
        # a tied lm_head is not read)
        expected = set(model.state_dict())
        stored = {k.removesuffix("_blocks") for k in metas if not k.endswith("_scales") and k not in side}
        if (rename := getattr(model, "state_name", None)) is not None:
            stored = {n for n in map(rename, stored) if n is not None}
        if getattr(model, "tied", cfg.get("tie_word_embeddings")):
            stored.discard("lm_head.weight")
        p += [f"{folder}: target tensor {k} missing (config.json implies it)" for k in sorted(expected - stored)]
        p += [f"{files.get(k, folder)}: unexpected target tensor {k!r} for this config" for k in sorted(stored - expected)]
    return p[:20]


def _runtime_model(cfg: dict):
    """The runtime's model for this config, built on the meta device (no memory: its state-dict
    names and shapes), or None for a family the CPU runtime does not run."""
    import torch

    if cfg.get("model_type") not in SUPPORTED:
        return None
    try:
        with torch.device("meta"):
            return build_target(cfg, max_len=1)   # (hf_config: a DFlashError if transformers refuses)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, RuntimeError) as e:
        # a field the rules above do not cover (family-specific) that the runtime cannot build from
        raise DFlashError(f"config.json: the runtime cannot build a {cfg['model_type']} model from it "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _check_drafter_tensors(folder: Path, d: DrafterConfig, allow_pickle: bool = False) -> list[str]:
    try:
        with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
            metas = {k.removeprefix("model."): r.meta(k) for k in r.keys()}
            # a quantized drafter's weights (models/weights.WEIGHT_FORMATS): checked in their stored form
            quantized = {k.removeprefix("model."): f for k in r.keys() if (f := weight_format(r, k)) is not None}
    except DFlashError as e:
        return [str(e)]
    import torch

    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in DFlashDrafter(d, max_len=1).state_dict().items()}
    except DFlashError as e:
        return [str(e).replace("config.json:", f"{folder / 'config.json'}:", 1)]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, RuntimeError) as e:
        return [f"{folder / 'config.json'}: the runtime cannot build the drafter from it "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    p = []
    for k, shape in expected.items():
        fmt = quantized.get(k)
        if fmt is not None:
            shape = fmt.stored_shape(shape)
        if k not in metas:
            p.append(f"drafter tensor {k} missing")
        elif tuple(metas[k][1]) != shape:
            p.append(f"drafter tensor {k} has shape {tuple(metas[k][1])}, config implies {shape}"
                     + (f" ({fmt.name})" if fmt else ""))
        elif fmt is None and not metas[k][0].is_floating_point:
            p.append(f"drafter tensor {k} has dtype {metas[k][0]}, expected a floating-point dtype")
    return p[:20]


def _scan(folder: Path) -> list[str]:
    try:
        with CheckpointReader(folder, allow_pickle=False) as r:
            return nonfinite_tensors(r)
    except DFlashError:
        return []   # unreadable or pickled: reported by the header checks, or scanned when loaded


def require_pair(target_dir: str | Path, drafter_dir: str | Path, allow_pickle: bool = False) -> None:
    """Refuse what `check` refuses (headers and configs only), with its first message."""
    raise_first(check_pair(target_dir, drafter_dir, allow_pickle=allow_pickle)["problems"])


def require_checkpoint_config(folder: str | Path) -> dict:
    """A checkpoint folder's config.json, by the rules of what it is (a DFlash drafter or a
    target): for commands that take either (quantize, convert)."""
    folder = Path(folder)
    problems: list[str] = []
    cfg = _read_config(folder, "checkpoint", problems)
    if cfg is not None:
        path = str(folder / "config.json")
        drafter = "DFlashDraftModel" in (cfg.get("architectures") or []) if isinstance(cfg.get("architectures"),
                                                                                      list) else False
        problems += drafter_config_problems(cfg, path) if drafter else target_config_problems(cfg, path)
    raise_first(problems)
    return cfg


def require_target(target_dir: str | Path, allow_pickle: bool = False) -> None:
    """`check`'s target rules alone (plain AR decoding has no drafter)."""
    target_dir = Path(target_dir)
    problems: list[str] = []
    cfg = _read_config(target_dir, "target", problems)
    if cfg is not None:
        problems += target_config_problems(cfg, str(target_dir / "config.json"))
        if not problems:
            problems += _check_target_tensors(target_dir, cfg, allow_pickle)
            try:
                stop_token_ids(target_dir)
            except DFlashError as e:
                problems.append(str(e))
    raise_first(problems)
