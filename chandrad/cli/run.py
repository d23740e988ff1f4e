"""`chandrad run`: the daemon, until SIGTERM; SIGHUP reloads the config."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import structlog

from chandrad.cli.common import EXIT_CONFIG, EXIT_STARTUP, config_option, load
from chandrad.errors import ConfigError
from chandrad.logs import configure_logging
from chandrad.service.notify import Notifier

log = structlog.get_logger("chandrad.cli")


@click.command()
@config_option
def run(config_path: Path | None) -> None:
    """Run the daemon: watch the inboxes until SIGTERM (drains, exits 0); SIGHUP reloads the config."""
    from chandrad.service.daemon import Daemon
    from chandrad.service.stopping import run_to_exit

    settings = load(config_path)
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
