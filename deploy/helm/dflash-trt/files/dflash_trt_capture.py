"""Opt-in capture of served request bodies, for `dflash-trt adapt` (docs/adapt.md): a pure ASGI middleware
that vLLM adds with `vllm serve --middleware dflash_trt_capture.CaptureMiddleware` (vLLM's
entrypoints/serve/middleware/register.py: a class is added with app.add_middleware(cls), no arguments,
so its settings come from the environment; `dflash-trt serve --capture DIR` sets them).

What it writes is the team's user data: the JSON body of a sampled share of POST /v1/chat/completions
and /v1/completions requests, one per line, nothing else (no header, so never Authorization; no
response; no client address). Files are created mode 0600 in a folder created 0700, readable only by
the serving user; a file past MAX_BYTES is closed and a new one started; only the newest KEEP are kept.
Unset DFLASH_TRT_CAPTURE_DIR, or a fraction of 0, and it passes every request through untouched.

    DFLASH_TRT_CAPTURE_DIR        the folder (a volume the team names)
    DFLASH_TRT_CAPTURE_FRACTION   share of requests kept, 0..1 (default 0: none)
    DFLASH_TRT_CAPTURE_MAX_BYTES  rotate past this size (default 64 MiB)
    DFLASH_TRT_CAPTURE_KEEP       files kept (default 16)

No import outside the standard library: it runs in whatever env serves.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

PATHS = ("/v1/chat/completions", "/v1/completions")   # what `dflash-trt adapt` reads
MAX_BODY = 8 << 20                                       # a larger body passes through, not captured


class Sink:
    """Rotating JSONL files in one folder, mode 0600, appended to under a lock."""

    def __init__(self, folder: str, max_bytes: int, keep: int):
        self.folder, self.max_bytes, self.keep = Path(folder), max_bytes, max(1, keep)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.fd, self.size, self.n = None, 0, 0

    def _open(self) -> None:
        self.n += 1
        name = f"capture-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{self.n:04d}.jsonl"
        self.fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        self.size = 0
        files = sorted(self.folder.glob("capture-*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
        for old in files[:-self.keep]:
            old.unlink(missing_ok=True)

    def write(self, line: bytes) -> None:
        with self.lock:
            if self.fd is None or self.size + len(line) > self.max_bytes:
                if self.fd is not None:
                    os.close(self.fd)
                self._open()
            os.write(self.fd, line)
            self.size += len(line)


def _settings() -> tuple[Sink | None, float]:
    folder = os.environ.get("DFLASH_TRT_CAPTURE_DIR", "")
    fraction = float(os.environ.get("DFLASH_TRT_CAPTURE_FRACTION", "0") or 0)
    if not folder or fraction <= 0:
        return None, 0.0
    sink = Sink(folder, int(os.environ.get("DFLASH_TRT_CAPTURE_MAX_BYTES", str(64 << 20))),
                int(os.environ.get("DFLASH_TRT_CAPTURE_KEEP", "16")))
    return sink, min(1.0, fraction)


class CaptureMiddleware:
    def __init__(self, app):
        self.app = app
        self.sink, self.fraction = _settings()

    async def __call__(self, scope, receive, send):
        if (self.sink is None or scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path", "").removeprefix(scope.get("root_path", "")) not in PATHS
                or random.random() >= self.fraction):
            return await self.app(scope, receive, send)
        chunks, size = [], 0

        async def tee():
            """The app reads the body as it always does; a copy is kept until the last chunk."""
            nonlocal size
            message = await receive()
            if message.get("type") == "http.request" and size <= MAX_BODY:
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if not message.get("more_body", False) and size <= MAX_BODY:
                    self._keep(b"".join(chunks))
            return message
        return await self.app(scope, tee, send)

    def _keep(self, body: bytes) -> None:
        try:
            row = json.loads(body)
        except ValueError:      # not a JSON body: the server answers it with an error; nothing to learn
            return
        if isinstance(row, dict):
            self.sink.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
