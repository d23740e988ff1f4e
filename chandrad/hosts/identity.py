"""This host among the others: its heartbeat (how often, and who wrote it: machine id, the
state_dir's instance id, the pid space) and the check at start-up that no other daemon uses its
host_id.

Each host rewrites its ``heartbeat`` in its claims folder (``claimed/<host_id>/heartbeat``) every
``heartbeat_interval``; the others judge it by that (``chandrad.hosts.takeover``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from chandrad.config import Settings
from chandrad.engine import processes
from chandrad.errors import ConfigError
from chandrad.runtime import from_iso
from chandrad.storage import folders
from chandrad.storage.durable import makedirs_durably, write_file_durably

MAX_HEARTBEAT_SECONDS = 30.0


def heartbeat_interval(takeover_seconds: float) -> float:
    """How often a host rewrites its heartbeat: four beats fit in the time others wait for one."""
    return min(MAX_HEARTBEAT_SECONDS, takeover_seconds / 4)


def machine_id() -> str:
    try:
        return Path("/etc/machine-id").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


INSTANCE_FILE = "instance-id"


def instance_id(state_dir: Path) -> str:
    """This installation's own identity: a random id kept in ``state_dir``, made at its first start.
    It tells apart two daemons with one host_id where /etc/machine-id cannot (containers without
    one, cloned VMs, two daemons on one machine). Blocking."""
    path = state_dir / INSTANCE_FILE
    try:
        value = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        value = ""
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}; remove it and chandrad makes a new one") from error
    if value:
        return value
    value = uuid.uuid4().hex
    makedirs_durably(state_dir)
    write_file_durably(path, value.encode("ascii"))
    return value


def read_heartbeat(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def heartbeat_time(beat: dict[str, Any]) -> float | None:
    """When the heartbeat says it was written (UTC, as ``now_iso`` writes it; a number is taken as
    epoch seconds), or None when it does not say in a form we read."""
    at = beat.get("at")
    if isinstance(at, (int, float)) and not isinstance(at, bool):
        return float(at)
    return from_iso(at) if isinstance(at, str) else None


def pid_space() -> str:
    """This kernel's boot and this process's pid namespace: where a pid names the same process as
    here. Empty when /proc does not say."""
    boot = processes.boot_id()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}" if boot else ""


def _pid_alive(pid: object) -> bool:
    """Whether a heartbeat's pid (another process than ours) runs here."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid != os.getpid() and processes.running(pid)


def _another_daemon(beat: dict[str, Any], mine: str, instance: str, space: str) -> str | None:
    """Why the heartbeat of our host_id comes from another daemon (None: it is ours, from before)."""
    theirs = beat.get("instance")
    machine = str(beat.get("machine_id") or "")
    other_machine = bool(mine and machine and machine != mine)
    if theirs is None:  # a heartbeat of a chandrad from before instance ids: machine-ids only
        return f"machine-id {machine}" if other_machine else None
    if theirs == instance:
        # Ourselves before a restart, unless this state_dir was copied to another machine.
        return f"a copy of this state_dir on machine-id {machine}" if other_machine else None
    if other_machine or not (mine and machine):
        return f"machine-id {machine or 'unknown'}, instance {theirs}"
    # This machine-id, another state_dir: a second daemon here, our own previous life with a
    # replaced state_dir, or a clone or container sharing the machine-id. Only where its pid names
    # a process of this kernel and pid namespace can its being gone be told.
    if space and beat.get("pid_space") == space:
        return f"another chandrad on this machine, pid {beat.get('pid')}" if _pid_alive(beat.get("pid")) else None
    return f"instance {theirs} with this machine-id, in another boot or pid namespace (a clone, a container)"


def check_host_id_free(settings: Settings, now: float | None = None) -> None:
    """Refuse to start when this host_id's heartbeat, on any inbox, was written recently by another
    daemon: two daemons claiming into one folder would take each other's documents for their own.
    "Another" is another instance id (state_dir), unless it is this machine's and its process, in
    this kernel and pid namespace, is gone; or this instance id on another machine (a copied
    state_dir). "Recently" is within ``takeover_seconds`` on the wall clock (the only clock two
    machines share). Blocking."""
    mine = machine_id()
    instance = instance_id(settings.state_dir)
    space = pid_space()
    now = time.time() if now is None else now
    for inbox in settings.inbox:
        path = folders.heartbeat_path(inbox.path, settings.host_id)
        beat = read_heartbeat(path)
        at = heartbeat_time(beat) if beat else None
        if beat is None or at is None or abs(now - at) >= settings.takeover_seconds:
            continue
        other = _another_daemon(beat, mine, instance, space)
        if other is not None:
            raise ConfigError(
                f"host_id {settings.host_id} is in use by another daemon ({other}; its heartbeat in "
                f"{inbox.path} is {now - at:.0f} s old): give each host its own host_id. If that daemon "
                f"is gone for good (this host with a new state_dir), remove {path} or wait "
                f"{settings.takeover_seconds:.0f} s"
            )
