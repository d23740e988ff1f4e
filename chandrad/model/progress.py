"""The progress of one model download, told to a terminal bar, the log and a callback (systemd's STATUS)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

log = structlog.get_logger("chandrad.model.progress")


class FetchProgress:
    """The bytes of one model download, told to a terminal bar, the log and a callback.

    ``advance`` is called from the download threads; ``on_update`` runs (in one of them) at most
    every ``update_seconds`` while bytes arrive, so a stalled download stops calling it. The log
    gets a line at each tenth of the download and at least every ``log_seconds``.
    """

    def __init__(
        self,
        *,
        bar: bool = False,
        on_update: Callable[[FetchProgress], None] | None = None,
        update_seconds: float = 2.0,
        log_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bar = bar
        self.on_update = on_update
        self.update_seconds = update_seconds
        self.log_seconds = log_seconds
        self.clock = clock
        self.model = ""
        self.total = 0
        self.present = 0  # bytes already there when this run began
        self.done = 0  # present + received
        self.started_at = 0.0
        self.last_bytes_at = 0.0
        self.receiving = False
        self._last_update = 0.0
        self._last_log = 0.0
        self._last_tenth = 0
        self._lock = threading.Lock()
        self._bar: hf_tqdm | None = None

    def begin(self, model: str, total: int, present: int, folder: Path) -> None:
        now = self.clock()
        with self._lock:
            self.model, self.total, self.present, self.done = model, total, present, present
            self.started_at = self.last_bytes_at = self._last_update = self._last_log = now
            self._last_tenth = self._tenth()
            self.receiving = True
        log.info(
            "downloading model files",
            model=model,
            total_bytes=total,
            present_bytes=present,
            to=str(folder),
        )
        if self.bar:
            self._bar = hf_tqdm(  # type: ignore[no-untyped-call]  # tqdm ships no type hints
                total=total, initial=present, unit="B", unit_scale=True, unit_divisor=1000, desc=model, disable=False
            )
        self._notify()

    def advance(self, n: int) -> None:
        now = self.clock()
        with self._lock:
            self.done += n
            if n > 0:
                self.last_bytes_at = now
            update = now - self._last_update >= self.update_seconds
            if update:
                self._last_update = now
            tenth = self._tenth()
            log_now = tenth > self._last_tenth or now - self._last_log >= self.log_seconds
            if log_now:
                self._last_tenth, self._last_log = tenth, now
            if self._bar is not None:
                self._bar.update(n)
        if log_now:
            (log.debug if self.bar else log.info)(
                "model download progress",
                model=self.model,
                done_bytes=self.done,
                total_bytes=self.total,
                percent=round(self.percent, 1),
                mb_per_s=round(self.rate() / 1e6, 1),
                eta_seconds=self.eta_seconds(),
            )
        if update:
            self._notify()

    def finish(self) -> None:
        with self._lock:
            self.receiving = False
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        seconds = self.clock() - self.started_at
        log.info(
            "model files downloaded",
            model=self.model,
            received_bytes=self.done - self.present,
            seconds=round(seconds, 1),
            mb_per_s=round(self.rate() / 1e6, 1),
        )

    def abandon(self) -> None:
        with self._lock:
            self.receiving = False
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0

    def rate(self) -> float:
        """Bytes per second received by this run."""
        elapsed = self.clock() - self.started_at
        return (self.done - self.present) / elapsed if elapsed > 0 else 0.0

    def eta_seconds(self) -> int | None:
        rate = self.rate()
        return round((self.total - self.done) / rate) if rate > 0 else None

    def seconds_since_bytes(self) -> float:
        return self.clock() - self.last_bytes_at

    def line(self) -> str:
        """One line for systemd's STATUS: how far, how fast, how long still."""
        eta = self.eta_seconds()
        left = f", about {_duration(eta)} left" if eta is not None and self.done < self.total else ""
        return (
            f"downloading {self.model}: {format_gb(self.done)} of {format_gb(self.total)} ({self.percent:.0f} %), "
            f"{self.rate() / 1e6:.1f} MB/s{left}"
        )

    def _tenth(self) -> int:
        return int(10 * self.done / self.total) if self.total else 10

    def _notify(self) -> None:
        if self.on_update is not None:
            try:
                self.on_update(self)
            except Exception:  # a progress report must never break the download
                log.exception("the download progress callback failed")


def format_gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _duration(seconds: int) -> str:
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"
