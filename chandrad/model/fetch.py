"""Fetching a model into the hub cache: all of ``chandrad fetch-model`` and of the daemon's start-up download.

The file list and sizes come from the hub (``model/hub.py``) and are checked against the free
space before a byte is written; what is missing is downloaded with resume (``model/download.py``).
``snapshot_download`` then builds the snapshot from those blobs as from its own (links, refs, tree
listing), so vLLM finds a normal cache.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from huggingface_hub import snapshot_download

from chandrad.model.cache import cached_snapshot, hand_over, snapshot_complete
from chandrad.model.download import check_free_space, disk_free_bytes, download_all, remove_stale_partials
from chandrad.model.hub import (
    HUB_TIMEOUT_SECONDS,
    FetchPlan,
    ModelFilesError,
    SilentTqdm,
    hub_errors,
    hub_offline,
    plan_fetch,
)
from chandrad.model.progress import FetchProgress

log = structlog.get_logger("chandrad.model.fetch")


# A stopped download (daemon stop) waits this long for its threads to notice before going on.
STOP_WAIT_SECONDS = 5.0


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
        remove_stale_partials(plan)
        check_free_space(plan, free_bytes or disk_free_bytes)
        (plan.storage / "blobs").mkdir(parents=True, exist_ok=True)
        progress.begin(repo_id, plan.total_bytes, plan.present_bytes, plan.snapshot)
        try:
            download_all(plan, todo, token, progress, stop)
        except BaseException:
            progress.abandon()
            if owner is not None:
                hand_over(hub_cache, owner)
            raise
        progress.finish()
    if all(f.blob is None for f in plan.files) and _ref(plan) == plan.commit and snapshot_complete(plan.snapshot):
        folder = plan.snapshot  # all there and linked: nothing to ask the hub
    else:
        with hub_errors(repo_id, endpoint, plan.revision):
            # Links the blobs into the snapshot, writes refs/<revision> and the tree listing, as for its own.
            folder = Path(
                snapshot_download(
                    repo_id,
                    revision=plan.revision,
                    cache_dir=hub_cache,
                    ignore_patterns=list(plan.ignored),
                    endpoint=endpoint,
                    token=token,
                    tqdm_class=SilentTqdm,
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


def _ref(plan: FetchPlan) -> str:
    if plan.revision == plan.commit:
        return plan.commit
    try:
        return (plan.storage / "refs" / plan.revision).read_text().strip()
    except OSError:
        return ""
