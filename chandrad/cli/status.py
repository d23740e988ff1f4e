"""`chandrad status`: the journal summarised (documents by state, in flight, recent failures,
deliveries, hosts on shared inboxes) for people, or as JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from chandrad.cli.common import config_option, load, local_time, open_journal
from chandrad.config import Settings
from chandrad.storage import folders
from chandrad.storage.journal import Delivery, Document


def _failed_entry(doc: Document) -> dict[str, object]:
    error = doc.error or {}
    return {
        "doc": doc.id,
        "inbox": doc.inbox,
        "file": doc.rel_path,
        "reason": error.get("reason", ""),
        "kind": error.get("kind", ""),
        "stage": error.get("stage", ""),
        "attempts": doc.attempts,
        "original": doc.final_path,
        "at": local_time(doc.updated_at),
    }


def _delivery_entry(delivery: Delivery, files: dict[str, str]) -> dict[str, object]:
    return {
        "id": delivery.id,
        "kind": delivery.kind,
        "target": delivery.target,
        "event": delivery.event,
        "doc": delivery.doc_id,
        "file": files.get(delivery.doc_id, ""),
        "state": delivery.state,
        "attempts": delivery.attempts,
        "status": delivery.last_status,
        "error": delivery.last_error,
        "at": local_time(delivery.updated_at),
    }


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--failed", "only_failed", is_flag=True, help="List failed documents with their reasons (for `chandrad retry`)."
)
def status(config_path: Path | None, as_json: bool, only_failed: bool) -> None:
    """Summarise the journal: documents by state, what is in flight, recent failures, deliveries."""
    settings = load(config_path)
    journal = open_journal(settings)
    try:
        if only_failed:
            failed_docs = journal.recent(FAILED_LISTED, state="failed")
            _print_failed(failed_docs, as_json)
            return
        counts = journal.counts()
        journal_path, journal_size, oldest = journal.path, journal.size_bytes(), journal.oldest()
        in_flight = journal.unfinished()
        failed = journal.recent(10, state="failed")
        delivery_counts = journal.delivery_counts()
        given_up = journal.deliveries(state="failed", limit=10)
        retrying = [d for d in journal.deliveries(state="pending", limit=50) if d.attempts > 0][:10]
        files = {}
        for delivery in [*given_up, *retrying]:
            try:
                files[delivery.doc_id] = journal.get(delivery.doc_id).rel_path
            except KeyError:
                pass
    finally:
        journal.close()
    hosts_seen = _hosts_seen(settings)
    report = {
        "counts": counts,
        "journal": _journal_entry(journal_path, journal_size, oldest, settings.retention.days),
        "in_flight": [
            {
                "doc": d.id,
                "inbox": d.inbox,
                "file": d.rel_path,
                "state": d.state,
                "pages": d.page_count,
                "attempts": d.attempts,
            }
            for d in in_flight
        ],
        "recent_failures": [
            {
                "doc": d.id,
                "inbox": d.inbox,
                "file": d.rel_path,
                "reason": (d.error or {}).get("reason", ""),
                "at": local_time(d.updated_at),
            }
            for d in failed
        ],
        "deliveries": delivery_counts,
        "hosts": hosts_seen,
        "failed_deliveries": [_delivery_entry(d, files) for d in given_up],
        "retrying_deliveries": [_delivery_entry(d, files) for d in retrying],
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo("documents: " + (", ".join(f"{state} {n}" for state, n in sorted(counts.items())) or "none yet"))
    click.echo(_journal_line(journal_size, oldest, settings.retention.days))
    for doc in in_flight:
        click.echo(f"  in flight: {doc.rel_path} ({doc.inbox}) — {doc.state}")
    for doc in failed:
        click.echo(f"  failed {local_time(doc.updated_at)}: {doc.rel_path} — {(doc.error or {}).get('reason', '')}")
    for host in hosts_seen:
        click.echo(f"  host {host['host']} on {host['inbox']}: heartbeat {host['age_s']} s ago (pid {host['pid']})")
    if delivery_counts:
        click.echo("deliveries: " + ", ".join(f"{state} {n}" for state, n in sorted(delivery_counts.items())))
    for delivery in given_up:
        click.echo(
            f"  failed {delivery.kind} {delivery.target} ({delivery.event}) {local_time(delivery.updated_at)}: "
            f"{files.get(delivery.doc_id, delivery.doc_id)} — {delivery.last_error}"
        )
    for delivery in retrying:
        click.echo(
            f"  retrying {delivery.kind} {delivery.target} ({delivery.event}): {files.get(delivery.doc_id, '')} — "
            f"{delivery.last_error} (attempt {delivery.attempts}, next {local_time(delivery.next_attempt_at)})"
        )


FAILED_LISTED = 1000


def _journal_entry(path: Path, size: int, oldest: Document | None, days: float) -> dict[str, object]:
    """The journal's size on disk, its oldest document, and how long final ones are kept."""
    return {
        "path": str(path),
        "size_bytes": size,
        "retention_days": days,
        "oldest": None
        if oldest is None
        else {
            "doc": oldest.id,
            "inbox": oldest.inbox,
            "file": oldest.rel_path,
            "state": oldest.state,
            "created_at": local_time(oldest.created_at),
            "updated_at": local_time(oldest.updated_at),
        },
    }


def _journal_line(size: int, oldest: Document | None, days: float) -> str:
    kept = f"final documents kept {days:g} days" if days > 0 else "final documents kept forever"
    if oldest is None:
        return f"journal: {_megabytes(size)}, no documents; {kept}"
    return (
        f"journal: {_megabytes(size)}; oldest document first seen {local_time(oldest.created_at)} ({oldest.state}, "
        f"last change {local_time(oldest.updated_at)}); {kept}"
    )


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _hosts_seen(settings: Settings) -> list[dict[str, object]]:
    """Every host with a heartbeat on a configured inbox, and its age by this machine's clock
    (the daemon itself judges by how long a heartbeat stays unchanged; this is for people)."""
    from chandrad.hosts.identity import read_heartbeat

    seen: list[dict[str, object]] = []
    for inbox in settings.inbox:
        try:
            beats = sorted(folders.claimed_root(inbox.path).glob("*/heartbeat"))
        except OSError:
            continue
        for path in beats:
            beat = read_heartbeat(path) or {}
            try:
                age = round(time.time() - path.stat().st_mtime, 1)
            except OSError:
                continue
            seen.append({"inbox": inbox.name, "host": path.parent.name, "pid": beat.get("pid"), "age_s": age})
    return seen


def _print_failed(failed: list[Document], as_json: bool) -> None:
    entries = [_failed_entry(doc) for doc in failed]
    if as_json:
        click.echo(json.dumps({"failed": entries}, indent=2))
        return
    if not entries:
        click.echo("no failed documents")
        return
    for entry in entries:
        click.echo(
            f"{entry['at']}  {entry['doc']}  {entry['inbox']}/{entry['file']}  [{entry['kind']}, "
            f"{entry['attempts']} attempt(s)]\n    {entry['reason']}"
            + (f"\n    original: {entry['original']}" if entry["original"] else "")
        )
    click.echo("(`chandrad retry DOC_ID` puts one back into processing)")
