"""Turn filesystem activity in an inbox into *settled* candidate files.

Sources of "something may have changed here": watchdog events (inotify, or polling where inotify
cannot see remote writes), a scan at start-up and a periodic rescan that catches whatever events
were lost. None of them is trusted to say a file is complete: a file is settled once its size and
mtime have stayed unchanged for ``settle_seconds``. The tracker resets on every change and never
gives up, so a scanner that writes for ten minutes is simply waited for.

This module never opens a document: it only ``lstat``s names, and only in the watcher's own
thread: never on the event loop (a stat on a share that stopped answering would hold it, and with
it every inbox, the engine's feed and systemd's watchdog ping), never in a pool another inbox
shares (a dead share would stall the healthy inboxes' watchers too).
"""

from __future__ import annotations

import asyncio
import functools
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import watchdog.events
from watchdog.events import (
    DirCreatedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from chandrad.config import InboxSettings, name_matcher
from chandrad.storage.folders import DAEMON_DIR, in_thread

log = structlog.get_logger("chandrad.inbox.watch")

# Junk that operating systems, office suites, sync tools and browsers leave in shared folders,
# and names that mean "still being written".
BUILTIN_IGNORED_NAMES = (
    ".DS_Store",
    "._*",
    "Thumbs.db",
    "desktop.ini",
    "~$*",
    ".~lock*",
    "*.part",
    "*.tmp",
    "*.crdownload",
    "*.partial",
    "*.download",
    "*.swp",
)
BUILTIN_IGNORED_DIRS = ("@eaDir", ".stfolder", ".stversions", "$RECYCLE.BIN", "#recycle", DAEMON_DIR)

# Mounts on which inotify does not report writes made by other hosts.
REMOTE_FS_TYPES = ("cifs", "smb3", "smbfs", "nfs", "nfs4", "9p", "afs", "ceph", "glusterfs", "davfs")


@dataclass(frozen=True)
class IgnoreRules:
    """Which names in an inbox are never documents. Patterns match one path component."""

    include: tuple[str, ...] = ("*",)
    ignore: tuple[str, ...] = ()

    @classmethod
    def for_inbox(cls, inbox: InboxSettings) -> IgnoreRules:
        return cls(include=inbox.include, ignore=inbox.ignore)

    # Compiled once: the watcher asks for every event of a burst (compiling each pattern on each
    # call was a tenth of the daemon's time holding the GIL in one, bench/intake.py --spy).
    @functools.cached_property
    def _builtin_dirs(self) -> Callable[[str], bool]:
        return name_matcher(BUILTIN_IGNORED_DIRS, case=True)

    @functools.cached_property
    def _builtin_names(self) -> Callable[[str], bool]:
        return name_matcher(BUILTIN_IGNORED_NAMES, case=True)

    @functools.cached_property
    def _ignored_names(self) -> Callable[[str], bool]:
        return name_matcher(self.ignore)

    @functools.cached_property
    def _included_names(self) -> Callable[[str], bool]:
        return name_matcher(self.include)

    def dir_ignored(self, name: str) -> bool:
        return name.startswith(".") or self._builtin_dirs(name)

    def file_ignored(self, name: str) -> bool:
        if name.startswith(".") or self._builtin_names(name) or self._ignored_names(name):
            return True
        return not self._included_names(name)

    def ignored(self, rel_path: Path) -> bool:
        *dirs, name = rel_path.parts
        return any(self.dir_ignored(part) for part in dirs) or self.file_ignored(name)


FileKind = Literal["regular", "symlink", "special"]


@dataclass(frozen=True)
class SettledFile:
    """A name in an inbox whose size and mtime stopped changing."""

    inbox: InboxSettings
    path: Path
    rel_path: Path
    size: int
    mtime_ns: int
    kind: FileKind


@dataclass
class _Observation:
    size: int
    mtime_ns: int
    kind: FileKind
    unchanged_since: float


# Some scanners create the final name empty and only later fill it: an empty file must stay
# empty this much longer before it is taken (and then refused as empty).
EMPTY_FILE_SETTLE_SECONDS = 60.0


class SettleTracker:
    """Pure bookkeeping of candidate files; the clock is passed in, so tests need no sleeping."""

    def __init__(self, settle_seconds: float, empty_settle_seconds: float = EMPTY_FILE_SETTLE_SECONDS) -> None:
        self.settle_seconds = settle_seconds
        self.empty_settle_seconds = max(settle_seconds, empty_settle_seconds)
        self._seen: dict[Path, _Observation] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, path: Path) -> bool:
        return path in self._seen

    def observe(self, path: Path, size: int, mtime_ns: int, kind: FileKind, now: float) -> None:
        previous = self._seen.get(path)
        if previous is None or (previous.size, previous.mtime_ns, previous.kind) != (size, mtime_ns, kind):
            self._seen[path] = _Observation(size, mtime_ns, kind, unchanged_since=now)

    def forget(self, path: Path) -> None:
        self._seen.pop(path, None)

    def paths(self) -> list[Path]:
        return list(self._seen)

    def _wait_for(self, obs: _Observation) -> float:
        empty_regular_file = obs.kind == "regular" and obs.size == 0
        return self.empty_settle_seconds if empty_regular_file else self.settle_seconds

    def pop_settled(self, now: float) -> list[tuple[Path, _Observation]]:
        settled = [(path, obs) for path, obs in self._seen.items() if now - obs.unchanged_since >= self._wait_for(obs)]
        for path, _ in settled:
            del self._seen[path]
        return settled


