"""Reading checkpoints: Hugging Face safetensors checkpoints one tensor at a time, checked
finite on the way (writing them is io/shards.py).

Every shard header is parsed and validated up front, so a bad checkpoint fails before any work is
done, with one line naming the file and tensor. Tensor bytes are memory-mapped and dropped again right
after use, so resident memory stays at about one tensor however large the checkpoint is.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io.formats import abs_max, block_abs_max
from dflash_trt.io.jsonio import read_json

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8, "I8": torch.int8,
    "U16": torch.uint16, "I16": torch.int16,
    "U32": torch.uint32, "I32": torch.int32,
    "U64": torch.uint64, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_COPY_SLICE = 64 * 2**20
_SCAN_SLICE = 16 * 2**20


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    begin: int   # absolute byte offset in the file
    nbytes: int


# ----------------------------------------------------------------------------------------------
# reading

def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and validate one safetensors file's header; returns (tensors, __metadata__)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DFlashError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:   # the file must hold the 8-byte length and then the n-byte header
                raise DFlashError(f"{path}: header of {n} bytes needs a file of at least {8 + n} bytes "
                                  f"(8-byte length + header), but the file has {size}")
            if n > MAX_HEADER_BYTES:
                raise DFlashError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            raw = f.read(n)
    except OSError as e:
        raise DFlashError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise DFlashError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise DFlashError(f"{path}: tensor {name!r}: header entry needs dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise DFlashError(f"{path}: tensor {name!r} has unknown dtype {entry['dtype']!r}")
        shape, offs = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise DFlashError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise DFlashError(f"{path}: tensor {name!r} has invalid data_offsets {offs!r}")
        begin, end = offs
        nbytes = math.prod(shape) * dtype_size(dtype)
        if end - begin != nbytes:
            raise DFlashError(f"{path}: tensor {name!r} data_offsets {offs} span {end - begin} bytes "
                              f"but {entry['dtype']}{shape} needs {nbytes}")
        if end > data_len:
            raise DFlashError(f"{path}: tensor {name!r} ends at data byte {end} but the file holds only "
                              f"{data_len} data bytes (truncated file or out-of-range offsets)")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, nbytes)
        spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise DFlashError(f"{path}: tensors {n0!r} and {n1!r} have overlapping data_offsets")
    # The safetensors library's own rule (safetensors/src/tensor.rs, Metadata::validate and
    # read_metadata, huggingface/safetensors@000a16f): tensors tile the data region exactly, from
    # byte 0 to the end of the file. A header length off by a few bytes (JSON that still parses)
    # would otherwise shift every tensor's bytes silently.
    expect = 0
    for b0, e0, n0 in spans:
        if b0 != expect:
            raise DFlashError(f"{path}: tensor {n0!r} starts at data byte {b0}, expected {expect} (tensors must "
                              "follow each other without gaps; wrong header length?)")
        expect = e0
    if expect != data_len:
        raise DFlashError(f"{path}: the tensors cover {expect} data bytes but the file has {data_len} after its "
                          "header (truncated, padded or wrong header length)")
    return tensors, metadata


def _safe_shard_path(folder: Path, index_file: Path, rel) -> Path:
    if not isinstance(rel, str) or not rel:
        raise DFlashError(f"{index_file}: weight_map entry {rel!r} is not a file name")
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")):
        raise DFlashError(f"{index_file}: weight_map names an absolute path {rel!r}; shards must lie in the checkpoint folder")
    if ".." in p.parts or ".." in rel.replace("\\", "/").split("/"):
        raise DFlashError(f"{index_file}: weight_map names {rel!r}, a path with '..'; shards must lie in the checkpoint folder")
    full = folder / p
    if not full.is_file():
        raise DFlashError(f"{index_file}: weight_map names shard {rel!r}, which does not exist")
    return inside_checkpoint(folder, full)


def inside_checkpoint(folder: Path, file: Path) -> Path:
    """`file`, if it lies in the checkpoint folder once symlinks are followed (realpath); else an
    error. A Hugging Face cache snapshot (models--org--name/snapshots/<rev>/) holds symlinks into
    that repo's blobs/ folder, which counts as inside."""
    real, root = Path(os.path.realpath(file)), Path(os.path.realpath(folder))
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(root.parent.parent / "blobs")
    if not any(real.is_relative_to(r) for r in roots):
        raise DFlashError(f"{file}: resolves to {real}, outside the checkpoint folder {root}; weight files "
                          "(and their symlinks) must lie inside it")
    return file


