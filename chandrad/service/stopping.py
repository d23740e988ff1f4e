"""A stop always stops: the daemon's loop tasks recorded and cancelled within a deadline, and the
process ended once the deadline is spent, whatever a share or a thread does.

Three things could hold a stop before: a loop that lost its cancel (``asyncio.wait_for`` on Python
3.11, CPython gh-86296; banned now, but any ``except CancelledError`` that goes on does the same),
``asyncio.run``'s clean-up (it waits without end for every task and for the default executor's
threads), and the interpreter's exit (it joins every executor thread, and one blocked in a stat on
a share that stopped answering never returns). ``LoopTasks`` cancels again what outlives a cancel
and names where it waits; ``run_to_exit`` bounds the clean-up and ends the process with
``os._exit`` when threads are still stuck; ``Backstop`` ends it at the deadline if all else fails.
Nothing is lost by that: each document's state is committed in the journal before and after each
step (the rules of a ``kill -9``), and the next start resumes what was in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger("chandrad.service.stopping")

# How long a cancelled task gets before it is cancelled again (and named in the log).
RECANCEL_SECONDS = 1.0
# What is kept of the stop's time for the threads' join and the process's exit.
EXIT_RESERVE_SECONDS = 2.0
# The exit status of a stop that the backstop ended (documents are safe: see the module's text).
EXIT_STOP_FORCED = 4
# Threads that get this long to end after the loop has closed, when the daemon set no deadline.
DEFAULT_JOIN_SECONDS = 5.0
# How long threads get to end once the loop has closed, before those left are taken to be stuck.
THREADS_END_SECONDS = 2.0
# Ignored while the threads are joined at exit, then given back their handlers.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def where_it_waits(task: asyncio.Task[Any]) -> str:
    """The chain of awaits ``task`` is suspended in, innermost last (``Task.get_stack`` gives only
    the outermost frame; the await it is stuck in is at the end of the ``cr_await`` chain)."""
    chain: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None and len(chain) < 40:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:  # a future's iterator (a task's, an event's, a sleep's): the end of the chain
            kind = type(awaited).__name__
            chain.append("awaiting a future" if kind in ("FutureIter", "Future") else f"awaiting a {kind}")
            break
        where = "/".join(Path(frame.f_code.co_filename).parts[-2:])
        chain.append(f"{where}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "\n".join(chain)


class LoopTasks:
    """Every long-running task of the daemon, recorded: a stop cancels each, cancels again one that
    outlives its cancel, and gives up on it at the deadline instead of waiting for it for ever (a
    ``TaskGroup`` waits for every child without end).

    A task that ends with an error (a loop outside ``supervised``, a worker) is an error of the
    daemon's: the first is kept in ``error`` and ``on_error`` is called (the daemon then stops).
    """

    def __init__(self, on_error: Any = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_error = on_error
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, name: str, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        log.error("a daemon task ended with an error; stopping", task=task.get_name(), error=repr(error))
        if self.error is None:
            self.error = error
            if self._on_error is not None:
                self._on_error()

    def alive(self) -> list[asyncio.Task[Any]]:
        return [task for task in self._tasks if not task.done()]

    async def wait(self, tasks: list[asyncio.Task[Any]], seconds: float) -> list[asyncio.Task[Any]]:
        """Wait up to ``seconds`` for ``tasks`` to end: those still running."""
        if not tasks:
            return []
        _, pending = await asyncio.wait(tasks, timeout=max(seconds, 0))
        return list(pending)

    async def cancel_all(self, deadline: float, tasks: list[asyncio.Task[Any]] | None = None) -> list[str]:
        """Cancel ``tasks`` (all recorded ones by default) and wait for them until ``deadline``
        (``time.monotonic``), cancelling again each second those that outlive their cancel: the names
        of those still running at the deadline (given up on: the process ends without them)."""
        pending = self.alive() if tasks is None else [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pending = await self.wait(pending, min(RECANCEL_SECONDS, left))
            for task in pending:
                log.warning(
                    "a task outlived its cancel; cancelling it again",
                    task=task.get_name(),
                    waiting_in=where_it_waits(task),
                )
                task.cancel()
        if pending:
            log.error(
                "tasks still running at the stop's deadline are left behind (the journal resumes their documents)",
                tasks={task.get_name(): where_it_waits(task) for task in pending},
            )
        return sorted(task.get_name() for task in pending)


class Backstop:
    """Ends the process at a deadline, from a thread of its own: the last guarantee that a stop
    stops, for what no deadline on the loop can reach (the loop itself held by a blocking call)."""

    def __init__(self) -> None:
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float) -> None:
        if self._timer is not None:
            return
        self._timer = threading.Timer(max(seconds, 0), _force_exit, args=(seconds,))
        self._timer.daemon = True
        self._timer.name = "stop-backstop"
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(1.0)  # it wakes at once to end: gone when this returns


def _force_exit(seconds: float) -> None:
    log.error(
        "the stop did not end within stop_timeout_seconds; ending the process now (documents in "
        "progress resume from the journal at the next start)",
        seconds=round(seconds, 1),
        threads=sorted(thread.name for thread in threading.enumerate() if thread is not threading.current_thread()),
    )
    _flush_and_exit(EXIT_STOP_FORCED)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class Stoppable(Protocol):
    async def serve(self) -> int: ...

    def exit_deadline(self) -> float | None:
        """When (``time.monotonic``) the process must have ended, once a stop began; else None."""
        ...

    def disarm_backstop(self) -> None:
        """Nothing may end the process at the stop's deadline any more (its caller goes on)."""
        ...


