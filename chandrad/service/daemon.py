"""Wiring: watchers → intake → document workers, with bounded queues, signals and a clean shutdown.

No stage logic lives here (``pipeline`` composes it: intake, stages, failures, recovery); this
module decides *when* things run. Phases
follow uvicorn's server: ``startup`` (folders, journal, engine warm-up, crash recovery),
``main_loop`` (every loop a task recorded in ``stopping.LoopTasks``; signal handlers only set flags), ``shutdown``
(stop watching, let in-flight documents finish for ``drain_seconds``, then cancel them: the
journal resumes them at the next start).
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import structlog

from chandrad.backoff import backoff_seconds
from chandrad.config import Settings, load_settings, prepare_folders
from chandrad.document.pipeline import Pipeline
from chandrad.document.retention import Pruner
from chandrad.engine import Engine, create_engine, loads_model_files, pages_in_flight
from chandrad.errors import ConfigError
from chandrad.hosts.identity import check_host_id_free
from chandrad.hosts.takeover import Hosts
from chandrad.inbox.intake import CONCURRENT_INTAKES
from chandrad.inbox.watch import InboxWatcher, SettledFile
from chandrad.metrics import Metrics, ObservedEngine
from chandrad.model.cache import is_hub_id, process_hub_cache
from chandrad.model.fetch import fetch_model_async
from chandrad.model.progress import FetchProgress
from chandrad.output.delivery import Deliverer
from chandrad.scan.orientation import TESSERACT_MISSING
from chandrad.service.notify import Notifier
from chandrad.service.starting import (
    end_engines_of_a_killed_chandrad,
    extend_start_timeout,
    report_download,
    run_unless_stopped,
    serve_metrics,
    turns_pages,
)
from chandrad.service.stopping import EXIT_RESERVE_SECONDS, Backstop, LoopTasks, where_it_waits
from chandrad.service.workqueue import WorkQueue
from chandrad.storage.journal import Journal

T = TypeVar("T")

log = structlog.get_logger("chandrad.service.daemon")

# Settled files waiting for intake; when full, watchers wait (backpressure) instead of piling up.
INTAKE_QUEUE_SIZE = 256
# Settled files one intake loop takes in together at most. Its first document is queued only
# once the whole batch is claimed, so a batch is a few tenths of a second of work, not more.
INTAKE_BATCH = 32
RETRY_POLL_SECONDS = 1.0
RETRY_QUEUE_DEPTH = 4  # × documents in flight: queued documents the retry loop keeps in memory
TICK_SECONDS = 1.0
# A watcher that has not ticked for this long (its rescan can take a while on a big share) is hung.
WATCHER_STALL_SECONDS = 120.0
MEMORY_SAMPLE_SECONDS = 10.0  # NVML takes a few ms: not every tick
IDLE_SWEEP_SECONDS = 10.0  # how often the page renderers kept idle for a minute are ended
# The config file read and each inbox's folders checked at start and at SIGHUP, in threads of the
# service's own (never on the loop, never behind page renders): a share that does not answer within
# this long is left to its watcher (which waits for it) instead of holding the start or the reload.
FOLDER_CHECK_SECONDS = 20.0
# Of the stop's time, what the engine's close and the journal's are given after the loops have ended.
SHUTDOWN_RESERVE_SECONDS = 4.0


async def supervised(name: str, loop_fn: Callable[[], Awaitable[None]]) -> None:
    """Keep a long-running loop alive: a bug in one must not stop the daemon."""
    while True:
        try:
            await loop_fn()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("loop crashed; restarting it in 5 s", loop=name)
            await asyncio.sleep(5)


def task_stacks() -> dict[str, str]:
    """Each live task of the running loop by name, with the chain of awaits it is suspended in."""
    return dict(sorted((task.get_name(), where_it_waits(task)) for task in asyncio.all_tasks()))


class Daemon:
    def __init__(
        self,
        settings: Settings,
        config_path: Path | None = None,
        engine: Engine | None = None,
        notifier: Notifier | None = None,
        backstop: bool = False,
    ) -> None:
        self.settings = settings
        self.notifier = notifier or Notifier(None)
        self.metrics = Metrics()
        self.observed: ObservedEngine | None = None
        self.ready = False
        self.config_path = config_path
        self.engine = engine
        self.should_exit = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.intake_queue: asyncio.Queue[SettledFile] = asyncio.Queue(INTAKE_QUEUE_SIZE)
        self.work = WorkQueue()
        self.watchers: dict[str, InboxWatcher] = {}
        self._watch_tasks: dict[str, asyncio.Task[None]] = {}
        self.journal: Journal | None = None
        self.pipeline: Pipeline | None = None
        self.hosts: Hosts | None = None
        self._rate_window: list[tuple[float, int]] = []
        self.started = False
        # Every long-running task (loops, watchers, workers): a stop ends each within its deadline.
        self.loops = LoopTasks(on_error=self.should_exit.set)
        self._stop_began: float | None = None
        # `chandrad run` only: ends the process at the stop's deadline if nothing else could
        # (never inside a test's own process).
        self._backstop = Backstop() if backstop else None
        # The config file and the inboxes' folders are checked here (FOLDER_CHECK_SECONDS).
        self._service_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="service")

    # -- phases --------------------------------------------------------------------------------

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for signum, handler in (
            (signal.SIGTERM, self.handle_exit),
            (signal.SIGINT, self.handle_exit),
            (signal.SIGHUP, self.handle_hup),
            (signal.SIGUSR1, self.handle_usr1),
        ):
            loop.add_signal_handler(signum, handler, signum)
        try:
            await self.startup()
            if self.started:
                await self.main_loop()
        finally:
            await self.shutdown()
            # SIGUSR1 stays until the loop closes: the loop's own clean-up is one more place where a
            # stop could wait, and the task dump shows it.
            # Under `chandrad run` they stay until run_to_exit ignores them: a second SIGTERM during
            # the last clean-up would otherwise end the process with the signal, not its status.
            if self._backstop is None:
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(signum)
        if self.loops.error is not None:
            raise self.loops.error
        return 0

    def exit_deadline(self) -> float | None:
        """When (``time.monotonic``) the process must have ended: ``stop_timeout_seconds`` after
        the stop began; None while no stop has begun."""
        if self._stop_began is None:
            return None
        return self._stop_began + self.settings.stop_timeout_seconds

    def disarm_backstop(self) -> None:
        if self._backstop is not None:
            self._backstop.disarm()

    def _begin_stop(self) -> float:
        if self._stop_began is None:
            self._stop_began = time.monotonic()
            if self._backstop is not None:
                # A hair early, so that "within stop_timeout_seconds" holds with the exit itself.
                self._backstop.arm(self.settings.stop_timeout_seconds - 0.25)
        deadline = self.exit_deadline()
        assert deadline is not None
        return deadline

    async def _blocking(self, fn: Callable[..., T], *args: Any, seconds: float | None = None) -> T:
        """``fn(*args)`` on the service's threads within ``seconds`` (default FOLDER_CHECK_SECONDS;
        TimeoutError after it; the thread finishes on its own)."""
        call = asyncio.get_running_loop().run_in_executor(self._service_threads, fn, *args)
        async with asyncio.timeout(FOLDER_CHECK_SECONDS if seconds is None else seconds):
            return await asyncio.shield(call)

    async def _check_host_id_free(self) -> None:
        """``check_host_id_free`` an inbox at a time, each within FOLDER_CHECK_SECONDS: a share that
        does not answer is not checked at this start (the other inboxes must not wait for it)."""
        for inbox in self.settings.inbox:
            try:
                await self._blocking(check_host_id_free, self.settings.model_copy(update={"inbox": (inbox,)}))
            except TimeoutError:
                log.warning(
                    "an inbox did not answer the host_id check in time (a hung network share?)",
                    inbox=inbox.name,
                    path=str(inbox.path),
                )

    async def _prepare_folders(self, settings: Settings) -> None:
        """``prepare_folders`` off the loop, an inbox at a time: a ConfigError refuses; an inbox
        whose share does not answer in time is left to its watcher, which waits for it."""
        await self._blocking(prepare_folders, settings.model_copy(update={"inbox": ()}))
        for inbox in settings.inbox:
            try:
                await self._blocking(prepare_folders, settings.model_copy(update={"inbox": (inbox,)}))
            except TimeoutError:
                log.warning(
                    "an inbox's folders did not answer in time (a hung network share?); its watcher waits for it",
                    inbox=inbox.name,
                    path=str(inbox.path),
                    seconds=FOLDER_CHECK_SECONDS,
                )

    async def startup(self) -> None:
        try:
            await self._prepare_folders(self.settings)
        except TimeoutError:  # the state directory itself: nothing can start without it
            raise ConfigError(
                f"state_dir {self.settings.state_dir} did not answer within {FOLDER_CHECK_SECONDS:.0f} s; "
                "check the disk it is on"
            ) from None
        # Opened off the loop like every file (a slow disk at start must not hold signals and the rest).
        self.journal = await self._blocking(Journal, self.settings.state_dir / "journal.sqlite3")
        # Before the engine's minutes of loading, so that a clash is told at once; again below,
        # just before our first heartbeat.
        await self._check_host_id_free()
        serve_metrics(self.metrics, self.settings.metrics_address)
        if turns_pages(self.settings) and await self._blocking(shutil.which, "tesseract") is None:
            log.warning("pages Leptonica cannot judge will not be turned upright", reason=TESSERACT_MISSING)
        await end_engines_of_a_killed_chandrad(self.settings.state_dir)
        # The model's files first, when this engine loads them itself from the hub cache (not a
        # local folder, not a remote server, not an engine handed in): a model not downloaded yet
        # is fetched here with its progress in the log and systemd's STATUS.
        fetch = None
        if self.engine is None:
            self.engine = create_engine(self.settings.engine, self.settings.state_dir)
            if loads_model_files(self.engine) and is_hub_id(self.settings.engine.model):
                fetch = FetchProgress(on_update=report_download(self.notifier))
        started = time.monotonic()
        self.notifier.status(f"loading the {self.engine.name} engine ({self.engine.model})")
        keep_systemd_waiting = asyncio.create_task(
            extend_start_timeout(self.notifier, lambda: fetch is not None and fetch.receiving)
        )
        try:
            # A stop while the engine loads ends the load: it may have minutes to go (a cold start on
            # a GPU, a model to download), more than systemd's TimeoutStopSec.
            if not await run_unless_stopped(self._load_engine(fetch), self.should_exit):
                self.notifier.stopping()
                log.info("stopped while the engine was loading", seconds=round(time.monotonic() - started, 1))
                return
        finally:
            keep_systemd_waiting.cancel()
        log.info(
            "engine ready",
            engine=self.engine.name,
            model=self.engine.model,
            seconds=round(time.monotonic() - started, 1),
        )
        self.observed = ObservedEngine(self.engine, self.metrics)
        self.pipeline = Pipeline(self.settings, self.journal, self.observed)
        # Our heartbeat is on every inbox before anything is claimed or resumed, and no other
        # machine's with our host_id is (it would take our claims for its own).
        await self._check_host_id_free()
        self.hosts = Hosts(self.pipeline.runtime, self.work.put)
        await self.hosts.beat()
        for doc_id in await self.pipeline.recover():
            self.work.put(doc_id)
        # What the imports and the engine's start built (vLLM, torch, transformers: millions of
        # objects) lives as long as the daemon. Left to the collector, every full collection walks
        # all of it, on whichever thread allocates: the event loop stood still 0.1-0.24 s per
        # collection in tests/test_event_loop.py. Frozen, full collections see only what came after.
        # Only the young generations are collected first: a full collection is one step of the loop
        # as long as the heap is big (65 ms with the tesseract engine on an idle core, 141 ms with
        # both cores busy, tests/test_stop.py), and the old generations' garbage it would free is
        # what the imports left, once.
        gc.collect(1)
        gc.freeze()
        self.started = True

    async def _load_engine(self, fetch: FetchProgress | None) -> None:
        assert self.engine is not None
        if fetch is not None:
            model = self.settings.engine.model
            await fetch_model_async(model, process_hub_cache(), progress=fetch)
            self.notifier.status(f"loading the {self.engine.name} engine ({model})")
        await self.engine.start()

    async def main_loop(self) -> None:
        self._start_watchers()
        loops = [
            # Several intakes at once: hashing and claiming one file at a time admitted only ~3
            # files/s on a busy loop and starved a GPU at the start of a burst (bench/NOTES-overhead.md).
            *(self._loop(f"intake-{n}", self._intake_loop) for n in range(CONCURRENT_INTAKES)),
            self._loop("retry", self._retry_loop),
            # Our heartbeat, the other hosts' watched, the documents of dead ones taken over.
            self._loop("hosts", self._hosts().run),
            # Webhooks and hooks of final documents, from the journal (never in a document's way).
            self._loop("delivery", self._deliverer().run),
            # Final rows and markers older than retention.days, in small batches off the loop.
            self._loop("retention", self._pruner().run),
        ]
        workers = [self.loops.start(f"worker-{n}", self._worker()) for n in range(self.documents_in_flight)]
        loops.append(self._loop("tick", self._tick_loop))
        while not self.should_exit.is_set():
            reload_wait = asyncio.ensure_future(self.reload_requested.wait())
            exit_wait = asyncio.ensure_future(self.should_exit.wait())
            await asyncio.wait({reload_wait, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
            reload_wait.cancel()
            exit_wait.cancel()
            if self.reload_requested.is_set() and not self.should_exit.is_set():
                self.reload_requested.clear()
                # A stop during a reload ends the reload: its checks have a deadline, the stop its own.
                await run_unless_stopped(self.reload(), self.should_exit)

        deadline = self._begin_stop()
        self.notifier.stopping()
        log.info("stopping: no new documents are taken", in_flight=len(self.work.active))
        if self.engine is not None:
            self.engine.stopping()
        for task in [*self._watch_tasks.values(), *loops]:
            task.cancel()
        self.work.stop_workers(len(workers))
        drain = min(self.settings.drain_seconds, deadline - SHUTDOWN_RESERVE_SECONDS - time.monotonic())
        if await self.loops.wait(workers, drain):
            log.warning(
                "drain deadline passed; in-flight documents resume at the next start",
                documents=sorted(self.work.active),
            )
        # The workers left, and any loop that outlived its cancel: cancelled (again) until the deadline.
        await self.loops.cancel_all(deadline - SHUTDOWN_RESERVE_SECONDS)

    async def shutdown(self) -> None:
        deadline = self._begin_stop()
        self.metrics.ready.set(0)
        for watcher in self.watchers.values():
            watcher.stop()
        if self.loops.alive():  # a start that failed or was stopped: nothing else ended them
            await self.loops.cancel_all(deadline - SHUTDOWN_RESERVE_SECONDS)
        if self.engine is not None:
            try:
                async with asyncio.timeout(max(deadline - EXIT_RESERVE_SECONDS - time.monotonic(), 0.5)):
                    await self.engine.aclose()
            except TimeoutError:
                log.error(
                    "the engine did not close before the stop's deadline; its processes are ended at the next start"
                )
        if self.pipeline is not None:
            self.pipeline.close()
        if self.journal is not None:
            try:  # off the loop: it waits for a statement in progress to end
                await self._blocking(self.journal.close, seconds=max(deadline - time.monotonic() - 1, 0.5))
            except TimeoutError:
                log.error("the journal did not close in time; SQLite's WAL keeps every committed step")
        self.metrics.close()
        self.notifier.close()
        self._service_threads.shutdown(wait=False, cancel_futures=True)
        log.info("chandrad stopped")

    # -- signals (handlers only set flags) ------------------------------------------------------

    def handle_exit(self, signum: int = signal.SIGTERM) -> None:
        log.info("signal received", signal=signal.Signals(signum).name)
        self._begin_stop()
        self.should_exit.set()

    def handle_hup(self, signum: int = signal.SIGHUP) -> None:
        self.reload_requested.set()

    def handle_usr1(self, signum: int = signal.SIGUSR1) -> None:
        # `systemctl kill --kill-whom=main -s USR1 chandrad` (the main process only: USR1 would end the
        # engine's processes and tools): what every task is waiting on, for a daemon that looks
        # stuck (threads' stacks need py-spy or faulthandler; an await shows in neither).
        log.warning("tasks", tasks=task_stacks())

    async def reload(self) -> None:
        """Re-read the config; on error keep running with the old one. Engine settings need a restart.
        Every file it reads and folder it checks is off the loop, within a deadline."""
        try:
            try:
                new_settings = await self._blocking(load_settings, self.config_path)
            except TimeoutError:
                raise ConfigError(
                    f"the config file did not answer within {FOLDER_CHECK_SECONDS:.0f} s (on a hung share?)"
                ) from None
            await self._prepare_folders(new_settings)
        except ConfigError as error:
            log.error("reload refused: keeping the running configuration", error=str(error))
            self.notifier.status(f"reload refused, running the old configuration: {error}".splitlines()[0])
            return
        self.notifier.reloading()
        if new_settings.engine != self.settings.engine or new_settings.state_dir != self.settings.state_dir:
            log.warning("engine and state_dir changes take effect at the next restart")
        self.settings = new_settings.model_copy(
            update={"engine": self.settings.engine, "state_dir": self.settings.state_dir}
        )
        assert self.pipeline is not None
        self.pipeline.update_settings(self.settings)
        for task in self._watch_tasks.values():
            task.cancel()
        for watcher in self.watchers.values():
            watcher.stop()
        self._start_watchers()
        self.notifier.ready(self.status_line())
        log.info("configuration reloaded", inboxes=[inbox.name for inbox in self.settings.inbox])

    # -- loops ---------------------------------------------------------------------------------

    def _loop(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """A supervised loop among the daemon's recorded tasks, named (task dumps and the stop's log
        then say which loop a slow step or a stuck await belongs to)."""
        return self.loops.start(name, supervised(name, loop_fn))

    def _start_watchers(self) -> None:
        self.watchers = {inbox.name: InboxWatcher(inbox, self.intake_queue.put) for inbox in self.settings.inbox}
        self._watch_tasks = {name: self._loop(f"watch:{name}", watcher.run) for name, watcher in self.watchers.items()}

    def _hosts(self) -> Hosts:
        assert self.hosts is not None
        return self.hosts

    def _pruner(self) -> Pruner:
        assert self.pipeline is not None
        return Pruner(lambda: self.settings, self.pipeline.runtime)

    def _deliverer(self) -> Deliverer:
        assert self.journal is not None
        return Deliverer(lambda: self.settings, self.journal, self.metrics)

    async def _intake_loop(self) -> None:
        assert self.pipeline is not None
        while True:
            # What has settled meanwhile comes along (up to INTAKE_BATCH): one journal commit
            # for all of them, and fewer turns of the loop for each.
            batch = [await self.intake_queue.get()]
            while len(batch) < INTAKE_BATCH and not self.intake_queue.empty():
                batch.append(self.intake_queue.get_nowait())
            try:
                docs = await self.pipeline.take_in_batch(batch)
            except Exception:
                log.exception(
                    "intake failed; the files stay in the inbox and are retried at the next rescan",
                    files=[str(settled.path) for settled in batch],
                )
                continue
            for doc in docs:
                self.work.put(doc.id)

    async def _retry_loop(self) -> None:
        """Queued documents whose time has come (retries with backoff, resumed ones) go to the workers."""
        assert self.journal is not None
        # Retry times are wall-clock (they survive restarts). A retry further ahead than any backoff
        # can be means the clock stepped back (NTP, a restored VM): it is due, not an hour away.
        longest_backoff = backoff_seconds(self.settings.retry_backoff_seconds, self.settings.max_attempts + 1) + 60
        # Enough waiting in memory to keep every worker busy; the rest stays in the journal, so a
        # backlog of 100 000 documents costs this loop a short indexed read, not the whole table.
        depth = RETRY_QUEUE_DEPTH * self.documents_in_flight
        while True:
            waiting = len(self.work.waiting)
            if waiting < depth:
                # The oldest due documents, including those already waiting here (still "queued").
                due = await self.journal.call(self.journal.due_queued, time.time(), longest_backoff, waiting + depth)
                for doc_id in due:
                    self.work.put(doc_id)
            await asyncio.sleep(RETRY_POLL_SECONDS)

    async def _worker(self) -> None:
        assert self.pipeline is not None
        while True:
            doc_id = await self.work.take()
            if doc_id is None:
                return
            if self.should_exit.is_set():
                self.work.done(doc_id)  # still queued in the journal: it resumes at the next start
                return
            started = time.monotonic()
            try:
                outcome = await self.pipeline.process(doc_id)
            finally:
                self.work.done(doc_id)
            doc = await self.journal.call(self.journal.find, doc_id) if self.journal else None
            inbox = doc.inbox if doc is not None else ""  # None: taken over by another host, forgotten
            self.metrics.documents.labels(inbox, outcome.state.metric).inc()
            self.metrics.stage_seconds.labels("document").observe(time.monotonic() - started)

    # -- systemd and metrics --------------------------------------------------------------------

    @property
    def documents_in_flight(self) -> int:
        engine_name = self.engine.name if self.engine else ""
        return self.settings.documents_in_flight(pages_in_flight(self.settings.engine, engine_name))

    def status_line(self) -> str:
        observed = self.observed
        engine = self.engine.status() if self.engine is not None else None
        pages_per_min = 0.0
        if observed is not None and self._rate_window:
            (t0, n0), (t1, n1) = self._rate_window[0], self._rate_window[-1]
            pages_per_min = (n1 - n0) / max(t1 - t0, 1e-9) * 60
        return (
            f"{len(self.work.waiting)} queued, {len(self.work.active)} in progress, "
            f"{observed.in_flight if observed else 0} pages at the engine, {pages_per_min:.1f} pages/min; "
            f"engine {self.engine.name if self.engine else '-'} {engine.state if engine else 'down'}"
            + (f" ({engine.restarts} restarts)" if engine and engine.restarts else "")
        )

    async def healthy(self) -> tuple[bool, str]:
        """Whether the pipeline is alive: watchers tick, the journal answers, pages make progress."""
        now = time.monotonic()
        for name, watcher in self.watchers.items():
            if now - watcher.last_tick > WATCHER_STALL_SECONDS:
                return False, f"watcher {name} has not ticked for {now - watcher.last_tick:.0f} s"
        assert self.journal is not None
        try:
            async with asyncio.timeout(10):
                await self.journal.call(self.journal.counts)
        except TimeoutError:
            return False, "the journal does not answer"
        observed = self.observed
        stall = self.settings.watchdog_stall_seconds or self.settings.engine.page_timeout_seconds
        if observed is not None and observed.in_flight and now - observed.last_progress > stall:
            return (
                False,
                f"{observed.in_flight} pages at the engine and none finished for {now - observed.last_progress:.0f} s",
            )
        return True, ""

    async def _tick_loop(self) -> None:
        """Once a second: READY once armed, STATUS when it changes, WATCHDOG while healthy, gauges."""
        armed_since = time.monotonic()
        last_status = ""
        last_ping = 0.0
        last_memory_sample = 0.0
        last_idle_sweep = time.monotonic()
        was_healthy = True
        while True:
            now = time.monotonic()
            if not self.ready and all(w.last_tick > armed_since for w in self.watchers.values()):
                self._announce_ready()
            if self.observed is not None:
                self._rate_window.append((now, self.observed.pages_done))
                while self._rate_window and now - self._rate_window[0][0] > 60:
                    self._rate_window.pop(0)
            status = self.status_line()
            if status != last_status and self.ready:
                self.notifier.status(status)
                last_status = status
            self._update_gauges()
            if self.engine is not None and now - last_memory_sample >= MEMORY_SAMPLE_SECONDS:
                last_memory_sample = now
                used = await self.engine.memory_in_use()
                if used is not None:
                    self.metrics.gpu_memory.set(used)
            if self.pipeline is not None and now - last_idle_sweep >= IDLE_SWEEP_SECONDS:
                last_idle_sweep = now
                await asyncio.to_thread(self.pipeline.runtime.render_workers.end_idle)
            interval = self.notifier.watchdog_interval
            if interval is not None and self.ready and now - last_ping >= interval:
                healthy, why = await self.healthy()
                if healthy:
                    self.notifier.watchdog()
                    last_ping = now
                elif was_healthy:
                    log.error("pipeline looks hung: watchdog pings stop, systemd will restart chandrad", why=why)
                was_healthy = healthy
            await asyncio.sleep(TICK_SECONDS)

    def _announce_ready(self) -> None:
        self.ready = True
        self.metrics.ready.set(1)
        self.notifier.ready(self.status_line())
        log.info(
            "chandrad ready",
            inboxes=[inbox.name for inbox in self.settings.inbox],
            documents_in_flight=self.documents_in_flight,
        )

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.labels("intake").set(self.intake_queue.qsize())
        self.metrics.queue_depth.labels("documents").set(len(self.work.waiting))
        self.metrics.documents_in_flight.set(len(self.work.active))
        if self.engine is not None:
            engine = self.engine.status()
            self.metrics.engine_restarts.set(engine.restarts)
            self.metrics.engine_recycles.set(engine.recycles)
