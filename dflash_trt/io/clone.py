"""A bundle's own copy of a source file (weights, configs) that no write can carry back to the source.

A hard link shares the inode: writing the bundle's `drafter/model.safetensors` in place rewrote the
source drafter (and root ignores a read-only mode, so no link is safe). So each file is a reflink
(FICLONE) where the filesystem has them, else a kernel-side copy_file_range(2), else a read/write copy
(docs/pipeline.md measures them). The copy's mode follows the umask (a 0600 cache file would make the
bundle unreadable to a pod's other uid); its mtime is the source's, so a rebuild recognises it unchanged.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from dflash_trt.io.atomic import file_mode

FICLONE = 0x40049409          # _IOW(0x94, 9, int), linux/fs.h
# errors that mean "this filesystem (pair) cannot do it", not "the copy failed"
UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF, errno.EPERM}
IGNORED = ("__pycache__", ".cache")


def clone_file(src: str | Path, dst: str | Path) -> str:
    """Copy src (a symlink is followed: a Hugging Face snapshot's files are links to blobs) to a new
    file dst; returns how: "reflink", "copy_file_range" or "copy"."""
    src, dst = os.path.realpath(src), Path(dst)
    with open(src, "rb") as fs, open(dst, "xb") as fd:
        how = _reflink(fs, fd) or _copy_range(fs, fd) or _copy(fs, fd)
        os.fchmod(fd.fileno(), file_mode())
    st = os.stat(src)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return how


def _reflink(fs, fd) -> str | None:
    try:
        fcntl.ioctl(fd.fileno(), FICLONE, fs.fileno())
        return "reflink"
    except OSError as e:
        if e.errno in UNSUPPORTED:
            return None
        raise


def _copy_range(fs, fd) -> str | None:
    size = os.fstat(fs.fileno()).st_size
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(fs.fileno(), fd.fileno(), size - done, done, done)
            if n == 0:
                break
            done += n
    except OSError as e:
        if done == 0 and e.errno in UNSUPPORTED:
            return None
        raise
    if done != size:   # the source shrank under us, or the call copied nothing: let the plain copy decide
        fd.truncate(0)
        fs.seek(0)
        return None
    return "copy_file_range"


def _copy(fs, fd) -> str:
    fs.seek(0)
    fd.seek(0)
    shutil.copyfileobj(fs, fd, 1 << 22)
    return "copy"


def _tree(src: Path, dst: Path, followlinks: bool) -> Iterator[tuple[Path, Path]]:
    """(source file, its destination) over a file or a folder (IGNORED folders left out), each
    destination folder made on the way."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        yield src, dst
        return
    for root, dirs, files in os.walk(src, followlinks=followlinks):
        dirs[:] = sorted(x for x in dirs if x not in IGNORED)
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in sorted(files):
            yield Path(root) / f, dst / rel / f


def clone_tree(src: str | Path, dst: str | Path, on_file=None) -> dict[str, int]:
    """Copy a file or folder with clone_file (folders' modes by the umask); `on_file(src, dst)` is
    called after each file. Returns {how: files} for the summary."""
    counts: dict[str, int] = {}
    for s, d in _tree(Path(src), Path(dst), followlinks=True):
        how = clone_file(s, d)
        counts[how] = counts.get(how, 0) + 1
        if on_file is not None:
            on_file(s, d)
    return counts


def carry_tree(src: str | Path, dst: str | Path) -> None:
    """Move a previous bundle's unchanged output into the bundle replacing it: a hard link where
    the previous bundle holds the only name of the file (the old bundle is removed once the new one
    is in place, so the file ends with one name again), a clone_file copy where the file has other
    names (a bundle written before bundles stopped hard-linking their sources)."""
    for s, d in _tree(Path(src), Path(dst), followlinks=False):
        if not s.is_symlink() and os.stat(s).st_nlink == 1:
            try:
                os.link(s, d)
                continue
            except OSError:   # another filesystem: copy
                pass
        clone_file(s, d)
