"""Logging set-up: structlog events, JSON when not on a terminal (systemd, files), pretty on one.

This is chandrad's one piece of global state, confessed here: ``configure_logging`` sets it up
once per process and tests may call it again. Context such as ``doc``, ``page`` and ``inbox`` is
bound with ``structlog.contextvars.bound_contextvars`` for the current asyncio task only.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


def configure_logging(
    log_format: Literal["auto", "json", "console"] = "auto",
    level: str = "info",
) -> None:
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if use_json else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
