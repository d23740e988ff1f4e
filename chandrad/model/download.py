"""Model files: where they live, fetching them with progress, and what they say about the model.

**Where.** The Hugging Face hub cache (``HF_HOME/hub``: ``models--ORG--NAME/{blobs,snapshots,refs}``),
the one vLLM reads. The systemd units set ``HF_HOME`` to the unit's cache directory
(``CacheDirectory=chandrad`` → ``/var/cache/chandrad/huggingface``); ``chandrad fetch-model`` and
``chandrad check`` run by root without ``HF_HOME`` use that same folder, and hand what they write
to the service's user. The daemon itself uses whatever huggingface_hub (and so vLLM) uses.

**Fetching.** The file list and sizes come from the hub (``HfApi.model_info(files_metadata=True)``)
and are checked against the free space before a byte is written. huggingface_hub >= 1.18 deletes a
partial file when a download is interrupted (and leaves ``*.incomplete`` orphans when it is killed),
so a 5 GB weight shard cut at 90 % starts again from zero; here each file is fetched over HTTP with
ranges into ``blobs/<etag>.chandrad-partial``, kept across interruptions and resumed, checked
against its size and SHA-256, and renamed to the blob huggingface_hub would have written.
``snapshot_download`` then builds the snapshot from those blobs as from its own (links, refs, tree
listing), so vLLM finds a normal cache.

**Facts.** Architecture, dtype, parameters (from the safetensors headers), the stop token ids the
engine will use, and whether the GPUs hold the weights and the KV cache (``gpu_fit``, pure).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import math
import os
import pwd
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

import httpx
import structlog
from huggingface_hub import HfApi, constants, get_hf_file_metadata, get_token, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from chandrad import __version__
from chandrad.config import EngineSettings

log = structlog.get_logger("chandrad.modelfiles")

# The units' CacheDirectory=chandrad and HF_HOME=%C/chandrad/huggingface (systemd/chandrad*.service).
SERVICE_CACHE_ROOT = Path("/var/cache/chandrad")
SERVICE_HF_HOME = SERVICE_CACHE_ROOT / "huggingface"
SERVICE_USER = "chandrad"

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
PARTIAL_SUFFIX = ".chandrad-partial"
# Partial downloads nobody has written to for this long are someone's leftovers (huggingface_hub's
# *.incomplete are never resumed by it; ours for a blob the hub no longer lists).
STALE_PARTIAL_SECONDS = 3600.0
# Room left on the disk after the download (the hub's sizes are exact; logs and the rest need some).
DISK_MARGIN_BYTES = 64 * 2**20
DOWNLOAD_WORKERS = 4
CHUNK_BYTES = 1 << 20  # for hashing
HUB_TIMEOUT_SECONDS = 20.0
READ_TIMEOUT_SECONDS = 30.0
# A file is retried (resuming) after a dropped connection; this many tries in a row that bring no
# byte make the download fail.
ATTEMPTS_WITHOUT_PROGRESS = 6
RETRY_DELAY_MAX_SECONDS = 30.0
# A stopped download (daemon stop) waits this long for its threads to notice before going on.
STOP_WAIT_SECONDS = 5.0


# -- errors ------------------------------------------------------------------------------------


class ModelFilesError(Exception):
    """The model's files cannot be had; the message is one line that says what to do."""


class NoNetworkError(ModelFilesError):
    pass


class DiskTooSmallError(ModelFilesError):
    pass


class FetchCancelled(ModelFilesError):
    pass


# -- where model files live --------------------------------------------------------------------


def hub_cache_for_admin(
    hf_home: Path | None = None, environ: Mapping[str, str] = os.environ, euid: int | None = None
) -> Path:
    """The hub cache the service reads, as seen by an admin's command (``fetch-model``, ``check``).

    An explicit ``--hf-home`` wins, then huggingface_hub's own variables (the unit sets HF_HOME),
    then, for root, the unit's cache directory; anyone else gets huggingface_hub's default.
    """
    if hf_home is not None:
        return hf_home / "hub"
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    if (os.geteuid() if euid is None else euid) == 0:
        return SERVICE_HF_HOME / "hub"
    return Path(constants.HF_HUB_CACHE)


