"""External programs (Ghostscript, poppler, the page renderer) as every step runs them: in a process
group of their own, with a deadline and a memory cap, their out-of-memory and outside kills told
apart from the file's fault, and the ones a document has running, so that a stop can end them."""

from __future__ import annotations

import contextvars
import json
import os
import resource
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chandrad.config import PrepareSettings
from chandrad.errors import PermanentError, ToolTimeoutError, TransientError
from chandrad.priority import lower_priority

# The programs a document's processing has running right now, so that stopping it can kill them.
# ``asyncio.to_thread`` copies the caller's context into the worker thread, so a set placed here by
# ``Pipeline.process`` collects exactly that document's programs. Without it a stop waited for a
# hung Ghostscript's timeout (300 s by default), past systemd's stop timeout.
running_tools: contextvars.ContextVar[set[subprocess.Popen[bytes]] | None] = contextvars.ContextVar(
    "running_tools", default=None
)


def kill_tools(procs: set[subprocess.Popen[bytes]]) -> int:
    """SIGKILL the process groups of ``procs``; returns how many there were."""
    found = list(procs)
    for proc in found:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(found)


# What Ghostscript, poppler, glibc and the loader print when an allocation is refused.
_OUT_OF_MEMORY = (
    b"MemoryError",
    b"Out of memory",
    b"VMerror",
    b"Cannot allocate memory",
    b"bad_alloc",
    b"failed to map segment",
    b"memory exhausted",
)


def run_tool(
    args: list[str],
    settings: PrepareSettings,
    stage: str,
    *,
    binary: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[Any]:
    """Run an external program; a timeout or a missing program is transient, its exit code is the caller's.

    The program gets its own process group, and a timeout (``subprocess_timeout_seconds``) kills
    the whole group: a wrapper script's children (or a tool's helpers) must not outlive it holding
    our pipes open. ``tool_memory_mb`` caps its address space (RLIMIT_AS): a hostile PDF makes
    Ghostscript fail with a reason instead of pushing the machine into the OOM killer; running out
    of it is permanent. It runs at a lower CPU priority than the daemon (``priority.lower_priority``).
    """
    timeout, memory_mb = settings.subprocess_timeout_seconds, settings.tool_memory_mb
    proc = _start(
        args,
        stage,
        memory_mb,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **env} if env else None,
    )
    registry = running_tools.get()
    if registry is not None:
        registry.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ToolTimeoutError(f"{args[0]} took longer than {timeout:.0f} s", stage=stage) from None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if registry is not None:
            registry.discard(proc)
    if out_of_memory := ran_out_of_memory(args[0], err, memory_mb, stage):
        raise out_of_memory
    if binary:
        return subprocess.CompletedProcess(args, proc.returncode, out, err.decode("utf-8", "replace"))
    return subprocess.CompletedProcess(
        args, proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    )


def ran_out_of_memory(program: str, stderr: bytes, memory_mb: int, stage: str) -> PermanentError | None:
    """The error to raise when ``stderr`` says ``program`` ran out of its capped memory, else None."""
    if not memory_mb or not any(marker in stderr for marker in _OUT_OF_MEMORY):
        return None
    return PermanentError(
        f"{Path(program).name} ran out of the memory it may use (prepare.tool_memory_mb = {memory_mb}); "
        f"raise prepare.tool_memory_mb if the machine has room, then drop the file again",
        stage=stage,
    )


def _start(args: list[str] | tuple[str, ...], stage: str, memory_mb: int, **pipes: Any) -> subprocess.Popen[bytes]:
    """A program started as every tool is: its stdout a pipe, in a process group of its own, at a
    lower CPU priority, its address space capped at ``memory_mb`` (0: no cap); a missing program is
    transient. ``pipes``: its stdin, stderr and environment, as ``subprocess.Popen`` takes them."""
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, start_new_session=True, **pipes)
    except FileNotFoundError:
        raise TransientError(
            f"{args[0]} is not installed; install it (chandrad check lists what is missing)", stage=stage
        ) from None
    lower_priority(proc.pid)
    if memory_mb:
        # Set from outside right after the start (no preexec_fn: unsafe in a threaded daemon).
        try:
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        except (ProcessLookupError, PermissionError, OSError):
            pass
    return proc


def _sigkill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    _sigkill_group(proc)
    proc.communicate()


# Signals that come from outside (the kernel's OOM killer sends SIGKILL, an admin SIGTERM): the
# file is not to blame, so the document is retried. A crash (SIGSEGV, SIGABRT) is the file's.
_OUTSIDE_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def killed_from_outside(tool: str, returncode: int, stage: str) -> TransientError | None:
    """A TransientError naming the signal when ``tool`` was killed from outside, else None."""
    if returncode >= 0 or -returncode not in _OUTSIDE_SIGNALS:
        return None
    name = signal.Signals(-returncode).name
    hint = " (the machine may be short of memory)" if -returncode == signal.SIGKILL else ""
    return TransientError(f"{tool} was killed by {name}{hint}", stage=stage)


# An answer's JSON line is a few hundred bytes; more without a line's end is not an answer.
MAX_ANSWER_HEADER = 65536


class WorkerGoneError(Exception):
    """A serving child ended (crashed, was killed, or broke its protocol) before it answered."""

    def __init__(self, returncode: int, stderr: bytes) -> None:
        super().__init__(f"exit {returncode}")
        self.returncode, self.stderr = returncode, stderr


