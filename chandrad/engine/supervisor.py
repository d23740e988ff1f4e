"""Keep an engine alive for months: restart it when it dies, recycle it before it degrades.

Two death channels, as in vLLM itself: a page whose request fails with ``EngineDied`` (the
EngineCore crashed or was OOM-killed mid-batch), and a periodic health check for deaths while
nothing is in flight. Either way the engine is torn down and started again with exponential
backoff, and every page that was in flight is sent again: callers of ``ocr`` only ever see a
result, a ``PermanentError`` for their page, or a timeout from the pipeline.

Poison pages: a page in flight when the engine died is sent again with the others. After
``poison_page_deaths`` such deaths it is a *suspect*: it is sent alone, with nothing else at the
engine, and if the engine dies then too it fails (``PermanentError``) so it cannot crash the
engine forever. Innocent pages are never failed for a crash they merely witnessed.

Replicas (``ReplicaSet``): a replica whose engine is down hands its pages back (``ReplicaDown``)
while another replica is up, so they are read there instead of waiting a whole engine start;
the count of crashes a page witnessed is shared between replicas, so a poison page cannot
crash them in turn forever.

Planned recycle (after ``recycle_after_pages`` pages, or when memory passes
``memory_watermark_gb``): new pages wait, pages in flight finish, then the engine process is
restarted. Nothing is dropped. A replica recycles only while every other replica is up: on the
GPU, a replica's planned recycle began while the other was still restarting after a crash, and
both were down at once (bench/results/gpu-2xh200-soak-rerun-*).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from chandrad.backoff import backoff_seconds
from chandrad.config import EngineSettings
from chandrad.engine.base import EngineStatus, PageRequest, PageResult
from chandrad.engine.processes import rss_bytes
from chandrad.errors import EngineDied, PermanentError, ReplicaDown

if TYPE_CHECKING:
    from chandrad.engine.vllm import EngineStats

log = structlog.get_logger("chandrad.engine.supervisor")


class RestartableEngine(Protocol):
    """One engine process the supervisor can replace (``VllmEngine``)."""

    name: str
    model: str
    stats: EngineStats

    async def start(self) -> None: ...
    async def ocr(self, request: PageRequest) -> PageResult: ...
    async def aclose(self) -> None: ...
    async def check_health(self) -> None: ...
    def engine_pids(self) -> list[int]: ...


def gpu_memory_used_bytes(gpus: tuple[int, ...] | None = None) -> int | None:
    """GPU memory in use on ``gpus`` (NVML indices; all when None), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            indices = range(pynvml.nvmlDeviceGetCount()) if gpus is None else gpus
            return int(sum(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used for i in indices))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


