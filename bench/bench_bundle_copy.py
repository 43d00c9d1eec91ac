"""How a bundle takes its own copy of the weights (issue 41, item 2; io/clone.py), measured.

The choices: a hard link (what bundles did: free, but the bundle's file IS the source's, so an
in-place write to one rewrites the other), and a copy that cannot write through: a reflink (FICLONE;
free on btrfs / XFS / bcachefs / OCFS2), else copy_file_range(2) (kernel-side), else a read/write
copy. Per source, per method: seconds (cold page cache is not forced: a bundle is built right after
its source is read by `check`, so its pages are usually warm), extra disk bytes (st_blocks of the
copy; a hard link and a reflink add none), and whether writing the copy in place changed the source.

Sources: the embedded pair's files (the SmolLM2-135M target converted under $DFLASH_TRT_HOME and our
drafter) and one synthetic checkpoint of --synthetic-gib GiB (random bytes, one file).

    python bench/bench_bundle_copy.py --out .bench/bundle_copy.json [--synthetic-gib 4]
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dflash_trt.io.clone import FICLONE, clone_file
from dflash_trt.presets.embedded import embedded_drafter_path, ensure_embedded_target


def sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while b := f.read(1 << 24):
            h.update(b)
    return h.hexdigest()


def plain_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fs, open(dst, "wb") as fd:
        shutil.copyfileobj(fs, fd, 1 << 22)


def reflink_supported(folder: Path) -> str:
    a, b = folder / ".probe-a", folder / ".probe-b"
    a.write_bytes(b"x" * 4096)
    try:
        with open(a, "rb") as fs, open(b, "wb") as fd:
            fcntl.ioctl(fd.fileno(), FICLONE, fs.fileno())
        return "yes"
    except OSError as e:
        return f"no ({errno.errorcode.get(e.errno, e.errno)})"
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def measure(files: list[Path], work: Path) -> dict:
    out = {}
    total = sum(f.stat().st_size for f in files)
    methods = {"hard_link": lambda s, d: os.link(os.path.realpath(s), d), "clone_file": clone_file,
               "read_write_copy": plain_copy}
    for name, fn in methods.items():
        dst = work / name
        dst.mkdir()
        t0 = time.perf_counter()
        hows = set()
        for f in files:
            r = fn(f, dst / f.name)
            if isinstance(r, str):
                hows.add(r)
        secs = time.perf_counter() - t0
        extra = 0 if name == "hard_link" else sum((dst / f.name).stat().st_blocks * 512 for f in files)
        # the in-place write test on the largest file: does the source change?
        big = max(files, key=lambda f: f.stat().st_size)
        before = sha(big)
        with open(dst / big.name, "r+b") as fh:
            fh.seek(min(4096, big.stat().st_size - 16))
            old = fh.read(16)
            fh.seek(min(4096, big.stat().st_size - 16))
            fh.write(bytes(b ^ 0xFF for b in old))
        after = sha(big)
        if after != before:   # put the source back (a hard link wrote through)
            with open(dst / big.name, "r+b") as fh:
                fh.seek(min(4096, big.stat().st_size - 16))
                fh.write(old)
        out[name] = {"seconds": round(secs, 3), "gb_per_s": round(total / secs / 1e9, 2) if secs else None,
                     "extra_disk_bytes": extra, "source_changed_by_in_place_write": after != before,
                     **({"method_used": sorted(hows)} if hows else {})}
        shutil.rmtree(dst)
    return {"files": len(files), "bytes": total, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".bench/bundle_copy.json")
    ap.add_argument("--synthetic-gib", type=float, default=4.0)
    a = ap.parse_args()
    tdir = ensure_embedded_target()
    work = Path(tempfile.mkdtemp(prefix="bench-copy-", dir=Path(a.out).resolve().parent
                                 if Path(a.out).resolve().parent.exists() else None))
    try:
        emb = [p for d in (tdir, embedded_drafter_path()) for p in sorted(d.iterdir()) if p.is_file()]
        res = {"filesystem": subprocess.run(["stat", "-f", "-c", "%T", str(work)], capture_output=True,
                                            text=True).stdout.strip(),
               "reflink": reflink_supported(work), "machine": platform.machine(), "cpus": os.cpu_count()}
        pair = work / "pair"
        pair.mkdir()
        copies = []
        for f in emb:   # the sources on the same filesystem as the bundle (a hard link needs that)
            c = pair / f.name if not (pair / f.name).exists() else pair / f"d-{f.name}"
            shutil.copyfile(f, c)
            copies.append(c)
        res["embedded_pair"] = measure(copies, work)
        syn = work / "synthetic"
        syn.mkdir()
        big = syn / "model.safetensors"
        with open(big, "wb") as fh:
            chunk = os.urandom(1 << 24)
            for _ in range(int(a.synthetic_gib * 64)):
                fh.write(chunk)
        res["synthetic"] = measure([big], work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
