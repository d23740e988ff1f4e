"""Where chandrad keeps its own files, in one place: nothing else spells these paths.

In each inbox, ``.chandrad/claimed/<doc_id>/<name>`` holds an original from the moment it is
taken in until its last move (to archive/ or failed/): a scanner re-using the name cannot touch
it, and the watcher ignores ``.chandrad``. In each outbox, ``.chandrad/staging/<doc_id>/doc`` is
where a document's outputs are written before the one rename that publishes them (same
filesystem, so the rename is atomic). Under ``state_dir``, ``work/<doc_id>`` holds a document's
working copies (a repaired or flattened PDF).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from chandrad.errors import InboxUnreachableError
from chandrad.publish import safe_component

T = TypeVar("T")

DAEMON_DIR = ".chandrad"


def claimed_root(inbox_path: Path) -> Path:
    return inbox_path / DAEMON_DIR / "claimed"


def claimed_path(inbox_path: Path, doc_id: str, rel_path: Path) -> Path:
    """Where a document's original waits while it is processed."""
    return claimed_root(inbox_path) / doc_id / safe_component(rel_path.name)


def staging_root(outbox: Path) -> Path:
    return outbox / DAEMON_DIR / "staging"


def staging_dir(outbox: Path, doc_id: str) -> Path:
    """The folder renamed into the outbox when the document is published (its parent is the doc's)."""
    return staging_root(outbox) / doc_id / "doc"


def work_root(state_dir: Path) -> Path:
    return state_dir / "work"


def work_dir(state_dir: Path, doc_id: str) -> Path:
    return work_root(state_dir) / doc_id


def inbox_reachable(inbox_path: Path) -> bool:
    """Whether the inbox's own ``.chandrad`` folder is there: an unmounted share leaves an empty
    mount point and a removed inbox nothing, and then a missing claimed original is not lost."""
    return (inbox_path / DAEMON_DIR).is_dir()


# A share that stops answering (a hard NFS mount, a dead SMB server) can block a stat for minutes.
PROBE_TIMEOUT_SECONDS = 20.0


async def probe(inbox_path: Path, check: Callable[[], T]) -> T:
    """Run a filesystem check on a path that may be remote, in a thread, within a deadline.

    A check that does not answer in time raises ``InboxUnreachableError`` (the document waits); its
    thread cannot be cancelled and finishes on its own, but the event loop goes on meanwhile.
    """
    try:
        return await asyncio.wait_for(asyncio.to_thread(check), PROBE_TIMEOUT_SECONDS)
    except TimeoutError:
        raise InboxUnreachableError(
            f"the inbox {inbox_path} did not answer within {PROBE_TIMEOUT_SECONDS:.0f} s (a hung network share?); "
            f"waiting for it",
            stage="resume",
        ) from None
