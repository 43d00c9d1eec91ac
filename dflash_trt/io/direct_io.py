"""Output files written with O_DIRECT at arbitrary offsets, from a background thread.

Why: quantized checkpoints are written once and not read back soon; on VMs whose fresh memory is
backed lazily, allocating page-cache pages dominates (1.5 GB: 2.8-4.4 s buffered, 0.73 s with
O_DIRECT, bench/bench_quantize.py), and O_DIRECT keeps a 65 GB output out of the page cache.

O_DIRECT needs offset, length and address aligned to the device block: a write's aligned middle goes
(through a page-aligned staging buffer, or the caller's memory where aligned and lent) to the writer
thread; its partial first and last blocks are kept and merged with their neighbours' bytes when the
file is finished (every byte of a shard is written exactly once). Where the filesystem refuses
O_DIRECT, plain pwrite.
"""
from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field

BLOCK = 4096
STAGING_BYTES = 16 * 2**20   # per buffer; writes of 4-16 MB ran at the disk's speed here
STAGING_BUFFERS = 6          # one being filled, the rest in flight


@dataclass
class OutFile:
    path: str
    fd: int
    direct: bool
    pending: dict[int, bytearray] = field(default_factory=dict)   # block index -> its bytes so far
    error: OSError | None = None


class DirectWriter:
    def __init__(self, staging_bytes: int = STAGING_BYTES, buffers: int = STAGING_BUFFERS):
        self._staging = staging_bytes
        self.free_buffers: queue.Queue = queue.Queue()   # staging buffers no write holds now
        for _ in range(buffers):   # anonymous mappings are page-aligned, as O_DIRECT needs
            self.free_buffers.put(memoryview(mmap.mmap(-1, staging_bytes)))
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._submitted = self._done = 0   # jobs, for tickets
        self._done_cv = threading.Condition()
        self.wait_seconds = 0.0            # time callers spent blocked on the disk

    # -- files --------------------------------------------------------------------------------
    def open(self, path: str, direct: bool = True) -> OutFile:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        direct = getattr(os, "O_DIRECT", 0) if direct else 0
        if direct:
            try:
                fd = os.open(path, flags | direct, 0o644)
                probe = self.free_buffers.get()
                try:    # some filesystems accept the flag at open and refuse the write
                    os.pwrite(fd, probe[:BLOCK], 0)
                    return OutFile(path, fd, True)
                except OSError:
                    os.close(fd)
                finally:
                    self.free_buffers.put(probe)
            except OSError:
                pass
        return OutFile(path, os.open(path, flags, 0o644), False)

    def pwrite(self, f: OutFile, data: memoryview, offset: int, address: int | None = None) -> int:
        """Write data (bytes-like, any length) at offset; returns a ticket for `wait`. Raises the
        OSError of an earlier background write to this file, if one failed.
        With `address` (data's memory address), data is borrowed where that address is aligned
        like the offset: the disk reads it in place, with no staging copy, and the caller must
        leave the memory unchanged until `wait(ticket)` returns. Otherwise data may be reused as
        soon as this returns."""
        self._raise(f)
        data = memoryview(data).cast("B")
        if not f.direct:
            _pwrite_all(f.fd, data, offset)
            return self._submitted
        end = offset + len(data)
        a0 = -(-offset // BLOCK) * BLOCK
        a1 = end // BLOCK * BLOCK
        if a0 >= a1:   # within one or two partial blocks
            self._merge(f, data, offset)
            return self._submitted
        if a0 > offset:
            self._merge(f, data[: a0 - offset], offset)
        if end > a1:
            self._merge(f, data[a1 - offset:], a1)
        if address is not None and (address + a0 - offset) % BLOCK == 0:
            self._submit(f, data[a0 - offset: a1 - offset], a1 - a0, a0, borrowed=True)
            return self._submitted
        pos = a0
        while pos < a1:
            n = min(self._staging, a1 - pos)
            buf = self._take()
            buf[:n] = data[pos - offset: pos - offset + n]
            self._submit(f, buf, n, pos)
            pos += n
            self._raise(f)
        return self._submitted

    def wait(self, ticket: int) -> None:
        """Block until the writes submitted up to `ticket` have completed (or failed)."""
        t = time.perf_counter()
        with self._done_cv:
            while self._done < ticket:
                self._done_cv.wait()
        self.wait_seconds += time.perf_counter() - t

    def finish(self, f: OutFile, size: int) -> None:
        """Write the pending partial blocks, set the exact size and close the file (fsync where
        it was written through the page cache).

        No fsync after O_DIRECT: every write has reached the device when pwrite returns, and
        the filesystem journals the blocks and size those writes allocated in a transaction
        whose commit first flushes the device's write cache (ext4, XFS), so by the time the
        caller's rename of the output folder is on disk, so is the data. An fsync would wait
        for that flush now: 1.5-2 s per 1.5 GB on this project's VMs, more than the writes."""
        try:
            self.drain()
            self._raise(f)
            if f.direct and f.pending:
                buf = self.free_buffers.get()
                try:
                    for blk in sorted(f.pending):
                        buf[:BLOCK] = f.pending[blk]
                        _pwrite_all(f.fd, buf[:BLOCK], blk * BLOCK)
                finally:
                    self.free_buffers.put(buf)
                f.pending.clear()
            if f.direct:
                os.ftruncate(f.fd, size)   # the last block (or the probe) may run past the end
            else:
                os.fsync(f.fd)
        finally:
            self.discard(f)

    def discard(self, f: OutFile) -> None:
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1

    def drain(self) -> None:
        """Wait until every submitted write has completed (or failed)."""
        if self._thread is not None:
            t = time.perf_counter()
            self._jobs.join()
            self.wait_seconds += time.perf_counter() - t

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # -- internals ----------------------------------------------------------------------------
    def _take(self) -> memoryview:
        """A free staging buffer, waiting for the disk to release one if none is free."""
        try:
            return self.free_buffers.get_nowait()
        except queue.Empty:
            t = time.perf_counter()
            buf = self.free_buffers.get()
            self.wait_seconds += time.perf_counter() - t
            return buf

    def _merge(self, f: OutFile, data: memoryview, offset: int) -> None:
        pos = 0
        while pos < len(data):
            blk, within = divmod(offset + pos, BLOCK)
            n = min(BLOCK - within, len(data) - pos)
            block = f.pending.get(blk)
            if block is None:
                block = f.pending[blk] = bytearray(BLOCK)
            block[within:within + n] = data[pos:pos + n]
            pos += n

    def _submit(self, f: OutFile, buf: memoryview, n: int, offset: int, borrowed: bool = False) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dflash-trt-writer", daemon=True)
            self._thread.start()
        self._submitted += 1
        self._jobs.put((f, buf, n, offset, borrowed))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            f, buf, n, offset, borrowed = job
            try:
                if f.error is None and f.fd >= 0:
                    _pwrite_all(f.fd, buf[:n], offset)
            except Exception as e:   # kept for the caller: a dead thread would leave it waiting
                f.error = e if isinstance(e, OSError) else OSError(errno.EIO, f"background write failed: {e}")
            finally:
                if not borrowed:
                    self.free_buffers.put(buf)
                with self._done_cv:   # jobs complete in order: one thread, FIFO
                    self._done += 1
                    self._done_cv.notify_all()
                self._jobs.task_done()

    @staticmethod
    def _raise(f: OutFile) -> None:
        if f.error is not None:
            raise f.error


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    short = False
    while len(buf):
        try:
            n = os.pwrite(fd, buf[: 1 << 30], offset)
        except OSError as e:
            # after a short write the rest is unaligned, which O_DIRECT refuses (EINVAL); a short
            # write to a regular file means the filesystem is full
            if short and e.errno == errno.EINVAL:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
            raise
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        short = n < len(buf)
        buf, offset = buf[n:], offset + n