def classify(st: os.stat_result) -> FileKind | None:
    if stat.S_ISREG(st.st_mode):
        return "regular"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if stat.S_ISDIR(st.st_mode):
        return None
    return "special"  # FIFO, socket, device node


def mount_fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (longest mount point prefix wins)."""
    resolved = str(path.resolve())
    best, best_type = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mountinfo:
            for line in mountinfo:
                fields = line.split()
                mount_point = fields[4].replace("\\040", " ")
                fs_type = fields[fields.index("-") + 1]
                inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fs_type
    except OSError:
        return ""
    return best_type


def wants_polling(inbox: InboxSettings) -> bool:
    if isinstance(inbox.polling, bool):
        return inbox.polling
    fs_type = mount_fs_type(inbox.path)
    return fs_type in REMOTE_FS_TYPES or fs_type.startswith("fuse")


# The events that can announce a file to settle or a folder to look into; watchdog asks the kernel
# for these alone (its ``event_filter`` sets the inotify mask). Not opens and closes after a read,
# nor a folder's "modified": the daemon's own reads of the inbox tree (intake's hash, each page's
# render of a claimed original) put two events each into watchdog's queue, where every move scans
# the queue for its other half (1 000 files renamed in: a fifth of the daemon's GIL-holding time,
# bench/intake.py --spy). A folder's "modified" only repeats what its files' events say.
WATCHED_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent,
    DirCreatedEvent,
    FileMovedEvent,
    DirMovedEvent,
    FileModifiedEvent,  # a write (and, before watchdog had FileAttribEvent, a touch)
    FileClosedEvent,  # closed after writing: a scanner is done
    # A touch or a chmod (watchdog 7 tells these apart from writes): a file made readable at last.
    *[event for event in (getattr(watchdog.events, "FileAttribEvent", None),) if event is not None],
]


class _DirtyPaths(FileSystemEventHandler):
    """Watchdog handler: runs on the observer thread and only hands paths to the event loop, which
    looks at them at its next tick. Paths under ``own_folder`` (the inbox's ``.chandrad``) are
    dropped here: each claim makes about five events there (its folder, its record, the file
    moved in), and handing each to the loop, to be parsed and ignored, held the GIL longer than
    anything else of intake's in a 1 000-file burst (bench/intake.py --spy)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sink: Callable[[Path, bool], None], own_folder: Path) -> None:
        self._loop = loop
        self._sink = sink
        self._own = str(own_folder)
        self._own_prefix = self._own + os.sep

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("deleted", "closed_no_write", "opened"):
            return
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            if raw:
                name = os.fsdecode(raw)
                if name.startswith(self._own_prefix) or name == self._own:
                    continue
                self._loop.call_soon_threadsafe(self._sink, Path(name), event.is_directory)


class InboxWatcher:
    """Watches one inbox and hands each settled file to ``emit``."""

    def __init__(
        self,
        inbox: InboxSettings,
        emit: Callable[[SettledFile], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inbox = inbox
        self.rules = IgnoreRules.for_inbox(inbox)
        # "/srv/inbox/": what every path inside the inbox starts with (_rel)
        self._root_prefix = os.path.join(str(inbox.path), "")
        self.tracker = SettleTracker(inbox.settle_seconds, inbox.empty_settle_seconds)
        # Decided in the watcher's thread when it starts (it resolves the path and reads /proc: on a
        # share that stopped answering, that would hold the loop at start and at every SIGHUP).
        self.polling: bool | None = None
        self._emit = emit
        self._clock = clock
        self._observer: BaseObserver | None = None
        self._dirs_to_scan: set[Path] = set()
        self._announced: set[Path] = set()  # files events named since the last tick, to be stat'ed by it
        self._fs = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"watch-{inbox.name}")
        self.last_tick = clock()
        self.log = log.bind(inbox=inbox.name)

    def _rel(self, path: Path) -> Path | None:
        """``path`` relative to the inbox, or None outside it (or deeper, when not recursive).
        By its string: both are normalised ``Path``s, and ``Path.relative_to`` was a twelfth of
        the GIL a 1 000-file burst took on 16 cores (bench/NOTES-overhead.md)."""
        named = str(path)
        if not named.startswith(self._root_prefix):
            return None
        rel = named[len(self._root_prefix) :]
        if not rel or (not self.inbox.recursive and os.sep in rel):
            return None
        return Path(rel)

    def _candidate(self, path: Path, is_directory: bool = False) -> None:
        """An event named ``path`` (on the loop): noted, and looked at by the next tick."""
        if path in self._announced:
            return  # a file's later events (modified, closed) while its first is still to be looked at
        rel = self._rel(path)
        if rel is None:
            return
        if is_directory:
            if not any(self.rules.dir_ignored(part) for part in rel.parts):
                self._dirs_to_scan.add(path)
            return
        if self.rules.ignored(rel):
            return
        self._announced.add(path)

    def _observe(self, path: Path, st: os.stat_result | None) -> None:
        """What a look found at ``path`` (None: nothing) into the tracker."""
        if st is None:
            self.tracker.forget(path)
            return
        kind = classify(st)
        if kind is None:
            if self.inbox.recursive:
                self._dirs_to_scan.add(path)
            self.tracker.forget(path)
            return
        self.tracker.observe(path, st.st_size, st.st_mtime_ns, kind, self._clock())

    def walk(self, top: Path) -> Iterator[Path]:
        """Every non-ignored name under ``top``; never follows symlinked directories."""
        try:
            entries = list(os.scandir(top))
        except OSError:
            return
        for entry in entries:
            path = Path(entry.path)
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if self.inbox.recursive and not self.rules.dir_ignored(entry.name):
                    yield from self.walk(path)
            elif not self.rules.file_ignored(entry.name):
                yield path

    def stat_tree(self, top: Path) -> list[tuple[Path, os.stat_result]]:
        """lstat every candidate under ``top``; safe to run in a worker thread (touches no state)."""
        found = []
        for path in self.walk(top):
            try:
                found.append((path, path.lstat()))
            except OSError:
                continue
        return found

    def look(self, dirs: list[Path], paths: list[Path]) -> list[tuple[Path, os.stat_result | None]]:
        """lstat every candidate under ``dirs``, and each of ``paths`` (None where nothing is there
        now). Blocking, and touches no state: it runs in the watcher's thread."""
        found: list[tuple[Path, os.stat_result | None]] = [(p, st) for top in dirs for p, st in self.stat_tree(top)]
        for path in paths:
            try:
                found.append((path, path.lstat()))
            except OSError:
                found.append((path, None))
        return found

    def start_observer(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.polling is None:
            self.polling = wants_polling(self.inbox)
        if self.polling:
            observer: BaseObserver = PollingObserver(timeout=self.inbox.poll_interval_seconds)
        else:
            observer = Observer()
        observer.schedule(
            _DirtyPaths(loop, self._candidate, self.inbox.path / DAEMON_DIR),
            str(self.inbox.path),
            recursive=self.inbox.recursive,
            event_filter=WATCHED_EVENTS,
        )
        observer.daemon = True
        observer.start()
        self._observer = observer

    def stop_observer(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None

    def stop(self) -> None:
        """No more events, and the watcher's thread ends once its look in progress returns."""
        self._stop_observer_in_turn()
        self._fs.shutdown(wait=False)

    def _stop_observer_in_turn(self) -> None:
        """Stop the observer in the watcher's thread, after what it is doing: stopped from the loop,
        an observer that thread was still starting would be started after the stop, and left running."""
        try:
            self._fs.submit(self.stop_observer)
        except RuntimeError:  # the thread was shut down: stop() queued this before
            pass

    async def tick(self, rescan: bool = False) -> None:
        """Look (in one hop to the watcher's thread) at what events named, what is being tracked and
        the folders to scan (the whole inbox if ``rescan``), then emit what has settled."""
        self.last_tick = self._clock()
        dirs = [self.inbox.path] if rescan else list(self._dirs_to_scan)
        paths = list(self._announced.union(self.tracker.paths()))
        self._dirs_to_scan.clear()
        self._announced.clear()
        for path, st in await in_thread(self._fs, self.look, dirs, paths):
            self._observe(path, st)
        for path, obs in self.tracker.pop_settled(self._clock()):
            rel = self._rel(path)
            if rel is not None:
                await self._emit(SettledFile(self.inbox, path, rel, obs.size, obs.mtime_ns, obs.kind))

    def _identity(self) -> tuple[int, int] | None:
        """(device, inode) of the inbox folder, or None while it is missing."""
        try:
            st = os.stat(self.inbox.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        identity = await in_thread(self._fs, self._identity)
        await in_thread(self._fs, self.start_observer, loop)
        self.log.info(
            "watching inbox",
            path=str(self.inbox.path),
            mode="polling" if self.polling else "inotify",
            settle_seconds=self.inbox.settle_seconds,
        )
        tick_every = min(1.0, max(0.1, self.inbox.settle_seconds / 4))
        next_rescan = self._clock()
        try:
            while True:
                # An inotify watch dies with its folder: after the inbox is removed and re-created,
                # or a share is remounted over it, nothing was seen until the periodic rescan
                # (5 minutes by default). Notice the new folder and watch it at once.
                current = await in_thread(self._fs, self._identity)
                if current != identity:
                    await in_thread(self._fs, self.stop_observer)
                    if current is None:
                        self.log.warning(
                            "the inbox folder is gone (removed or unmounted); waiting for it", path=str(self.inbox.path)
                        )
                    else:
                        self.log.warning(
                            "the inbox folder was replaced (re-created or remounted); watching it again",
                            path=str(self.inbox.path),
                        )
                        await in_thread(self._fs, self.start_observer, loop)
                        next_rescan = self._clock()  # what is in it now was never announced
                    identity = current
                rescan = self._clock() >= next_rescan
                await self.tick(rescan)
                if rescan:
                    next_rescan = self._clock() + self.inbox.rescan_seconds
                await asyncio.sleep(tick_every)
        finally:
            self._stop_observer_in_turn()
