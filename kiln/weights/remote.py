"""An HF-style repository over HTTP(S), read with range requests: `kiln pack URL OUT`'s source.

Files are addressed as `URL/resolve/REV/FILE`; a HEAD of config.json resolves REV to a commit
(`X-Repo-Commit`), and every later request names that commit, so a repository that moves on during
a pack cannot mix two revisions. Bytes come in ranges of a fixed size, a bounded number in flight,
each retried with backoff where the connection or the server failed; a response that is not 206
with exactly the asked Content-Range and length is never taken as data."""

from __future__ import annotations

import http.client
import json
import struct
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KilnError
from .checkpoint import Checkpoint
from .hf import canonical_name, text_config
from .quantized import quantized_view

CHUNK = 16 << 20          # bytes a range request asks for
RETRIES = 4               # attempts a range gets before the pack stops (resumable)
BACKOFF_S = 0.25          # doubled after each failed attempt
TIMEOUT_S = 60
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "U32": torch.int32}     # mlx-lm's packed words: the same 32 bits


class Retry(Exception):
    """A failure worth another attempt: the connection, a 5xx, a short body."""


class Remote:
    def __init__(self, url: str, revision: str = "main", jobs: int = 4, chunk: int = CHUNK):
        self.base, self.revision, self.jobs, self.chunk = url.rstrip("/"), revision, jobs, chunk
        self.sizes: dict[str, int | None] = {}
        head = self.head("config.json", revision)
        if head is None:
            raise KilnError(f"{url}: no config.json at revision {revision!r} (is it an HF-style repository?)")
        self.commit = head.get("x-repo-commit") or revision

    def url(self, file: str, rev: str | None = None) -> str:
        return f"{self.base}/resolve/{rev or self.commit}/{file}"

    def head(self, file: str, rev: str | None = None) -> dict | None:
        """The file's headers (lower-case keys), or None where it does not exist."""
        req = urllib.request.Request(self.url(file, rev), method="HEAD")
        for attempt in range(RETRIES):
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                    return {k.lower(): v for k, v in r.headers.items()}
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code < 500 or attempt == RETRIES - 1:
                    raise KilnError(f"{self.url(file, rev)}: HTTP {e.code} {e.reason}") from None
            except (urllib.error.URLError, OSError) as e:
                if attempt == RETRIES - 1:
                    raise KilnError(f"{self.url(file, rev)}: {getattr(e, 'reason', e)}") from None
            time.sleep(BACKOFF_S * 2 ** attempt)
        return None

    def size(self, file: str) -> int | None:
        if file not in self.sizes:
            h = self.head(file)
            length = None if h is None else (h.get("x-linked-size") or h.get("content-length"))
            if h is not None and not str(length).isdigit():
                raise KilnError(f"{self.url(file)}: no Content-Length in its headers (cannot plan range requests)")
            self.sizes[file] = None if h is None else int(length)
        return self.sizes[file]

    def range(self, file: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `file`: retried where worth it, else a one-line KilnError."""
        last = ""
        for attempt in range(RETRIES):
            try:
                return self._range_once(file, start, end)
            except Retry as e:
                last = str(e)
            time.sleep(BACKOFF_S * 2 ** attempt)
        raise KilnError(f"{file}: bytes {start}-{end - 1} failed {RETRIES} times ({last}); "
                        f"run the same command again to resume")

    def _range_once(self, file: str, start: int, end: int) -> bytes:
        want = f"bytes {start}-{end - 1}/{self.size(file)}"
        req = urllib.request.Request(self.url(file), headers={"Range": f"bytes={start}-{end - 1}"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                if r.status != 206:
                    raise KilnError(f"{self.url(file)}: answered {r.status} to a range request (expected 206): "
                                    f"the server does not serve ranges")
                if r.headers.get("Content-Range") != want:
                    raise KilnError(f"{self.url(file)}: Content-Range {r.headers.get('Content-Range')!r}, "
                                    f"asked for {want!r}")
                body = r.read()
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code == 429:
                raise Retry(f"HTTP {e.code}") from None
            raise KilnError(f"{self.url(file)}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            raise Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        if len(body) != end - start:
            raise Retry(f"{len(body)} bytes of {end - start}")
        return body

    def read(self, file: str, start: int, nbytes: int) -> bytearray:
        """nbytes at `start`, in ranges of `chunk` bytes, at most `jobs` in flight."""
        out = bytearray(nbytes)
        spans = [(a, min(a + self.chunk, start + nbytes)) for a in range(start, start + nbytes, self.chunk)]

        def get(span):
            a, b = span
            out[a - start:b - start] = self.range(file, a, b)

        if len(spans) == 1:
            get(spans[0])
        else:
            with ThreadPoolExecutor(min(self.jobs, len(spans))) as pool:
                list(pool.map(get, spans))
        return out

    def stream(self, file: str, start: int, nbytes: int):
        """nbytes at `start` as successive pieces of at most `jobs` ranges: memory stays at a window."""
        window = self.chunk * self.jobs
        for a in range(start, start + nbytes, window):
            yield self.read(file, a, min(window, start + nbytes - a))

    def json(self, file: str) -> dict:
        size = self.size(file)
        if size is None:
            raise KilnError(f"{self.url(file)}: not found")
        try:
            return json.loads(self.read(file, 0, size))
        except ValueError as e:
            raise KilnError(f"{self.url(file)}: not valid JSON ({e})") from None


def open_remote(remote: Remote) -> Checkpoint:
    """The repository's safetensors as a Checkpoint whose tensors are fetched when loaded."""
    config, wrapped = text_config(remote.json("config.json"))
    if remote.size("model.safetensors.index.json") is not None:
        shards = sorted(set(remote.json("model.safetensors.index.json").get("weight_map", {}).values()))
    elif remote.size("model.safetensors") is not None:
        shards = ["model.safetensors"]
    else:
        raise KilnError(f"{remote.base}: no model.safetensors or model.safetensors.index.json at {remote.commit}")
    where, shapes = {}, {}
    for shard in shards:
        n = struct.unpack("<Q", remote.read(shard, 0, 8))[0]
        header = json.loads(remote.read(shard, 8, n))
        for name, info in header.items():
            canon = None if name == "__metadata__" else canonical_name(name, wrapped)
            if canon is None:
                continue
            if info["dtype"] not in DTYPES:
                raise KilnError(f"{shard}: tensor {name} has dtype {info['dtype']}, which kiln does not read")
            start, end = info["data_offsets"]
            where[canon] = (shard, 8 + n + start, end - start, DTYPES[info["dtype"]], tuple(info["shape"]))
            shapes[canon] = tuple(info["shape"])

    def load(canon: str) -> torch.Tensor:
        shard, at, nbytes, dtype, shape = where[canon]
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(remote.read(shard, at, nbytes), dtype=dtype).view(shape)

    def locate(canon: str) -> RemoteSpan:
        shard, at, nbytes, dtype, shape = where[canon]
        return RemoteSpan(remote, shard, at, nbytes, dtype, shape)

    generation = remote.json("generation_config.json") if remote.size("generation_config.json") else {}
    return quantized_view(Checkpoint(Path(remote.base), "hf", config, shapes, load, generation, locator=locate,
                                     located=load))


@dataclass(frozen=True)
class RemoteSpan:
    """Where a tensor's bytes lie in the repository (FileSpan's remote twin): a pack copies them as
    they come, a window at a time, instead of holding the tensor."""
    remote: Remote
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def chunks(self):
        return self.remote.stream(self.file, self.offset, self.nbytes)
