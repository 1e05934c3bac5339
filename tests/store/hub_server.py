"""A local HTTP server speaking the part of the Hugging Face hub's API that downloads use.

Enough for `huggingface_hub` (2.x) with `HF_ENDPOINT` pointing here:
- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: model info with `sha` and
  `siblings` (with `?blobs=true`: `size`, `blobId`, `lfs {sha256, size, pointerSize}`);
- `GET /api/models/{repo}/tree/{rev}[/{folder}]`: the file listing;
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: the file, with `X-Repo-Commit`, `ETag`, and for LFS
  files `X-Linked-Etag`/`X-Linked-Size`; `Range: bytes=a-[b]` answers 206 with `Content-Range`.
No Xet headers are ever sent, so clients download over plain HTTP.

Behaviours for tests: gated repos (401 without a token, 403 with a token lacking access, as the
hub answers), private repos (401 RepoNotFound), missing repos and revisions (404 with the hub's
`X-Error-Code`), a download cut off after N bytes the first time (`cut_after`) or every time
(`cut_always`), a download that sends N bytes then stalls until released (`stall_after`, for
killing a client mid-file), and a file served once with a wrong byte (`corrupt`).
Every request is logged in `requests` as (method, path, range header).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tokenizers import Tokenizer, models, pre_tokenizers

from tests.tiny_gguf import tiny_llama_gguf

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES = [
    ("info", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("tree", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("resolve", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    name: str  # canonical "org/name"; requests may use any letter case, as on the hub
    files: dict[str, bytes]
    commit: str
    gated: bool = False
    private: bool = False
    granted_tokens: set[str] = field(default_factory=set)

    def entry(self, path: str) -> dict[str, Any]:
        data = self.files[path]
        entry: dict[str, Any] = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry


class HubServer:
    """Serves repos on 127.0.0.1 at a free port; use as a context manager or call start/stop."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut_after: dict[str, int] = {}  # file path -> bytes sent before the connection drops (once)
        self.cut_always: dict[str, int] = {}  # the same, every time
        self.stall_after: dict[str, int] = {}  # file path -> bytes sent before waiting for `release`
        self.corrupt: set[str] = set()  # file paths served once with their first byte changed
        self.stalled = threading.Event()  # set when a stalled download has sent its bytes
        self.release = threading.Event()
        self._lock = threading.Lock()
        handler = type("BoundHubHandler", (HubHandler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(
        self,
        repo: str,
        files: dict[str, bytes],
        *,
        gated: bool = False,
        private: bool = False,
        granted_tokens: tuple[str, ...] = (),
    ) -> str:
        """Publishes `files` as `repo` at branch main; returns the commit sha."""
        digest = hashlib.sha1(repo.encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        commit = digest.hexdigest()
        self.repos[repo] = Repo(repo, dict(files), commit, gated, private, set(granted_tokens))
        return commit

    def downloads_of(self, path: str) -> list[str | None]:
        """The Range headers of each GET of a file (None: the whole file)."""
        return [r for m, p, r in self.requests if m == "GET" and "/resolve/" in p and p.endswith("/" + path)]

    def log_request(self, method: str, path: str, range_header: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, range_header))

    def take_faults(self, path: str, data: bytes) -> tuple[bytes, int | None, int | None]:
        """(data, bytes before a cut, bytes before a stall) for one download of `path`; one-time faults are used up."""
        with self._lock:
            cut = self.cut_after.pop(path, self.cut_always.get(path))
            stall = self.stall_after.pop(path, None)
            if path in self.corrupt and data:
                self.corrupt.discard(path)
                data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data, cut, stall

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class HubHandler(BaseHTTPRequestHandler):
    """Answers one request for `hub`, which `HubServer` sets on a subclass of its own."""

    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def do_GET(self) -> None:
        self._dispatch(body=True)

    def _dispatch(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.hub.log_request(self.command, path, self.headers.get("Range"))
        for kind, pattern in _ROUTES:
            match = pattern.match(path)
            if match:
                groups = {k: unquote(v) if v else v for k, v in match.groupdict().items()}
                return getattr(self, f"_{kind}")(body=body, **groups)
        self._error(404, "EntryNotFound", "no such route")

    # -- access rules, as the hub applies them

    def _repo(self, repo: str, rev: str | None, download: bool) -> Repo | None:
        found = next((r for name, r in self.hub.repos.items() if name.lower() == repo.lower()), None)
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if found is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif found.private and token not in found.granted_tokens:
            self._error(401, "RepoNotFound", "Repository not found")
        elif rev not in (None, "main", found.commit):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
        elif download and found.gated and token not in found.granted_tokens:
            status = 403 if token else 401
            self._error(status, "GatedRepo", f"Access to model {repo} is restricted")
        else:
            return found
        return None

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, obj: Any, body: bool, commit: str) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if body:
            self.wfile.write(data)

    # -- the model API: info and file listings

    def _info(self, repo: str, rev: str | None, body: bool) -> None:
        found = self._repo(repo, rev, download=False)
        if found is None:
            return
        query = urlsplit(self.path).query
        siblings = [found.entry(p) if "blobs=true" in query else {"rfilename": p} for p in sorted(found.files)]
        info = {
            "id": found.name,
            "modelId": found.name,
            "sha": found.commit,
            "private": found.private,
            "gated": "manual" if found.gated else False,
            "siblings": siblings,
            "tags": [],
        }
        self._json(info, body, found.commit)

    def _tree(self, repo: str, rev: str, path: str | None, body: bool) -> None:
        found = self._repo(repo, rev, download=False)
        if found is None:
            return
        prefix = f"{path.rstrip('/')}/" if path else ""
        items = []
        for name in sorted(p for p in found.files if p.startswith(prefix)):
            entry = found.entry(name)
            item = {"type": "file", "oid": entry["blobId"], "size": entry["size"], "path": name}
            if "lfs" in entry:
                item["lfs"] = {"oid": entry["lfs"]["sha256"], "size": entry["size"], "pointerSize": 134}
            items.append(item)
        self._json(items, body, found.commit)

    # -- files: whole or ranged, with the faults the tests ask for

    def _resolve(self, repo: str, rev: str, path: str, body: bool) -> None:
        found = self._repo(repo, rev, download=True)
        if found is None:
            return
        if path not in found.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        data = found.files[path]
        start, end = self._range(len(data))
        self._file_headers(found, path, start, end)
        if body:
            self._send_body(path, data[start:end])

    def _file_headers(self, found: Repo, path: str, start: int, end: int) -> None:
        size = len(found.files[path])
        entry = found.entry(path)
        self.send_response(206 if (start, end) != (0, size) else 200)
        self.send_header("X-Repo-Commit", found.commit)
        etag = entry["lfs"]["sha256"] if "lfs" in entry else entry["blobId"]
        self.send_header("ETag", f'"{etag}"')
        if "lfs" in entry:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if (start, end) != (0, size):
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()

    def _range(self, size: int) -> tuple[int, int]:
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if not match:
            return 0, size
        start = int(match.group(1))
        end = int(match.group(2)) + 1 if match.group(2) else size
        return min(start, size), min(end, size)

    def _send_body(self, path: str, data: bytes) -> None:
        data, cut, stall = self.hub.take_faults(path, data)
        limit = cut if cut is not None else stall
        try:
            if limit is None:
                self.wfile.write(data)
                return
            self.wfile.write(data[:limit])
            self.wfile.flush()
            if stall is not None:
                self.hub.stalled.set()
                self.hub.release.wait(timeout=60)
            self.close_connection = True
            self.connection.shutdown(2)  # the client sees the body end early
        except OSError:
            self.close_connection = True  # the client went away


# ---------------------------------------------------------------------------------------------
# Tiny repos to serve


def tiny_llama_files(fixture: Path, model_type: str = "llama") -> dict[str, bytes]:
    """A safetensors repo from the committed tiny llama fixture, with a word-level tokenizer and
    files a pull must leave alone (README, a .bin and an ONNX export)."""
    config = json.loads((fixture / "config.json").read_text())
    config["model_type"] = model_type
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": (fixture / "generation_config.json").read_bytes(),
        "model.safetensors": (fixture / "model.safetensors").read_bytes(),
        "tokenizer.json": tokenizer.to_str().encode(),
        "tokenizer_config.json": json.dumps({"eos_token": "t2", "chat_template": "{{ messages }}"}).encode(),
        "README.md": b"# tiny\n",
        "pytorch_model.bin": b"\0" * 1000,
        "onnx/model.onnx": b"\0" * 1000,
    }


def tiny_gguf_files(fixture: Path, folder: Path, tags: tuple[str, ...] = ("Q4_0", "Q8_0", "F32")) -> dict[str, bytes]:
    """A GGUF repo: the tiny llama fixture written once per quant type (2-D weights quantized)."""
    files = {"README.md": b"# tiny gguf\n"}
    for tag in tags:
        path, _ = tiny_llama_gguf(folder / f"tiny-llama.{tag}.gguf", tag, fixture)
        files[path.name] = path.read_bytes()
    return files
