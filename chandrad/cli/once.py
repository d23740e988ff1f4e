"""`chandrad once`: convert files without a daemon, through the library's own pipeline
(``document/once.py``); the originals stay where they are."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import get_args

import click

from chandrad.cli.common import EXIT_CONFIG, EXIT_FAILED, config_option, load
from chandrad.config import OutputFormat
from chandrad.document.once import convert_once
from chandrad.errors import ConfigError
from chandrad.logs import configure_logging


@click.command()
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
    settings = load(config_path)
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