def process_hub_cache() -> Path:
    """The hub cache huggingface_hub, and so vLLM, uses in this process."""
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository rather than a local directory."""
    return not Path(model).expanduser().exists() and bool(_HUB_ID.match(model)) and not model.startswith(".")


def repo_storage(repo_id: str, hub_cache: Path) -> Path:
    return hub_cache / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, hub_cache: Path, revision: str | None = None) -> Path | None:
    """The complete snapshot of ``repo_id`` in the cache, or None.

    Complete: the config, a tokenizer, and every weight shard its index names (or one safetensors
    file without an index) are there — what vLLM needs, checked without the network.
    """
    storage = repo_storage(repo_id, hub_cache)
    revision = revision or "main"
    commit = revision
    if not re.fullmatch(r"[0-9a-f]{40}", revision):
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:
            return None
    folder = storage / "snapshots" / commit
    return folder if snapshot_complete(folder) else None


def snapshot_complete(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(path.is_file() for path in folder.glob("*.safetensors"))


# -- progress ----------------------------------------------------------------------------------


class FetchProgress:
    """The bytes of one model download, told to a terminal bar, the log and a callback.

    ``advance`` is called from the download threads; ``on_update`` runs (in one of them) at most
    every ``update_seconds`` while bytes arrive, so a stalled download stops calling it. The log
    gets a line at each tenth of the download and at least every ``log_seconds``.
    """

    def __init__(
        self,
        *,
        bar: bool = False,
        on_update: Callable[[FetchProgress], None] | None = None,
        update_seconds: float = 2.0,
        log_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bar = bar
        self.on_update = on_update
        self.update_seconds = update_seconds
        self.log_seconds = log_seconds
        self.clock = clock
        self.model = ""
        self.total = 0
        self.present = 0  # bytes already there when this run began
        self.done = 0  # present + received
        self.started_at = 0.0
        self.last_bytes_at = 0.0
        self.receiving = False
        self._last_update = 0.0
        self._last_log = 0.0
        self._last_tenth = 0
        self._lock = threading.Lock()
        self._bar: hf_tqdm | None = None

    def begin(self, model: str, total: int, present: int, folder: Path) -> None:
        now = self.clock()
        with self._lock:
            self.model, self.total, self.present, self.done = model, total, present, present
            self.started_at = self.last_bytes_at = self._last_update = self._last_log = now
            self._last_tenth = self._tenth()
            self.receiving = True
        log.info(
            "downloading model files",
            model=model,
            total_bytes=total,
            present_bytes=present,
            to=str(folder),
        )
        if self.bar:
            self._bar = hf_tqdm(  # type: ignore[no-untyped-call]  # tqdm ships no type hints
                total=total, initial=present, unit="B", unit_scale=True, unit_divisor=1000, desc=model, disable=False
            )
        self._notify()

    def advance(self, n: int) -> None:
        now = self.clock()
        with self._lock:
            self.done += n
            if n > 0:
                self.last_bytes_at = now
            update = now - self._last_update >= self.update_seconds
            if update:
                self._last_update = now
            tenth = self._tenth()
            log_now = tenth > self._last_tenth or now - self._last_log >= self.log_seconds
            if log_now:
                self._last_tenth, self._last_log = tenth, now
            if self._bar is not None:
                self._bar.update(n)
        if log_now:
            (log.debug if self.bar else log.info)(
                "model download progress",
                model=self.model,
                done_bytes=self.done,
                total_bytes=self.total,
                percent=round(self.percent, 1),
                mb_per_s=round(self.rate() / 1e6, 1),
                eta_seconds=self.eta_seconds(),
            )
        if update:
            self._notify()

    def finish(self) -> None:
        with self._lock:
            self.receiving = False
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        seconds = self.clock() - self.started_at
        log.info(
            "model files downloaded",
            model=self.model,
            received_bytes=self.done - self.present,
            seconds=round(seconds, 1),
            mb_per_s=round(self.rate() / 1e6, 1),
        )

    def abandon(self) -> None:
        with self._lock:
            self.receiving = False
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0

    def rate(self) -> float:
        """Bytes per second received by this run."""
        elapsed = self.clock() - self.started_at
        return (self.done - self.present) / elapsed if elapsed > 0 else 0.0

    def eta_seconds(self) -> int | None:
        rate = self.rate()
        return round((self.total - self.done) / rate) if rate > 0 else None

    def seconds_since_bytes(self) -> float:
        return self.clock() - self.last_bytes_at

    def line(self) -> str:
        """One line for systemd's STATUS: how far, how fast, how long still."""
        eta = self.eta_seconds()
        left = f", about {_duration(eta)} left" if eta is not None and self.done < self.total else ""
        return (
            f"downloading {self.model}: {_gb(self.done)} of {_gb(self.total)} ({self.percent:.0f} %), "
            f"{self.rate() / 1e6:.1f} MB/s{left}"
        )

    def _tenth(self) -> int:
        return int(10 * self.done / self.total) if self.total else 10

    def _notify(self) -> None:
        if self.on_update is not None:
            try:
                self.on_update(self)
            except Exception:  # a progress report must never break the download
                log.exception("the download progress callback failed")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _duration(seconds: int) -> str:
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


# -- fetching ----------------------------------------------------------------------------------


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
    with _hub_errors(repo_id, endpoint, revision):
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
            partial = _partial(planned.blob)
            if partial.is_file():
                planned.partial_bytes = min(partial.stat().st_size, planned.size)
    return plan


