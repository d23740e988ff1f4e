"""A settled name becomes a claimed journal row: the first step of a document's journey.

``Intake.take_in`` hashes the file, journals it (``settled``), moves it into this host's claims,
``.chandrad/claimed/<host_id>/<doc_id>/`` beside its ``.claim.json`` (an atomic rename, so a scanner
re-using the name cannot touch it, and of several hosts only one wins it), checks it is no copy, and
only then marks it ``queued``: a queued row is the workers' to take.
Files that can never be read (a link, a device) and copies of content already taken in (here, or by
another host: ``hosts.seen.mark_seen``) are journaled too, then failed with their reason: every name
that enters an inbox ends somewhere.
"""

from __future__ import annotations

import asyncio
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from chandrad import prepare
from chandrad.config import InboxSettings
from chandrad.errors import DocumentError, DuplicateError, PermanentError
from chandrad.hosts import claims, seen
from chandrad.inbox.watch import SettledFile
from chandrad.output import delivery
from chandrad.output.failures import FailureEntry, Failures
from chandrad.runtime import Runtime, now_iso, remove_claim_folder
from chandrad.storage import folders
from chandrad.storage.durable import move_durably
from chandrad.storage.journal import Document, NewFile

log = structlog.get_logger("chandrad.inbox.intake")

# Files taken in at once (the daemon's intake loops). Their file work runs on the runtime's inbox
# threads, not behind page renders (runtime.INBOX_THREADS says why).
CONCURRENT_INTAKES = 4


async def duplicate_of(runtime: Runtime, doc: Document, inbox: InboxSettings) -> DuplicateError | None:
    """Why ``doc`` is a copy of a document taken in before it, here or by another host, or None.
    Call it only once ``doc`` is claimed: its content's marker on the share is made here."""
    if inbox.effective(doc.rel_path).duplicates != "skip" or not doc.sha256:  # a rule may say otherwise
        return None
    journal = runtime.journal
    twin = await journal.call(journal.find_duplicate, doc.sha256, doc.id, True)
    if twin is not None:
        where = (
            f"published to {twin.output_dir}"
            if twin.output_dir and twin.state == "published"
            else ("still being processed")
        )
        return _duplicate(f"{twin.rel_path} (first seen {now_iso(twin.created_at)}, {where})")
    if not runtime.move_originals:
        return None
    for _ in range(3):
        marker = await runtime.probe(inbox.path, lambda: seen.mark_seen(inbox.path, doc.sha256, runtime.host_id, doc))
        if marker is None:
            return None
        known = await journal.call(journal.find, str(marker.get("doc_id")))
        if known is None or known.state != "failed":
            return _duplicate(
                f"{marker.get('rel_path')} (taken in by host {marker.get('host_id')} at {marker.get('at')})"
            )
        # A marker our own failed document left (a crash before its removal): no twin.
        await runtime.on_inbox(inbox.path, seen.forget_seen, inbox.path, doc.sha256, known.id)
    return None


def _duplicate(original: str) -> DuplicateError:
    return DuplicateError(
        f'it is identical to {original}; set duplicates = "reprocess" to process copies again', stage="dedupe"
    )


def _hash_unchanged(settled: SettledFile) -> str | None:
    """The file's sha256, or None when it changed while it was read (it must settle again)."""
    sha256 = prepare.hash_file(settled.path)
    st = settled.path.lstat()
    return sha256 if (st.st_size, st.st_mtime_ns) == (settled.size, settled.mtime_ns) else None


def _rehash_if_replaced(claimed: Path, settled: SettledFile) -> tuple[str, int, int] | None:
    """The claimed file's (sha256, size, mtime_ns) when it is not the file that was hashed: a new
    file put under the same name between our hash and our claim (another host's claim of the first
    one came in between, or the scanner replaced it). None when it is the same file. A new file
    may still be being written: it is hashed once it has held still for the inbox's settle time."""
    settle = settled.inbox.settle_seconds
    deadline = time.monotonic() + max(10 * settle, 30.0)
    st = claimed.lstat()
    if (st.st_size, st.st_mtime_ns) == (settled.size, settled.mtime_ns):
        return None
    while True:
        if not stat.S_ISREG(st.st_mode):
            raise PermanentError(
                "it was replaced by something that is not a regular file while it was taken in", stage="intake"
            )
        time.sleep(settle)  # as the watcher settles: unchanged for this long, then hashed
        sha256 = prepare.hash_file(claimed)
        after = claimed.lstat()
        if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
            return sha256, st.st_size, st.st_mtime_ns
        if time.monotonic() > deadline:
            raise PermanentError(
                "it kept changing after it was taken in; drop it again once it is written", stage="intake"
            )
        st = after


