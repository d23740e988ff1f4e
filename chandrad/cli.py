"""The command line: a thin layer over ``Daemon``, ``Pipeline`` and the journal.

Exit codes: 0 success; 1 some document failed (``once``) or a check failed; 2 usage or
configuration error; 3 the daemon could not start.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, get_args

import click
import structlog

from chandrad import __version__
from chandrad.config import InboxSettings, OutputFormat, Settings, load_settings, prepare_folders
from chandrad.document.once import convert_once
from chandrad.engine import create_engine, cuda_gpu_visible
from chandrad.errors import ConfigError, DocumentError
from chandrad.logs import configure_logging
from chandrad.output.failures import REPORT_SUFFIX, FailureEntry
from chandrad.runtime import now_iso
from chandrad.service.notify import Notifier
from chandrad.storage import folders
from chandrad.storage.durable import move_durably
from chandrad.storage.journal import Delivery, Document, Journal

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_STARTUP = 3

log = structlog.get_logger("chandrad.cli")

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="TOML config file (default: $CHANDRAD_CONFIG, then /etc/chandrad/config.toml, then embedded defaults).",
)


def _load(config_path: Path | None, **overrides: object) -> Settings:
    try:
        return load_settings(config_path, **overrides)
    except ConfigError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_CONFIG)


@click.group()
@click.version_option(__version__, prog_name="chandrad")
def main() -> None:
    """chandrad: drop PDFs and images into an inbox, get Markdown, HTML and JSON in the outbox."""


@main.command()
def version() -> None:
    """Print chandrad's version and the versions of the tools it drives."""
    click.echo(f"chandrad {__version__}")


@main.command()
@config_option
def run(config_path: Path | None) -> None:
    """Run the daemon: watch the inboxes until SIGTERM (drains, exits 0); SIGHUP reloads the config."""
    from chandrad.service.daemon import Daemon
    from chandrad.service.stopping import run_to_exit

    settings = _load(config_path)
    configure_logging(settings.log_format, settings.log_level, settings.journal_socket)
    try:
        # Not asyncio.run: its clean-up waits without end for tasks and threads that a share which
        # stopped answering holds; run_to_exit bounds that and ends the process regardless.
        code = run_to_exit(
            Daemon(settings, config_path, notifier=Notifier.from_environment(), backstop=True), process_exits=True
        )
    except ConfigError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_CONFIG)
    except Exception as error:  # startup failed: say so in one line; the log has the traceback
        log.exception("chandrad could not start")
        click.echo(f"chandrad: could not start: {error}", err=True)
        sys.exit(EXIT_STARTUP)
    sys.exit(code)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    "output_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder that receives one sub-folder per document.",
)
@click.option("--engine", "engine_kind", type=click.Choice(["auto", "vllm", "tesseract"]), default=None)
@click.option(
    "--formats",
    default=None,
    help="Outputs, comma-separated, of md, html, json, pdf (the searchable PDF); default: the first inbox's.",
)
@config_option
def once(
    files: tuple[Path, ...], output_dir: Path, engine_kind: str | None, formats: str | None, config_path: Path | None
) -> None:
    """Convert FILES once, without a daemon; originals are left where they are."""
    settings = _load(config_path)
    overrides: dict[str, object] = {}
    if formats is not None:
        chosen = tuple(part.strip() for part in formats.split(",") if part.strip())
        unknown = sorted(set(chosen) - set(get_args(OutputFormat)))
        if unknown or not chosen:
            click.echo(
                f"chandrad: --formats takes md, html, json and pdf, not {', '.join(unknown) or 'nothing'}", err=True
            )
            sys.exit(EXIT_CONFIG)
        overrides["formats"] = chosen
    configure_logging(settings.log_format, "warning" if settings.log_level == "info" else settings.log_level)
    if engine_kind:
        settings = settings.model_copy(update={"engine": settings.engine.model_copy(update={"kind": engine_kind})})
    try:
        failures = asyncio.run(
            convert_once(settings, files, output_dir, overrides, lambda file, out: click.echo(f"{file}: {out}"))
        )
    except ConfigError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_CONFIG)
    for name, reason in failures:
        click.echo(f"{name}: failed: {reason}", err=True)
    sys.exit(EXIT_FAILED if failures else 0)


