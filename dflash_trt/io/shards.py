"""Writing checkpoints: size-capped safetensors shards streamed tensor by tensor at their planned
offsets (ShardedWriter), a whole small state dict byte-reproducibly (save_safetensors), and the
byte-counting progress bar of a streaming pass. Reading is io/checkpoint.py."""
from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import disk_error, write_text
from dflash_trt.io.checkpoint import DTYPE_NAMES, dtype_size
from dflash_trt.io.direct_io import BLOCK, DirectWriter, OutFile


class Progress(tqdm):
    """A tqdm bar on stderr counting bytes, with the tensor count as its postfix."""

    def __init__(self, total_bytes: int, total_tensors: int, desc: str, enabled: bool = True):
        super().__init__(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                         file=sys.stderr, disable=not enabled, dynamic_ncols=True, mininterval=0.5)
        self.total_tensors, self.tensors = total_tensors, 0

    def update(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors += tensors
        self.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
        super().update(nbytes)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file, byte for byte the same in every process: the library writes the header's
    __metadata__ in the order of a Rust HashMap, whose hash seed is random per process, so two runs over the same
    tensors and metadata give different files (two metadata keys: one order or the other). Its header is
    rewritten in place with the metadata keys sorted: the same JSON reordered, so the same length."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    if not metadata or len(metadata) < 2:
        return
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(raw) > n:   # serde_json and json agree on this JSON's text; a longer one would move the data
            raise DFlashError(f"{path}: safetensors header re-serialized to {len(raw)} bytes, over its {n}")
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


OUT_BUFFERS = 4
MAX_SHARDS = 99999  # model-00001-of-99999.safetensors


class ShardedWriter:
    """Write safetensors shards of at most `max_shard_bytes` (plus an index when there is more
    than one shard), streaming: each tensor goes to disk as soon as it is given.

    Why not the `safetensors` library: its writers (`save_file`, `save_torch_state_dict`) take a
    whole state dict, i.e. a full shard held in memory at once. Here the caller declares every
    output tensor's dtype and shape up front (a quantization plan knows them before any weight
    is read); headers and offsets follow from that, so each tensor can be written with
    `pwrite` at its final offset, in any order, and dropped. The files are plain safetensors
    (contiguous offsets, 8-byte-aligned header, tensors ordered by alignment within a shard),
    readable by the safetensors library.
    """

    def __init__(self, folder: str | Path, specs: list[TensorSpec], max_shard_bytes: int = 5 * 2**30,
                 metadata: dict | None = None, prefix: str = "model", io: DirectWriter | None = None):
        self.folder = Path(folder)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise DFlashError(f"output tensor {dup!r} is planned twice")
        # Greedy split in the given order (keeps a layer's tensors together), then order each
        # shard by element size, largest first, so every tensor starts aligned to its element.
        groups: list[list[TensorSpec]] = [[]]
        size = 0
        for s in specs:
            if groups[-1] and size + s.nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(s)
            size += s.nbytes
        n = len(groups)
        if n > MAX_SHARDS:
            raise DFlashError(f"{self.folder}: {n} shards of at most {max_shard_bytes} bytes each; the shard names "
                              f"allow at most {MAX_SHARDS}: raise the maximum shard size")
        self.shard_names = [f"{prefix}.safetensors"] if n == 1 else \
            [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._where: dict[str, tuple[int, int, TensorSpec]] = {}  # name -> (shard, absolute offset, spec)
        self._headers: list[bytes] = []
        self._sizes: list[int] = []
        meta = {"format": "pt", **(metadata or {})}
        for si, group in enumerate(groups):
            group = sorted(group, key=lambda s: -dtype_size(s.dtype))
            header: dict = {"__metadata__": meta}
            off, starts = 0, []
            for s in group:
                header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
                starts.append(off)
                off += s.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-(8 + len(raw)) % 8)
            blob = struct.pack("<Q", len(raw)) + raw
            self._headers.append(blob)
            self._sizes.append(len(blob) + off)
            for s, start in zip(group, starts):
                self._where[s.name] = (si, len(blob) + start, s)
        self._files: dict[int, OutFile] = {}
        # writers of one job (e.g. convert's ranks) share one background writer and its buffers
        self._own_io = io is None
        self._io = DirectWriter() if io is None else io
        # out_buffer's ring: NVFP4 asks for (codes, scales) per weight, so with 4 the codes
        # alternate between two buffers, as do the scales
        self._buffers: list[torch.Tensor | None] = [None] * OUT_BUFFERS
        self._buffer_tickets = [0] * OUT_BUFFERS
        self._next_buffer = 0
        self._written: set[str] = set()
        self.total_bytes = sum(s.nbytes for s in specs)

    def _file(self, si: int) -> OutFile:
        f = self._files.get(si)
        if f is None:
            path = self.folder / self.shard_names[si]
            try:
                f = self._files[si] = self._io.open(str(path))
                self._io.pwrite(f, memoryview(self._headers[si]), 0)
            except OSError as e:
                raise disk_error(path, "the safetensors header", e) from None
        return f

    def out_buffer(self, name: str) -> torch.Tensor:
        """A uint8 buffer of planned tensor `name`'s size to compute it into: its memory is
        aligned like the tensor's place in the file, so `write(name, buffer)` hands it to the
        disk without a copy (a 65 GB model's output is ~16 GB of memcpy less). The buffers are
        used in turn; asking for one waits until the disk has finished with it."""
        nbytes = self._where[name][2].nbytes
        i = self._next_buffer
        self._next_buffer = (i + 1) % OUT_BUFFERS
        self._io.wait(self._buffer_tickets[i])
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes + BLOCK:
            self._buffers[i] = None   # free the smaller one first
            buf = self._buffers[i] = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
        start = (self._where[name][1] - buf.data_ptr()) % BLOCK
        return buf[start:start + nbytes]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor. Its bytes are copied before this returns (the caller may
        reuse the tensor's memory), except for a buffer from `out_buffer`, which the disk reads
        in place; the disk write itself may finish later, in the background."""
        if name not in self._where:
            raise DFlashError(f"output tensor {name!r} was not planned")
        si, offset, spec = self._where[name]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise DFlashError(f"output tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, planned "
                              f"{spec.dtype}{list(spec.shape)}")
        f = self._file(si)
        if spec.nbytes:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            lent = [i for i, b in enumerate(self._buffers)
                    if b is not None and b.data_ptr() <= tensor.data_ptr() < b.data_ptr() + b.numel()]
            try:
                ticket = self._io.pwrite(f, memoryview(data), offset, address=tensor.data_ptr() if lent else None)
                if lent:
                    self._buffer_tickets[lent[0]] = ticket
            except OSError as e:
                raise disk_error(self.folder / self.shard_names[si], f"tensor {name!r}", e) from None
        self._written.add(name)

    @property
    def disk_wait_seconds(self) -> float:
        """Time spent waiting for the disk (staging buffers, out_buffer, the final flush)."""
        return self._io.wait_seconds

    def close(self) -> list[str]:
        """Check every planned tensor was written, flush, write the index; returns file names."""
        if missing := [n for n in self._where if n not in self._written]:
            self.abort()
            raise DFlashError(f"output tensor {missing[0]!r} was planned but never written ({len(missing)} missing)")
        for si in range(len(self.shard_names)):
            f = self._file(si)  # a shard whose tensors are all empty still gets its header
            try:
                self._io.finish(f, self._sizes[si])
            except OSError as e:
                self.abort()
                raise disk_error(self.folder / self.shard_names[si], "the shard", e) from None
        self.abort()
        files = list(self.shard_names)
        if len(self.shard_names) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {n: self.shard_names[si] for n, (si, _, _) in sorted(self._where.items())}}
            path = self.folder / "model.safetensors.index.json"
            write_text(path, json.dumps(index, indent=2) + "\n")
            files.append(path.name)
        return files

    def abort(self) -> None:
        """Stop writing: wait for the background writes, close every file (removing them is the
        caller's atomic_output_dir's job)."""
        self._io.drain()
        for f in self._files.values():
            self._io.discard(f)
        self._files.clear()
        if self._own_io:
            self._io.close()
