"""Retention's pass over an inbox's markers (``MarkerSweep``, run by ``chandrad.document.retention``):
seen markers, takeover markers and long-dead hosts' heartbeats older than ``retention.days``."""

from __future__ import annotations

import os
import stat
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

from chandrad.runtime import remove_claim_folder
from chandrad.storage import folders


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
