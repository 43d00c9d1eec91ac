"""Output that is never half-written: folders published by one rename, and disk errors as one line."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from dflash_trt.errors import DFlashError


def disk_error(path: Path, what: str, e: OSError) -> DFlashError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DFlashError(f"{path}: disk full while writing {what} ({e.strerror}); nothing was published")
    return DFlashError(f"{path}: cannot write {what} ({e.strerror})")


def write_text(path: Path, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise disk_error(Path(path), "the file", e) from None


@contextlib.contextmanager
def atomic_output_dir(dest: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `dest`; on success it replaces `dest` (the old
    content is removed only after the new one is in place); on any failure it is deleted and
    `dest` is left as it was."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DFlashError(f"{dest}: exists and is not a folder")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    except OSError as e:
        raise disk_error(dest.parent, "a temporary folder", e) from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
            try:
                os.replace(tmp, dest)
            except OSError:
                os.replace(old / dest.name, dest)  # put the previous output back
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(dest, "the output folder", e) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
