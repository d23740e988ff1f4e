"""The command line: a thin layer over ``Daemon``, ``Pipeline`` and the journal.

Exit codes: 0 success; 1 some document failed (``once``) or a check failed; 2 usage or
configuration error; 3 the daemon could not start.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import structlog

from chandrad import __version__
from chandrad.config import InboxSettings, Settings, load_settings, prepare_folders
from chandrad.engine import create_engine, cuda_gpu_visible
from chandrad.errors import ConfigError
from chandrad.journal import Journal
from chandrad.logs import configure_logging
from chandrad.notify import Notifier

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
    from chandrad.daemon import Daemon

    settings = _load(config_path)
    configure_logging(settings.log_format, settings.log_level, settings.journal_socket)
    try:
        code = asyncio.run(Daemon(settings, config_path, notifier=Notifier.from_environment()).serve())
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
@config_option
def once(files: tuple[Path, ...], output_dir: Path, engine_kind: str | None, config_path: Path | None) -> None:
    """Convert FILES once, without a daemon; originals are left where they are."""
    settings = _load(config_path)
    configure_logging(settings.log_format, "warning" if settings.log_level == "info" else settings.log_level)
    if engine_kind:
        settings = settings.model_copy(update={"engine": settings.engine.model_copy(update={"kind": engine_kind})})
    try:
        failures = asyncio.run(_convert_once(settings, files, output_dir))
    except ConfigError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_CONFIG)
    for name, reason in failures:
        click.echo(f"{name}: failed: {reason}", err=True)
    sys.exit(EXIT_FAILED if failures else 0)


async def _convert_once(settings: Settings, files: tuple[Path, ...], output_dir: Path) -> list[tuple[str, str]]:
    from chandrad.folders import staging_root
    from chandrad.pipeline import Pipeline

    template = settings.inbox[0] if settings.inbox else None
    failures: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="chandrad-once-") as scratch:
        scratch_path = Path(scratch)
        inbox = InboxSettings(
            path=scratch_path / "inbox",
            outbox=output_dir,
            failed=scratch_path / "failed",
            name="once",
            on_success="keep",
            duplicates="reprocess",
            **(
                {key: getattr(template, key) for key in ("prompt_type", "formats", "compress", "pdf_password")}
                if template
                else {}
            ),
        )
        once_settings = settings.model_copy(
            update={"state_dir": scratch_path / "state", "inbox": (inbox,), "retry_backoff_seconds": 0.0}
        )
        prepare_folders(once_settings)
        journal = Journal(once_settings.state_dir / "journal.sqlite3")
        engine = create_engine(once_settings.engine, once_settings.state_dir)
        await engine.start()
        pipeline = Pipeline(once_settings, journal, engine, move_originals=False)
        try:
            doc_ids = []
            for file in files:
                if not file.exists() and not file.is_symlink():
                    failures.append((str(file), "no such file"))
                    continue
                stat = file.lstat()
                doc = await journal.call(journal.add_document, "once", file.name, "", stat.st_size, stat.st_mtime_ns)
                await journal.call(journal.set_state, doc.id, "queued", claimed_path=str(file.absolute()))
                doc_ids.append((file, doc.id))

            async def convert(file: Path, doc_id: str) -> None:
                while (outcome := await pipeline.process(doc_id)).state == "queued":
                    pass  # transient failure: retried at once, up to max_attempts
                if outcome.state == "failed":
                    failures.append((str(file), outcome.reason))
                else:
                    click.echo(f"{file}: {outcome.output_dir}")

            sem = asyncio.Semaphore(settings.documents_in_flight(engine.name))

            async def bounded(file: Path, doc_id: str) -> None:
                async with sem:
                    await convert(file, doc_id)

            async with asyncio.TaskGroup() as group:
                for file, doc_id in doc_ids:
                    group.create_task(bounded(file, doc_id))
        finally:
            await engine.aclose()
            journal.close()
            # Leave the output folder holding only outputs: the staging folders are empty now.
            for leftover in (staging_root(output_dir), staging_root(output_dir).parent):
                try:
                    leftover.rmdir()
                except OSError:  # absent, or not empty (another chandrad's): leave it
                    pass
    return failures


@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(config_path: Path | None, as_json: bool) -> None:
    """Summarise the journal: documents by state, what is in flight, recent failures."""
    settings = _load(config_path)
    journal_path = settings.state_dir / "journal.sqlite3"
    if not journal_path.exists():
        click.echo(f"no journal at {journal_path}: chandrad has not run with this state_dir yet", err=True)
        sys.exit(EXIT_FAILED)
    journal = Journal(journal_path)
    try:
        counts = journal.counts()
        in_flight = journal.unfinished()
        failed = journal.recent(10, state="failed")
    finally:
        journal.close()
    report = {
        "counts": counts,
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
                "at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.updated_at)),
            }
            for d in failed
        ],
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo("documents: " + (", ".join(f"{state} {n}" for state, n in sorted(counts.items())) or "none yet"))
    for doc in in_flight:
        click.echo(f"  in flight: {doc.rel_path} ({doc.inbox}) — {doc.state}")
    for doc in failed:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc.updated_at))
        click.echo(f"  failed {at}: {doc.rel_path} — {(doc.error or {}).get('reason', '')}")


@main.command()
@config_option
def check(config_path: Path | None) -> None:
    """Check the configuration, folders and tools; exit 1 if something would stop chandrad."""
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
    for tool, args in (("gs", ["--version"]), ("pdftoppm", ["-v"]), ("pdfinfo", ["-v"]), ("tesseract", ["--version"])):
        path = shutil.which(tool)
        if path is None:
            report(tool == "tesseract" and settings.engine.kind == "vllm", tool, "not installed")
            continue
        output = subprocess.run([path, *args], capture_output=True, text=True, timeout=30)
        report(True, tool, (output.stdout + output.stderr).strip().splitlines()[0])
    report(True, "GPU", "visible" if cuda_gpu_visible() else "none visible (engine auto → tesseract)")
    try:
        engine = create_engine(settings.engine, settings.state_dir)
        report(True, "engine", engine.name)
    except ConfigError as error:
        report(False, "engine", str(error))
    sys.exit(EXIT_FAILED if problems else 0)
