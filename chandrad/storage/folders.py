"""Where chandrad keeps its own files, in one place: nothing else spells these paths.

Several hosts may share one inbox; each keeps to its own folders there. In each inbox,
``.chandrad/claimed/<host_id>/<doc_id>/<name>`` holds an original from the moment this host takes
it in until its last move (to archive/ or failed/): a scanner re-using the name cannot touch it,
and the watcher ignores ``.chandrad``. Beside it, ``.claim.json`` says what the file is (its path
in the inbox, its hash), so that another host can take the document over; ``claimed/<host_id>/
heartbeat`` says the host is alive, and ``claimed/<host_id>/<doc_id>.taken`` that another host took
that document over. ``.chandrad/seen/ab/cd/<sha256>`` (sharded by the hash's first two and next two
hex digits, so that no folder of a share holds more than a few thousand names) names the first
document with that content, for every host, until retention prunes it; an older chandrad's flat
``seen/<sha256>`` is still read. In each outbox, ``.chandrad/staging/<host_id>/<doc_id>/doc`` is
where a document's outputs are written before the one rename that publishes them (same filesystem,
so the rename is atomic). Under ``state_dir``, ``work/<doc_id>`` holds a document's working copies
(a repaired or flattened PDF). Claims and staging folders of an older chandrad (``claimed/<doc_id>``,
``staging/<doc_id>``) lack the host level; the journal names them by their full path.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

from chandrad.errors import InboxUnreachableError
from chandrad.storage.naming import safe_component

T = TypeVar("T")

DAEMON_DIR = ".chandrad"


def claimed_root(inbox_path: Path) -> Path:
    """Every host's claims (and, from an older chandrad, claim folders of its documents)."""
    return inbox_path / DAEMON_DIR / "claimed"


def host_claims(inbox_path: Path, host_id: str) -> Path:
    """One host's claim folders, its heartbeat and the takeover markers of its documents."""
    return claimed_root(inbox_path) / host_id


def claim_dir(inbox_path: Path, host_id: str, doc_id: str) -> Path:
    return host_claims(inbox_path, host_id) / doc_id


def claimed_path(inbox_path: Path, host_id: str, doc_id: str, rel_path: Path) -> Path:
    """Where a document's original waits while it is processed."""
    return claim_dir(inbox_path, host_id, doc_id) / safe_component(rel_path.name)


# Hidden, like every name chandrad keeps beside a file: the watcher never takes a dot-name in, so no
# original dropped as "claim.json" can land on it.
CLAIM_RECORD = ".claim.json"


def is_original(name: str) -> bool:
    """Whether a name in a claim folder is the claimed original: the record and the temporary files
    chandrad writes beside it are all dot-names, which the watcher never takes in."""
    return not name.startswith(".")


def claim_record(claim_folder: Path) -> Path:
    """What the claimed file is (its path in the inbox, its hash): what a takeover needs."""
    return claim_folder / CLAIM_RECORD


def heartbeat_path(inbox_path: Path, host_id: str) -> Path:
    return host_claims(inbox_path, host_id) / "heartbeat"


TAKEN_SUFFIX = ".taken"


def taken_marker(inbox_path: Path, host_id: str, doc_id: str) -> Path:
    """Left in ``host_id``'s claims by the host that took ``doc_id`` over from it."""
    return host_claims(inbox_path, host_id) / f"{doc_id}{TAKEN_SUFFIX}"


def seen_root(inbox_path: Path) -> Path:
    return inbox_path / DAEMON_DIR / "seen"


def seen_marker(inbox_path: Path, sha256: str) -> Path:
    """Names the document (and host) that first took in this content: ``seen/ab/cd/<sha256>``."""
    return seen_root(inbox_path) / sha256[:2] / sha256[2:4] / sha256


def flat_seen_marker(inbox_path: Path, sha256: str) -> Path:
    """Where an older chandrad kept the marker, ``seen/<sha256>``: read, never written."""
    return seen_root(inbox_path) / sha256


def staging_root(outbox: Path) -> Path:
    return outbox / DAEMON_DIR / "staging"


def host_staging(outbox: Path, host_id: str) -> Path:
    return staging_root(outbox) / host_id


def staging_dir(outbox: Path, host_id: str, doc_id: str) -> Path:
    """The folder renamed into the outbox when the document is published (its parent is the doc's)."""
    return host_staging(outbox, host_id) / doc_id / "doc"


def work_root(state_dir: Path) -> Path:
    return state_dir / "work"


def work_dir(state_dir: Path, doc_id: str) -> Path:
    return work_root(state_dir) / doc_id


def inbox_reachable(inbox_path: Path) -> bool:
    """Whether the inbox's own ``.chandrad`` folder is there: an unmounted share leaves an empty
    mount point and a removed inbox nothing, and then a missing claimed original is not lost."""
    return (inbox_path / DAEMON_DIR).is_dir()


async def in_thread(threads: Executor, fn: Callable[..., T], *args: Any) -> T:
    """``asyncio.to_thread`` on a pool of the caller's: ``fn`` sees the caller's context variables
    (structlog's bound ``doc_id``) as it would there."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(threads, call)


# A share that stops answering (a hard NFS mount, a dead SMB server) can block a stat for minutes.
PROBE_TIMEOUT_SECONDS = 20.0


class ShareProbes:
    """Filesystem checks on inboxes that may be remote, each in a thread of its inbox's (``threads_for``)
    and within a deadline, with at most one left stuck per inbox.

    A check that does not answer in time raises ``InboxUnreachableError`` (the document waits); its
    thread cannot be cancelled and finishes on its own, but the event loop goes on meanwhile. Until it
    has finished, further checks of that inbox fail at once: each would tie up one more thread until
    the share answers (minutes, or never, on a hard NFS mount), and the heartbeats and document checks
    of one dead share, a few a minute, emptied its pool.
    """

    def __init__(self, threads_for: Callable[[Path], Executor]) -> None:
        self._threads_for = threads_for
        self._stuck: dict[Path, tuple[asyncio.Future[Any], float]] = {}

    async def run(self, inbox_path: Path, check: Callable[[], T]) -> T:
        stuck = self._stuck.get(inbox_path)
        if stuck is not None:
            call, since = stuck
            if not call.done():
                raise InboxUnreachableError(
                    f"the inbox {inbox_path} has not answered a check for {time.monotonic() - since:.0f} s (a hung "
                    f"network share?); waiting for it",
                    stage="resume",
                )
            del self._stuck[inbox_path]
        call = asyncio.ensure_future(in_thread(self._threads_for(inbox_path), check))
        try:
            # Shielded: the call stays pending while its thread is stuck, which is what says so.
            async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
                return await asyncio.shield(call)
        except TimeoutError:
            call.add_done_callback(_retrieve)  # its eventual error has nobody to go to
            self._stuck[inbox_path] = (call, time.monotonic() - PROBE_TIMEOUT_SECONDS)
            raise InboxUnreachableError(
                f"the inbox {inbox_path} did not answer within {PROBE_TIMEOUT_SECONDS:.0f} s (a hung network "
                f"share?); waiting for it",
                stage="resume",
            ) from None


def _retrieve(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()
