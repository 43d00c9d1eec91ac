"""The target's features (and teacher-forced labels) over training sequences: labelled once, on disk.

    sequences ──packed target forwards, on N ranks──▶ shards (safetensors) ──memory-mapped──▶ batches

Labelling. The sequences not yet on disk are dealt to the ranks (longest first, round robin, so
the token counts even out); each rank packs whole sequences into forwards of about
`pack_tokens` tokens through our target runtime's own layers (the code that captures the
features at decode time), with a block-diagonal causal mask and each sequence's own positions,
so every sequence sees only itself, as in a forward of its own (tests/test_features.py checks it
against TargetModel.forward in float64). pack_tokens=0 is one sequence per forward (as before
packing). With topk > 0 the same pass keeps the target's top-k next tokens and their
log-probabilities at every position.

Shards. A shard holds whole sequences: tensors `features` [n, n_feat*H] bf16 and, with labels,
`top_ids` [n, K] int32 and `top_logp` [n, K] float16; its safetensors metadata lists each
sequence's key (a hash of its tokens) and length. A shard is written once (temp + rename) and
never changed; the folder's shard headers are the index, read at start, so runs that share a
--feature-cache share every sequence already labelled, whoever labelled it. Multi-node runs need
the folder on storage every node sees (a ReadWriteMany volume): a rank that cannot see another
rank's shards says so.

Reading. safetensors' safe_open memory-maps each shard; `SequenceRows` reads one sequence's rows
at a time (get_slice), so a data set larger than RAM trains from disk: the pages a batch touches
are page cache (the kernel's to evict), not process memory.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import PROCESS_START, alive, io_failure
from dflash_trt.kernels import gemm
from dflash_trt.models.target import TargetModel, load_target
from dflash_trt.train.distributed import World

FORMAT = "dflash-trt-features/1"
PACK_TOKENS = 0             # tokens per labelling forward; 0: one sequence per forward (faster on CPU, measured: 76 vs 30 positions/s at 2048)
SHARD_TOKENS = 1 << 17      # tokens per shard: ~0.75 GB of SmolLM2-135M features (5.8 KB a token)
LOGIT_ROWS = 512            # lm_head rows per chunk: a [rows, vocab] float32 block at a time


class SequenceRows:
    """One tensor (features, top_ids or top_logp) of every sequence of a data set, read from the
    shards on demand. Indexed like the flat [N_tok, ...] tensor it stands for, by a slice that lies
    inside one sequence (data.seq(i), or a part of it)."""

    def __init__(self, name: str, offsets: torch.Tensor, locations: list[tuple], width: int, dtype: torch.dtype):
        self.name, self.locations = name, locations   # per sequence: (safe_open handle, first row)
        self.starts = offsets.tolist()
        self.shape = (self.starts[-1], width)
        self.dtype = dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, sl: slice) -> torch.Tensor:
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError("SequenceRows takes a slice within one sequence")
        i = bisect.bisect_right(self.starts, sl.start) - 1
        stop = self.starts[i + 1] if sl.stop is None else sl.stop
        if not (0 <= i < len(self.locations) and stop <= self.starts[i + 1]):
            raise IndexError(f"rows {sl.start}:{stop} are not inside one sequence")
        handle, first = self.locations[i]
        a = first + sl.start - self.starts[i]
        return handle.get_slice(self.name)[a:a + stop - sl.start]


# ------------------------------------------------------------------------------------ labelling
def _packed_forward(target: TargetModel, seqs: list[torch.Tensor], capture: list[int], topk: int):
    """TargetModel.forward over several sequences at once (block-diagonal causal mask, per-sequence
    positions): features [T, n*H] and, with topk, the top-k next tokens and log-probabilities.
    The loop is TargetModel.forward's; only the positions and the mask differ."""
    lens = torch.tensor([len(s) for s in seqs])
    T = int(lens.sum())
    tokens = torch.cat(seqs)
    seq_id = torch.repeat_interleave(torch.arange(len(seqs)), lens)
    pos = torch.arange(T) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    # index order within a sequence is position order, so the runtime's sliding-window test on
    # indices is the one on positions; other sequences are masked out entirely
    mask = (seq_id[None, :] == seq_id[:, None]) & (pos[None, :] <= pos[:, None])
    target.setup_cache(T + 1)
    cos, sin = target.rope(pos)
    with torch.no_grad():
        x = target.model.embed_tokens(tokens)
        feats, last = {}, target.num_layers - 1
        for i, layer in enumerate(target.model.layers):
            x = layer(x, cos, sin, 0, mask)
            if i in capture and i != last:
                feats[i] = x
        x = target.model.norm(x)
        if last in capture:
            feats[last] = x
        out = {"features": torch.cat([feats[i] for i in capture], -1).to(torch.bfloat16)}
        if topk:
            ids, logp = [], []
            for c in range(0, T, LOGIT_ROWS):
                lp, ix = torch.log_softmax(target.logits(x[c:c + LOGIT_ROWS]).float(), -1).topk(topk, -1)
                ids.append(ix.to(torch.int32))
                logp.append(lp.to(torch.float16))
            out.update(top_ids=torch.cat(ids), top_logp=torch.cat(logp))
    return out


