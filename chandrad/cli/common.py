"""What every command shares: the exit codes, the --config and --hf-home options, loading the
settings, opening the journal beside a running daemon, refusing with a message."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NoReturn

import click

from chandrad.config import Settings, load_settings
from chandrad.errors import ConfigError
from chandrad.storage.journal import Journal

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_STARTUP = 3

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="TOML config file (default: $CHANDRAD_CONFIG, then /etc/chandrad/config.toml, then embedded defaults).",
)

hf_home_option = click.option(
    "--hf-home",
    type=click.Path(path_type=Path),
    default=None,
    help="Hugging Face home holding the model (default: $HF_HOME; for root, the service's "
    "/var/cache/chandrad/huggingface; else ~/.cache/huggingface).",
)


def load(config_path: Path | None, **overrides: object) -> Settings:
    """The settings, or exit 2 with the configuration's error in one line."""
    try:
        return load_settings(config_path, **overrides)
    except ConfigError as error:
        click.echo(f"chandrad: {error}", err=True)
        sys.exit(EXIT_CONFIG)


def open_journal(settings: Settings) -> Journal:
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


def refuse(message: str) -> NoReturn:
    click.echo(f"chandrad: {message}", err=True)
    sys.exit(EXIT_FAILED)


def local_time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