def fetch_model(
    repo_id: str,
    hub_cache: Path,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    progress: FetchProgress | None = None,
    stop: threading.Event | None = None,
    free_bytes: Callable[[Path], int] | None = None,
    owner: tuple[int, int] | None = None,
) -> Path:
    """Make sure the cache holds ``repo_id`` complete; download what is missing. Returns its folder.

    Offline (HF_HUB_OFFLINE) or with the hub out of reach, a complete cached snapshot is used as
    it is. ``owner``: hand every file under the cache's HF_HOME to this uid/gid afterwards (root
    filling the service's cache). ``stop``: set it to end the download early (FetchCancelled); what
    arrived is kept for the next run.
    """
    stop = stop or threading.Event()
    progress = progress or FetchProgress()
    if hub_offline():
        cached = cached_snapshot(repo_id, hub_cache, revision)
        if cached is None:
            raise ModelFilesError(
                f"{repo_id} is not in {hub_cache} and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE "
                f"(systemctl edit chandrad) to let chandrad download it, or run chandrad fetch-model without it"
            )
        log.info("model files in the cache (HF_HUB_OFFLINE: not checked against the hub)", folder=str(cached))
        return cached
    try:
        plan = plan_fetch(repo_id, hub_cache, revision=revision, endpoint=endpoint, token=token)
    except ModelFilesError as error:  # the hub is out of reach, down, or refuses: the cache will do
        cached = cached_snapshot(repo_id, hub_cache, revision)
        if cached is None:
            raise
        log.warning("the hub cannot tell what is current: using the model files in the cache", error=str(error))
        return cached
    todo = [f for f in plan.files if f.needed]
    if todo:
        _remove_stale_partials(plan)
        _check_free_space(plan, free_bytes or _free_bytes)
        (plan.storage / "blobs").mkdir(parents=True, exist_ok=True)
        progress.begin(repo_id, plan.total_bytes, plan.present_bytes, plan.snapshot)
        try:
            _download_all(plan, todo, token, progress, stop)
        except BaseException:
            progress.abandon()
            if owner is not None:
                hand_over(hub_cache, owner)
            raise
        progress.finish()
    if all(f.blob is None for f in plan.files) and _ref(plan) == plan.commit and snapshot_complete(plan.snapshot):
        folder = plan.snapshot  # all there and linked: nothing to ask the hub
    else:
        with _hub_errors(repo_id, endpoint, plan.revision):
            # Links the blobs into the snapshot, writes refs/<revision> and the tree listing, as for its own.
            folder = Path(
                snapshot_download(
                    repo_id,
                    revision=plan.revision,
                    cache_dir=hub_cache,
                    ignore_patterns=list(plan.ignored),
                    endpoint=endpoint,
                    token=token,
                    tqdm_class=_SilentTqdm,
                    etag_timeout=HUB_TIMEOUT_SECONDS,
                )
            )
    if owner is not None:
        hand_over(hub_cache, owner)
    if not snapshot_complete(folder):
        raise ModelFilesError(f"{repo_id} has no config.json, tokenizer or complete weights at {plan.commit}")
    log.info("model files in the cache", model=repo_id, folder=str(folder), bytes=plan.total_bytes)
    return folder


async def fetch_model_async(
    repo_id: str, hub_cache: Path, *, progress: FetchProgress | None = None, **kwargs: Any
) -> Path:
    """``fetch_model`` in a thread of its own; cancelling this ends the download (kept for a resume)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Path] = loop.create_future()
    stop = threading.Event()

    def deliver(result: Path | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            assert result is not None
            done.set_result(result)

    def work() -> None:
        result: Path | None = None
        error: BaseException | None = None
        try:
            result = fetch_model(repo_id, hub_cache, progress=progress, stop=stop, **kwargs)
        except BaseException as caught:  # handed to the awaiting task
            error = caught
        try:
            loop.call_soon_threadsafe(deliver, result, error)
        except RuntimeError:  # the loop is gone (the daemon stopped): nobody waits for it
            pass

    # A thread of its own, not the loop's executor: a stop must not wait at exit for a read to time out.
    threading.Thread(target=work, name=f"fetch {repo_id}", daemon=True).start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait({done}, timeout=STOP_WAIT_SECONDS)
        if done.done() and not done.cancelled():
            done.exception()  # retrieved: the stop's FetchCancelled is expected
        raise


class _SilentTqdm(hf_tqdm):
    """snapshot_download's bars, off: the download's own bar and log lines are chandrad's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # tqdm ships no type hints


def _ref(plan: FetchPlan) -> str:
    if plan.revision == plan.commit:
        return plan.commit
    try:
        return (plan.storage / "refs" / plan.revision).read_text().strip()
    except OSError:
        return ""


def _partial(blob: Path) -> Path:
    return blob.with_name(blob.name + PARTIAL_SUFFIX)


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _check_free_space(plan: FetchPlan, free_bytes: Callable[[Path], int]) -> None:
    needed = plan.missing_bytes
    free = free_bytes(plan.storage)
    if free < needed + DISK_MARGIN_BYTES:
        raise DiskTooSmallError(
            f"not enough disk space for {plan.repo_id}: it needs {_gb(needed)} more and "
            f"{plan.storage.parent} has {_gb(free)} free; free some space there or point HF_HOME "
            f"(fetch-model --hf-home) at a larger disk"
        )


def _remove_stale_partials(plan: FetchPlan) -> None:
    """Partial files nobody will resume: huggingface_hub's (it never resumes them) and ours for blobs
    the hub no longer lists, once nobody has written to them for a while."""
    wanted = {_partial(f.blob).name for f in plan.files if f.blob is not None}
    now = time.time()
    for path in (plan.storage / "blobs").glob("*"):
        if not path.name.endswith((".incomplete", PARTIAL_SUFFIX)) or path.name in wanted:
            continue
        try:
            st = path.stat()
            if now - st.st_mtime > STALE_PARTIAL_SECONDS:
                path.unlink()
                log.info("removed a partial download nobody resumes", file=str(path), bytes=st.st_size)
        except OSError:
            pass


