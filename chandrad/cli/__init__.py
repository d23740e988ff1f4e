"""The command line: a thin layer over ``Daemon``, ``Pipeline`` and the journal, a module per command.

Exit codes: 0 success; 1 some document failed (``once``) or a check failed; 2 usage or
configuration error; 3 the daemon could not start.
"""

from __future__ import annotations

import click

from chandrad import __version__
from chandrad.cli.check import check
from chandrad.cli.common import EXIT_CONFIG, EXIT_FAILED, EXIT_STARTUP, load
from chandrad.cli.fetch_model import fetch_model
from chandrad.cli.once import once
from chandrad.cli.retry import retry
from chandrad.cli.run import run
from chandrad.cli.status import status

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_STARTUP", "load", "main"]


@click.group()
@click.version_option(__version__, prog_name="chandrad")
def main() -> None:
    """chandrad: drop PDFs and images into an inbox, get Markdown, HTML and JSON in the outbox."""


@main.command()
def version() -> None:
    """Print chandrad's version and the versions of the tools it drives."""
    click.echo(f"chandrad {__version__}")


for command in (run, once, status, retry, fetch_model, check):
    main.add_command(command)