class ToolWorker:
    """One long-lived child that answers requests one at a time: a JSON line in; a JSON line with
    ``bytes``, then that many raw bytes, out. Started as ``run_tool`` starts a tool (its own process
    group, a lower priority, the memory cap); each request gets the tools' deadline. Not thread-safe:
    ``ToolWorkers`` lends it to one thread at a time."""

    def __init__(self, command: tuple[str, ...], memory_mb: int, stage: str) -> None:
        # Its stderr goes to a file, emptied after each answer: a pipe nobody read would fill with
        # a library's warnings and stall the child; the file keeps the last request's words for a crash.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (it lives as long as the child: close())
        try:
            self.proc = _start(command, stage, memory_mb, stdin=subprocess.PIPE, stderr=self._stderr)
        except TransientError:
            self._stderr.close()
            raise
        self.command, self.memory_mb, self.served = command, memory_mb, 0

    def ask(
        self, request: dict[str, Any], timeout: float, stage: str, max_bytes: int | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """The answer to ``request`` within ``timeout`` seconds, its raw part at most ``max_bytes``.
        Raises ToolTimeoutError (the child is killed) or WorkerGoneError (the child is gone; its
        exit code and stderr say why)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        registry = running_tools.get()
        if registry is not None:
            registry.add(self.proc)
        try:
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._gone() from None
            header, rest = self._read_line(deadline, stage)
            try:
                answer = json.loads(header)
                size = int(answer["bytes"])
                if size < 0 or (max_bytes is not None and size > max_bytes):
                    raise ValueError(f"{size} bytes")
            except (ValueError, KeyError, TypeError):
                self.kill()
                raise WorkerGoneError(1, b"answered outside the protocol: " + header[:200]) from None
            payload = self._read_exactly(size, rest, deadline, stage)
        except BaseException:
            if self.proc.poll() is None:
                self.kill()
            raise
        finally:
            if registry is not None:
                registry.discard(self.proc)
        self.served += 1
        # Emptied after an answer, not before a request: what a child says as it starts (a library
        # it cannot load) is the first request's reason when it ends before answering.
        self._stderr.seek(0)
        self._stderr.truncate()
        return answer, payload

    def _wait_readable(self, deadline: float, stage: str) -> None:
        assert self.proc.stdout is not None
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
            self.kill()
            raise ToolTimeoutError(f"{self.command[0]} took longer than the deadline", stage=stage)

    def _read_line(self, deadline: float, stage: str) -> tuple[bytes, bytes]:
        assert self.proc.stdout is not None
        got = b""
        while b"\n" not in got:
            if len(got) > MAX_ANSWER_HEADER:  # not an answer: the child does not speak the protocol
                self.kill()
                raise WorkerGoneError(1, b"answered outside the protocol: " + got[:200])
            self._wait_readable(deadline, stage)
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise self._gone()
            got += chunk
        line, _, rest = got.partition(b"\n")
        return line, rest

    def _read_exactly(self, size: int, got: bytes, deadline: float, stage: str) -> bytes:
        assert self.proc.stdout is not None
        parts, have = [got], len(got)
        while have < size:
            self._wait_readable(deadline, stage)
            chunk = os.read(self.proc.stdout.fileno(), min(size - have, 1 << 20))
            if not chunk:
                raise self._gone()
            parts.append(chunk)
            have += len(chunk)
        if have > size:  # the child wrote past its answer: it cannot be trusted with the next request
            self.kill()
        return b"".join(parts)[:size]

    def _gone(self) -> WorkerGoneError:
        try:
            returncode = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            returncode = self.proc.returncode
        self._stderr.seek(0)
        return WorkerGoneError(returncode, self._stderr.read()[-65536:])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        _sigkill_group(self.proc)
        self.proc.wait()

    def close(self) -> None:
        """Its stdin ends, and so does it (killed if it does not within a second)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._stderr.close()


class ToolWorkers:
    """Idle serving children, kept for the next request of the same command and memory cap.

    A request takes an idle one or starts one; a worker given back goes idle again unless it is
    gone, has served ``max_served`` requests (a library's leaks and fragmentation stay bounded), or
    ``keep`` are idle already. One idle for ``idle_seconds`` ends at the next ``end_idle`` (a page
    renderer holds 30-60 MB: a quiet daemon need not keep one a core). Thread-safe; nothing starts
    until asked."""

    def __init__(
        self,
        keep: int,
        max_served: int = 200,
        idle_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep, self.max_served, self.idle_seconds, self.clock = keep, max_served, idle_seconds, clock
        self._idle: list[tuple[ToolWorker, float]] = []  # and since when
        self._lock = threading.Lock()
        self._closed = False

    def take(self, command: tuple[str, ...], memory_mb: int, stage: str, *, fresh: bool = False) -> ToolWorker:
        """An idle worker of ``command`` with ``memory_mb``, or a new one (always, when ``fresh``)."""
        with self._lock:
            for index, (worker, _) in enumerate([] if fresh else self._idle):
                if worker.command == command and worker.memory_mb == memory_mb:
                    del self._idle[index]
                    if worker.alive:
                        return worker
                    worker.close()
                    break
        return ToolWorker(command, memory_mb, stage)

    def give_back(self, worker: ToolWorker) -> None:
        with self._lock:
            if not self._closed and worker.alive and worker.served < self.max_served and len(self._idle) < self.keep:
                self._idle.append((worker, self.clock()))
                return
        worker.close()

    def end_idle(self) -> int:
        """End the workers idle for ``idle_seconds`` or longer; returns how many. Blocking (a
        second at most a worker): run it in a thread."""
        now = self.clock()
        with self._lock:
            ending = [worker for worker, since in self._idle if now - since >= self.idle_seconds]
            self._idle = [(worker, since) for worker, since in self._idle if now - since < self.idle_seconds]
        for worker in ending:
            worker.close()
        return len(ending)

    def close(self) -> None:
        """Every idle worker ends; those lent out end when given back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker, _ in idle:
            worker.close()
