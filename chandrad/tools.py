"""External programs (Ghostscript, poppler, the page renderer) as every step runs them: in a process
group of their own, with a deadline and a memory cap, their out-of-memory and outside kills told
apart from the file's fault, and the ones a document has running, so that a stop can end them."""

from __future__ import annotations

import contextvars
import os
import resource
import signal
import subprocess
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
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
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
    if memory_mb and any(marker in err for marker in _OUT_OF_MEMORY):
        raise PermanentError(
            f"{Path(args[0]).name} ran out of the memory it may use (prepare.tool_memory_mb = {memory_mb}); "
            f"raise prepare.tool_memory_mb if the machine has room, then drop the file again",
            stage=stage,
        )
    if binary:
        return subprocess.CompletedProcess(args, proc.returncode, out, err.decode("utf-8", "replace"))
    return subprocess.CompletedProcess(
        args, proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
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
