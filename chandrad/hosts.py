"""Several chandrad hosts on one shared inbox: claims another host can read, heartbeats, takeovers
and the markers that recognise duplicates across hosts.

Each host claims into its own folder (``claimed/<host_id>/<doc_id>/``, with a ``.claim.json`` that
says what the file is) and rewrites its ``heartbeat`` there every ``heartbeat_interval``. A host
judges another dead on its own monotonic clock: when that host's heartbeat has not changed for
``takeover_seconds`` since this one first saw it (so no clock skew between machines matters, and a
host just started waits that long before it takes anything over). A dead host's claim folders are
taken over one by one: a ``<doc_id>.taken`` marker first, then an atomic rename into our claims
(of several survivors, exactly one rename succeeds); the winner journals the document under the
same id and processes it from the start. The marker tells the dead host, once restarted, that the
document is no longer its own (``taken_over_by``).

Duplicates: ``seen/ab/cd/<sha256>``, created with O_EXCL after a successful claim, names the
document that first took that content in, whichever host it was (an older chandrad's flat
``seen/<sha256>`` counts too). Retention (``MarkerSweep``, run by ``chandrad.document.retention``) removes
markers, takeover markers and long-dead hosts' heartbeats older than ``retention.days``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from chandrad.config import InboxSettings, Settings
from chandrad.engine import processes
from chandrad.errors import ConfigError, InboxUnreachableError
from chandrad.runtime import Runtime, from_iso, now_iso, remove_claim_folder
from chandrad.storage import folders
from chandrad.storage.durable import create_exclusively, fsync_dir, makedirs_durably, write_file_durably
from chandrad.storage.journal import Document
from chandrad.storage.schema import FINAL_STATES

log = structlog.get_logger("chandrad.hosts")

MAX_HEARTBEAT_SECONDS = 30.0


def heartbeat_interval(takeover_seconds: float) -> float:
    """How often a host rewrites its heartbeat: four beats fit in the time others wait for one."""
    return min(MAX_HEARTBEAT_SECONDS, takeover_seconds / 4)


class ClaimLost(Exception):
    """Another host took the document over (this host's heartbeat looked dead to it): this host
    must stop working on it and never publish it."""

    def __init__(self, taker: str) -> None:
        super().__init__(f"document taken over by host {taker}")
        self.taker = taker


# -- the claim record ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRecord:
    """What a claimed file is, written beside it: the claim folder keeps only the file's name, a
    takeover needs its sub-folders and hash. ``output_dir`` is named before the outputs' rename,
    so that a host taking over a document published but not yet archived finishes it instead of
    publishing it twice."""

    rel_path: str
    sha256: str
    size: int
    mtime_ns: int
    inbox: str
    first_seen: float
    host_id: str
    output_dir: str | None = None

    def encoded(self) -> bytes:
        return (json.dumps(asdict(self), ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def claim_record_of(doc: Document, host_id: str) -> ClaimRecord:
    return ClaimRecord(doc.rel_path, doc.sha256, doc.size, doc.mtime_ns, doc.inbox, doc.created_at, host_id)


def write_claim_record(claim_folder: Path, record: ClaimRecord) -> None:
    """Blocking. Creates the claim folder (durably) if needed."""
    makedirs_durably(claim_folder)
    write_file_durably(folders.claim_record(claim_folder), record.encoded())


def read_claim_record(claim_folder: Path) -> ClaimRecord | None:
    try:
        values = json.loads(folders.claim_record(claim_folder).read_text(encoding="utf-8"))
        return ClaimRecord(**values)
    except (OSError, ValueError, TypeError):
        return None


def note_output_dir(claimed: Path, output_dir: Path) -> None:
    """Add the output folder to the record of the claim ``claimed`` lies in (blocking; a claim of an
    older chandrad without a record is left so)."""
    record = read_claim_record(claimed.parent)
    if record is not None and record.output_dir != str(output_dir):
        write_claim_record(claimed.parent, ClaimRecord(**{**asdict(record), "output_dir": str(output_dir)}))


def claimed_file(claim_folder: Path) -> Path | None:
    """The original in a claim folder (its record and temporary files do not count)."""
    try:
        names = os.listdir(claim_folder)
    except OSError:
        return None
    for name in names:
        if folders.is_original(name):
            return claim_folder / name
    return None


# -- who has a document -------------------------------------------------------------------------


def taken_over_by(inbox_path: Path, host_id: str, doc_id: str) -> str | None:
    """The host that took ``doc_id`` over from ``host_id``, or None (blocking). Its claim folder
    under another host's claims says so; else our ``<doc_id>.taken`` marker, which a taker writes
    just before its rename. Call it when our claimed original is gone: a marker beside a claim
    folder still here only means that the taker stopped between the two (``keep_claim``)."""
    holder = _held_by_another(inbox_path, host_id, doc_id)
    if holder is not None:
        return holder
    marker = folders.taken_marker(inbox_path, host_id, doc_id)
    try:
        return str(json.loads(marker.read_text(encoding="utf-8")).get("host_id") or "another host")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return "another host"


def _held_by_another(inbox_path: Path, host_id: str, doc_id: str) -> str | None:
    """The other host whose claims hold ``doc_id``'s folder, or None (blocking)."""
    try:
        others = [entry for entry in folders.claimed_root(inbox_path).iterdir() if entry.name != host_id]
    except OSError:
        return None
    return next((other.name for other in others if (other / doc_id).is_dir()), None)


def marker_before_rename(inbox_path: Path, host_id: str, doc_id: str) -> bool:
    """Whether ``doc_id``'s ``.taken`` marker is only a taker's first one, written before its rename,
    and no other host's claims hold the document (blocking): the taker may have stopped before its
    rename. A taker whose rename succeeded says so in the marker (``renamed``)."""
    if _held_by_another(inbox_path, host_id, doc_id) is not None:
        return False
    try:
        marker = json.loads(folders.taken_marker(inbox_path, host_id, doc_id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("renamed") is not True


def claim_owner(inbox_path: Path, claimed: Path) -> str | None:
    """The host whose claims hold the original ``claimed`` (``claimed/<host>/<doc>/<name>``), or
    None for a claim of an older chandrad (``claimed/<doc>/<name>``: no host takes those over). The
    owner is read from the path, not assumed to be us: a host whose host_id changed still has
    claims under its old name, and others take those over once its old heartbeat stops."""
    if claimed.parent.parent == folders.claimed_root(inbox_path):
        return None
    return claimed.parent.parent.name


def lost_to(inbox_path: Path, claimed: Path, doc_id: str) -> str | None:
    """The host that took this claim over, if its original is gone because of a takeover (blocking)."""
    owner = claim_owner(inbox_path, claimed)
    if owner is None or claimed.exists() or claimed.is_symlink():
        return None
    return taken_over_by(inbox_path, owner, doc_id)


def keep_claim(inbox_path: Path, host_id: str, doc_id: str) -> None:
    """Our claim folder is still here: a marker left by a taker that stopped before its rename
    no longer applies (blocking)."""
    folders.taken_marker(inbox_path, host_id, doc_id).unlink(missing_ok=True)


async def forget_taken_over(runtime: Runtime, doc: Document, inbox: InboxSettings, taker: str) -> None:
    """The document is another host's now: no trace of it stays here, and nothing is reported
    (it is neither failed nor lost; the taker publishes it)."""
    journal = runtime.journal
    await journal.call(journal.forget, doc.id)

    def clean() -> None:
        shutil.rmtree(runtime.staging_dir(inbox, doc.id).parent, ignore_errors=True)
        shutil.rmtree(runtime.work_dir(doc.id), ignore_errors=True)

    owner = claim_owner(inbox.path, Path(doc.claimed_path)) if doc.claimed_path else None
    await asyncio.to_thread(clean)
    # The marker is on the share: its inbox's threads, never the default executor behind page renders.
    await runtime.on_inbox(inbox.path, folders.taken_marker(inbox.path, owner or runtime.host_id, doc.id).unlink, True)
    log.info("document taken over by another host", doc=doc.id, inbox=inbox.name, file=doc.rel_path, host=taker)


async def journal_claim(runtime: Runtime, inbox: InboxSettings, claim_folder: Path) -> Document | None:
    """A claim folder of ours the journal has not recorded (taken over just now, or before a crash
    that came before the journal's commit) becomes a document under the folder's id: queued, to be
    processed from the start, or ``publishing`` if its record names an output folder (resume then
    finishes it if those outputs are its own). None: the folder holds no file or no record, or
    the journal has it as final."""
    record = await runtime.on_inbox(inbox.path, read_claim_record, claim_folder)
    original = await runtime.on_inbox(inbox.path, claimed_file, claim_folder)
    if record is None or original is None:
        return None
    journal, doc_id = runtime.journal, claim_folder.name
    doc = await journal.call(journal.find, doc_id)
    if doc is None:
        doc = await journal.call(
            journal.add_document,
            inbox.name,
            record.rel_path,
            record.sha256,
            record.size,
            record.mtime_ns,
            doc_id=doc_id,
            created_at=record.first_seen,
        )
    elif doc.state in FINAL_STATES:
        log.warning("a claimed file belongs to a final document; leaving it", doc=doc_id, path=str(original))
        return None
    state = "publishing" if record.output_dir else "queued"
    if doc.state in ("queued", "publishing") and doc.claimed_path is not None:
        state = doc.state
    fields: dict[str, Any] = {"claimed_path": str(original), "next_attempt_at": 0.0}
    if record.output_dir:
        fields["output_dir"] = record.output_dir
    return await journal.call(journal.set_state, doc_id, state, **fields)


# -- heartbeats ---------------------------------------------------------------------------------


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


class HostWatch:
    """Which other hosts are dead, judged on this host's monotonic clock: a host whose heartbeat
    content has not changed for ``takeover_seconds`` since this one last saw it change (or first
    saw it). Pure; the clock is injected."""

    def __init__(self, takeover_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.takeover_seconds = takeover_seconds
        self.clock = clock
        self._seen: dict[tuple[Path, str], tuple[bytes, float]] = {}

    def observe(self, inbox_path: Path, host_id: str, content: bytes) -> None:
        key = (inbox_path, host_id)
        previous = self._seen.get(key)
        if previous is None or previous[0] != content:
            self._seen[key] = (content, self.clock())

    def unchanged_for(self, inbox_path: Path, host_id: str) -> float | None:
        seen = self._seen.get((inbox_path, host_id))
        return None if seen is None else self.clock() - seen[1]

    def is_dead(self, inbox_path: Path, host_id: str) -> bool:
        unchanged = self.unchanged_for(inbox_path, host_id)
        return unchanged is not None and unchanged >= self.takeover_seconds

    def hosts(self) -> dict[str, float]:
        """Each host seen (on any inbox) and how long its heartbeat has been unchanged, in seconds."""
        ages: dict[str, float] = {}
        now = self.clock()
        for (_, host_id), (_, changed) in self._seen.items():
            ages[host_id] = min(ages.get(host_id, float("inf")), now - changed)
        return ages


def _other_heartbeats(inbox_path: Path, host_id: str) -> dict[str, bytes]:
    """Every other host's heartbeat content on this inbox (blocking). A folder without one is
    a claim folder of an older chandrad, not a host."""
    beats: dict[str, bytes] = {}
    try:
        entries = list(folders.claimed_root(inbox_path).iterdir())
    except OSError:
        return beats
    for entry in entries:
        if entry.name == host_id:
            continue
        try:
            beats[entry.name] = (entry / "heartbeat").read_bytes()
        except OSError:
            continue
    return beats


def _dead_host_claims(inbox_path: Path, dead: str) -> list[str]:
    """The ids of a dead host's claim folders that hold a file and its record (blocking)."""
    try:
        entries = list(folders.host_claims(inbox_path, dead).iterdir())
    except OSError:
        return []
    return [
        entry.name
        for entry in entries
        if entry.is_dir()
        and not entry.is_symlink()
        and folders.claim_record(entry).is_file()
        and claimed_file(entry) is not None
    ]


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def _take_folder(inbox_path: Path, dead: str, me: str, doc_id: str) -> Path | None:
    """Mark, then rename a dead host's claim folder into ours (blocking): the folder now, or None
    if another survivor's rename came first (then nothing is removed: the marker is the winner's
    as much as ours)."""
    marker: dict[str, object] = {"host_id": me, "at": now_iso()}
    write_file_durably(folders.taken_marker(inbox_path, dead, doc_id), json.dumps(marker).encode("utf-8"), writer=me)
    source = folders.claim_dir(inbox_path, dead, doc_id)
    target = folders.claim_dir(inbox_path, me, doc_id)
    makedirs_durably(target.parent)
    try:
        os.rename(source, target)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
            log.warning("a claim folder of ours already has this id; not taking it over", doc=doc_id, host=dead)
            return None
        raise
    fsync_dir(target.parent)
    fsync_dir(source.parent)
    # Again after the rename: the dead host, restarting between our marker and our rename, may
    # have found its folder still there and removed the marker (keep_claim); it must learn that
    # the folder is ours now.
    # "renamed": the claim is ours now (recovery's test of a stale marker believes this one).
    marker["renamed"] = True
    write_file_durably(folders.taken_marker(inbox_path, dead, doc_id), json.dumps(marker).encode("utf-8"), writer=me)
    return target


class Hosts:
    """The hosts task: our heartbeat on every inbox, the other hosts' watched, the dead ones'
    documents taken over. ``on_taken`` hands a taken-over document's id to the workers."""

    def __init__(
        self, runtime: Runtime, on_taken: Callable[[str], object], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.runtime = runtime
        self.on_taken = on_taken
        self.watch = HostWatch(runtime.settings.takeover_seconds, clock)
        self.seq = 0
        self.machine_id = machine_id()
        self.instance = instance_id(runtime.settings.state_dir)
        self.pid_space = pid_space()

    @property
    def interval(self) -> float:
        return heartbeat_interval(self.runtime.settings.takeover_seconds)

    def _inboxes(self) -> list[InboxSettings]:
        return list({inbox.path: inbox for inbox in self.runtime.settings.inbox}.values())

    async def beat(self) -> None:
        """Write our heartbeat on every reachable inbox (at start-up, before anything is claimed)."""
        self.seq += 1
        content = {
            "host_id": self.runtime.host_id,
            "machine_id": self.machine_id,
            "instance": self.instance,
            "pid_space": self.pid_space,
            "pid": os.getpid(),
            "seq": self.seq,
            "at": now_iso(),
        }
        data = json.dumps(content).encode("utf-8")
        for inbox in self._inboxes():
            path = folders.heartbeat_path(inbox.path, self.runtime.host_id)

            def write(path: Path = path) -> None:
                makedirs_durably(path.parent)
                write_file_durably(path, data)

            try:
                await self.runtime.probe(inbox.path, write)
            except (OSError, InboxUnreachableError) as error:
                log.warning("cannot write the heartbeat", inbox=inbox.name, error=str(error))

    async def run(self) -> None:
        """Heartbeats and takeovers in two loops: a slow takeover (many claims on a slow share) must
        not stop our heartbeat, or the other hosts would take everything we hold."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._beat_loop(), name="heartbeat")
            group.create_task(self._look_loop(), name="takeover")

    async def _beat_loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.interval)

    async def _look_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for inbox in self._inboxes():
                try:
                    await self.look_after(inbox)
                except (OSError, InboxUnreachableError) as error:
                    log.warning("cannot look at the other hosts", inbox=inbox.name, error=str(error))

    async def look_after(self, inbox: InboxSettings) -> None:
        """Read the other hosts' heartbeats on one inbox and take over the documents of the dead."""
        self.watch.takeover_seconds = self.runtime.settings.takeover_seconds  # after a reload
        me = self.runtime.host_id
        beats = await self.runtime.probe(inbox.path, lambda: _other_heartbeats(inbox.path, me))
        for host_id, content in beats.items():
            self.watch.observe(inbox.path, host_id, content)
            if self.watch.is_dead(inbox.path, host_id):
                await self.take_over(inbox, host_id)

    async def take_over(self, inbox: InboxSettings, dead: str) -> None:
        me = self.runtime.host_id
        heartbeat = folders.heartbeat_path(inbox.path, dead)
        for doc_id in await self.runtime.probe(inbox.path, lambda: _dead_host_claims(inbox.path, dead)):
            # Looked at again before each folder: a host that comes back mid-takeover keeps the rest.
            content = await self.runtime.probe(inbox.path, lambda: _read_bytes(heartbeat))
            self.watch.observe(inbox.path, dead, content)
            if not self.watch.is_dead(inbox.path, dead):
                log.info("a host came back during its takeover; leaving it the rest", inbox=inbox.name, host=dead)
                return
            # No deadline here: a rename given up on while its thread goes on would leave a folder of
            # ours that is journaled only at the next start.
            folder = await self.runtime.on_inbox(inbox.path, _take_folder, inbox.path, dead, me, doc_id)
            if folder is None:
                continue
            doc = await journal_claim(self.runtime, inbox, folder)
            await asyncio.to_thread(
                shutil.rmtree, folders.host_staging(inbox.outbox, dead) / doc_id, True
            )  # the dead host's half-made outputs: processed from the start here
            unchanged = self.watch.unchanged_for(inbox.path, dead) or 0.0
            log.warning(
                "took over a document of a host that stopped",
                doc=doc_id,
                inbox=inbox.name,
                host=dead,
                file=doc.rel_path if doc else None,
                heartbeat_unchanged_s=round(unchanged, 1),
            )
            if doc is not None:
                self.on_taken(doc.id)


# -- duplicates across hosts ---------------------------------------------------------------------


def mark_seen(inbox_path: Path, sha256: str, host_id: str, doc: Document) -> dict[str, Any] | None:
    """Record that ``doc`` took this content in, unless a marker is there already (blocking).
    Returns the marker of another document if there is one (ours: None).

    An older chandrad's flat marker (``seen/<sha256>``) is looked at first and counts like one of
    ours. New markers are only ever made in the sharded layout (``seen/ab/cd/<sha256>``), so
    between hosts of this version the one exclusive link there decides who was first."""
    flat = _marker_content(folders.flat_seen_marker(inbox_path, sha256))
    if flat is not None:
        return None if flat.get("doc_id") == doc.id else flat
    marker = folders.seen_marker(inbox_path, sha256)
    content = {"host_id": host_id, "doc_id": doc.id, "rel_path": doc.rel_path, "at": now_iso(doc.created_at)}
    makedirs_durably(marker.parent)
    if create_exclusively(marker, json.dumps(content, ensure_ascii=False).encode("utf-8"), host_id):
        return None
    try:
        existing = json.loads(marker.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return mark_seen(inbox_path, sha256, host_id, doc)  # removed meanwhile (its document failed)
    except (OSError, ValueError):
        return None  # unreadable: it cannot name a twin
    if not isinstance(existing, dict) or existing.get("doc_id") == doc.id:
        return None
    return existing


def _marker_content(marker: Path) -> dict[str, Any] | None:
    """A seen marker's content, or None if it is absent or unreadable."""
    try:
        content = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def forget_seen(inbox_path: Path, sha256: str, doc_id: str) -> None:
    """Remove the content's marker, sharded or flat, if it names ``doc_id`` (which failed: a copy
    dropped again is processed again). Blocking."""
    if not sha256:
        return
    for marker in (folders.seen_marker(inbox_path, sha256), folders.flat_seen_marker(inbox_path, sha256)):
        content = _marker_content(marker)
        if content is not None and content.get("doc_id") == doc_id:
            try:
                marker.unlink(missing_ok=True)
            except OSError:
                pass


# -- retention: markers and long-dead hosts ------------------------------------------------------


@dataclass
class MarkerTally:
    """What one inbox's retention pass removed, and how many names it looked at."""

    seen: int = 0  # seen markers (a copy of their content is no duplicate any more)
    taken: int = 0  # takeover markers
    heartbeats: int = 0  # heartbeats of hosts dead for longer than retention.days
    folders: int = 0  # empty claim folders of those hosts, and their own folders
    leftovers: int = 0  # temporary files a crash left beside markers and heartbeats
    examined: int = 0


class MarkerSweep:
    """One retention pass over an inbox's markers, a step at a time; each ``step`` is blocking
    (run it on the inbox's threads) and looks at up to ``limit`` names.

    Every marker is judged by its own age, its mtime (when it was made: markers are never
    rewritten), not by the journal: the markers on a shared inbox belong to every host's
    documents, and an unlink is atomic, so a kill at any point leaves each marker there or gone
    and the next pass judges what is left exactly as this one would have. The mtime, not the
    "at" in a seen marker: one stat for each name (on an SMB share often answered from the
    folder listing) instead of an open, a read and a close; "at" is the document's first sight,
    minutes before the marker was made. A share copied without its times makes markers look
    young: kept longer, never pruned early.

    Removed, when older than ``cutoff``: seen markers (``seen/ab/cd/<sha256>`` and the flat
    ``seen/<sha256>``); ``<doc_id>.taken`` markers in every host's claims; temporary files a crash
    left there. A host other than this one whose heartbeat is older than ``cutoff`` (and than
    ``takeover_seconds``: it is dead to every host) loses its claim folders that hold no file, then
    its heartbeat, then its folder; while any claim folder of it still holds a file, the heartbeat
    stays (the others judge the host by it, to take that file over). A folder of another host that
    is empty and has no heartbeat (a pass killed between the heartbeat and the folder) is removed
    once unchanged for ``takeover_seconds``. The shard folders stay (at most 65 536, and a marker
    being made in one must never find it gone). This host's heartbeat and folder are never touched.

    Two hosts' passes may remove the same marker; the later unlink finds it gone, which is fine.
    One narrow race remains: a marker removed by another pass and made anew for a new copy between
    this pass's stat and its unlink is removed too (that copy's own journal still knows it).
    """

    def __init__(self, inbox_path: Path, host_id: str, cutoff: float, *, now: float, takeover_seconds: float) -> None:
        self.tally = MarkerTally()
        self.done = False
        self._walk = self._pass(
            inbox_path, host_id, cutoff, min(cutoff, now - takeover_seconds), now - takeover_seconds
        )

    def step(self, limit: int) -> bool:
        """Look at up to ``limit`` more names, removing what is old enough: whether the pass is done."""
        looked = 0
        for _ in self._walk:
            looked += 1
            if looked >= limit:
                break
        else:
            self.done = True
        self.tally.examined += looked
        return self.done

    def _pass(
        self, inbox_path: Path, me: str, cutoff: float, dead_before: float, settled_before: float
    ) -> Iterator[None]:
        yield from self._seen_folder(folders.seen_root(inbox_path), cutoff, depth=0)
        root = folders.claimed_root(inbox_path)
        for host in _entries(root):
            if not host.is_dir(follow_symlinks=False):
                continue
            if host.name == me:
                yield from self._host_folder(Path(host.path), cutoff, dead=False)
                continue
            heartbeat = folders.heartbeat_path(inbox_path, host.name)
            beat_at = _mtime(heartbeat)
            if beat_at is None:
                # No heartbeat: an older chandrad's claim folder, or a dead host's folder whose
                # heartbeat a killed pass removed. Removed only if empty (it holds nothing).
                at = _mtime(Path(host.path))
                if at is not None and at < settled_before and _rmdir(Path(host.path)):
                    self.tally.folders += 1
                yield
                continue
            dead = beat_at < dead_before
            holds_a_file = yield from self._host_folder(Path(host.path), cutoff, dead=dead)
            if dead and not holds_a_file:
                # The heartbeat after the folders it vouches for, the host's folder last: a kill in
                # between leaves an empty folder without a heartbeat, removed by a later pass.
                if _unlink(heartbeat):
                    self.tally.heartbeats += 1
                if _rmdir(Path(host.path)):
                    self.tally.folders += 1
                yield

    def _seen_folder(self, folder: Path, cutoff: float, depth: int) -> Iterator[None]:
        for entry in _entries(folder):
            name = entry.name
            if depth < 2 and len(name) == 2 and _is_hex(name):
                if entry.is_dir(follow_symlinks=False):
                    yield from self._seen_folder(Path(entry.path), cutoff, depth + 1)
                continue
            is_marker = len(name) == 64 and _is_hex(name)
            if not (is_marker or _is_leftover(name)):
                continue
            if _old_file(entry, cutoff) and _unlink(Path(entry.path)):
                if is_marker:
                    self.tally.seen += 1
                else:
                    self.tally.leftovers += 1
            yield

    def _host_folder(self, folder: Path, cutoff: float, *, dead: bool) -> Generator[None, None, bool]:
        """Takeover markers and leftovers older than ``cutoff``; with ``dead``, the claim folders
        that hold no file. Returns whether a claim folder still holds one."""
        holds_a_file = False
        for entry in _entries(folder):
            name = entry.name
            if name == "heartbeat":
                continue
            if entry.is_dir(follow_symlinks=False):
                if not dead:
                    continue  # a live host's claims: its own business
                if remove_claim_folder(Path(entry.path)):
                    self.tally.folders += 1
                else:
                    holds_a_file = True
            elif name.endswith(folders.TAKEN_SUFFIX) or _is_leftover(name):
                if _old_file(entry, cutoff) and _unlink(Path(entry.path)):
                    if name.endswith(folders.TAKEN_SUFFIX):
                        self.tally.taken += 1
                    else:
                        self.tally.leftovers += 1
            else:
                continue
            yield
        return holds_a_file


_HEX = frozenset("0123456789abcdef")


def _is_hex(name: str) -> bool:
    return all(char in _HEX for char in name)


def _is_leftover(name: str) -> bool:
    """A temporary file of ``create_exclusively`` or ``write_file_durably`` (``.<name>...tmp``)."""
    return name.startswith(".") and name.endswith(".tmp")


def _entries(folder: Path) -> Iterator[os.DirEntry[str]]:
    """The entries of ``folder``, read as they are looked at (a flat ``seen`` of an older chandrad
    may hold a million); none if it cannot be read."""
    try:
        listing = os.scandir(folder)
    except OSError:
        return
    with listing:
        while True:
            try:
                entry = next(listing)
            except StopIteration:
                return
            except OSError:
                return
            yield entry


def _old_file(entry: os.DirEntry[str], cutoff: float) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff


def _mtime(path: Path) -> float | None:
    try:
        return path.lstat().st_mtime
    except OSError:
        return None


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False  # gone already (another host's pass), or not ours to remove
    return True


def _rmdir(path: Path) -> bool:
    try:
        os.rmdir(path)
    except OSError:
        return False  # not empty (a file arrived), or gone already
    return True
