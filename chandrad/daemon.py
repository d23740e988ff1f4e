"""Wiring: watchers → intake → document workers, with bounded queues, signals and a clean shutdown.

No stage logic lives here (that is ``pipeline``); this module decides *when* things run. Phases
follow uvicorn's server: ``startup`` (folders, journal, engine warm-up, crash recovery),
``main_loop`` (everything runs in one ``TaskGroup``; signal handlers only set flags), ``shutdown``
(stop watching, let in-flight documents finish for ``drain_seconds``, then cancel them: the
journal resumes them at the next start).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from chandrad.config import Settings, load_settings, prepare_folders
from chandrad.engine import Engine, create_engine
from chandrad.errors import ConfigError
from chandrad.journal import Journal
from chandrad.pipeline import Pipeline
from chandrad.watch import InboxWatcher, SettledFile

log = structlog.get_logger("chandrad.daemon")

# Settled files waiting for intake; when full, watchers wait (backpressure) instead of piling up.
INTAKE_QUEUE_SIZE = 256
RETRY_POLL_SECONDS = 1.0


class Daemon:
    def __init__(self, settings: Settings, config_path: Path | None = None, engine: Engine | None = None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.engine = engine
        self.should_exit = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.intake_queue: asyncio.Queue[SettledFile] = asyncio.Queue(INTAKE_QUEUE_SIZE)
        self.doc_queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.enqueued: set[str] = set()
        self.active: set[str] = set()
        self.watchers: dict[str, InboxWatcher] = {}
        self._watch_tasks: dict[str, asyncio.Task[None]] = {}
        self.journal: Journal | None = None
        self.pipeline: Pipeline | None = None
        self.started = False

    # -- phases --------------------------------------------------------------------------------

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for signum, handler in (
            (signal.SIGTERM, self.handle_exit), (signal.SIGINT, self.handle_exit), (signal.SIGHUP, self.handle_hup)
        ):
            loop.add_signal_handler(signum, handler, signum)
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
        return 0

    async def startup(self) -> None:
        prepare_folders(self.settings)
        self.journal = Journal(self.settings.state_dir / "journal.sqlite3")
        if self.engine is None:
            self.engine = create_engine(self.settings.engine, self.settings.state_dir)
        started = time.monotonic()
        await self.engine.start()
        log.info("engine ready", engine=self.engine.name, model=self.engine.model,
                 seconds=round(time.monotonic() - started, 1))
        self.pipeline = Pipeline(self.settings, self.journal, self.engine)
        for doc_id in await self.pipeline.recover():
            self._enqueue(doc_id)
        self.started = True

    async def main_loop(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._start_watchers()
            loops = [
                group.create_task(self._supervised("intake", self._intake_loop)),
                group.create_task(self._supervised("retry", self._retry_loop)),
            ]
            workers = [
                group.create_task(self._worker()) for _ in range(self.settings.max_documents_in_flight)
            ]
            log.info("chandrad running", inboxes=[inbox.name for inbox in self.settings.inbox],
                     documents_in_flight=self.settings.max_documents_in_flight)
            while not self.should_exit.is_set():
                reload_wait = asyncio.ensure_future(self.reload_requested.wait())
                exit_wait = asyncio.ensure_future(self.should_exit.wait())
                await asyncio.wait({reload_wait, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
                reload_wait.cancel()
                exit_wait.cancel()
                if self.reload_requested.is_set() and not self.should_exit.is_set():
                    self.reload_requested.clear()
                    self.reload()

            log.info("stopping: no new documents are taken", in_flight=len(self.active))
            for task in [*self._watch_tasks.values(), *loops]:
                task.cancel()
            for _ in workers:
                self.doc_queue.put_nowait(None)
            _, unfinished = await asyncio.wait(workers, timeout=self.settings.drain_seconds)
            if unfinished:
                log.warning("drain deadline passed; in-flight documents resume at the next start",
                            documents=sorted(self.active))
                for task in unfinished:
                    task.cancel()

    async def shutdown(self) -> None:
        for watcher in self.watchers.values():
            watcher.stop_observer()
        if self.engine is not None:
            await self.engine.aclose()
        if self.journal is not None:
            self.journal.close()
        log.info("chandrad stopped")

    # -- signals (handlers only set flags) ------------------------------------------------------

    def handle_exit(self, signum: int = signal.SIGTERM) -> None:
        log.info("signal received", signal=signal.Signals(signum).name)
        self.should_exit.set()

    def handle_hup(self, signum: int = signal.SIGHUP) -> None:
        self.reload_requested.set()

    def reload(self) -> None:
        """Re-read the config; on error keep running with the old one. Engine settings need a restart."""
        try:
            new_settings = load_settings(self.config_path)
            prepare_folders(new_settings)
        except ConfigError as error:
            log.error("reload refused: keeping the running configuration", error=str(error))
            return
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
            watcher.stop_observer()
        self._start_watchers()
        log.info("configuration reloaded", inboxes=[inbox.name for inbox in self.settings.inbox])

    # -- loops ---------------------------------------------------------------------------------

    def _start_watchers(self) -> None:
        self.watchers = {inbox.name: InboxWatcher(inbox, self.intake_queue.put) for inbox in self.settings.inbox}
        self._watch_tasks = {
            name: self._group.create_task(self._supervised(f"watch:{name}", watcher.run))
            for name, watcher in self.watchers.items()
        }

    async def _supervised(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> None:
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

    def _enqueue(self, doc_id: str) -> None:
        if doc_id not in self.enqueued and doc_id not in self.active:
            self.enqueued.add(doc_id)
            self.doc_queue.put_nowait(doc_id)

    async def _intake_loop(self) -> None:
        assert self.pipeline is not None
        while True:
            settled = await self.intake_queue.get()
            try:
                doc = await self.pipeline.intake(settled)
            except Exception:
                log.exception("intake failed; the file stays in the inbox and is retried at the next rescan",
                              file=str(settled.path))
                continue
            if doc is not None:
                self._enqueue(doc.id)

    async def _retry_loop(self) -> None:
        """Queued documents whose time has come (retries with backoff, resumed ones) go to the workers."""
        assert self.journal is not None
        while True:
            now = time.time()
            for doc in await self.journal.call(self.journal.unfinished):
                if doc.state == "queued" and doc.next_attempt_at <= now and doc.claimed_path:
                    self._enqueue(doc.id)
            await asyncio.sleep(RETRY_POLL_SECONDS)

    async def _worker(self) -> None:
        assert self.pipeline is not None
        while True:
            doc_id = await self.doc_queue.get()
            if doc_id is None or self.should_exit.is_set():
                return
            self.enqueued.discard(doc_id)
            self.active.add(doc_id)
            try:
                await self.pipeline.process(doc_id)
            finally:
                self.active.discard(doc_id)