def _read_index(index_file: Path) -> dict:
    try:
        idx = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"{index_file}: cannot read index ({e})") from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise DFlashError(f"{index_file}: missing or empty 'weight_map'")
    return wm


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


def _populate(mm: mmap.mmap, start: int, length: int) -> None:
    """Map a range's pages in one call (Linux >= 5.14: MADV_POPULATE_READ reads them in and fills
    the page tables, instead of one fault per 16 pages later); elsewhere, read-ahead advice."""
    global _MADV_POPULATE_READ
    if _MADV_POPULATE_READ is not None:
        try:
            mm.madvise(_MADV_POPULATE_READ, start, length)
            return
        except OSError:
            _MADV_POPULATE_READ = None   # older kernel: EINVAL
    if hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED, start, length)


class CheckpointReader:
    """Memory-mapped, one-tensor-at-a-time reader for a Hugging Face checkpoint folder: `model.safetensors`,
    sharded safetensors with `model.safetensors.index.json`, or any other `*.safetensors` files. Pickle
    checkpoints (`*.bin`, `*.pt`) can run code when loaded, so they are refused unless `allow_pickle=True`,
    and then loaded only with `torch.load(weights_only=True)`."""

    def __init__(self, folder: str | Path, allow_pickle: bool = False):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise DFlashError(f"{self.folder}: checkpoint folder does not exist")
        self._infos: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._files: dict[Path, object] = {}
        self._pickled: dict[str, torch.Tensor] | None = None
        self.metadata: dict = {}
        st_index = self.folder / "model.safetensors.index.json"
        st_files = sorted(self.folder.glob("*.safetensors"))
        if st_index.is_file():
            wm = _read_index(st_index)
            shards: dict[Path, list[str]] = {}
            for name, rel in wm.items():
                shards.setdefault(_safe_shard_path(self.folder, st_index, rel), []).append(name)
            seen: dict[str, Path] = {}
            for shard, names in shards.items():
                tensors, _ = read_safetensors_header(shard)
                for name in tensors:
                    if name in seen:
                        raise DFlashError(f"{shard}: tensor {name!r} is also in {seen[name].name} (the index maps it to "
                                          f"{wm.get(name)!r}); a tensor must be stored in exactly one shard")
                    seen[name] = shard
                for name in names:
                    if name not in tensors:
                        raise DFlashError(f"{st_index}: tensor {name!r} is mapped to {shard.name}, which does not contain it")
                    self._infos[name] = tensors[name]
        elif st_files:
            for shard in st_files:
                tensors, meta = read_safetensors_header(inside_checkpoint(self.folder, shard))
                for name, info in tensors.items():
                    if name in self._infos:
                        raise DFlashError(f"{shard}: tensor {name!r} also appears in {self._infos[name].file.name}")
                    self._infos[name] = info
                self.metadata.update(meta)
        else:
            pickles = sorted(inside_checkpoint(self.folder, p) for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if not pickles:
                raise DFlashError(f"{self.folder}: no weights found (expected model.safetensors or model.safetensors.index.json)")
            if not allow_pickle:
                raise DFlashError(f"{pickles[0]}: pickle checkpoint refused (loading pickles can run arbitrary code); "
                                  "convert it to safetensors, or pass --allow-pickle to load it with torch.load(weights_only=True)")
            self._load_pickles(pickles)
        self._sort()

    def _sort(self) -> None:
        # Stream in file order, then byte order: sequential reads, one shard mapped at a time.
        self._order = sorted(self._infos, key=lambda k: (str(self._infos[k].file), self._infos[k].begin))

    def _load_pickles(self, files: list[Path]) -> None:
        self._pickled = {}
        for f in files:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises many types for bad pickles
                raise DFlashError(f"{f}: cannot load with torch.load(weights_only=True): {str(e).splitlines()[0]}") from None
            if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
                sd = sd["state_dict"]
            for name, t in sd.items():
                if not isinstance(t, torch.Tensor):
                    continue
                self._pickled[name] = t
                self._infos[name] = TensorInfo(name, t.dtype, tuple(t.shape), f, 0, t.numel() * t.element_size())

    # -- API --------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._order)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise DFlashError(f"{self.folder}: no tensor named {name!r}") from None

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        i = self.info(name)
        return i.dtype, i.shape

    def file_of(self, name: str) -> Path:
        return self.info(name).file

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def get(self, name: str) -> torch.Tensor:
        """The tensor as an owned CPU tensor (a copy). Streaming passes use `view` instead."""
        info = self.info(name)
        if self._pickled is not None:
            return self._pickled[name].clone()
        out = torch.empty(info.shape, dtype=info.dtype)
        if info.nbytes == 0:
            return out
        fd = self._open(info.file).fileno()
        # pread straight into the tensor: one copy from the page cache, and no mapped pages left
        # behind in this process for a tensor the caller keeps.
        dst = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        pos = 0
        while pos < info.nbytes:
            n = os.preadv(fd, [dst[pos:min(pos + _COPY_SLICE, info.nbytes)]], info.begin + pos)
            if n <= 0:
                raise DFlashError(f"{info.file}: tensor {name!r} ends past the end of the file (truncated?)")
            pos += n
        return out

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of its shard's memory map (streaming quantization measured ~2x
        faster than pread into buffers): call `release(name)` when done with it. The view stays valid after
        the reader is closed (it holds its map); writes through it never reach the file (a private mapping)."""
        info = self.info(name)
        if self._pickled is not None:
            return self._pickled[name]
        if info.nbytes == 0 or info.begin % dtype_size(info.dtype):
            return self.get(name)   # (an unaligned tensor cannot be viewed as its dtype)
        mm = self._map(info.file)
        start = info.begin - info.begin % mmap.PAGESIZE
        _populate(mm, start, info.begin + info.nbytes - start)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.begin)
        return flat.view(info.dtype).reshape(info.shape)

    def release(self, name: str) -> None:
        """Drop the pages of a viewed tensor from this process (they stay in the page cache)."""
        info = self.info(name)
        mm = self._maps.get(info.file)
        if mm is not None and info.nbytes and hasattr(mmap, "MADV_DONTNEED"):
            start = info.begin - info.begin % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, info.begin + info.nbytes - start)

    def iter_slices(self, name: str, max_bytes: int = _SCAN_SLICE) -> Iterator[tuple[int, torch.Tensor]]:
        """(first flat index, a flat view of the next elements) over a tensor, at most `max_bytes`
        mapped at a time and dropped after use: a scan of any checkpoint in bounded memory."""
        info = self.info(name)
        if self._pickled is not None or info.nbytes == 0 or info.begin % dtype_size(info.dtype):
            flat = self.get(name).reshape(-1) if self._pickled is None else self._pickled[name].reshape(-1)
            step = max(1, max_bytes // max(1, flat.element_size()))
            for i in range(0, flat.numel(), step):
                yield i, flat[i:i + step]
            return
        mm, esize = self._map(info.file), dtype_size(info.dtype)
        step = max(esize, max_bytes - max_bytes % esize)
        for off in range(0, info.nbytes, step):
            n = min(step, info.nbytes - off)
            start = info.begin + off
            page = start - start % mmap.PAGESIZE
            _populate(mm, page, start + n - page)
            yield off // esize, torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=start).view(info.dtype)
            if hasattr(mmap, "MADV_DONTNEED"):
                mm.madvise(mmap.MADV_DONTNEED, page, start + n - page)

    def split(self, name: str, pieces: list[tuple[str, tuple[int, ...]]]) -> None:
        """Present one stored tensor as consecutive pieces that tile its bytes in order (e.g. a fused
        3-D experts tensor as per-expert matrices): each piece reads, views and releases like a
        stored tensor, with no copy."""
        info = self.info(name)
        begin, size = info.begin, dtype_size(info.dtype)
        for new, shape in pieces:
            nbytes = math.prod(shape) * size
            self._infos[new] = TensorInfo(new, info.dtype, tuple(shape), info.file, begin, nbytes)
            if self._pickled is not None:
                flat = self._pickled[name].reshape(-1)
                start = (begin - info.begin) // size
                self._pickled[new] = flat[start:start + nbytes // size].view(shape)
            begin += nbytes
        if begin != info.begin + info.nbytes:
            raise ValueError(f"the pieces of {name} do not tile it")
        del self._infos[name]
        if self._pickled is not None:
            del self._pickled[name]
        self._sort()

    def get_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """rows of a 2-D tensor (e.g. embeddings for some token ids) without reading the rest."""
        info = self.info(name)
        if self._pickled is not None:
            return self._pickled[name][rows].clone()
        if len(info.shape) != 2:
            raise DFlashError(f"{info.file}: tensor {name!r} is not 2-D")
        mm = self._map(info.file)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.begin)
        row_bytes = flat.view(info.shape[0], -1)
        out = row_bytes[rows].clone().view(info.dtype).reshape(len(rows), info.shape[1])
        del flat, row_bytes
        return out

    def _open(self, path: Path):
        """The shard's file for pread, opened once; one is open at a time (streaming goes file by file)."""
        f = self._files.get(path)
        if f is None:
            for other in self._files.values():
                other.close()
            self._files.clear()
            f = self._files[path] = open(path, "rb")
        return f

    def _map(self, path: Path) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is None:
            # ACCESS_COPY gives a writable (private, copy-on-write) view that torch.frombuffer
            # accepts without a warning; nothing is ever written through it.
            with open(path, "rb") as f:
                mm = self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return mm

    def _close_maps(self) -> None:
        # Maps are dropped, never closed: a tensor from view() holds a reference to its map, so
        # the map is unmapped when the last such tensor is freed (closing it would leave the
        # tensor pointing at unmapped memory).
        self._maps.clear()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def close(self) -> None:
        self._close_maps()
        self._pickled = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_config(folder: str | Path) -> dict:
    """The folder's config.json as a dict, with a one-line error if missing or invalid."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise DFlashError(f"{path}: missing (a Hugging Face checkpoint folder needs a config.json)")
    return read_json(path)


def check_finite(name: str, tensor: torch.Tensor, file: str | Path | None = None) -> torch.Tensor | None:
    """Raise if a floating-point tensor holds NaN or Inf (quantization would silently spread
    it). Returns max |tensor| as an fp32 scalar (None for non-float tensors), which callers
    reuse as the quantization amax: one pass over the data does both (amax propagates NaN/Inf)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    amax, finite = abs_max(_wide(tensor))
    if not finite:
        raise DFlashError(_nonfinite_message(name, tensor, file))
    return amax


