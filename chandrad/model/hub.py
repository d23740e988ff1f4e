"""The hub: what a repository holds there and what of it is missing here (the fetch plan), and the
hub's and the network's errors turned into one line that says what to do.

The file list and sizes come from the hub (``HfApi.model_info(files_metadata=True)``); each
missing file's blob (its ETag) and exact size from a HEAD of its URL.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import httpx
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from chandrad.model.cache import partial_path, repo_storage

# What is not fetched: weights in formats other than safetensors and large assets, the files vLLM
# itself never reads (vllm/transformers_utils/repo_utils.py _WEIGHT_FILE_PATTERNS). Everything
# else is, READMEs included: vLLM snapshots a repository's non-weight files, and offline that
# snapshot is complete only if they are all there.
NOT_FETCHED_PATTERNS = (
    "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data",
    "*.png", "*.jpg", "*.jpeg", "*.gif", "*.webp", "*.mp3", "*.mp4", "*.wav", "*.flac",
    "*.parquet", "*.arrow", "*.ipynb", "*.zip", "*.tar*",
)  # fmt: skip
# ...but a repository without safetensors has its weights in these.
LEGACY_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth")
HUB_TIMEOUT_SECONDS = 20.0


class ModelFilesError(Exception):
    """The model's files cannot be had; the message is one line that says what to do."""


class NoNetworkError(ModelFilesError):
    pass


def hub_offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


@dataclass
class PlannedFile:
    path: str  # in the repository
    size: int
    url: str = ""
    blob: Path | None = None  # where it goes; None: already in the snapshot
    sha256: str | None = None  # the LFS checksum, for weight files
    partial_bytes: int = 0

    @property
    def needed(self) -> bool:
        return self.blob is not None and not self.blob.is_file()


@dataclass
class FetchPlan:
    repo_id: str
    revision: str
    commit: str
    storage: Path
    ignored: tuple[str, ...]  # the patterns not fetched
    files: list[PlannedFile] = field(default_factory=list)
    parameters: int | None = None  # the hub's count (its safetensors metadata)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def present_bytes(self) -> int:
        return sum(f.size if not f.needed else f.partial_bytes for f in self.files)

    @property
    def missing_bytes(self) -> int:
        return self.total_bytes - self.present_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.files if f.path.endswith((".safetensors", ".bin", ".pt")))

    @property
    def snapshot(self) -> Path:
        return self.storage / "snapshots" / self.commit


def plan_fetch(
    repo_id: str,
    hub_cache: Path,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> FetchPlan:
    """Ask the hub what ``repo_id`` holds and what of it is missing here (raises ModelFilesError)."""
    revision = revision or "main"
    storage = repo_storage(repo_id, hub_cache)
    with hub_errors(repo_id, endpoint, revision):
        info = HfApi(endpoint=endpoint, token=token).model_info(
            repo_id, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_SECONDS
        )
        if not info.sha:
            raise ModelFilesError(f"the hub gave no commit for {repo_id}@{revision}")
        siblings = info.siblings or []
        names = [s.rfilename for s in siblings]
        patterns: tuple[str, ...] = NOT_FETCHED_PATTERNS
        if not any(fnmatch(name, "*.safetensors") for name in names):
            patterns = tuple(p for p in patterns if p not in LEGACY_WEIGHT_PATTERNS)
        plan = FetchPlan(
            repo_id,
            revision,
            info.sha,
            storage,
            patterns,
            parameters=info.safetensors.total if info.safetensors else None,
        )
        for sibling in siblings:
            if any(fnmatch(sibling.rfilename, pattern) for pattern in patterns):
                continue
            planned = PlannedFile(sibling.rfilename, sibling.size or 0)
            plan.files.append(planned)
            if (plan.snapshot / sibling.rfilename).is_file():
                continue  # already linked into this commit's snapshot
            planned.url = hf_hub_url(repo_id, sibling.rfilename, revision=info.sha, endpoint=endpoint)
            metadata = get_hf_file_metadata(planned.url, token=token, timeout=HUB_TIMEOUT_SECONDS)
            if not metadata.etag:
                raise ModelFilesError(f"the hub gave no ETag for {repo_id}/{sibling.rfilename}")
            planned.size = metadata.size if metadata.size is not None else planned.size
            planned.blob = storage / "blobs" / metadata.etag
            planned.sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
            partial = partial_path(planned.blob)
            if partial.is_file():
                planned.partial_bytes = min(partial.stat().st_size, planned.size)
    return plan


class SilentTqdm(hf_tqdm):
    """snapshot_download's bars, off: the download's own bar and log lines are chandrad's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # tqdm ships no type hints


class hub_errors:
    """Turn huggingface_hub's and the network's errors into one line that says what to do."""

    def __init__(self, repo_id: str, endpoint: str | None, revision: str) -> None:
        self.repo_id = repo_id
        self.endpoint = hub_endpoint(endpoint)
        self.revision = revision

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is None or isinstance(error, ModelFilesError) or not isinstance(error, Exception):
            return
        what = f"cannot download {self.repo_id}"
        if isinstance(error, OfflineModeIsEnabled):
            raise ModelFilesError(f"{what}: HF_HUB_OFFLINE is set; unset it to download") from None
        if isinstance(error, GatedRepoError):
            raise ModelFilesError(
                f"{what}: it is gated on {self.endpoint}; accept its terms there and set HF_TOKEN"
            ) from None
        if isinstance(error, RevisionNotFoundError):
            raise ModelFilesError(f"{what}: it has no revision {self.revision!r}") from None
        if isinstance(error, RepositoryNotFoundError):
            raise ModelFilesError(
                f"{what}: {self.endpoint} has no such model (or it is private: set HF_TOKEN); check engine.model"
            ) from None
        network = _network_failure(error)
        if network is not None:
            raise NoNetworkError(
                f"{what}: cannot reach {self.endpoint} ({network}); check the network, the proxy "
                f"(HTTPS_PROXY) or HF_ENDPOINT"
            ) from None
        if isinstance(error, HfHubHTTPError):
            status = error.response.status_code if error.response is not None else "?"
            raise ModelFilesError(f"{what}: {self.endpoint} answered HTTP {status}; try again later") from None


def _network_failure(error: BaseException) -> str | None:
    """What went wrong, if ``error`` (or what caused it) is the network's failure."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (httpx.TransportError, ConnectionError, TimeoutError, socket.gaierror)) or (
            type(current).__name__
            in {"ConnectError", "ConnectTimeout", "ReadTimeout", "PoolTimeout", "ProxyError", "NetworkError"}
        ):
            return describe_error(current)
        current = current.__cause__ or current.__context__
    return None


def describe_error(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:200]
