"""An original's last move once its document is published: into the archive, deleted, or put back
where it was (``on_success``), the one place that decides it (``stages.finish``, and a batch
scan's stack once its parts are final, ``split``)."""

from __future__ import annotations

from pathlib import Path

from chandrad.config import InboxSettings
from chandrad.hosts import claims
from chandrad.runtime import Runtime
from chandrad.storage.durable import move_durably
from chandrad.storage.journal import Document


async def settle_original(runtime: Runtime, doc: Document, inbox: InboxSettings) -> None:
    """Archive, delete or keep ``doc``'s claimed original; a part of a batch scan's is deleted (its
    stack's original is the one archived). Idempotent: a crash after the move finds nothing to move."""
    if not runtime.move_originals or doc.claimed_path is None:
        return
    claimed = Path(doc.claimed_path)
    if inbox.on_success == "delete" or doc.parent_id is not None:
        await runtime.on_inbox(inbox.path, lambda: claimed.unlink(missing_ok=True))
        return
    folder = inbox.archive if inbox.on_success == "archive" else inbox.path
    assert folder is not None
    if await runtime.on_inbox(inbox.path, claimed.exists):  # else moved before a crash: nothing left to do
        # A final_path in failed/ (named by a failure whose move never happened, failed/
        # unwritable, before this retry published the document) gives way to one here.
        # Named in the state the document is in (publishing; a batch scan's stack: split, so that
        # a crash before the move resumes it as a stack, not as a document to prepare again).
        # Named in the claim record too: a host that takes the document over after the
        # reservation moves it onto it, instead of beside an empty placeholder.
        async def note(target: Path) -> None:
            await runtime.on_inbox(inbox.path, claims.note_final_path, claimed, target)

        target = await runtime.reserve_final_path(doc, folder, doc.state, note)
        await runtime.on_inbox(inbox.path, move_durably, claimed, target)