def check_finite_blocks(name: str, tensor: torch.Tensor, file: str | Path | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """check_finite for a weight NVFP4 will encode: (amax, each 16-block's max |x| or None),
    from the same one pass (formats.block_abs_max)."""
    amax, finite, bmax = block_abs_max(tensor)
    if not finite:
        raise DFlashError(_nonfinite_message(name, tensor, file))
    return amax, bmax


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in a dtype torch reduces over (FP8 widened to fp32)."""
    return t if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else t.float()


def _nonfinite_message(name: str, t: torch.Tensor, file: str | Path | None, offset: int = 0) -> str:
    t = _wide(t)
    idx = int((~torch.isfinite(t)).reshape(-1).nonzero()[0])
    bad = "NaN" if bool(torch.isnan(t.reshape(-1)[idx])) else "Inf"
    where = f"{file}: " if file else ""
    return f"{where}tensor {name!r} contains {bad} (first at flat index {offset + idx})"


def nonfinite_tensors(reader: CheckpointReader, limit: int = 20) -> list[str]:
    """One line per floating-point tensor holding NaN or Inf (the first `limit`), from a streaming
    scan: at most _SCAN_SLICE bytes of the checkpoint are mapped at a time (C kernel where built)."""
    found = []
    for name in reader.keys():
        info = reader.info(name)
        if not info.dtype.is_floating_point:
            continue
        for offset, flat in reader.iter_slices(name):
            if not abs_max(_wide(flat))[1]:
                found.append(_nonfinite_message(name, flat, info.file, offset))
                break
        if len(found) >= limit:
            break
    return found
