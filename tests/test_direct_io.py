"""DirectWriter: writes at arbitrary offsets, in any order, give exactly the bytes written."""
import os
import random

import pytest

from dflash_trt.io.direct_io import BLOCK, DirectWriter


def _pieces(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """Split [0, size) into pieces of mixed lengths: sub-block, block-straddling, multi-buffer."""
    cuts, pos = [], 0
    while pos < size:
        n = min(size - pos, rng.choice([1, 7, BLOCK - 3, BLOCK, BLOCK + 5, 3 * BLOCK + 1, 70_000, 300_001]))
        cuts.append((pos, n))
        pos += n
    rng.shuffle(cuts)
    return cuts


@pytest.mark.parametrize("size", [1, BLOCK - 1, BLOCK, 5 * BLOCK + 17, 1_234_567])
@pytest.mark.parametrize("direct", [True, False])
def test_pieces_in_any_order_give_the_file(tmp_path, size, direct):
    rng = random.Random(size)
    data = os.urandom(size)
    w = DirectWriter(staging_bytes=64 * 1024, buffers=2)   # small buffers: many background writes
    f = w.open(str(tmp_path / "out.bin"), direct=direct)   # False: as on filesystems refusing O_DIRECT
    assert f.direct == (direct and hasattr(os, "O_DIRECT"))
    for off, n in _pieces(size, rng):
        w.pwrite(f, memoryview(data)[off:off + n], off)
    w.finish(f, size)
    w.close()
    assert (tmp_path / "out.bin").read_bytes() == data


def test_o_direct_is_used_where_the_filesystem_allows_it(tmp_path):
    w = DirectWriter()
    f = w.open(str(tmp_path / "x.bin"))
    flags = int(open(f"/proc/self/fdinfo/{f.fd}").read().split("flags:")[1].split()[0], 8)
    assert bool(flags & getattr(os, "O_DIRECT", 0)) == f.direct
    w.finish(f, 0)
    w.close()
    assert (tmp_path / "x.bin").stat().st_size == 0


def test_borrowed_aligned_memory_is_written_in_place(tmp_path):
    """Memory aligned like its file offset is handed to the disk without a staging copy: the
    write takes no staging buffer, and after wait(ticket) the file holds the bytes."""
    import torch

    size, offset = 3 * 2**20 + 123, 4096 * 5 + 77
    buf = torch.empty(size + BLOCK, dtype=torch.uint8)
    start = (offset - buf.data_ptr()) % BLOCK
    data = buf[start:start + size]
    data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    head = os.urandom(offset)
    w = DirectWriter(staging_bytes=64 * 1024, buffers=2)
    f = w.open(str(tmp_path / "b.bin"))
    w.wait(w.pwrite(f, memoryview(head), 0))
    ticket = w.pwrite(f, memoryview(data.numpy()), offset, address=data.data_ptr())
    if f.direct:
        assert w.free_buffers.qsize() == 2   # no staging buffer in use: the middle went in place
    w.wait(ticket)
    w.finish(f, offset + size)
    w.close()
    assert (tmp_path / "b.bin").read_bytes() == head + data.numpy().tobytes()
