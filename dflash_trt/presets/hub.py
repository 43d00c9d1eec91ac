"""A checkpoint named by its Hugging Face hub id (`org/name`, at a revision): where it is looked
for, in this order (docs/pipeline.md, "Where the target and the drafter come from"), and how it is
fetched when it is in none of them: $DFLASH_TRT_HOME/models/<org>--<name>, then the Hugging Face cache
as huggingface_hub lays it out, then snapshot_download of PIPELINE_FILES into that cache when the hub
is reachable. A snapshot is checked complete wherever found; offline, the error is one line naming
every place looked in and the `hf download` command that fills the cache.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json
from dflash_trt.paths import dflash_home

# What the pipeline reads from a checkpoint (check, quantize, convert, export-onnx, the reference
# runtime, the serving configs): weights, and the small JSON / text files beside them (config,
# index, tokenizer, generation config, chat template). Top level only (IGNORE): openai/gpt-oss-*
# also carry original/ and metal/, the same weights in other formats, which would double the download.
PIPELINE_FILES = ["*.safetensors", "*.json", "tokenizer.model", "merges.txt", "*.jinja"]
IGNORE = ["*/*"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
DISK_MARGIN = 1 << 30   # left free after a download
HUB_PROBE_SECONDS = 3.0   # one TCP connect to the hub before any download (huggingface_hub retries for ~26 s)


class HubMissing(DFlashError):
    """A checkpoint in none of the places looked in, with the hub off or unreachable: `command` is
    the `hf download` line that fills the cache (callers missing two checkpoints name both)."""

    def __init__(self, message: str, what: str, command: str, why: str, looked: str = ""):
        super().__init__(message)
        self.what, self.command, self.why, self.looked = what, command, why, looked


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (one line), or None: HF_HUB_OFFLINE, else one TCP connect to
    its endpoint (HF_ENDPOINT, default huggingface.co:443) within HUB_PROBE_SECONDS, so a machine
    without network is told at once instead of after huggingface_hub's retries."""
    if hub_offline():
        return "the hub is off (HF_HUB_OFFLINE)"
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as e:
        return f"the hub is unreachable ({host}:{port}: {e.strerror or type(e).__name__})"
    return None


def is_hub_id(spec: str) -> bool:
    """`org/name` as the hub spells repository ids (and not an existing path: callers check that first)."""
    return bool(HUB_ID.match(spec)) and not spec.startswith((".", "/"))


def hf_hub_cache() -> Path:
    """The Hugging Face cache folder, by huggingface_hub's rules (huggingface_hub/constants.py),
    read from the environment at call time."""
    env = os.environ.get
    home = env("HF_HOME") or os.path.join(env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                                          "huggingface")
    cache = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set true, as huggingface_hub reads it."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.upper() in ("1", "ON", "YES", "TRUE")


def repo_folder(hf_id: str) -> Path:
    return hf_hub_cache() / f"models--{hf_id.replace('/', '--')}"


def own_folder(hf_id: str) -> Path:
    return dflash_home() / "models" / hf_id.replace("/", "--")


def download_command(hf_id: str, revision: str | None) -> str:
    """The `hf download` line that puts exactly what the pipeline reads into the cache."""
    rev = f" --revision {revision}" if revision and revision != "main" else ""
    inc = "".join(f" --include '{p}'" for p in PIPELINE_FILES)
    return f"hf download {hf_id}{rev}{inc} --exclude '*/*'"


def snapshot_revision(folder: Path) -> str | None:
    """The commit of a folder that is a Hugging Face cache snapshot (…/snapshots/<commit>), else None."""
    folder = Path(folder)
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--") \
            and COMMIT.match(folder.name):
        return folder.name
    return None