@dataclass
class _Arrival:
    """One settled file of a batch, as intake learns about it."""

    settled: SettledFile
    sha256: str = ""
    refusal: DocumentError | None = None


@dataclass(frozen=True)
class _OnDisk:
    """What a claim found once the file was in its claim folder: the file that was there in place
    of the one hashed (``replaced``: its sha256, size and mtime), or why that could not be told
    (``changed``)."""

    replaced: tuple[str, int, int] | None = None
    changed: DocumentError | OSError | None = None


def _claim_on_disk(claimed: Path, record: claims.ClaimRecord, settled: SettledFile, check: bool) -> _OnDisk:
    """The claim record, then the file beside it (blocking); then, when ``check``, whether the
    file claimed is the one hashed (``_rehash_if_replaced``), in the same thread hop: a burst's
    hops to the inbox threads cost the event loop's time, which bounds intake. The record first: a
    claim folder holding a file always says what it is (a takeover needs that), and a claim lost
    to another host leaves only the record, which the caller removes."""
    claims.write_claim_record(claimed.parent, record)
    move_durably(settled.path, claimed)
    if not check:
        return _OnDisk()
    try:
        return _OnDisk(replaced=_rehash_if_replaced(claimed, settled))
    except (DocumentError, OSError) as error:
        return _OnDisk(changed=error)