def _open_journal(settings: Settings) -> Journal:
    """The daemon's journal, opened beside a running daemon (SQLite WAL: both may use it at once)."""
    journal_path = settings.state_dir / "journal.sqlite3"
    if not journal_path.exists():
        click.echo(f"no journal at {journal_path}: chandrad has not run with this state_dir yet", err=True)
        sys.exit(EXIT_FAILED)
    try:
        return Journal(journal_path)
    except ConfigError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_FAILED)


def _local(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


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
        "at": _local(doc.updated_at),
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
        "at": _local(delivery.updated_at),
    }


@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--failed", "only_failed", is_flag=True, help="List failed documents with their reasons (for `chandrad retry`)."
)
def status(config_path: Path | None, as_json: bool, only_failed: bool) -> None:
    """Summarise the journal: documents by state, what is in flight, recent failures, deliveries."""
    settings = _load(config_path)
    journal = _open_journal(settings)
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
                "at": _local(d.updated_at),
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
        click.echo(f"  failed {_local(doc.updated_at)}: {doc.rel_path} — {(doc.error or {}).get('reason', '')}")
    for host in hosts_seen:
        click.echo(f"  host {host['host']} on {host['inbox']}: heartbeat {host['age_s']} s ago (pid {host['pid']})")
    if delivery_counts:
        click.echo("deliveries: " + ", ".join(f"{state} {n}" for state, n in sorted(delivery_counts.items())))
    for delivery in given_up:
        click.echo(
            f"  failed {delivery.kind} {delivery.target} ({delivery.event}) {_local(delivery.updated_at)}: "
            f"{files.get(delivery.doc_id, delivery.doc_id)} — {delivery.last_error}"
        )
    for delivery in retrying:
        click.echo(
            f"  retrying {delivery.kind} {delivery.target} ({delivery.event}): {files.get(delivery.doc_id, '')} — "
            f"{delivery.last_error} (attempt {delivery.attempts}, next {_local(delivery.next_attempt_at)})"
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
            "created_at": _local(oldest.created_at),
            "updated_at": _local(oldest.updated_at),
        },
    }


