"""`chandrad retry`: a failed document back into processing."""

from __future__ import annotations

from pathlib import Path

import click

from chandrad.cli.common import config_option, load, open_journal, refuse
from chandrad.config import InboxSettings
from chandrad.output.failures import REPORT_SUFFIX, FailureEntry
from chandrad.runtime import now_iso
from chandrad.storage import folders
from chandrad.storage.durable import move_durably
from chandrad.storage.journal import Document, Journal


@click.command()
@click.argument("target")
@config_option
def retry(target: str, config_path: Path | None) -> None:
    """Put the failed document TARGET (its doc id, its original in failed/, or its name in the inbox)
    back into processing: the original goes back from failed/ to the inbox's claim folder, the
    document is queued with its attempts counted anew, and its errors stay in its history. Works
    while the daemon runs (it takes the document within seconds); otherwise at its next start."""
    settings = load(config_path)
    journal = open_journal(settings)
    try:
        doc = _failed_document(journal, target)
        inbox = next((inbox for inbox in settings.inbox if inbox.name == doc.inbox), None)
        if inbox is None:
            refuse(f"{doc.rel_path}: its inbox {doc.inbox!r} is no longer configured")
        claimed = _put_back(journal, doc, inbox, settings.host_id)
    finally:
        journal.close()
    click.echo(f"{doc.inbox}/{doc.rel_path} ({doc.id}): queued again (original back in {claimed.parent})")


def _failed_document(journal: Journal, target: str) -> Document:
    """The failed document ``target`` names: a doc id, the path of its original in failed/, or its
    path relative to its inbox."""
    try:
        doc = journal.get(target)
    except KeyError:
        path = Path(target)
        candidates = dict.fromkeys([target, str(path.absolute()), str(path.resolve())])
        for candidate in candidates:
            found = journal.find_failed(candidate)
            if found is not None:
                return found
        refuse(f"no failed document is {target!r} (a doc id, the file in failed/, or its name in the inbox)")
    if doc.state != "failed":
        refuse(f"{doc.rel_path} ({doc.id}) is {doc.state}, not failed: nothing to retry")
    return doc


def _put_back(journal: Journal, doc: Document, inbox: InboxSettings, host_id: str) -> Path:
    """Move the original from failed/ back to its claim folder, then queue the document. Each
    step is idempotent: a crash between them leaves the original in the claim folder and the
    document failed, and running ``chandrad retry`` again finishes it."""
    if doc.claimed_path is None:
        refuse(f"{doc.rel_path} was never taken in (it was left in the inbox): fix the reason and drop it again")
    claimed = folders.claimed_path(inbox.path, host_id, doc.id, Path(doc.rel_path))
    original = Path(doc.final_path) if doc.final_path else None
    if original is not None and (original.exists() or original.is_symlink()):
        from chandrad.hosts import claims

        claims.write_claim_record(claimed.parent, claims.claim_record_of(doc, host_id))  # for a takeover
        move_durably(original, claimed)
    elif not claimed.exists():
        refuse(f"{doc.rel_path}: its original is no longer in failed/ ({original}); drop the file into the inbox again")
    entry = FailureEntry(
        "put back into processing by `chandrad retry`",
        "retry",
        "retry",
        doc.attempts,
        now_iso(),
        put_back_from=str(original) if original is not None else None,
    ).as_json()
    try:
        journal.requeue_failed(doc.id, str(claimed), entry)
    except ValueError as error:
        refuse(str(error))
    if original is not None:  # the reason is in the document's history now; failed/ no longer holds it
        original.with_name(original.name + REPORT_SUFFIX).unlink(missing_ok=True)
    return claimed
