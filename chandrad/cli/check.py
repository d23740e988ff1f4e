"""`chandrad check`: configuration, folders, rules, tools, the PDF renderer, GPU, engine and model,
each reported [ok]/[FAIL]/[warn]; exit 1 if something would stop chandrad."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import click

from chandrad.cli.common import EXIT_FAILED, config_option, hf_home_option, load
from chandrad.config import Settings, prepare_folders
from chandrad.engine import create_engine, cuda_gpu_visible
from chandrad.errors import ConfigError, DocumentError
from chandrad.scan import leptonica


@click.command()
@config_option
@hf_home_option
def check(config_path: Path | None, hf_home: Path | None) -> None:
    """Check the configuration, folders, tools and model; exit 1 if something would stop chandrad."""
    settings = load(config_path)
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
    report(
        True,
        "leptonica",
        "loaded (orientation's quick check)" if leptonica.available() else "not found (tesseract judges every page)",
    )
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


def _check_pdf_renderer(settings: Settings) -> tuple[bool, str, str]:
    """Render a blank US-Letter page as the daemon renders every PDF page (PDFium in a kept child,
    ``--serve``, under the tools' timeout and memory cap): whether the renderer works, not only exists."""
    import pikepdf

    from chandrad import prepare
    from chandrad.tools import ToolWorkers

    command = " ".join(prepare.renderer_command())
    with tempfile.TemporaryDirectory(prefix="chandrad-check-") as folder:
        blank = Path(folder) / "blank.pdf"
        with pikepdf.new() as pdf:
            pdf.add_blank_page(page_size=(612, 792))
            pdf.save(blank)
        renderers = ToolWorkers(keep=1)
        try:
            page = prepare.render_pdf_page(blank, 1, settings.prepare, workers=renderers)
        except DocumentError as error:
            return False, "pdf renderer", f"{command}: {error.reason}"
        finally:
            renderers.close()
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