def _download_all(
    plan: FetchPlan, todo: list[PlannedFile], token: str | None, progress: FetchProgress, stop: threading.Event
) -> None:
    # The bytes on disk are the bytes counted: no compression.
    headers = {"User-Agent": f"chandrad/{__version__}", "Accept-Encoding": "identity"}
    token = token or get_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    locks = plan.storage.parent / ".locks" / plan.storage.name
    locks.mkdir(parents=True, exist_ok=True)

    def one(planned: PlannedFile) -> None:
        try:
            _download_file(planned, headers, locks, progress, stop)
        except BaseException:
            stop.set()  # the other files end too: the run has failed
            raise

    # Smallest first: the configs and tokenizer are there early, the big shards share the pipe.
    todo = sorted(todo, key=lambda f: f.size)
    pool = ThreadPoolExecutor(max_workers=min(DOWNLOAD_WORKERS, len(todo)), thread_name_prefix="fetch")
    try:
        futures = [pool.submit(one, planned) for planned in todo]
        errors = [future.exception() for future in futures]
    except BaseException:  # Ctrl-C: the workers end at their next chunk instead of finishing the files
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True)
    first = next((e for e in errors if e is not None and not isinstance(e, FetchCancelled)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _download_file(
    planned: PlannedFile, headers: dict[str, str], locks: Path, progress: FetchProgress, stop: threading.Event
) -> None:
    assert planned.blob is not None
    blob, partial = planned.blob, _partial(planned.blob)
    # The lock huggingface_hub takes for this blob (.locks/<repo>/<etag>.lock, flock): a concurrent
    # hf_hub_download or fetch-model of the same file waits instead of writing beside us.
    with _flock(locks / f"{blob.name}.lock", stop):
        if blob.is_file():
            progress.advance(planned.size - planned.partial_bytes)
            return
        fruitless = 0
        while True:
            have = partial.stat().st_size if partial.exists() else 0
            if have > planned.size:
                partial.unlink()
                progress.advance(-have)
                have = 0
            if have == planned.size:
                break
            before = have
            try:
                _receive(planned, partial, have, headers, progress, stop)
            except (httpx.TransportError, _RetryableStatus) as error:
                now_have = partial.stat().st_size if partial.exists() else 0
                fruitless = 0 if now_have > before else fruitless + 1
                if fruitless >= ATTEMPTS_WITHOUT_PROGRESS:
                    raise NoNetworkError(
                        f"the download of {planned.path} keeps failing ({_describe(error)}); what arrived is "
                        f"kept: run it again to continue"
                    ) from None
                delay = min(RETRY_DELAY_MAX_SECONDS, 2.0 ** max(fruitless - 1, 0))
                log.warning(
                    "the model download was interrupted; resuming",
                    file=planned.path,
                    have_bytes=now_have,
                    retry_in_seconds=delay,
                    error=_describe(error),
                )
                if stop.wait(delay):
                    raise FetchCancelled("the download was stopped; what arrived is kept") from None
        _verify(planned, partial, stop)
        os.replace(partial, blob)


class _RetryableStatus(Exception):
    pass


def _receive(
    planned: PlannedFile,
    partial: Path,
    have: int,
    headers: dict[str, str],
    progress: FetchProgress,
    stop: threading.Event,
) -> None:
    """One GET of the file from byte ``have`` on, appended to the partial file."""
    request_headers = {**headers, **({"Range": f"bytes={have}-"} if have else {})}
    timeout = httpx.Timeout(READ_TIMEOUT_SECONDS, connect=HUB_TIMEOUT_SECONDS)
    # Redirects to the hub's CDN are followed; httpx drops the Authorization header on the way out.
    with (
        httpx.Client(follow_redirects=True, timeout=timeout) as client,
        client.stream("GET", planned.url, headers=request_headers) as response,
    ):
        if response.status_code == 416 and have:
            partial.unlink()  # the file changed under the same name: start again
            progress.advance(-have)
            raise _RetryableStatus("range not satisfiable")
        if response.status_code >= 500 or response.status_code == 429:
            raise _RetryableStatus(f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise ModelFilesError(f"the hub refused {planned.path}: HTTP {response.status_code}")
        mode = "ab"
        if response.status_code != 206 and have:  # the server ignored the range: from the start
            progress.advance(-have)
            mode = "wb"
        with open(partial, mode) as handle:
            for chunk in response.iter_bytes():  # as it arrives: a stop is seen at once, even on a slow line
                if stop.is_set():
                    raise FetchCancelled("the download was stopped; what arrived is kept")
                handle.write(chunk)
                progress.advance(len(chunk))
            handle.flush()
            os.fsync(handle.fileno())


def _verify(planned: PlannedFile, partial: Path, stop: threading.Event) -> None:
    size = partial.stat().st_size
    if size != planned.size:
        partial.unlink()
        raise ModelFilesError(f"{planned.path} arrived with {size} bytes instead of {planned.size}; run it again")
    if planned.sha256 is None:
        return
    digest = hashlib.sha256()
    with open(partial, "rb") as handle:
        while block := handle.read(8 * CHUNK_BYTES):
            if stop.is_set():
                raise FetchCancelled("the download was stopped; what arrived is kept")
            digest.update(block)
    if digest.hexdigest() != planned.sha256:
        partial.unlink()
        raise ModelFilesError(f"{planned.path} does not match its SHA-256 (corrupted in transit); run it again")


class _flock:
    """An exclusive flock on ``path`` (huggingface_hub's lock file for the blob), interruptible by ``stop``."""

    def __init__(self, path: Path, stop: threading.Event) -> None:
        self.path = path
        self.stop = stop
        self.fd = -1

    def __enter__(self) -> None:
        existed = self.path.exists()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o664)
        waiting_logged = False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if not waiting_logged:
                    log.info("waiting for another download of the same file to finish", lock=str(self.path))
                    waiting_logged = True
            except OSError as error:
                # No flock on this filesystem (some network ones): huggingface_hub then takes the lock
                # file's existence as the lock, so one made here must not stay behind.
                log.debug("no flock on the model cache's filesystem", lock=str(self.path), error=str(error))
                self._close()
                if not existed:
                    self.path.unlink(missing_ok=True)
                return
            if self.stop.wait(1.0):
                self._close()
                raise FetchCancelled("the download was stopped while waiting for another one")

    def __exit__(self, *exc: object) -> None:
        self._close()  # closing the descriptor releases the lock

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _hub_errors:
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
            return _describe(current)
        current = current.__cause__ or current.__context__
    return None


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:200]


def service_owner(hub_cache: Path, euid: int | None = None) -> tuple[int, int] | None:
    """Whom root's downloads into the service's cache must belong to (the service's user), or None."""
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    try:
        hub_cache.resolve().relative_to(SERVICE_CACHE_ROOT)
    except ValueError:
        return None
    try:
        user = pwd.getpwnam(SERVICE_USER)
        return user.pw_uid, user.pw_gid
    except KeyError:
        pass
    try:
        st = SERVICE_CACHE_ROOT.stat()
    except OSError:
        return None
    return (st.st_uid, st.st_gid) if st.st_uid != 0 else None


def hand_over(hub_cache: Path, owner: tuple[int, int]) -> None:
    """Give everything under the cache's HF_HOME to ``owner``: the service writes its locks and refs there.

    systemd fixes a CacheDirectory's ownership only when its top folder has the wrong owner, so
    root's files inside a folder the service already owns would stay root's.
    """
    uid, gid = owner
    home = hub_cache.parent if hub_cache.name == "hub" else hub_cache
    tops = [home] + [p for p in home.parents if p == SERVICE_CACHE_ROOT or SERVICE_CACHE_ROOT in p.parents]
    for path in [*tops, *_walk(home)]:
        try:
            st = path.lstat()
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.lchown(path, uid, gid)
        except OSError as error:
            log.warning("cannot hand a model file to the service's user", file=str(path), error=str(error))


def _walk(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            yield Path(folder) / name


# -- facts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StopToken:
    id: int
    token: str
    sources: tuple[str, ...]  # "chandrad", "generation config", "tokenizer eos"


@dataclass(frozen=True)
class TextDims:
    """The language model's shape, as far as memory goes."""

    layers: int
    full_attention_layers: int
    kv_heads: int
    head_dim: int
    # Per sequence, all linear-attention (Gated DeltaNet) layers: their state does not grow with length.
    linear_state_bytes: int
    dtype: str


@dataclass(frozen=True)
class ModelFacts:
    folder: Path
    architecture: str
    model_type: str
    dtype: str
    parameters: int | None
    weight_bytes: int | None
    dims: TextDims
    patch_size: int
    merge_size: int
    stop_tokens: tuple[StopToken, ...]

    @property
    def stop_ids(self) -> list[int]:
        return [token.id for token in self.stop_tokens]


DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype.removeprefix("torch.").lower(), 2)


def text_dims(config: Mapping[str, Any]) -> TextDims:
    """Layer and head sizes from a model's config.json (its text_config for a vision-language model)."""
    text = config.get("text_config") or config
    declared = next(
        (d for d in (text.get("dtype"), text.get("torch_dtype"), config.get("dtype"), config.get("torch_dtype")) if d),
        "bfloat16",
    )
    dtype = str(declared).removeprefix("torch.")
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    layer_types = text.get("layer_types")
    if layer_types:
        full = sum(1 for kind in layer_types if kind in ("full_attention", "attention", "sliding_attention"))
    elif text.get("full_attention_interval"):
        full = layers // int(text["full_attention_interval"])
    else:
        full = layers
    linear = layers - full
    state = 0
    if linear:
        key_heads = int(text.get("linear_num_key_heads", 0))
        value_heads = int(text.get("linear_num_value_heads", 0))
        key_dim = int(text.get("linear_key_head_dim", 0))
        value_dim = int(text.get("linear_value_head_dim", 0))
        kernel = int(text.get("linear_conv_kernel_dim", 4))
        ssm_bytes = dtype_bytes(str(text.get("mamba_ssm_dtype") or dtype))
        recurrent = value_heads * key_dim * value_dim * ssm_bytes
        conv = (kernel - 1) * (2 * key_heads * key_dim + value_heads * value_dim) * dtype_bytes(dtype)
        state = linear * (recurrent + conv)
    return TextDims(layers, full, kv_heads, head_dim, state, dtype)


def read_model_facts(folder: Path, parameters: int | None = None, weight_bytes: int | None = None) -> ModelFacts:
    """What a model folder (local, or a snapshot in the cache) says about the model.

    ``parameters``/``weight_bytes`` stand in where the weights are not there yet (the hub's counts).
    """
    config = _read_json(folder / "config.json")
    if config is None:
        raise ModelFilesError(f"{folder} has no readable config.json")
    vision = config.get("vision_config") or {}
    counted = _count_safetensors(folder)
    if counted is not None:
        parameters, weight_bytes = counted
    dims = text_dims(config)
    return ModelFacts(
        folder=folder,
        architecture=", ".join(config.get("architectures") or []) or "?",
        model_type=str(config.get("model_type", "?")),
        dtype=dims.dtype,
        parameters=parameters,
        weight_bytes=weight_bytes,
        dims=dims,
        patch_size=int(vision.get("patch_size", 16)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        stop_tokens=tuple(stop_tokens(folder)),
    )


def stop_tokens(folder: Path) -> list[StopToken]:
    """The ids generation stops at: chandrad's stop tokens, the generation config's and the tokenizer's eos.

    Chandra 2's generation config lists only ``<|endoftext|>`` while the model ends its turn with
    ``<|im_end|>``: chandrad's own list (engine/vllm.py STOP_TOKENS, passed as stop_token_ids)
    adds it; vLLM adds the generation config's and the tokenizer's eos to every request.
    """
    from chandrad.engine.vllm import STOP_TOKENS

    vocab = _vocab(folder)
    names = {token_id: token for token, token_id in vocab.items()}
    found: dict[int, list[str]] = {}

    def add(token_id: int, source: str) -> None:
        found.setdefault(token_id, [])
        if source not in found[token_id]:
            found[token_id].append(source)

    for token in STOP_TOKENS:
        if token in vocab:
            add(vocab[token], "chandrad")
    generation = _read_json(folder / "generation_config.json") or {}
    eos = generation.get("eos_token_id")
    for token_id in eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []:
        add(int(token_id), "generation config")
    tokenizer_config = _read_json(folder / "tokenizer_config.json") or {}
    tokenizer_eos = tokenizer_config.get("eos_token")
    if isinstance(tokenizer_eos, dict):
        tokenizer_eos = tokenizer_eos.get("content")
    if isinstance(tokenizer_eos, str) and tokenizer_eos in vocab:
        add(vocab[tokenizer_eos], "tokenizer eos")
    return [StopToken(token_id, names.get(token_id, "?"), tuple(sources)) for token_id, sources in found.items()]


def _vocab(folder: Path) -> dict[str, int]:
    """token → id, as ``tokenizer.get_vocab()`` gives it (added tokens included), from the files alone."""
    vocab: dict[str, int] = {}
    tokenizer = _read_json(folder / "tokenizer.json") or {}
    model_vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update({str(k): int(v) for k, v in model_vocab.items()})
    elif (folder / "vocab.json").is_file():
        vocab.update({str(k): int(v) for k, v in (_read_json(folder / "vocab.json") or {}).items()})
    for added in tokenizer.get("added_tokens") or []:
        vocab[str(added["content"])] = int(added["id"])
    decoder = (_read_json(folder / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    for token_id, added in decoder.items():
        vocab.setdefault(str(added["content"]), int(token_id))
    return vocab


def _count_safetensors(folder: Path) -> tuple[int, int] | None:
    """(parameters, weight bytes) from the safetensors headers, or None without weights."""
    files = sorted(folder.glob("*.safetensors"))
    if not files or not all(path.is_file() for path in files):
        return None
    parameters = size = 0
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            parameters += math.prod(tensor["shape"])
            start, end = tensor["data_offsets"]
            size += end - start
    return parameters, size


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remote_facts(
    repo_id: str,
    hub_cache: Path,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    owner: tuple[int, int] | None = None,
) -> ModelFacts:
    """The facts of a model not downloaded yet: its small files into the cache, its counts from the hub."""
    plan = plan_fetch(repo_id, hub_cache, endpoint=endpoint, token=token)
    small = [f.path for f in plan.files if not f.path.endswith((".safetensors", ".bin", ".pt"))]
    with _hub_errors(repo_id, endpoint, plan.revision):
        folder = Path(
            snapshot_download(
                repo_id,
                revision=plan.commit,
                cache_dir=hub_cache,
                allow_patterns=small,
                endpoint=endpoint,
                token=token,
                tqdm_class=_SilentTqdm,
            )
        )
    if owner is not None:
        hand_over(hub_cache, owner)
    return read_model_facts(folder, plan.parameters, plan.weight_bytes)


# -- GPU fit -----------------------------------------------------------------------------------

# vLLM's budget is gpu_memory_utilization of the GPU; out of it come the weights, the peak
# activations of its profile run (a max_num_batched_tokens prefill, the vision encoder on a page)
# with CUDA graphs and the CUDA context, and the rest is KV cache. The middle part, estimated:
ACTIVATION_BYTES = 3 * 2**30
# A typical page: a US-Letter page at 192 dpi is ~5 000 prompt tokens with Chandra's ocr_layout
# prompt, and ~1 500 output tokens (bench/NOTES-gpu.md).
TYPICAL_PAGE_TOKENS = 6500
# Below this a page at Chandra's pixel cap no longer fits with a useful answer.
MIN_MODEL_LEN = 8192


@dataclass(frozen=True)
class MemoryNeeds:
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int

    def sequence_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token + self.state_bytes_per_sequence


def memory_needs(facts_or_dims: ModelFacts | TextDims, weight_bytes: int, kv_cache_dtype: str = "auto") -> MemoryNeeds:
    dims = facts_or_dims.dims if isinstance(facts_or_dims, ModelFacts) else facts_or_dims
    kv_bytes = dtype_bytes(dims.dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    return MemoryNeeds(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=2 * dims.full_attention_layers * dims.kv_heads * dims.head_dim * kv_bytes,
        state_bytes_per_sequence=dims.linear_state_bytes,
    )


@dataclass(frozen=True)
class GpuFit:
    fits: bool  # vLLM starts: the weights and one sequence of max_model_len fit
    kv_room_bytes: int  # the KV cache vLLM will have
    sequences_at_max_len: int  # sequences of max_model_len tokens it holds at once
    sequences_typical: int  # typical pages it holds at once
    min_gpu_bytes: int  # the smallest GPU that holds max_num_seqs typical pages
    setting: str | None  # the setting to change, or None
    value: str | None  # ...to this
    detail: str


def gpu_fit(
    needs: MemoryNeeds,
    gpu_bytes: int,
    *,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel: int = 1,
    kv_cache_bytes: int | None = None,
    typical_tokens: int = TYPICAL_PAGE_TOKENS,
) -> GpuFit:
    """Whether ``tensor_parallel`` GPUs of ``gpu_bytes`` each hold the model at these settings.

    Pure arithmetic, an estimate (the activation allowance is a constant). vLLM refuses to start
    without room for one sequence of ``max_model_len`` beside the weights; with room for fewer
    than ``max_num_seqs`` typical pages it preempts and recomputes pages all the time, so
    ``max_num_seqs`` should come down to what fits. Fewer full-length sequences than
    ``max_num_seqs`` is normal: pages rarely run to the limit.
    """
    n = tensor_parallel
    typical = min(typical_tokens, max_model_len)
    full = needs.sequence_bytes(max_model_len)
    if kv_cache_bytes is not None:  # a fixed KV cache per GPU (engine.kv_cache_memory_gb)
        kv_room = n * kv_cache_bytes
        if needs.weight_bytes + n * (ACTIVATION_BYTES + kv_cache_bytes) > n * gpu_bytes:
            kv_room = 0
    else:
        kv_room = int(n * (gpu_bytes * gpu_memory_utilization - ACTIVATION_BYTES)) - needs.weight_bytes
    at_max = max(kv_room, 0) // full
    at_typical = max(kv_room, 0) // needs.sequence_bytes(typical)
    smallest = min_gpu_bytes(
        needs,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel=n,
        typical_tokens=typical_tokens,
    )
    if at_max < 1:
        setting, value = _make_it_fit(needs, gpu_bytes, n, full, kv_room, kv_cache_bytes is not None, smallest)
        detail = (
            f"a KV cache of {_gib(n * kv_cache_bytes)} (engine.kv_cache_memory_gb) beside the weights "
            f"({_gib(needs.weight_bytes)}) does not hold one sequence of {max_model_len} tokens ({_gib(full)})"
            if kv_cache_bytes is not None
            else f"the weights ({_gib(needs.weight_bytes)}) and one sequence of {max_model_len} tokens "
            f"({_gib(full)}) do not fit in {n} × {_gib(gpu_bytes)} × {gpu_memory_utilization}"
        )
        return GpuFit(False, kv_room, 0, 0, smallest, setting, value, detail)
    setting_or_none, value_or_none = (
        ("engine.max_num_seqs", str(at_typical)) if at_typical < max_num_seqs else (None, None)
    )
    detail = (
        f"weights {_gib(needs.weight_bytes)}, KV cache {_gib(kv_room)}: {at_max} sequences of {max_model_len} "
        f"tokens or {at_typical} typical pages (~{typical} tokens) at once, for max_num_seqs = {max_num_seqs}"
    )
    return GpuFit(True, kv_room, at_max, at_typical, smallest, setting_or_none, value_or_none, detail)


def min_gpu_bytes(
    needs: MemoryNeeds,
    *,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel: int = 1,
    typical_tokens: int = TYPICAL_PAGE_TOKENS,
) -> int:
    """The smallest GPU (each of ``tensor_parallel``) that holds ``max_num_seqs`` typical pages."""
    kv = max(
        max_num_seqs * needs.sequence_bytes(min(typical_tokens, max_model_len)), needs.sequence_bytes(max_model_len)
    )
    per_gpu = (needs.weight_bytes + kv) / tensor_parallel + ACTIVATION_BYTES
    return math.ceil(per_gpu / gpu_memory_utilization)


def _make_it_fit(
    needs: MemoryNeeds, gpu_bytes: int, n: int, full: int, kv_room: int, fixed_kv: bool, smallest: int
) -> tuple[str, str]:
    """The setting that lets vLLM start: more of the GPU, a shorter context, or more GPUs."""
    utilization = (needs.weight_bytes / n + ACTIVATION_BYTES + full / n) / gpu_bytes
    if not fixed_kv and utilization <= 0.95:
        return "engine.gpu_memory_utilization", f"{math.ceil(utilization * 100) / 100:.2f}"
    longest = (kv_room - needs.state_bytes_per_sequence) // needs.kv_bytes_per_token // 256 * 256
    if longest >= MIN_MODEL_LEN:
        return "engine.max_model_len", str(longest)
    gpus = 2
    while (needs.weight_bytes + full) / gpus + ACTIVATION_BYTES > 0.9 * gpu_bytes and gpus < 64:
        gpus *= 2
    return "engine.layout", f'"tensor-parallel" with {gpus} GPUs in engine.gpus (or GPUs of {_gib(smallest)})'


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_bytes: int


def visible_gpus() -> list[GpuInfo] | None:
    """The NVIDIA GPUs (nvidia-smi's indices and total memory), without initialising CUDA; None: no driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                gpus.append(
                    GpuInfo(
                        index,
                        name.decode() if isinstance(name, bytes) else str(name),
                        int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    )
                )
            return gpus
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, or no driver: ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(result.stdout) if result.returncode == 0 else None


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` (MiB)."""
    gpus = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            gpus.append(GpuInfo(int(parts[0]), parts[1], int(parts[2]) * 2**20))
    return gpus


# -- the check's report ------------------------------------------------------------------------

Level = Literal["ok", "warn", "FAIL"]


@dataclass(frozen=True)
class CheckLine:
    level: Level
    what: str
    detail: str


def check_model(
    engine: EngineSettings,
    hub_cache: Path,
    gpus: list[GpuInfo] | None,
    *,
    will_use_gpu: bool,
    endpoint: str | None = None,
) -> list[CheckLine]:
    """``chandrad check``'s lines about the model: where its files are, its facts, stop ids, GPU fit."""
    lines: list[CheckLine] = []
    model = engine.model
    facts: ModelFacts | None
    if not is_hub_id(model):
        folder = Path(model).expanduser()
        if not snapshot_complete(folder):
            return [CheckLine("FAIL", "model", f"{folder} lacks config.json, a tokenizer or complete weights")]
        lines.append(CheckLine("ok", "model", f"local folder {folder}"))
        facts = _readable_facts(folder, lines)
    elif (folder_or_none := cached_snapshot(model, hub_cache)) is not None:
        lines.append(CheckLine("ok", "model", f"{model} in {folder_or_none}"))
        facts = _readable_facts(folder_or_none, lines)
    else:
        where = f"{model} is not downloaded to {hub_cache} yet"
        if not will_use_gpu:
            lines.append(CheckLine("warn", "model", f"{where} (no GPU visible: the daemon would use tesseract)"))
            return lines
        if hub_offline():
            return [CheckLine("FAIL", "model", f"{where}, and HF_HUB_OFFLINE is set: run chandrad fetch-model")]
        try:
            facts = remote_facts(model, hub_cache, endpoint=endpoint, owner=service_owner(hub_cache))
        except (ModelFilesError, KeyError, ValueError, TypeError, OSError) as error:
            detail = f"its config lacks {error}" if isinstance(error, KeyError) else str(error)
            return [CheckLine("warn", "model", f"{where}; its facts cannot be read: {detail}")]
        lines.append(
            CheckLine(
                "warn",
                "model",
                f"{where} ({_gb(facts.weight_bytes or 0)} of weights): the daemon downloads it at start, "
                f"or run chandrad fetch-model now",
            )
        )
    if facts is None:
        return lines
    lines.append(CheckLine("ok", "model facts", describe_facts(facts)))
    stops = ", ".join(f"{t.id} {t.token} ({', '.join(t.sources)})" for t in facts.stop_tokens)
    if not any(t.token == "<|im_end|>" for t in facts.stop_tokens):
        lines.append(
            CheckLine("FAIL", "stop tokens", f"{stops or 'none'}: no <|im_end|>, every page would run to max_tokens")
        )
    else:
        lines.append(CheckLine("ok", "stop tokens", stops))
    lines.append(_fit_line(engine, facts, gpus))
    return lines


def _readable_facts(folder: Path, lines: list[CheckLine]) -> ModelFacts | None:
    try:
        return read_model_facts(folder)
    except (ModelFilesError, KeyError, ValueError, TypeError, OSError) as error:
        detail = f"missing {error}" if isinstance(error, KeyError) else str(error)
        lines.append(CheckLine("FAIL", "model facts", f"cannot read {folder / 'config.json'}: {detail}"))
        return None


def describe_facts(facts: ModelFacts) -> str:
    count = facts.parameters
    parameters = (
        "parameters unknown"
        if not count
        else f"{count / 1e9:.2f} B parameters"
        if count >= 1e9
        else f"{count:,} parameters"
    )
    weights = f", {_gb(facts.weight_bytes)} of weights" if facts.weight_bytes else ""
    layers = f"{facts.dims.layers} layers"
    if facts.dims.full_attention_layers != facts.dims.layers:
        layers += f" ({facts.dims.full_attention_layers} full attention)"
    return f"{facts.architecture} ({facts.model_type}), {facts.dtype}, {parameters}{weights}, {layers}"


def _fit_line(engine: EngineSettings, facts: ModelFacts, gpus: list[GpuInfo] | None) -> CheckLine:
    weight_bytes = facts.weight_bytes or 0
    dtype = facts.dtype if engine.dtype == "auto" else engine.dtype
    kv_dtype = str(engine.engine_args.get("kv_cache_dtype", "auto"))
    needs = memory_needs(replace(facts.dims, dtype=dtype), weight_bytes, kv_dtype)
    tensor_parallel = len(engine.gpus) if engine.layout == "tensor-parallel" else 1
    used = [engine.gpus[1]] if engine.layout == "encoder-split" else list(engine.gpus)
    kv_cache = int(engine.kv_cache_memory_gb * 2**30) if engine.kv_cache_memory_gb else None
    if not gpus:
        least = min_gpu_bytes(
            needs,
            max_num_seqs=engine.max_num_seqs,
            max_model_len=engine.max_model_len,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            tensor_parallel=tensor_parallel,
        )
        return CheckLine(
            "warn",
            "GPU fit",
            f"no GPU visible, nothing to check; at max_num_seqs = {engine.max_num_seqs} and max_model_len = "
            f"{engine.max_model_len} it needs {tensor_parallel} GPU(s) of at least {_gib(least)} "
            f"(gpu_memory_utilization {engine.gpu_memory_utilization})",
        )
    by_index = {gpu.index: gpu for gpu in gpus}
    missing = [index for index in used if index not in by_index]
    if missing:
        return CheckLine("FAIL", "GPU fit", f"engine.gpus lists {missing}, but the visible GPUs are {sorted(by_index)}")
    smallest = min((by_index[index] for index in used), key=lambda gpu: gpu.memory_bytes)
    fit = gpu_fit(
        needs,
        smallest.memory_bytes,
        max_num_seqs=engine.max_num_seqs,
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        tensor_parallel=tensor_parallel,
        kv_cache_bytes=kv_cache,
    )
    where = f"GPU {smallest.index} ({smallest.name}, {_gib(smallest.memory_bytes)})"
    advice = f"; set {fit.setting} = {fit.value}" if fit.setting else ""
    level: Level = "ok" if fit.fits and fit.setting is None else "warn" if fit.fits else "FAIL"
    return CheckLine(level, "GPU fit", f"{where}: {fit.detail}{advice}")