class SupervisedEngine:
    def __init__(
        self, factory: Callable[[], RestartableEngine], settings: EngineSettings, recycle_phase: float = 0.0
    ) -> None:
        self._factory = factory
        self.settings = settings
        # Replicas recycle in turn, not all at once: replica i of n first recycles i/n of a period late.
        self._recycle_delay_pages = int((settings.recycle_after_pages or 0) * recycle_phase)
        self.engine: RestartableEngine | None = None
        self.name = "vllm"
        self.model = settings.model
        self.restarts = 0
        self.recycles = 0
        self._generation = 0
        # Set when the engine of the current generation is replaced: see _read_on
        self._generation_replaced = asyncio.Event()
        self._ready = asyncio.Event()
        self._restart_lock = asyncio.Lock()
        self._suspect_lock = asyncio.Lock()
        self._others_up: Callable[[], bool] = lambda: False  # see join_replicas
        self._all_others_up: Callable[[], bool] = lambda: True
        self._deaths: dict[tuple[str, int], int] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._solo = asyncio.Event()  # cleared while a suspect page runs alone
        self._solo.set()
        self._pages_since_start = 0
        self._recycling = False
        self._stopping = False
        self._monitor: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    def join_replicas(
        self, others_up: Callable[[], bool], all_others_up: Callable[[], bool], deaths: dict[tuple[str, int], int]
    ) -> None:
        """Called by a ReplicaSet: while ``others_up()``, pages this engine cannot read now are handed
        back (``ReplicaDown``); a planned recycle waits for ``all_others_up()``; crashes a page
        witnessed are counted in ``deaths``, shared by all."""
        self._others_up = others_up
        self._all_others_up = all_others_up
        self._deaths = deaths

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)

    @property
    def state(self) -> str:
        return "up" if self._ready.is_set() else ("starting" if self._generation == 0 else "restarting")

    @property
    def peak_running(self) -> int | None:
        return self.engine.stats.peak_running if self.engine is not None else None

    def status(self) -> EngineStatus:
        return EngineStatus(self.state, self.restarts, self.recycles, self.peak_running)

    async def memory_in_use(self) -> int | None:
        return await asyncio.to_thread(gpu_memory_used_bytes, tuple(self.settings.gpus))

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._start_engine()
        self._monitor = asyncio.create_task(self._watch(), name="engine-monitor")

    async def _start_engine(self) -> None:
        engine = self._factory()
        started = time.monotonic()
        async with asyncio.timeout(self.settings.start_timeout_seconds):
            await engine.start()
        self.engine = engine
        self.model = engine.model
        self._generation += 1
        self._generation_replaced = asyncio.Event()
        self._pages_since_start = -self._recycle_delay_pages if self._generation == 1 else 0
        self._ready.set()
        log.info("engine up", generation=self._generation, seconds=round(time.monotonic() - started, 1))

    def stopping(self) -> None:
        # A recycle begun now would hold the drain's last pages for a whole engine start (on the GPU
        # one began a second after SIGTERM), only for the new engine to be closed.
        self._stopping = True

    async def aclose(self) -> None:
        self._closed = True
        tasks = [task for task in (self._monitor, *self._background) if task is not None]
        for task in tasks:
            task.cancel()
        # A restart or recycle cancelled in the middle of an engine start ends that start (see
        # VllmEngine.start): awaited, so that "chandrad stopped" comes after it, not before.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None

    async def _restart(self, generation: int, reason: str, planned: bool = False) -> None:
        """Replace the engine of ``generation`` (once, however many pages noticed its death)."""
        async with self._restart_lock:
            if generation != self._generation or self._closed:
                return
            self._ready.clear()
            started = time.monotonic()
            if planned:
                log.info("engine recycling", reason=reason, pages_in_flight=self._in_flight)
                await self._idle.wait()  # pages in flight finish first
                if self._stopping and self.engine is not None:
                    # The stop came while they finished: the old engine serves the drain, if it is
                    # alive (a death meanwhile has its own restart waiting for this lock).
                    try:
                        await self.engine.check_health()
                    except EngineDied:
                        pass
                    else:
                        self._ready.set()
                        log.info("engine recycle skipped: chandrad is stopping", reason=reason)
                        return
            old, self.engine = self.engine, None
            self._generation_replaced.set()  # its pages still in flight go back (_read_on)
            if old is not None:
                await old.aclose()
            failures = 0
            while not self._closed:
                try:
                    await self._start_engine()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as error:
                    failures += 1
                    delay = backoff_seconds(
                        self.settings.restart_backoff_seconds, failures, self.settings.restart_backoff_max_seconds
                    )
                    log.error("engine failed to start; retrying", error=str(error), attempt=failures, retry_in_s=delay)
                    await asyncio.sleep(delay)
            if planned:
                self.recycles += 1
            else:
                self.restarts += 1
            log.warning(
                "engine recycled" if planned else "engine restarted",
                reason=reason,
                seconds=round(time.monotonic() - started, 1),
                restarts=self.restarts,
                recycles=self.recycles,
            )

    async def _watch(self) -> None:
        """Health checks (deaths while idle) and the memory watermark."""
        while not self._closed:
            await asyncio.sleep(self.settings.health_check_seconds)
            engine, generation = self.engine, self._generation
            if engine is None or not self._ready.is_set():
                continue
            try:
                await engine.check_health()
            except EngineDied as died:
                await self._restart(generation, f"health check: {died.reason}")
                continue
            watermark = self.settings.memory_watermark_gb
            if watermark is not None:
                used = gpu_memory_used_bytes(tuple(self.settings.gpus))
                if used is None:
                    used = rss_bytes(engine.engine_pids())
                if used > watermark * 2**30:
                    self._request_recycle(generation, f"memory {used / 2**30:.1f} GiB > {watermark} GiB")

    def _request_recycle(self, generation: int, reason: str) -> None:
        """Start a planned recycle unless one is under way or chandrad is stopping (asked per page)."""
        if self._recycling or self._stopping:
            return
        self._recycling = True  # now, not when the task first runs: the next page asks again at once
        self._spawn(self._recycle(generation, reason))

    async def _recycle(self, generation: int, reason: str) -> None:
        try:
            if not self._all_others_up():
                log.info("engine recycle waits for the other replicas to be up", reason=reason)
            # Other replicas' states have no event to wait on; this replica reads pages meanwhile.
            while not self._all_others_up() and not self._closed and not self._stopping:  # noqa: ASYNC110
                await asyncio.sleep(1.0)
            if self._stopping:
                log.info("engine recycle skipped: chandrad is stopping", reason=reason)
                return
            await self._restart(generation, reason, planned=True)
        finally:
            self._recycling = False

    # -- pages ---------------------------------------------------------------------------------

    async def ocr(self, request: PageRequest) -> PageResult:
        key = (request.doc_id, request.page_no)
        while True:
            deaths = self._deaths.get(key, 0)
            # One crash says little (kill -9, OOM, a driver reset): its pages go back with the rest.
            # A page that keeps being in flight when the engine dies is tried alone, and only a
            # page the engine dies on while it runs alone is set aside: 190 pages in flight at a
            # crash were otherwise re-read one at a time (bench/results/gpu-2xh200-soak-*).
            alone = deaths >= self.settings.poison_page_deaths
            died: EngineDied | None = None
            if alone:
                await self._suspect_lock.acquire()
                self._solo.clear()  # no new pages start while the suspect runs alone
            try:
                # Both conditions at once: a restart may begin while waiting for the other one.
                gate = self._idle if alone else self._solo
                while not (self._ready.is_set() and gate.is_set()):
                    if not self._ready.is_set() and self._others_up():
                        raise ReplicaDown()
                    try:
                        # Re-checked every second: another replica may come up meanwhile.
                        async with asyncio.timeout(1.0):
                            await self._ready.wait()
                    except TimeoutError:
                        continue
                    await gate.wait()
                engine, generation, replaced = self.engine, self._generation, self._generation_replaced
                assert engine is not None
                self._in_flight += 1
                self._idle.clear()
                try:
                    result = await _read_on(engine, request, replaced)
                except EngineDied as error:
                    died = error
                    if generation == self._generation:
                        self._ready.clear()  # at once: no page may start on the dead engine
                finally:
                    self._in_flight -= 1
                    if self._in_flight == 0:
                        self._idle.set()
            finally:
                if alone:
                    self._solo.set()
                    self._suspect_lock.release()
            if died is not None:
                self._deaths[key] = deaths + 1
                log.warning(
                    "engine died with the page in flight",
                    page=request.page_no,
                    deaths=deaths + 1,
                    alone=alone,
                    error=died.detail or died.reason,
                )
                if alone:
                    self._deaths.pop(key, None)
                    self._spawn(self._restart(generation, died.reason))
                    raise PermanentError(
                        f"page {request.page_no} crashed the engine {deaths + 1} times, the last time while it "
                        f"was the only page being read; it was set aside so the other pages can go on",
                        stage="engine",
                    )
                # Pages still in flight on the dead engine fail too; one restart serves them all.
                if self._others_up():
                    self._spawn(self._restart(generation, died.reason))
                    raise ReplicaDown()
                await self._restart(generation, died.reason)
                continue
            self._deaths.pop(key, None)
            self._pages_since_start += 1
            recycle_after = self.settings.recycle_after_pages
            if recycle_after is not None and self._pages_since_start >= recycle_after:
                self._request_recycle(generation, f"planned after {self._pages_since_start} pages")
            return result


async def _read_on(engine: RestartableEngine, request: PageRequest, replaced: asyncio.Event) -> PageResult:
    """``engine.ocr(request)``, or ``EngineDied`` once ``replaced`` is set: the engine was restarted
    while the page was in flight. vLLM marks its engine dead (what the health check sees) before
    it tells the pages in flight; a restart closes its front end, and a page it had not told yet
    was never answered: it waited for its page timeout (600 s), as did the pages with it."""
    reading = asyncio.ensure_future(engine.ocr(request))
    waiting = asyncio.ensure_future(replaced.wait())
    try:
        await asyncio.wait((reading, waiting), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # Cancelled from outside (the page's deadline, a stop): the read ends as it did when it was
        # awaited directly, its own cleanup (vLLM's abort) included.
        reading.cancel()
        with contextlib.suppress(BaseException):
            await reading
        raise
    finally:
        waiting.cancel()
    if reading.done():
        return reading.result()
    # Not awaited: the replaced engine is being closed, and its abort may never return.
    reading.add_done_callback(lambda task: task.cancelled() or task.exception())
    reading.cancel()
    raise EngineDied("the engine was restarted while the page was in flight", stage="engine")
