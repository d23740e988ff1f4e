"""The processes behind chandrad's vLLM engines: which children are vLLM's, ending them, and ending
the ones a killed chandrad left behind. The process tree, programs, states and memory come from
psutil; only the durable identity of a process (its start in clock ticks since boot, and the boot)
is read from /proc itself, for the reason at ``process_start_time``.

vLLM runs each engine's EngineCore in a child process (spawned by multiprocessing, then retitled
"VLLM::EngineCore"); it does not die with its parent and holds the GPU's memory while it lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil


def end_process_tree(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still this process's vLLM child, and its descendants (an
    engine load nobody waits for: nothing to save, and the driver frees a dead process's GPU memory).
    A pid that has meanwhile exited and been reused by anything else is left alone."""
    for pid in pids:
        if parent_pid(pid) == os.getpid() and is_vllm_process(pid):
            kill_tree(pid)


def kill_tree(pid: int) -> bool:
    """SIGKILL ``pid`` and its descendants: whether ``pid`` itself could be killed."""
    for victim in descendant_pids(pid):
        with contextlib.suppress(OSError):
            os.kill(victim, signal.SIGKILL)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def spawned_children() -> list[int]:
    """Direct children of this process that multiprocessing spawned or vLLM named (EngineCore).

    Direct only: an engine already loading may spawn processes of its own (workers, compilers),
    which must not be taken for the next engine's EngineCore.
    """
    return [pid for pid in descendant_pids(os.getpid(), depth=1) if is_vllm_process(pid)]


def is_vllm_process(pid: int) -> bool:
    """Whether ``pid`` runs vLLM (its processes retitle themselves "VLLM::EngineCore", "VLLM::Worker"…)
    or is a multiprocessing child about to. Judged by the program, never by its arguments: the
    pdftoppm or gs this process runs meanwhile may have a file called EngineCore.pdf to read."""
    argv = process_argv(pid)
    if not argv:
        return False
    if argv[0].startswith("VLLM") or "EngineCore" in argv[0]:
        return True
    return "-c" in argv and any(arg.startswith("from multiprocessing.spawn import spawn_main") for arg in argv)


# -- engines a killed chandrad left behind ---------------------------------------------------------

ENGINE_RECORDS = "engine-processes"


def record_engine_process(state_dir: Path, pid: int) -> None:
    """Note an EngineCore this process spawned, so that the next chandrad on ``state_dir`` can end it
    if this one is killed (kill -9, the OOM killer): vLLM's EngineCore outlives its parent and keeps
    its GPU memory, and the next start would not find enough. systemd ends the service's whole
    cgroup; a daemon started by hand (make run) has nobody else to do it."""
    started = process_start_time(pid)
    if started is None:
        return  # already gone
    folder = state_dir / ENGINE_RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    for record in folder.glob("*.json"):  # engines gone since (restarts, recycles)
        old = _read_record(record)
        if old is not None and not _is_alive(old["pid"], old["started"]):
            record.unlink(missing_ok=True)
    entry = {
        "pid": pid,
        "started": started,
        "owner": os.getpid(),
        "owner_started": process_start_time(os.getpid()),
        "boot": boot_id(),
    }
    partial = folder / f".{pid}.tmp"  # renamed into place: a reader never sees half a record
    partial.write_text(json.dumps(entry))
    os.replace(partial, folder / f"{pid}.json")


def end_engines_left_behind(state_dir: Path) -> list[int]:
    """End the recorded EngineCores whose chandrad is gone (same pid, start time and boot: never a
    process that merely reused the number, nor one whose chandrad still runs); wait until they have
    exited. Returns those ended."""
    folder = state_dir / ENGINE_RECORDS
    ended: list[int] = []
    try:
        if not folder.is_dir():
            return ended
        records = sorted(folder.glob("*.json"))
        leftovers = list(folder.glob(".*.tmp"))  # a crash between write and rename
    except OSError:
        return ended
    for record in records:
        entry = _read_record(record)
        if entry is not None and entry.get("boot") == boot_id() and _is_alive(entry["pid"], entry["started"]):
            if _is_alive(entry["owner"], entry["owner_started"]):
                continue  # its chandrad still runs
            if is_vllm_process(entry["pid"]) and kill_tree(entry["pid"]):
                ended.append(entry["pid"])
        with contextlib.suppress(OSError):
            record.unlink(missing_ok=True)
    for partial in leftovers:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    deadline = time.monotonic() + 10.0  # the GPU memory is free once the processes have exited
    while any(running(pid) for pid in ended) and time.monotonic() < deadline:
        time.sleep(0.1)
    return ended


def running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has: only its exit status is left)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _is_alive(pid: int, started: int) -> bool:
    """Whether the process that had ``pid`` and started at ``started`` still runs."""
    return process_start_time(pid) == started and running(pid)


def _read_record(record: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    keys = ("pid", "started", "owner", "owner_started")
    if not isinstance(entry, dict) or not all(isinstance(entry.get(key), int) for key in keys):
        return None
    return entry


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid and the boot, names one process for
    good. Not psutil's ``create_time()``: that is the ticks plus the boot's wall-clock time, which
    moves when the clock is set (an NTP step after boot), so a record written before the step would
    no longer match its own process after it; the ticks never move."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            # "pid (comm) state ppid …": comm may hold spaces and parentheses, so split after the last ")".
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if len(fields) > 19 else None


def parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def process_argv(pid: int) -> list[str]:
    try:
        return [arg for arg in psutil.Process(pid).cmdline() if arg]
    except psutil.Error:
        return []


def descendant_pids(pid: int, depth: int | None = None) -> list[int]:
    """Descendants of ``pid``: all, or ``depth`` generations (1: its direct children)."""
    if depth is not None and depth < 1:
        return []
    try:
        parent = psutil.Process(pid)
        if depth is None:
            return [child.pid for child in parent.children(recursive=True)]
        children = parent.children()
    except psutil.Error:
        return []
    found: list[int] = []
    for child in children:
        found.append(child.pid)
        found.extend(descendant_pids(child.pid, depth - 1))
    return found


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time in clock ticks (None once it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return round((times.user + times.system) * os.sysconf("SC_CLK_TCK"))
