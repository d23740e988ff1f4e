"""systemd's service notification protocol (sd_notify), spoken directly.

A datagram of ``KEY=value`` lines to the AF_UNIX socket named by ``NOTIFY_SOCKET``: READY=1,
STATUS=..., WATCHDOG=1, RELOADING=1, STOPPING=1, EXTEND_TIMEOUT_USEC=... (see sd_notify(3)).
Twenty lines of socket code are clearer than a dependency: the PyPI clients are unmaintained
(sdnotify, 2017) or need libsystemd headers to build (systemd-python). Outside systemd every
call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import structlog

log = structlog.get_logger("chandrad.service.notify")


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        # systemd wants a ping at least every WATCHDOG_USEC; half of it leaves room for a slow tick.
        self.watchdog_interval = watchdog_usec / 2 / 1e6 if watchdog_usec else None
        self._socket: socket.socket | None = None
        if address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """Read systemd's variables (the protocol's edge, so the one place chandrad reads them)."""
        watchdog_usec = None
        if environ.get("WATCHDOG_USEC") and environ.get("WATCHDOG_PID", str(os.getpid())) == str(os.getpid()):
            watchdog_usec = int(environ["WATCHDOG_USEC"])
        return cls(environ.get("NOTIFY_SOCKET") or None, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, *lines: str) -> None:
        if self._socket is None or self.address is None:
            return
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._socket.sendto("\n".join(lines).encode(), address)
        except OSError as error:  # systemd gone or socket full: never take the daemon down for it
            log.debug("sd_notify failed", error=str(error))

    def ready(self, status: str | None = None) -> None:
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd (>= 253) tell this reload from an earlier one.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping: finishing documents in flight")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