def cached_snapshot(hf_id: str, revision: str) -> tuple[Path | None, list[str]]:
    """(the cache's snapshot of hf_id at revision or None, the commits the cache holds)."""
    repo = repo_folder(hf_id)
    snaps = repo / "snapshots"
    held = sorted(p.name for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    commit = revision if COMMIT.match(revision) else None
    if commit is None:
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else None
    if commit and (snaps / commit / "config.json").is_file():
        return snaps / commit, held
    return None, held


def snapshot_problem(folder: Path) -> str | None:
    """Why a found snapshot is not complete (None: it is): config.json and every shard its index
    names must be there (an interrupted download leaves a missing or dangling one)."""
    if not (folder / "config.json").is_file():
        return "no config.json"
    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    if index is not None:
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if missing := [s for s in shards if not (folder / s).is_file()]:
            return (f"incomplete snapshot, {len(missing)} of {len(shards)} shard(s) named in {index.name} missing "
                    f"({', '.join(missing[:3])})")
    elif not any(folder.glob("*.safetensors")):
        return "no *.safetensors weights"
    return None


def check_complete(folder: Path, what: str, hint: str) -> Path:
    if problem := snapshot_problem(folder):
        raise DFlashError(f"{what} at {folder}: {problem}; {hint}")
    return folder


def resolve_hub_id(hf_id: str, revision: str | None = None, role: str = "target") -> Path:
    """The local folder of hf_id at revision (None: main), found or downloaded (module docstring, docs/pipeline.md)."""
    rev = revision or "main"
    what = f"{role} {hf_id}" + (f"@{rev}" if rev != "main" else "")
    cmd = download_command(hf_id, rev)
    mine = own_folder(hf_id)
    if (mine / "config.json").is_file():
        return check_complete(mine, what, f"complete it or remove it ({mine})")
    snap, held = cached_snapshot(hf_id, rev)
    looked = f"looked in {mine} and {repo_folder(hf_id) / 'snapshots' / (rev if COMMIT.match(rev) else '')}"
    if not COMMIT.match(rev):
        looked += f" (via refs/{rev})"
    if snap is not None:
        problem = snapshot_problem(snap)
        if problem is None:
            return snap
        if hub_offline():
            raise DFlashError(f"{what} at {snap}: {problem}; finish the download: `{cmd}`")
        looked += f" (there, but {problem})"   # e.g. only config.json fetched by another tool: download the rest
    elif held:
        looked += f", which holds revision(s) {', '.join(held)} but not {rev}"
    if off := hub_unreachable():
        raise HubMissing(f"{what} not found and {off}: {looked}; on a machine with hub access run `{cmd}` (and "
                         "point HF_HUB_CACHE at that cache)", what, cmd, off, looked)
    return check_complete(download(hf_id, rev, what, cmd, looked), what, f"finish the download: `{cmd}`")


def find_config(hf_id: str, revision: str | None = None) -> Path | None:
    """A local folder holding hf_id's config.json at revision (our folder, else the cache's snapshot,
    weights or not), or None. What `build --configs-only` reads before any download."""
    mine = own_folder(hf_id)
    if (mine / "config.json").is_file():
        return mine
    return cached_snapshot(hf_id, revision or "main")[0]


def download_config(hf_id: str, revision: str | None, role: str) -> Path:
    """find_config, else config.json alone from the hub into the cache (a few KB): the folder holding it.
    With the hub off or unreachable: HubMissing naming the download command."""
    rev = revision or "main"
    what = f"{role} {hf_id}" + (f"@{rev}" if rev != "main" else "")
    found = find_config(hf_id, revision)
    if found is not None:
        return found
    cmd = f"hf download {hf_id}" + (f" --revision {rev}" if rev != "main" else "") + " config.json"
    if off := hub_unreachable():
        raise HubMissing(f"{what}: no config.json here and {off}; on a machine with hub access run `{cmd}`",
                         what, cmd, off)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(hf_id, "config.json", revision=rev, cache_dir=str(hf_hub_cache()))).parent
    except Exception as e:   # huggingface_hub's errors: one line, no traceback
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DFlashError(f"{what}: cannot fetch config.json ({reason[:160]}); run `{cmd}`") from None


def download(hf_id: str, rev: str, what: str, cmd: str, looked: str) -> Path:
    """snapshot_download of PIPELINE_FILES after a dry run that sizes what is still missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:  # huggingface_hub >= 2 talks through httpx2, 1.x through httpx
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError
    cache = hf_hub_cache()
    kw = {"revision": rev, "cache_dir": str(cache), "allow_patterns": PIPELINE_FILES, "ignore_patterns": IGNORE,
          "endpoint": os.environ.get("HF_ENDPOINT") or None}
    try:
        plan = snapshot_download(hf_id, dry_run=True, **kw)
        missing = sum(f.file_size or 0 for f in plan if f.will_download)
        check_disk(cache, missing, what, cmd)
        if missing:
            print(f"dflash-trt: downloading {what}: {len(plan)} files, {missing / 1e9:.2f} GB to fetch, into {cache}",
                  flush=True, file=sys.stderr)
        return Path(snapshot_download(hf_id, **kw))
    except GatedRepoError:
        raise DFlashError(f"{what}: the repository is gated; accept its terms at https://huggingface.co/{hf_id} and "
                          "set HF_TOKEN (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise DFlashError(f"{what}: the hub has no revision {rev} of {hf_id}") from None
    except RepositoryNotFoundError:
        raise DFlashError(f"{what}: no such repository on the hub (or it is private: set HF_TOKEN)") from None
    except (TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DFlashError(f"{what} not found and the hub is unreachable ({reason[:160]}): {looked}; on a machine "
                          f"with hub access run `{cmd}` (and point HF_HUB_CACHE at that cache)") from None


def check_disk(cache: Path, needed: int, what: str, cmd: str) -> None:
    """Refuse before the first byte when the cache's disk cannot take what is left to fetch."""
    probe = cache
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed + DISK_MARGIN > free:
        raise DFlashError(f"{what}: {needed / 1e9:.1f} GB to download but {probe} has {free / 1e9:.1f} GB free "
                          f"(1 GB kept spare); free space or set HF_HUB_CACHE to a bigger disk, then `{cmd}`")