def _single_forward(target: TargetModel, seq: torch.Tensor, capture: list[int], topk: int):
    """One sequence per forward, TargetModel.forward itself (the labelling before packing)."""
    target.setup_cache(len(seq) + 1)
    logits, feats = target(seq, 0, capture=capture, all_logits=bool(topk))
    out = {"features": feats.to(torch.bfloat16)}
    if topk:
        logp, ids = torch.log_softmax(logits.float(), -1).topk(topk, -1)
        out.update(top_ids=ids.to(torch.int32), top_logp=logp.to(torch.float16))
    return out


def _packs(items: list[tuple[str, torch.Tensor]], pack_tokens: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive items grouped up to pack_tokens tokens (a longer sequence alone)."""
    packs, cur, n = [], [], 0
    for it in items:
        if cur and n + len(it[1]) > pack_tokens:
            packs.append(cur)
            cur, n = [], 0
        cur.append(it)
        n += len(it[1])
    if cur:
        packs.append(cur)
    return packs


def label_sequences(target_dir: str | Path, data, layer_ids: list[int], cache_dir: Path, world: World | None = None,
                    progress: bool = True, dtype: torch.dtype = torch.float32, topk: int = 0,
                    pack_tokens: int = PACK_TOKENS, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Label every sequence of `data` not yet in the cache (this rank's share), write shards, wait
    for the other ranks, then point data.features (and data.top_ids / data.top_logp with topk)
    at the shards. Returns what was done: sequences and positions labelled here, seconds."""
    world = world or World()
    folder = shard_folder(target_dir, layer_ids, cache_dir, dtype, topk)
    folder.mkdir(parents=True, exist_ok=True)
    if world.main:
        _remove_stale_temps(folder)
    world.barrier("the feature cache check")
    keys = [hashlib.sha256(data.tokens[data.seq(i)].numpy().tobytes()).hexdigest()[:24] for i in range(len(data))]
    known = scan_shards(folder)
    todo = {}
    for i, k in enumerate(keys):
        if k not in known and k not in todo:
            todo[k] = data.tokens[data.seq(i)]
    # longest first, dealt round robin: every rank gets about the same number of tokens
    order = sorted(todo.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    mine = order[world.rank::world.size]
    report = {"sequences": len(mine), "positions": sum(len(t) for _, t in mine), "seconds": 0.0}
    if mine:
        t0 = time.perf_counter()
        target = load_target(target_dir, dtype=dtype)
        bar = tqdm(total=report["positions"], unit="tok", unit_scale=True, disable=not (progress and world.main),
                   desc=("target labels" if topk else "target features") + (f" (rank 0 of {world.size})"
                                                                           if world.distributed else ""),
                   file=sys.stderr, dynamic_ncols=True)
        buffer, buffered = [], 0
        for pack in _packs(mine, pack_tokens) if pack_tokens else [[it] for it in mine]:
            if len(pack) == 1 or (dtype == torch.float32 and sum(len(t) for _, t in pack) <= gemm.MAX_ROWS):
                # (the runtime's float32 C attention at decode sizes is causal over one sequence)
                outs = [_single_forward(target, t, layer_ids, topk) for _, t in pack]
            else:
                out = _packed_forward(target, [t for _, t in pack], layer_ids, topk)
                cuts = torch.tensor([len(t) for _, t in pack]).cumsum(0).tolist()
                outs = [{k: v[a:b] for k, v in out.items()} for a, b in zip([0] + cuts[:-1], cuts)]
            for (k, t), o in zip(pack, outs):
                buffer.append((k, o))
                buffered += len(t)
            bar.update(sum(len(t) for _, t in pack))
            if buffered >= shard_tokens:
                _write_shard(folder, buffer, world.rank)
                buffer, buffered = [], 0
        if buffer:
            _write_shard(folder, buffer, world.rank)
        bar.close()
        report["seconds"] = time.perf_counter() - t0
    world.barrier("labelling the features")
    attach(data, folder, keys, topk)
    return report


def shard_folder(target_dir, layer_ids, cache_dir: Path, dtype: torch.dtype, topk: int) -> Path:
    """One folder per (target config, captured layers, dtype, top-k): their features differ."""
    cfg_text = (Path(target_dir) / "config.json").read_text()
    salt = hashlib.sha256(json.dumps([FORMAT, layer_ids, cfg_text, str(dtype)] + ([topk] if topk else [])).encode()
                          ).hexdigest()[:12]
    return Path(cache_dir) / f"layers-{salt}"


def _write_shard(folder: Path, items: list[tuple[str, dict]], rank: int) -> None:
    keys = [k for k, _ in items]
    names = items[0][1].keys()
    tensors = {n: torch.cat([o[n] for _, o in items]).contiguous() for n in names}
    meta = {"format": FORMAT, "keys": json.dumps(keys), "lengths": json.dumps([len(o["features"]) for _, o in items])}
    name = f"shard-{hashlib.sha256(''.join(keys).encode()).hexdigest()[:16]}.safetensors"
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, folder / name)
    except Exception as e:  # OSError, or safetensors' own error type for a failed write
        tmp.unlink(missing_ok=True)
        why = io_failure(e) or (e.strerror if isinstance(e, OSError) else None)
        if why is None:
            raise
        raise DFlashError(f"{folder}: cannot write a feature shard ({why})") from None


def scan_shards(folder: Path) -> dict[str, tuple[Path, int, int]]:
    """key -> (shard file, first row, length), from the shard headers (nothing else is read)."""
    index = {}
    for path in sorted(Path(folder).glob("shard-*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                rows = f.get_slice("features").get_shape()[0]
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT}")
            keys, lengths = json.loads(meta["keys"]), json.loads(meta["lengths"])
            if len(keys) != len(lengths) or sum(lengths) != rows:
                raise ValueError(f"its metadata lists {sum(lengths)} rows in {len(keys)} sequences, it holds {rows}")
        except Exception as e:  # noqa: BLE001  safetensors raises its own error types for damaged files
            raise DFlashError(f"{path}: not a readable feature shard ({str(e).splitlines()[0][:160]}); delete it "
                              "to label those sequences again") from None
        first = 0
        for k, n in zip(keys, lengths):
            index.setdefault(k, (path, first, n))
            first += n
    return index


def attach(data, folder: Path, keys: list[str], topk: int) -> None:
    """data.features (+ top_ids, top_logp) as SequenceRows over the folder's shards."""
    index = scan_shards(folder)
    if missing := [i for i, k in enumerate(keys) if k not in index]:
        raise DFlashError(f"{folder}: {len(missing)} of {len(keys)} sequences have no features after labelling; "
                          "with several nodes the feature cache must be on storage every node sees")
    handles, locations = {}, []
    for i, k in enumerate(keys):
        path, first, n = index[k]
        if n != data.seq(i).stop - data.seq(i).start:
            raise DFlashError(f"{path}: sequence {k} has {n} rows, its tokens {data.seq(i).stop - data.seq(i).start}")
        if path not in handles:
            handles[path] = safe_open(str(path), "pt")
        locations.append((handles[path], first))
    h0 = next(iter(handles.values()))
    names = ["features"] + (["top_ids", "top_logp"] if topk else [])
    rows = {}
    for name in names:
        sl = h0.get_slice(name)
        width = sl.get_shape()[1]
        dt = {"BF16": torch.bfloat16, "I32": torch.int32, "F16": torch.float16}[sl.get_dtype()]
        rows[name] = SequenceRows(name, data.offsets, locations, width, dt)
    data.features = rows["features"]
    if topk:
        data.top_ids, data.top_logp = rows["top_ids"], rows["top_logp"]


def _remove_stale_temps(folder: Path) -> None:
    """`.<shard>.<pid>.tmp` files of labelling runs that were killed (their process is gone and
    started before this one), with a line saying so."""
    for f in folder.glob(".*.tmp"):
        pid = f.name.rsplit(".", 2)[-2]
        try:
            if pid.isdigit() and not alive(int(pid)) and f.stat().st_mtime < PROCESS_START:
                f.unlink()
                print(f"dflash-trt: removed {f}, left behind by an interrupted run (pid {pid})", file=sys.stderr)
        except OSError:
            continue
