"""What the daemon's start needs besides its own steps: running a step unless a stop comes first,
keeping systemd's start timeout at bay while a large model loads or downloads, the metrics
endpoint, and the EngineCores a killed chandrad left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import structlog

from chandrad.config import Settings
from chandrad.engine.processes import end_engines_left_behind
from chandrad.errors import ConfigError
from chandrad.metrics import Metrics
from chandrad.model.progress import FetchProgress
from chandrad.service.notify import Notifier

log = structlog.get_logger("chandrad.service.daemon")

# While a large model loads, systemd's start timeout is pushed out by this much at a time.
EXTEND_START_SECONDS = 90.0


async def run_unless_stopped(work: Coroutine[Any, Any, None], should_exit: asyncio.Event) -> bool:
    """Run ``work`` unless a stop signal comes first, which cancels it: whether it ran to the end."""
    task = asyncio.create_task(work)
    stop_asked = asyncio.create_task(should_exit.wait())
    try:
        await asyncio.wait({task, stop_asked}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_asked.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is None:
        return True
    if not should_exit.is_set():
        task.result()  # its error: it failed on its own
    if not task.cancelled():
        # The error of a start ended by the stop (or failing as the stop came) is no start-up failure.
        log.info("the engine start ended with an error after the stop", error=str(task.exception()))
    return False


async def extend_start_timeout(notifier: Notifier, downloading: Callable[[], bool] = lambda: False) -> None:
    """Loading a large model can outlast TimeoutStartSec: keep telling systemd we are working.

    While the model downloads, arriving bytes extend it instead (``report_download``), so a
    download that stalls stops extending it and systemd's timeout ends the start.
    """
    while True:
        if not downloading():
            notifier.extend_timeout(EXTEND_START_SECONDS)
        await asyncio.sleep(EXTEND_START_SECONDS / 3)


def report_download(notifier: Notifier) -> Callable[[FetchProgress], None]:
    """What a start-up download tells systemd while bytes arrive: its progress, and more time."""

    def report(progress: FetchProgress) -> None:  # called in the download's threads
        notifier.status(progress.line())
        notifier.extend_timeout(EXTEND_START_SECONDS)

    return report


def serve_metrics(metrics: Metrics, address: str) -> None:
    if not address:
        return
    try:
        metrics.serve(address)
    except OSError as error:
        raise ConfigError(
            f"cannot serve metrics on {address}: {error.strerror}; "
            f'change metrics_address (or set it to "" to turn metrics off)'
        ) from None


async def end_engines_of_a_killed_chandrad(state_dir: Path) -> None:
    """vLLM EngineCores a chandrad killed earlier left running hold the GPU memory the new engines
    need: end them first (in a thread: it waits for them to exit)."""
    left_behind = await asyncio.to_thread(end_engines_left_behind, state_dir)
    if left_behind:
        log.warning(
            "ended vLLM engine processes that a chandrad killed earlier had left running (they "
            "held GPU memory the new engines need)",
            pids=left_behind,
        )


def turns_pages(settings: Settings) -> bool:
    """Whether some inbox, or a rule of one, turns pages upright (``rotate_pages``)."""
    return any(inbox.rotate_pages or any(rule.rotate_pages for rule in inbox.rule) for inbox in settings.inbox)
