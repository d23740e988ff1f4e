"""`chandrad fetch-model`: the model into the cache the service reads, resumable."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from chandrad.cli.common import EXIT_FAILED, config_option, hf_home_option, load
from chandrad.logs import configure_logging


@click.command("fetch-model")
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

    settings = load(config_path)
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
