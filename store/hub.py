"""The Hugging Face hub client: which files a model needs, and downloading them safely.

Built on `huggingface_hub` for the API, auth and HTTP session (it honours `HF_TOKEN`; `HF_ENDPOINT`
is read here at call time, since the library reads it once at import). Files are fetched
with plain HTTP GETs (never Xet), into `<folder>/<file>.part`, so an interrupted download,
even of a killed process, resumes where it stopped (an HTTP Range request). Every finished
file is checked against what the hub reports: its size, and its sha256 (LFS files) or its
git blob id (small files). Only the files a model needs are fetched: config, tokenizer and
safetensors for an HF repo; the one `.gguf` of the requested quant for a GGUF repo (or every
part of a split one, `NAME-00001-of-0000n.gguf` and on), and the repo's vision projector
(`mmproj*.gguf`) when it has one: the one llama.cpp's `-hf` takes (`choose_mmproj`), another
named, or none.

Callers hold the model's store lock while downloading, so one `.part` file has one writer.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from huggingface_hub import HfApi
from huggingface_hub import errors as hf_errors
from huggingface_hub.file_download import hf_hub_url
from huggingface_hub.utils import build_hf_headers, filter_repo_objects, get_session, hf_raise_for_status

from baselm.store.errors import ModelFileError, StoreError, UnsupportedModelError
from baselm.store.fs import publish
from baselm.store.gguf_split import is_mmproj_name
from baselm.store.progress import NoProgress, Progress

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK_SIZE = 256 * 1024  # bytes written (and resumable) at a time
DOWNLOAD_TIMEOUT = 30.0  # seconds without data before a read counts as a network failure
MAX_RETRIES = 5  # consecutive attempts that bring no new bytes
RETRY_DELAY = 0.1  # seconds before the first retry; doubles after each fruitless attempt, up to 2 s

# What an HF (safetensors) model needs; weights and the rest of the repo are left out.
HF_PATTERNS = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
)
# GGUF quant tags in order of preference when none is asked for: first the types base keeps bit
# for bit (MLX reads Q4_0/Q4_1/Q8_0 as its own affine groups), 4-bit before 8-bit, then floats,
# then K-quants (which need re-quantizing).
GGUF_DEFAULT_ORDER = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K")
_COMMIT = re.compile(r"[0-9a-f]{40}")  # a git commit id, as the hub writes it
_GGUF_TAG = re.compile(r"[-._]((?:I?Q\d[A-Z0-9_]*)|F16|BF16|F32)\Z", re.IGNORECASE)
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf\Z", re.IGNORECASE)  # gguf-split's part names


class HubError(StoreError):
    """The hub refused or failed a request; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a repo as the hub lists it."""

    path: str  # relative to the repo root
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1 (small files)


@dataclass(frozen=True, slots=True)
class RepoSnapshot:
    """A repo at one commit: what the hub lists for it."""

    repo: str
    revision: str  # as asked (branch, tag or commit)
    commit: str  # the commit sha it resolved to
    files: tuple[HubFile, ...]

    def file(self, path: str) -> HubFile | None:
        return next((f for f in self.files if f.path == path), None)


@dataclass(frozen=True, slots=True)
class Selection:
    """The files to fetch for one model: `kind` is "safetensors" or "gguf"; a GGUF model's vision
    projector, when it has one, apart from its own files."""

    kind: str
    files: tuple[HubFile, ...]
    gguf_tag: str | None = None  # the quant tag of the chosen .gguf, e.g. "Q4_K_M"
    mmproj: HubFile | None = None  # the vision projector GGUF that goes with it

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files) + (self.mmproj.size if self.mmproj else 0)


@dataclass(frozen=True, slots=True)
class MmprojChoice:
    """Which vision projector a GGUF model takes: the one `name` names (a file of the hub repo, or a
    local file for a local model), else the default one (see `choose_mmproj`), or none when not `wanted`."""

    name: str | None = None
    wanted: bool = True

    def __post_init__(self) -> None:
        if self.name is not None and not self.wanted:
            raise StoreError("--mmproj and --no-mmproj ask for opposite things; give one")


DEFAULT_MMPROJ = MmprojChoice()  # the projector llama.cpp's `-hf` takes, when the repo has one


# ---------------------------------------------------------------------------------------------
# The API side


class HubClient:
    """Talks to the hub at `endpoint` (default `$HF_ENDPOINT`, else huggingface.co)."""

    def __init__(self, endpoint: str | None = None, token: str | None = None) -> None:
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = token or os.environ.get("HF_TOKEN") or None

    def snapshot(self, repo: str, revision: str = "main") -> RepoSnapshot:
        """The repo's files (with sizes and hashes) at `revision`."""
        api = HfApi(endpoint=self.endpoint, token=self.token)
        with _hub_errors(repo, revision, self.endpoint):
            info = api.model_info(repo, revision=revision, files_metadata=True)
        files = tuple(
            HubFile(self._checked_name(s.rfilename, repo), int(s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
            for s in info.siblings or []
        )
        if not info.sha:
            raise HubError(f"{self.endpoint} did not say which commit {repo}@{revision} is; is HF_ENDPOINT a hub?")
        if not _COMMIT.fullmatch(info.sha):  # it names a folder of the downloads, removed with the others
            raise HubError(
                f"{self.endpoint} gave {info.sha!r} as the commit of {repo}@{revision}, which is not a commit id "
                "(40 hex digits); is HF_ENDPOINT a hub?"
            )
        # The hub matches repo ids in any case and answers with the canonical spelling: store by that.
        if info.id and info.id.lower() != repo.lower():
            raise HubError(f"{self.endpoint} answered for {info.id!r} when asked for {repo!r}; is HF_ENDPOINT a hub?")
        return RepoSnapshot(info.id or repo, revision, info.sha, files)

    def _checked_name(self, name: str, repo: str) -> str:
        """`name`, a listed file's path, unless it could reach outside the folder it is downloaded into."""
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
            raise HubError(
                f"{self.endpoint} lists a file named {name!r} in {repo}, which is not a path inside the repo; "
                "refused (is HF_ENDPOINT a hub you trust?)"
            )
        return name

    def download(self, snapshot: RepoSnapshot, file: HubFile, folder: Path, progress: Progress | None = None) -> Path:
        """`file` under `folder`, fetched (or resumed from its `.part`) and verified; a verified copy is reused."""
        target = folder / file.path
        if target.is_file() and _matches(target, file):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        if part.is_file() and part.stat().st_size > file.size:
            part.unlink()  # not a prefix of this file: start over
        url = hf_hub_url(snapshot.repo, file.path, revision=snapshot.commit, endpoint=self.endpoint)
        progress = progress or NoProgress()
        with open(part, "ab") as f:
            progress.start(file.path, file.size, f.tell())
            try:
                with _hub_errors(snapshot.repo, snapshot.revision, self.endpoint):
                    self._fetch(url, f, file.size, progress)
            finally:
                progress.finish()
        if not _matches(part, file):
            part.unlink()
            raise HubError(
                f"{file.path} from {snapshot.repo} does not match the hash the hub lists; it was removed, pull again"
            )
        publish(part, target)
        return target

    def _fetch(self, url: str, f: BinaryIO, size: int, progress: Progress) -> None:
        """Appends the rest of the file to `f`, resuming with a Range request after each cut."""
        headers = build_hf_headers(token=self.token)
        headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets in the file
        failures = 0
        while f.tell() < size:
            done = f.tell()
            try:
                ranged = {**headers, "Range": f"bytes={done}-"} if done else headers
                with get_session().stream("GET", url, headers=ranged, timeout=DOWNLOAD_TIMEOUT) as response:
                    hf_raise_for_status(response)
                    if done and response.status_code == 200:  # the server ignored the Range: start over
                        f.seek(0)
                        f.truncate()
                    for chunk in response.iter_bytes(CHUNK_SIZE):
                        f.write(chunk)
                        progress.advance(len(chunk))
            except Exception as exc:
                if not _is_network_error(exc):
                    raise
                failures = 0 if f.tell() > done else failures + 1
                if failures >= MAX_RETRIES:
                    raise
                time.sleep(min(RETRY_DELAY * 2**failures, 2.0))
                continue
            if f.tell() > size:
                raise HubError(f"{url} sent more bytes than the {size} the hub lists; pull again")
            failures = 0 if f.tell() > done else failures + 1
            if failures >= MAX_RETRIES:  # answers that end early without an error, and bring nothing
                raise HubError(f"{url} stops sending data at byte {done} of {size}; try again later")


def select_files(snapshot: RepoSnapshot, tag: str | None, mmproj: MmprojChoice = DEFAULT_MMPROJ) -> Selection:
    """The files to fetch: a GGUF file when `tag` names one (or the repo has only GGUF), else the HF files.

    A GGUF model comes with the repo's vision projector as `choose_mmproj` picks it, or the one
    `mmproj` names (its path in the repo, or its file name), or none."""
    ggufs = [f for f in snapshot.files if f.path.endswith(".gguf") and not _is_extra_gguf(f.path)]
    has_safetensors = any(f.path.endswith(".safetensors") for f in snapshot.files)
    tagged = [f for f in ggufs if tag and gguf_tag(f.path).upper() == tag.upper()]
    if has_safetensors and snapshot.file("config.json") and not tagged:
        if mmproj.name is not None:
            raise ModelFileError(
                f"{snapshot.repo} is pulled from its safetensors weights; --mmproj picks a GGUF model's vision "
                "projector (ask for a GGUF file with :QUANT)"
            )
        files = filter_repo_objects(snapshot.files, allow_patterns=list(HF_PATTERNS), key=lambda f: f.path)
        return Selection("safetensors", tuple(files))
    if not ggufs:
        raise ModelFileError(f"{snapshot.repo} has neither safetensors weights with a config.json nor .gguf files")
    chosen = _choose_gguf(snapshot.repo, ggufs, tag)
    if mmproj.name is not None:
        projector = named_mmproj(snapshot, mmproj.name)
    else:
        projector = choose_mmproj(snapshot, chosen) if mmproj.wanted else None
    return Selection("gguf", _gguf_parts(snapshot, chosen), gguf_tag(chosen.path).upper(), projector)


def choose_mmproj(snapshot: RepoSnapshot, model: HubFile) -> HubFile | None:
    """The vision projector llama.cpp's `-hf` takes beside `model` (`find_best_mmproj` in its
    common/download.cpp), None when the repo has none.

    A projector is a `.gguf` with `mmproj` in its name, in the model's folder or one above it: the
    nearest folder wins, then the quantization closest in bits to the model's (the first number of
    the name's quant tag: `Q4_K_M` 4, `Q8_0` 8, `F16` and `BF16` 16, `F32` 32, none 0), then the first
    by name (the order the hub lists files in, which llama.cpp keeps)."""
    folder = PurePosixPath(model.path).parent.parts
    model_bits = quant_bits(model.path)
    projectors = [
        f
        for f in sorted(snapshot.files, key=lambda f: f.path)
        if f.path.endswith(".gguf") and is_mmproj_name(f.path) and _is_folder_of(f.path, folder)
    ]
    if not projectors:
        return None
    return min(
        projectors,
        key=lambda f: (-len(PurePosixPath(f.path).parent.parts), abs(quant_bits(f.path) - model_bits)),
    )


def named_mmproj(snapshot: RepoSnapshot, name: str) -> HubFile:
    """The projector a user named: a `.gguf` of the repo by its path, or by its file name when one file has it."""
    found = snapshot.file(name)
    if found is None:
        found_by_name = [f for f in snapshot.files if f.path.endswith(".gguf") and PurePosixPath(f.path).name == name]
        if len(found_by_name) > 1:
            paths = ", ".join(sorted(f.path for f in found_by_name))
            raise ModelFileError(f"{snapshot.repo} has several files named {name} ({paths}); give its path")
        found = found_by_name[0] if found_by_name else None
    if found is None or not found.path.endswith(".gguf"):
        listed = sorted(f.path for f in snapshot.files if f.path.endswith(".gguf") and is_mmproj_name(f.path))
        has = f"its projectors are {', '.join(listed)}" if listed else "it has no vision projector"
        raise ModelFileError(f"{snapshot.repo} has no GGUF file {name!r} to take as the vision projector; {has}")
    return found


def quant_bits(path: str) -> int:
    """The bits a GGUF file name's quant tag says (`Q4_K_M` 4, `BF16` 16), 0 when it has no number."""
    digits = re.search(r"\d+", gguf_tag(path))
    return int(digits.group()) if digits else 0


def _is_folder_of(path: str, folder: tuple[str, ...]) -> bool:
    """Whether the file at `path` lies in `folder` or a folder above it."""
    parts = PurePosixPath(path).parent.parts
    return folder[: len(parts)] == parts


def gguf_tag(path: str) -> str:
    """The quant tag in a GGUF file name (`SmolLM2-135M-Instruct.Q4_K_M.gguf` -> `Q4_K_M`, also for a
    split's `...Q4_K_M-00001-of-00002.gguf`), or ""."""
    name = Path(path).name
    match = _GGUF_TAG.search(_SPLIT_PART.sub("", name) if _SPLIT_PART.search(name) else name.removesuffix(".gguf"))
    return match.group(1) if match else ""


def _is_extra_gguf(path: str) -> bool:
    """Vision projectors and a split's later parts are not whole language models (its first part stands for it)."""
    part = _SPLIT_PART.search(Path(path).name)
    return is_mmproj_name(path) or (part is not None and part.group(1) != "00001")


def _gguf_parts(snapshot: RepoSnapshot, chosen: HubFile) -> tuple[HubFile, ...]:
    """The chosen GGUF, or every part of the split it is the first of; a missing part is named."""
    part = _SPLIT_PART.search(chosen.path)
    if part is None:
        return (chosen,)
    count, prefix = int(part.group(2)), chosen.path[: part.start()]
    names = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [n for n in names if snapshot.file(n) is None]
    if missing:
        raise ModelFileError(f"{snapshot.repo} lacks part(s) {', '.join(missing)} of the split GGUF {chosen.path}")
    return tuple(snapshot.file(n) for n in names)


def _choose_gguf(repo: str, ggufs: list[HubFile], tag: str | None) -> HubFile:
    by_tag = {gguf_tag(f.path).upper(): f for f in ggufs}
    if tag:
        if tag.upper() in by_tag:
            return by_tag[tag.upper()]
        raise ModelFileError(f"{repo} has no {tag} GGUF file; it has {', '.join(sorted(t or '?' for t in by_tag))}")
    if len(ggufs) == 1:
        return ggufs[0]
    for preferred in GGUF_DEFAULT_ORDER:
        if preferred in by_tag:
            return by_tag[preferred]
    raise ModelFileError(f"{repo} has several GGUF files; pick one: {', '.join(sorted(by_tag))}")


def check_model_type(config: dict[str, Any], supported: Iterable[str], repo: str) -> str:
    """The config's model_type, or an error when base cannot run it."""
    model_type = config.get("model_type")
    supported = set(supported)
    if model_type not in supported:
        raise UnsupportedModelError(
            f"{repo} is a {model_type!r} model, which base does not run; supported: {', '.join(sorted(supported))}"
        )
    return str(model_type)


# ---------------------------------------------------------------------------------------------
# Errors, verification, plumbing


@contextmanager
def _hub_errors(repo: str, revision: str, endpoint: str) -> Iterator[None]:
    """Turns huggingface_hub and network errors into one-sentence HubErrors."""
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:
        message = _hub_error_message(exc, repo, revision, endpoint)
        if message is None:
            raise
        raise HubError(message) from None


def _hub_error_message(exc: BaseException, repo: str, revision: str, endpoint: str) -> str | None:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, hf_errors.GatedRepoError) or status == 403:
        return f"{repo} is gated or private: it needs a token (set HF_TOKEN) with access granted on its hub page"
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return f"{repo} has no revision {revision!r}"
    if isinstance(exc, hf_errors.RepositoryNotFoundError) or status == 401:
        hint = "; if it is private or gated, set HF_TOKEN to a token with access" if status == 401 else ""
        return f"no such repo {repo!r} on {endpoint} (or no such revision {revision!r}){hint}"
    if isinstance(exc, hf_errors.EntryNotFoundError) or status == 404:
        return f"{repo}@{revision}: a listed file is missing on the hub; try again later or another revision"
    if isinstance(exc, hf_errors.HfHubHTTPError):
        return f"the hub answered {status} for {repo}; try again later"
    if _is_network_error(exc):
        kind = type(exc).__name__
        if kind == "ConnectError":
            return f"cannot reach {endpoint} ({kind}); check the network, or HF_ENDPOINT"
        return f"the connection to {endpoint} failed ({kind}); pull again to resume"
    return None


def _is_network_error(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "TimeoutException", "ConnectionError"})


def _matches(path: Path, file: HubFile) -> bool:
    """Size and content hash against the hub's listing (sha256 for LFS, git blob sha1 otherwise)."""
    size = path.stat().st_size
    if size != file.size:
        return False
    if file.sha256:
        return _digest(path, hashlib.sha256()) == file.sha256
    if file.blob_id:
        return _digest(path, hashlib.sha1(f"blob {size}\0".encode())) == file.blob_id
    return True


def _digest(path: Path, h: Any) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
