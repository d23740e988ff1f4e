"""Logging set-up: structlog events, to journald natively, as JSON lines, or pretty on a terminal.

Under systemd (stderr is the journal: ``JOURNAL_STREAM`` matches it) each event goes to journald
as one entry with its context as fields — ``DOC``, ``INBOX``, ``PAGE``, ``STAGE``, ... — so
``journalctl -u chandrad DOC=3f2a...`` or ``INBOX=scans`` filters. Elsewhere: JSON lines when
stderr is not a terminal, coloured text when it is.

This is chandrad's one piece of global state, confessed here: ``configure_logging`` sets it up
once per process and tests may call it again. Context (``doc``, ``page``, ``inbox``) is bound
with ``structlog.contextvars.bound_contextvars`` for the current asyncio task only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import structlog

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
_SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
_FIELD = re.compile(r"[^A-Z0-9_]")


def stderr_is_journal(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """systemd sets JOURNAL_STREAM=dev:inode of the stream it connected to stderr."""
    stream = environ.get("JOURNAL_STREAM", "")
    if ":" not in stream:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def journal_fields(event: Mapping[str, Any]) -> bytes:
    """One journald native-protocol datagram: MESSAGE, PRIORITY and every context key as a field."""
    fields: dict[str, str] = {
        "MESSAGE": str(event.get("event", "")),
        "PRIORITY": str(_SYSLOG_PRIORITY.get(str(event.get("level", "info")), 6)),
        "SYSLOG_IDENTIFIER": "chandrad",
    }
    for key, value in event.items():
        if key in ("event", "level", "timestamp"):
            continue
        name = _FIELD.sub("_", key.upper())
        if name and not name[0].isdigit() and not name.startswith("_"):
            fields[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    fields["CHANDRAD_JSON"] = json.dumps(event, default=str)
    payload = bytearray()
    for name, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:  # binary-safe form: name, newline, little-endian length, data
            payload += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            payload += name.encode() + b"=" + data + b"\n"
    return bytes(payload)


class JournaldLogger:
    """A structlog logger whose messages are journald datagrams; falls back to stderr if refused."""

    def __init__(self, address: Path) -> None:
        self._address = str(address)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def msg(self, payload: bytes) -> None:
        try:
            self._socket.sendto(payload, self._address)
        except OSError:
            sys.stderr.write(payload.decode("utf-8", "replace").replace("\n", " ") + "\n")

    debug = info = warning = warn = error = critical = exception = log = msg


def _journald_renderer(logger: Any, method: str, event: structlog.typing.EventDict) -> bytes:
    return journal_fields(event)


def configure_logging(
    log_format: Literal["auto", "json", "console", "journald"] = "auto",
    level: str = "info",
    journal_socket: Path = JOURNAL_SOCKET,
) -> None:
    if log_format == "auto":
        if stderr_is_journal() and journal_socket.exists():
            log_format = "journald"
        else:
            log_format = "console" if sys.stderr.isatty() else "json"
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    factory: Any
    if log_format == "journald":
        processors += [structlog.processors.format_exc_info, _journald_renderer]
        factory = lambda *args: JournaldLogger(journal_socket)  # noqa: E731
    elif log_format == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        # One write() per event, line and newline together: print() writes them apart, and vLLM's own
        # log lines on the same stream could land in between, corrupting two JSON lines.
        factory = structlog.WriteLoggerFactory(file=sys.stderr)
    else:
        processors += [structlog.processors.StackInfoRenderer(), structlog.dev.ConsoleRenderer()]
        factory = structlog.WriteLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
