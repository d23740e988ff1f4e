"""Downloading the files a fetch plan lacks, each under huggingface_hub's own lock for its blob.

huggingface_hub >= 1.18 deletes a partial file when a download is interrupted (and leaves
``*.incomplete`` orphans when it is killed), so a 5 GB weight shard cut at 90 % starts again from
zero; here each file is fetched over HTTP with ranges into ``blobs/<etag>.chandrad-partial``, kept
across interruptions and resumed, checked against its size and SHA-256, and renamed to the blob
huggingface_hub would have written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import structlog
from filelock import BaseFileLock, FileLock, SoftFileLock, Timeout
from huggingface_hub import get_token

from chandrad import __version__
from chandrad.backoff import backoff_seconds
from chandrad.model.cache import PARTIAL_SUFFIX, partial_path
from chandrad.model.hub import (
    HUB_TIMEOUT_SECONDS,
    FetchPlan,
    ModelFilesError,
    NoNetworkError,
    PlannedFile,
    describe_error,
)
from chandrad.model.progress import FetchProgress, format_gb

log = structlog.get_logger("chandrad.model.download")


# Partial downloads nobody has written to for this long are someone's leftovers (huggingface_hub's
# *.incomplete are never resumed by it; ours for a blob the hub no longer lists).
STALE_PARTIAL_SECONDS = 3600.0
# Room left on the disk after the download (the hub's sizes are exact; logs and the rest need some).
DISK_MARGIN_BYTES = 64 * 2**20
DOWNLOAD_WORKERS = 4
CHUNK_BYTES = 1 << 20  # for hashing
READ_TIMEOUT_SECONDS = 30.0
# A file is retried (resuming) after a dropped connection; this many tries in a row that bring no
# byte make the download fail.
ATTEMPTS_WITHOUT_PROGRESS = 6
RETRY_DELAY_MAX_SECONDS = 30.0
# huggingface_hub's mode for its lock files: group-writable, so users sharing a cache can wait for one another.
LOCK_FILE_MODE = 0o664
# How often a download waiting for another one's lock tries again.
LOCK_POLL_SECONDS = 1.0


class DiskTooSmallError(ModelFilesError):
    pass


class FetchCancelled(ModelFilesError):
    pass


def disk_free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(plan: FetchPlan, free_bytes: Callable[[Path], int]) -> None:
    needed = plan.missing_bytes
    free = free_bytes(plan.storage)
    if free < needed + DISK_MARGIN_BYTES:
        raise DiskTooSmallError(
            f"not enough disk space for {plan.repo_id}: it needs {format_gb(needed)} more and "
            f"{plan.storage.parent} has {format_gb(free)} free; free some space there or point HF_HOME "
            f"(fetch-model --hf-home) at a larger disk"
        )


def remove_stale_partials(plan: FetchPlan) -> None:
    """Partial files nobody will resume: huggingface_hub's (it never resumes them) and ours for blobs
    the hub no longer lists, once nobody has written to them for a while."""
    wanted = {partial_path(f.blob).name for f in plan.files if f.blob is not None}
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


def download_all(
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
    blob, partial = planned.blob, partial_path(planned.blob)
    # The lock huggingface_hub takes for this blob (.locks/<repo>/<etag>.lock): a concurrent
    # hf_hub_download or fetch-model of the same file waits instead of writing beside us, and
    # nothing is written here without it.
    with _blob_lock(locks / f"{blob.name}.lock", stop):
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
                        f"the download of {planned.path} keeps failing ({describe_error(error)}); what arrived is "
                        f"kept: run it again to continue"
                    ) from None
                delay = backoff_seconds(1.0, fruitless, RETRY_DELAY_MAX_SECONDS)
                log.warning(
                    "the model download was interrupted; resuming",
                    file=planned.path,
                    have_bytes=now_have,
                    retry_in_seconds=delay,
                    error=describe_error(error),
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


@contextmanager
def _blob_lock(path: Path, stop: threading.Event) -> Iterator[None]:
    """Hold ``path`` (huggingface_hub's lock file for the blob) while the block runs; ``stop`` ends the wait.

    The lock huggingface_hub's own downloads take (``WeakFileLock``): filelock's ``FileLock`` on
    the same file, or its ``SoftFileLock`` where the filesystem has no flock (some network ones),
    which takes the lock file's existence as the lock and removes it on release.
    """
    lock: BaseFileLock = FileLock(path, mode=LOCK_FILE_MODE)
    waiting_logged = False
    while True:
        try:
            lock.acquire(timeout=0)
            break
        except Timeout:
            if not waiting_logged:
                log.info("waiting for another download of the same file to finish", lock=str(path))
                waiting_logged = True
        except NotImplementedError as error:  # filelock 3 where flock is missing (4 falls back by itself)
            log.debug("no flock on the model cache's filesystem", lock=str(path), error=str(error))
            lock = SoftFileLock(path)
            continue
        # Polled, not a blocking acquire: a stop must end the wait at once.
        if stop.wait(LOCK_POLL_SECONDS):
            raise FetchCancelled("the download was stopped while waiting for another one")
    try:
        yield
    finally:
        lock.release()