class Intake:
    def __init__(self, runtime: Runtime, failures: Failures) -> None:
        self.runtime = runtime
        self.failures = failures
        # Names being taken in right now. The daemon runs several intakes at once, and a name can
        # be queued twice (a rescan re-announces it while intake is slow): the second would hash
        # it, lose the race to claim it, and journal a phantom "vanished" document.
        self._taking_in: set[Path] = set()

    async def take_in(self, settled: SettledFile) -> Document | None:
        """Journal and claim a settled file. Returns the queued document, or None if nothing is to do."""
        taken = await self.take_in_batch([settled])
        return taken[0] if taken else None

    async def take_in_batch(self, batch: Sequence[SettledFile]) -> list[Document]:
        """Journal and claim settled files together: one transaction journals them all before any
        is claimed, one queues them all once each is claimed and checked (a burst of drops costs
        two commits, not three for each file). Returns the documents queued."""
        fresh: list[SettledFile] = []
        for settled in batch:
            if settled.path not in self._taking_in:  # else another intake has this very name in hand
                self._taking_in.add(settled.path)
                fresh.append(settled)
        try:
            return await self._take_in_batch(fresh) if fresh else []
        finally:
            self._taking_in.difference_update(settled.path for settled in fresh)

    async def _take_in_batch(self, batch: list[SettledFile]) -> list[Document]:
        journal = self.runtime.journal
        known = await journal.call(
            journal.find_same_files,
            [(s.inbox.name, str(s.rel_path), s.size, s.mtime_ns, str(s.path)) for s in batch],
        )
        # A kept original, or a file we could not move: already accounted for.
        looked_at = await asyncio.gather(*(self._look_at(s) for s, twin in zip(batch, known, strict=True) if not twin))
        arrivals = [arrival for arrival in looked_at if arrival is not None]
        if not arrivals:
            return []
        added = await journal.call(
            journal.add_documents,
            [
                NewFile(a.settled.inbox.name, str(a.settled.rel_path), a.sha256, a.settled.size, a.settled.mtime_ns)
                for a in arrivals
            ],
        )
        checked = await asyncio.gather(
            *(self._claim_and_check(doc, arrival) for doc, arrival in zip(added, arrivals, strict=True))
        )
        # Queued only now, all in one commit: the retry loop hands every due queued row to a
        # worker, and a worker taking a copy in the middle of its duplicate check failed it a
        # second time (two reports). A crash before this commit leaves claimed "settled" rows,
        # which recovery finishes (it finds each file in its claim folder).
        changes = [(doc.id, "queued", journaled) for doc, journaled in checked if journaled is not None]
        if not changes:
            return []
        queued = await journal.call(journal.set_states, changes)
        for doc in queued:
            log.info("document queued", doc=doc.id, inbox=doc.inbox, file=doc.rel_path, size=doc.size)
        return queued

    async def _look_at(self, settled: SettledFile) -> _Arrival | None:
        """What is known of ``settled`` before it is journaled: its hash, or why it is refused.
        None when there is nothing to take in (gone again, or changed while it was read)."""
        inbox = settled.inbox
        if settled.kind == "symlink":
            return _Arrival(
                settled, refusal=PermanentError("it is a symbolic link; chandrad never follows links", stage="intake")
            )
        if settled.kind == "special":
            return _Arrival(
                settled, refusal=PermanentError("it is not a regular file (a pipe, socket or device)", stage="intake")
            )
        try:
            unchanged = await self.runtime.on_inbox(inbox.path, _hash_unchanged, settled)
        except FileNotFoundError:
            return None  # gone again before we got to it: nothing entered
        except DocumentError as error:
            return _Arrival(settled, refusal=error)
        if unchanged is None:
            log.info(
                "file changed while it was read; waiting for it to settle again",
                inbox=inbox.name,
                file=str(settled.rel_path),
            )
            return None
        return _Arrival(settled, sha256=unchanged)

    async def _claim_and_check(self, doc: Document, arrival: _Arrival) -> tuple[Document, dict[str, Any] | None]:
        """Claim ``doc``'s file and check it is no copy. Returns the fields to journal with its
        ``queued`` state, or None when it is not to be queued (lost to another host, failed)."""
        journaled = await self._claim(doc, arrival.settled)
        if journaled is None:
            return doc, None
        claimed_doc = replace(doc, **journaled)
        refusal = arrival.refusal or await duplicate_of(self.runtime, claimed_doc, arrival.settled.inbox)
        if refusal is not None:
            journal = self.runtime.journal
            await self.failures.fail(await journal.call(journal.set_state, doc.id, "settled", **journaled), refusal)
            return doc, None
        return doc, journaled

    async def _claim(self, doc: Document, settled: SettledFile) -> dict[str, Any] | None:
        """Move the file into the claimed area. Returns what to journal of it (where it is, and
        its hash when it was replaced under our feet), or None when it was not claimed (gone, or
        failed: told and journaled here). The row stays ``settled`` until intake is done with it
        (recovery queues a ``settled`` row whose file is claimed)."""
        inbox, journal = settled.inbox, self.runtime.journal
        claimed = folders.claimed_path(inbox.path, self.runtime.host_id, doc.id, settled.rel_path)
        record = claims.claim_record_of(doc, self.runtime.host_id)
        check = bool(doc.sha256) and settled.kind == "regular"
        try:
            on_disk = await self.runtime.on_inbox(inbox.path, _claim_on_disk, claimed, record, settled, check)
        except FileNotFoundError:
            # Gone before it was taken in (another host's claim came first): no document.
            await self.runtime.on_inbox(inbox.path, remove_claim_folder, claimed.parent)
            await journal.call(journal.forget, doc.id)
            return None
        except OSError as error:
            await self.runtime.on_inbox(inbox.path, remove_claim_folder, claimed.parent)
            reason = (
                f"chandrad cannot move the file out of the inbox: {error.strerror}; give its user "
                f"write access to the folder and drop the file again (it was left where it is)"
            )
            log.error("cannot claim file", inbox=inbox.name, file=str(settled.rel_path), error=str(error))
            entry = FailureEntry(reason, "permanent", "intake", 1, now_iso(self.runtime.clock())).as_json()
            await self.failures.report_only(doc, inbox, entry)
            # Failed like any other document: its webhooks and hooks are told, in the same commit.
            deliveries = await delivery.planned(self.runtime, doc, self.runtime.inbox_of(doc), "failed", entry)
            await journal.call(journal.fail, doc.id, entry, deliveries)
            return None
        journaled: dict[str, Any] = {"claimed_path": str(claimed)}
        if check:
            if (changed := on_disk.changed) is not None:
                refusal = (
                    changed
                    if isinstance(changed, DocumentError)
                    else PermanentError(f"it changed while it was taken in ({changed})", stage="intake")
                )
                doc = await journal.call(journal.set_state, doc.id, "settled", **journaled)
                await self.failures.fail(doc, refusal)
                return None
            if (replaced := on_disk.replaced) is not None:
                # What is in our claim is what the document is: its hash decides duplicates.
                sha256, size, mtime_ns = replaced
                log.info("file replaced before its claim; hashed again", inbox=inbox.name, file=str(settled.rel_path))
                # The claim record first: after a crash in between, a host taking the claim over
                # reads the record, and only this host's own journal keeps the old hash.
                record = claims.claim_record_of(
                    replace(doc, sha256=sha256, size=size, mtime_ns=mtime_ns), self.runtime.host_id
                )
                await self.runtime.on_inbox(inbox.path, claims.write_claim_record, claimed.parent, record)
                journaled.update(sha256=sha256, size=size, mtime_ns=mtime_ns)
        return journaled
