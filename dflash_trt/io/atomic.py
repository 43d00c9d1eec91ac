"""Output that is never half-written: folders published by one rename, disk errors as one line,
and nothing left behind by a failed or killed run. A run writes into `.<name>.tmp-XXXX` beside its
output, marked (MARKER: pid, host, start time); the next run removes such folders of processes that
started before it and are gone (a SIGKILL cannot clean up; docs/pipeline.md).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from dflash_trt.errors import DFlashError

MARKER = ".dflash-trt-partial"


def disk_error(path: Path, what: str, e: OSError) -> DFlashError:
    """One line for a failed write: disk full, read-only, permission, a file where a folder must be."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DFlashError(f"{path}: disk full while writing {what} ({e.strerror}); nothing was published")
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in [Path(path), *Path(path).parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return DFlashError(f"{path}: cannot write {what}: {blocker} is a file, not a folder")
    return DFlashError(f"{path}: cannot write {what} ({e.strerror or e})")


def current_umask() -> int:
    """This process's umask, read without changing it (Linux /proc; else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode open(2) gives a new file: 0666 less the umask (0644 under 022). mkstemp and
    mkdtemp make 0600 / 0700 whatever the umask; what we publish from them gets this instead, so
    a pod running as another uid reads a bundle like any other file."""
    return 0o666 & ~current_umask()


def write_text(path: Path, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise disk_error(Path(path), "the file", e) from None


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write a file through a temp file beside it and a rename: a reader, a crash or a Ctrl-C never
    leaves half a file under the name (nor the temp file, short of a kill -9). UTF-8."""
    return atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """atomic_write_text for bytes (a rendered image; the text files, encoded)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode())   # mkstemp's 0600 is for the temp name, not for the result
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise disk_error(path, "the file", e) from None
        raise
    return path


def _process_start() -> float:
    """This process's start time (epoch seconds): Linux /proc, else this module's import time."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()
PROCESS_START = _process_start()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _stale_pid(folder: Path) -> int | None:
    """The pid that left `folder`, if it is stale: ours (marker inside), from a process on this host
    that started before this one and is gone; else None."""
    try:
        m = json.loads((folder / MARKER).read_text())
        pid, host, started = int(m["pid"]), str(m["host"]), float(m["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    stale = host == socket.gethostname() and started < PROCESS_START and not (pid != os.getpid() and alive(pid))
    return pid if stale else None


def remove_stale_temps(dest: str | Path, log=None) -> list[Path]:
    """Remove the leftovers of killed runs beside `dest` (see the module docstring), saying so on
    stderr (or through `log`); returns what was removed. A killed swap (`.<name>.old-*` holding the
    previous output while `dest` is missing) is put back instead of removed."""
    dest = Path(dest)
    say = log or (lambda msg: print(f"dflash-trt: {msg}", file=sys.stderr, flush=True))
    removed = []
    try:
        entries = sorted(dest.parent.glob(f".{dest.name}.tmp-*")) + sorted(dest.parent.glob(f".{dest.name}.old-*"))
    except OSError:
        return removed
    for p in entries:
        pid = None if not p.is_dir() or p.is_symlink() else _stale_pid(p)
        if pid is None:
            continue
        prev = p / dest.name
        if ".old-" in p.name and prev.is_dir() and not dest.exists():
            os.replace(prev, dest)
            say(f"restored {dest} from {p.name}, left by an interrupted run")
        shutil.rmtree(p, ignore_errors=True)
        say(f"removed {p}, left behind by an interrupted run (pid {pid})")
        removed.append(p)
    return removed


def _temp_dir(parent: Path, prefix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        # mkdir(2)'s mode, 0777 less the umask: mkdtemp's 0700 would outlive the rename that publishes it
        os.chmod(tmp, 0o777 & ~current_umask())
        (tmp / MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                              "started": PROCESS_START, "argv": sys.argv[:8]}))
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def temp_dir_beside(dest: str | Path) -> Path:
    """A fresh marked temporary folder beside `dest` (for a caller that publishes files from it
    itself), after removing the leftovers of killed runs for the same `dest`."""
    dest = Path(dest)
    remove_stale_temps(dest)
    return _temp_dir(dest.parent, f".{dest.name}.tmp-")


def refuse_inside(out: str | Path, flag: str, *inputs: tuple[str, str | Path | None]) -> None:
    """`out` may be neither inside an input (the run would read what it writes, or publish into
    its source) nor contain one (replacing `out` would delete it). inputs: (flag, path) pairs."""
    o = Path(os.path.realpath(out))
    for name, path in inputs:
        if path is None:
            continue
        i = Path(os.path.realpath(path))
        if o == i or o.is_relative_to(i):
            raise DFlashError(f"{flag} {out}: lies inside {name} {path}; write the output outside the input folder")
        if i.is_relative_to(o):
            raise DFlashError(f"{flag} {out}: contains {name} {path}, which replacing it would delete; "
                              "choose an output folder outside the input")


def _missing_parents(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first."""
    out = []
    for p in [path, *path.parents]:
        if p.exists() or p.is_symlink():
            break
        out.append(p)
    return out


@contextlib.contextmanager
def no_new_empty_dirs(*paths: str | Path) -> Iterator[None]:
    """On failure, remove the folders among `paths` (and their parents) that did not exist before
    and are still empty: a failed command leaves no new empty folder."""
    new = [p for path in paths if path is not None for p in _missing_parents(Path(os.path.abspath(path)))]
    try:
        yield
    except BaseException:
        for p in sorted(set(new), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                p.rmdir()   # only succeeds when empty
        raise


@contextlib.contextmanager
def atomic_output_dir(dest: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `dest`; on success it replaces `dest` (the old
    content is removed only after the new one is in place); on any failure it is deleted and
    `dest` is left as it was. Leftovers of killed earlier runs are removed first."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DFlashError(f"{dest}: exists and is not a folder")
    with no_new_empty_dirs(dest.parent):
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(dest)
            tmp = _temp_dir(dest.parent, f".{dest.name}.tmp-")
        except NotADirectoryError as e:
            raise DFlashError(f"{dest.parent}: not a folder ({e.strerror})") from None
        except OSError as e:
            raise disk_error(dest.parent, "a temporary folder", e) from None
        try:
            yield tmp
            (tmp / MARKER).unlink()
            if dest.exists():
                old = _temp_dir(dest.parent, f".{dest.name}.old-")
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
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if io := io_failure(e):
                raise DFlashError(f"{dest}: cannot write the output folder ({io}); nothing was published") from None
            raise


def io_failure(e: BaseException) -> str | None:
    """The I/O error inside a library's own exception type, or None: safetensors reports a failed
    write as SafetensorError("Error while serializing: I/O error: File too large (os error 27)")."""
    if type(e).__name__ == "SafetensorError" and "I/O error" in str(e):
        return str(e).split("I/O error:", 1)[1].strip()
    return None
