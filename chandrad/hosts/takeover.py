"""Takeover of a dead host's claims, and the hosts task that writes our heartbeat and watches the
others'.

A host judges another dead on its own monotonic clock: when that host's heartbeat has not changed
for ``takeover_seconds`` since this one first saw it (so no clock skew between machines matters,
and a host just started waits that long before it takes anything over). A dead host's claim
folders are taken over one by one: a ``<doc_id>.taken`` marker first, then an atomic rename into
our claims (of several survivors, exactly one rename succeeds); the winner journals the document
under the same id and processes it from the start.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from chandrad.config import InboxSettings
from chandrad.errors import InboxUnreachableError
from chandrad.hosts.claims import claimed_file, held_by_another, journal_claim, read_claim_record
from chandrad.hosts.identity import heartbeat_interval, instance_id, machine_id, pid_space
from chandrad.runtime import Runtime, now_iso, remove_claim_folder
from chandrad.storage import folders
from chandrad.storage.durable import fsync_dir, makedirs_durably, write_file_durably

log = structlog.get_logger("chandrad.hosts")


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
        # Another survivor's rename came first, and our marker may have replaced its "renamed" one:
        # the marker names the host whose claims hold the folder, as that host left it.
        winner = held_by_another(inbox_path, dead, doc_id)
        if winner is not None and winner != me:
            settled = {"host_id": winner, "at": now_iso(), "renamed": True}
            write_file_durably(
                folders.taken_marker(inbox_path, dead, doc_id), json.dumps(settled).encode("utf-8"), writer=me
            )
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


def _stack_parts(inbox_path: Path, dead: str, stack_folder: Path) -> tuple[list[str], list[str]]:
    """The parts of the stack just taken into ``stack_folder`` that are still in the dead host's
    claims (blocking): those its record lists, and the leftovers of a split cut short."""
    stack = read_claim_record(stack_folder)
    listed = set(stack.parts or []) if stack is not None else set()
    prefix = f"{stack_folder.name}-"
    try:
        names = [name for name in os.listdir(folders.host_claims(inbox_path, dead)) if name.startswith(prefix)]
    except OSError:
        return [], []
    parts: list[str] = []
    leftovers: list[str] = []
    for name in sorted(names):
        record = read_claim_record(folders.claim_dir(inbox_path, dead, name))
        if record is None:
            leftovers.append(name)  # cut short between its PDF and its record: a copy, never listed
        elif (record.split_from or {}).get("parent") == stack_folder.name:
            (parts if name in listed else leftovers).append(name)
    return parts, leftovers


def _remove_leftover_parts(inbox_path: Path, dead: str, part_ids: list[str]) -> None:
    """Part folders of a split the stack's record never committed: copies of the stack's own pages,
    written again when the stack is split again (blocking)."""
    for part_id in part_ids:
        folder = folders.claim_dir(inbox_path, dead, part_id)
        original = claimed_file(folder)
        if original is not None:
            original.unlink(missing_ok=True)
        remove_claim_folder(folder)


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
            dead_folder = folders.claim_dir(inbox.path, dead, doc_id)
            record = await self.runtime.on_inbox(inbox.path, read_claim_record, dead_folder)
            if record is None or record.split_from is not None:
                # Gone meanwhile (another survivor's), or a batch scan's part: it goes with its stack.
                continue
            # No deadline here: a rename given up on while its thread goes on would leave a folder of
            # ours that is journaled only at the next start.
            folder = await self.runtime.on_inbox(inbox.path, _take_folder, inbox.path, dead, me, doc_id)
            if folder is None:
                continue
            taken = [folder]
            # A batch scan's stack takes its parts along: the ones its record lists are documents
            # (journaled before the stack, which completes once none of its parts is pending); any
            # other is a leftover of a split cut short (the stack is split again here).
            listed: list[str] = []
            leftovers: list[str] = []
            if inbox.split_on or record.parts:  # else no part of it can exist: no listing per document
                listed, leftovers = await self.runtime.on_inbox(inbox.path, _stack_parts, inbox.path, dead, folder)
            for part_id in listed:
                part_folder = await self.runtime.on_inbox(inbox.path, _take_folder, inbox.path, dead, me, part_id)
                if part_folder is not None:
                    taken.insert(0, part_folder)
            await self.runtime.on_inbox(inbox.path, _remove_leftover_parts, inbox.path, dead, leftovers)
            for taken_folder in taken:
                await self._journal_taken(inbox, dead, taken_folder)

    async def _journal_taken(self, inbox: InboxSettings, dead: str, folder: Path) -> None:
        doc = await journal_claim(self.runtime, inbox, folder)
        await asyncio.to_thread(
            shutil.rmtree, folders.host_staging(inbox.outbox, dead) / folder.name, True
        )  # the dead host's half-made outputs: processed from the start here
        unchanged = self.watch.unchanged_for(inbox.path, dead) or 0.0
        log.warning(
            "took over a document of a host that stopped",
            doc=folder.name,
            inbox=inbox.name,
            host=dead,
            file=doc.rel_path if doc else None,
            heartbeat_unchanged_s=round(unchanged, 1),
        )
        if doc is not None:
            self.on_taken(doc.id)