def _journal_line(size: int, oldest: Document | None, days: float) -> str:
    kept = f"final documents kept {days:g} days" if days > 0 else "final documents kept forever"
    if oldest is None:
        return f"journal: {_megabytes(size)}, no documents; {kept}"
    return (
        f"journal: {_megabytes(size)}; oldest document first seen {_local(oldest.created_at)} ({oldest.state}, "
        f"last change {_local(oldest.updated_at)}); {kept}"
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


@main.command()
@click.argument("target")
@config_option
def retry(target: str, config_path: Path | None) -> None:
    """Put the failed document TARGET (its doc id, its original in failed/, or its name in the inbox)
    back into processing: the original goes back from failed/ to the inbox's claim folder, the
    document is queued with its attempts counted anew, and its errors stay in its history. Works
    while the daemon runs (it takes the document within seconds); otherwise at its next start."""
    settings = _load(config_path)
    journal = _open_journal(settings)
    try:
        doc = _failed_document(journal, target)
        inbox = next((inbox for inbox in settings.inbox if inbox.name == doc.inbox), None)
        if inbox is None:
            _refuse(f"{doc.rel_path}: its inbox {doc.inbox!r} is no longer configured")
        claimed = _put_back(journal, doc, inbox, settings.host_id)
    finally:
        journal.close()
    click.echo(f"{doc.inbox}/{doc.rel_path} ({doc.id}): queued again (original back in {claimed.parent})")


def _refuse(message: str) -> NoReturn:
    click.echo(f"chandrad: {message}", err=True)
    sys.exit(EXIT_FAILED)


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
        _refuse(f"no failed document is {target!r} (a doc id, the file in failed/, or its name in the inbox)")
    if doc.state != "failed":
        _refuse(f"{doc.rel_path} ({doc.id}) is {doc.state}, not failed: nothing to retry")
    return doc


def _put_back(journal: Journal, doc: Document, inbox: InboxSettings, host_id: str) -> Path:
    """Move the original from failed/ back to its claim folder, then queue the document. Each
    step is idempotent: a crash between them leaves the original in the claim folder and the
    document failed, and running ``chandrad retry`` again finishes it."""
    if doc.claimed_path is None:
        _refuse(f"{doc.rel_path} was never taken in (it was left in the inbox): fix the reason and drop it again")
    claimed = folders.claimed_path(inbox.path, host_id, doc.id, Path(doc.rel_path))
    original = Path(doc.final_path) if doc.final_path else None
    if original is not None and (original.exists() or original.is_symlink()):
        from chandrad.hosts import claims

        claims.write_claim_record(claimed.parent, claims.claim_record_of(doc, host_id))  # for a takeover
        move_durably(original, claimed)
    elif not claimed.exists():
        _refuse(
            f"{doc.rel_path}: its original is no longer in failed/ ({original}); drop the file into the inbox again"
        )
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
        _refuse(str(error))
    if original is not None:  # the reason is in the document's history now; failed/ no longer holds it
        original.with_name(original.name + REPORT_SUFFIX).unlink(missing_ok=True)
    return claimed


def _check_pdf_renderer(settings: Settings) -> tuple[bool, str, str]:
    """Render a blank US-Letter page as prepare renders every PDF page (PDFium in a child process,
    under the tools' timeout and memory cap): whether the renderer works, not only exists."""
    import pikepdf

    from chandrad import prepare

    command = " ".join(prepare.renderer_command())
    with tempfile.TemporaryDirectory(prefix="chandrad-check-") as folder:
        blank = Path(folder) / "blank.pdf"
        with pikepdf.new() as pdf:
            pdf.add_blank_page(page_size=(612, 792))
            pdf.save(blank)
        try:
            page = prepare.render_pdf_page(blank, 1, settings.prepare)
        except DocumentError as error:
            return False, "pdf renderer", f"{command}: {error.reason}"
    width, height = page.image.size
    return True, "pdf renderer", f"PDFium ({command}): a blank Letter page → {width}×{height} px at {page.dpi:.0f} dpi"


def _print_rules(settings: Settings, report: Callable[[bool, str, str], None]) -> None:
    """Each hook's program (found and executable?), each webhook, and which [[inbox.rule]] each
    existing sub-folder of an inbox gets (inboxes with rules only)."""
    for hook in settings.hook:
        program = shutil.which(hook.command[0])
        runnable = program is not None and os.access(program, os.X_OK)
        detail = f"{program}" if runnable else f"{hook.command[0]} is not an executable program"
        report(runnable, f"hook {hook.name}", f"{detail} ({', '.join(hook.events)})")
    for webhook in settings.webhook:
        report(True, f"webhook {webhook.name}", f"{', '.join(webhook.events)}{', signed' if webhook.secret else ''}")
    for inbox in settings.inbox:
        if not inbox.rule:
            continue
        click.echo(f"[ok] rules of inbox {inbox.name}: {len(inbox.rule)}")
        subfolders = _subfolders(inbox.path)
        for rel in ["", *subfolders[:RULE_FOLDERS_LISTED]]:
            found, by_name = inbox.folder_rules(rel)
            gets = f'rule {found[0]} "{found[1].match}"' if found else "the inbox's own settings"
            first = "".join(f'; files matching "{rule.match}": rule {number}' for number, rule in by_name)
            click.echo(f"    {rel + '/' if rel else '(top level)'} → {gets}{first}")
        if len(subfolders) > RULE_FOLDERS_LISTED:
            click.echo(f"    ... and {len(subfolders) - RULE_FOLDERS_LISTED} more folders")


RULE_FOLDERS_LISTED = 200


def _subfolders(root: Path) -> list[str]:
    """Sub-folders of an inbox, relative and sorted, without chandrad's own or hidden ones."""
    found: list[str] = []
    for folder, dirs, _files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if folder != str(root):
            found.append(Path(folder).relative_to(root).as_posix())
        if len(found) > RULE_FOLDERS_LISTED * 5:
            break
    return sorted(found)


hf_home_option = click.option(
    "--hf-home",
    type=click.Path(path_type=Path),
    default=None,
    help="Hugging Face home holding the model (default: $HF_HOME; for root, the service's "
    "/var/cache/chandrad/huggingface; else ~/.cache/huggingface).",
)


@main.command("fetch-model")
@click.argument("model", required=False)
@click.option("--revision", default=None, help="Branch, tag or commit of the model (default: main).")
@hf_home_option
@config_option
def fetch_model(model: str | None, revision: str | None, hf_home: Path | None, config_path: Path | None) -> None:
    """Download MODEL (default: engine.model) into the cache the service reads; run again to resume."""
    from chandrad.model import fetch
    from chandrad.model.cache import hub_cache_for_admin, is_hub_id, service_owner
    from chandrad.model.hub import ModelFilesError
    from chandrad.model.progress import FetchProgress

    settings = _load(config_path)
    configure_logging(settings.log_format, settings.log_level, settings.journal_socket)
    model = model or settings.engine.model
    if not is_hub_id(model):
        click.echo(f"{model} is a local folder: nothing to download")
        return
    hub_cache = hub_cache_for_admin(hf_home)
    progress = FetchProgress(bar=sys.stderr.isatty())
    try:
        folder = fetch.fetch_model(
            model, hub_cache, revision=revision, progress=progress, owner=service_owner(hub_cache)
        )
    except ModelFilesError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        click.echo("chandrad: interrupted; what arrived is kept: run the same command again to continue", err=True)
        sys.exit(130)
    click.echo(f"{model}: {folder}")


@main.command()
@config_option
@hf_home_option
def check(config_path: Path | None, hf_home: Path | None) -> None:
    """Check the configuration, folders, tools and model; exit 1 if something would stop chandrad."""
    settings = _load(config_path)
    problems = 0

    def report(ok: bool, what: str, detail: str = "") -> None:
        nonlocal problems
        problems += 0 if ok else 1
        click.echo(f"[{'ok' if ok else 'FAIL'}] {what}{': ' + detail if detail else ''}")

    try:
        prepare_folders(settings)
        report(True, "folders", ", ".join(str(inbox.path) for inbox in settings.inbox))
    except ConfigError as error:
        report(False, "folders", str(error))
    _print_rules(settings, report)
    for tool, args in (("gs", ["--version"]), ("pdfinfo", ["-v"]), ("tesseract", ["--version"])):
        path = shutil.which(tool)
        if path is None:
            report(tool == "tesseract" and settings.engine.kind == "vllm", tool, "not installed")
            continue
        output = subprocess.run([path, *args], capture_output=True, text=True, timeout=30)
        report(True, tool, (output.stdout + output.stderr).strip().splitlines()[0])
    report(*_check_pdf_renderer(settings))
    report(True, "GPU", "visible" if cuda_gpu_visible() else "none visible (engine auto → tesseract)")
    try:
        engine = create_engine(settings.engine, settings.state_dir)
        report(True, "engine", engine.name)
    except ConfigError as error:
        report(False, "engine", str(error))
    if settings.engine.kind != "tesseract" and not settings.engine.url:
        from chandrad.model.cache import hub_cache_for_admin
        from chandrad.model.gpus import visible_gpus
        from chandrad.model.report import check_model

        gpus = visible_gpus()
        hub_cache = hub_cache_for_admin(hf_home)
        will_use_gpu = settings.engine.kind == "vllm" or cuda_gpu_visible()
        for line in check_model(settings.engine, hub_cache, gpus, will_use_gpu=will_use_gpu):
            if line.level == "warn":
                click.echo(f"[warn] {line.what}: {line.detail}")
            else:
                report(line.level == "ok", line.what, line.detail)
    sys.exit(EXIT_FAILED if problems else 0)