def run_to_exit(daemon: Stoppable, *, process_exits: bool = False) -> int:
    """``asyncio.run(daemon.serve())`` with every wait of its clean-up bounded: tasks left running are
    cancelled and waited for briefly, the default executor's threads are not joined without end,
    and if threads are still running at the deadline (blocked on a share), the process ends here
    with the daemon's exit status instead of hanging in the interpreter's exit.

    ``process_exits`` (``chandrad run``): the caller exits with the returned status at once, so
    after a stop the stop signals stay ignored: a second SIGTERM arriving in the interpreter's last
    milliseconds (systemd's, an admin's, a test harness's) must not turn a clean exit into death
    by the signal. Otherwise the caller gets its own handlers back, as it does whenever
    ``serve()`` raises."""
    # Only what the daemon started is ours to wait for: a thread that was there before (a caller's
    # own, such as a test runner's) is neither joined nor a reason to end the process.
    threads_before = set(threading.enumerate())
    handlers_before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    loop = asyncio.new_event_loop()
    # Our own default executor, so that its threads can be let go of (asyncio.run's
    # shutdown_default_executor joins them without a deadline on 3.11).
    default_threads = ThreadPoolExecutor(thread_name_prefix="asyncio")
    loop.set_default_executor(default_threads)
    asyncio.set_event_loop(loop)
    try:
        try:
            code = loop.run_until_complete(daemon.serve())
        finally:
            deadline = daemon.exit_deadline() or time.monotonic() + DEFAULT_JOIN_SECONDS
            try:
                _cancel_left_behind(loop, deadline - EXIT_RESERVE_SECONDS / 2)
                with contextlib.suppress(Exception):
                    loop.run_until_complete(_bounded(loop.shutdown_asyncgens(), 1.0))
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                # The stop is under way: a second SIGTERM (or ^C) now would end the process with the
                # signal instead of its status, halfway through the threads' join.
                for signum in STOP_SIGNALS:
                    signal.signal(signum, signal.SIG_IGN)
                default_threads.shutdown(wait=False, cancel_futures=True)
        # Threads that were let go of end within moments; one still running after that is stuck (on
        # a share), and waiting for it to the deadline would only hand the exit to the backstop.
        stuck = _join_threads(
            min(deadline - EXIT_RESERVE_SECONDS / 4, time.monotonic() + THREADS_END_SECONDS), threads_before
        )
        if stuck:
            log.error(
                "threads still blocked at exit (a share that stopped answering?); ending the process without them",
                threads=stuck,
            )
            _flush_and_exit(code)
    except BaseException:
        # The start was refused (a ConfigError) or the daemon failed: the caller reports it and
        # decides what comes next, so the backstop the stop armed must not end its process at the
        # deadline (a test runner's worker, half a minute after an in-process `chandrad run` that
        # could not create a folder, 2026-12-04).
        daemon.disarm_backstop()
        _give_back(handlers_before)
        raise
    # A stop that ran its course keeps the backstop armed: the promise is that the process ends
    # within stop_timeout_seconds, and the interpreter's own exit (atexit, a child's join) is part
    # of it. A caller that means to go on disarms it (``disarm_backstop``).
    if not process_exits:
        _give_back(handlers_before)
    return code


def _give_back(handlers: dict[signal.Signals, Any]) -> None:
    # Ignored signals are inherited by every program started later (an exec keeps SIG_IGN): a
    # caller that goes on after us must get its own handlers back.
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


async def _bounded(work: Coroutine[Any, Any, Any], seconds: float) -> None:
    async with asyncio.timeout(seconds):
        await work


def _cancel_left_behind(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    """Tasks the daemon did not end itself (an engine's monitor, a probe's): cancelled, waited
    for until ``deadline`` at most."""
    left = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not left:
        return
    for task in left:
        task.cancel()

    async def settle() -> None:
        await asyncio.wait(left, timeout=max(deadline - time.monotonic(), 0.1))

    loop.run_until_complete(settle())
    for task in left:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.warning("a task ended with an error at exit", task=task.get_name(), error=repr(task.exception()))
    still = [task.get_name() for task in left if not task.done()]
    if still:
        log.warning("tasks still running when the event loop closed", tasks=still)


def _join_threads(deadline: float, threads_before: set[threading.Thread]) -> list[str]:
    """Join every non-daemon thread started since ``threads_before`` until ``deadline``: the names
    of those still alive."""

    def ours() -> list[threading.Thread]:
        return [
            thread
            for thread in threading.enumerate()
            if thread not in threads_before and thread is not threading.current_thread() and not thread.daemon
        ]

    for thread in ours():
        thread.join(max(deadline - time.monotonic(), 0))
    return sorted(thread.name for thread in ours() if thread.is_alive())
