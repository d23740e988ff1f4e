"""What tests and benchmarks need from chandrad that the daemon itself never calls.

As ``structlog.testing`` does for structlog: one public module, so that production modules carry
no code whose only callers are tests or benches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chandrad.config import PrepareSettings
from chandrad.engine.processes import cpu_ticks, process_argv
from chandrad.output.publish import stage_files
from chandrad.prepare import PageImage, PreparedDocument
from chandrad.storage.durable import rename_dir_durably

__all__ = [
    "EC_LOADED_LINE",
    "ec_loads_logging_config",
    "process_cmdline",
    "process_cpu_ticks",
    "publish_directory",
    "render_pages",
]

# encoder-split's hand-off, made countable: vLLM's example EC connector logs each encoder output the
# language engine loads only at debug level. A run started with VLLM_LOGGING_CONFIG_PATH pointing at
# ec_loads_logging_config() (as JSON) logs that one logger's lines too; each load is one EC_LOADED_LINE.
EC_LOADED_LINE = "Success load encoder cache for hash"


def ec_loads_logging_config() -> dict[str, Any]:
    """vLLM's logging at INFO on stdout, its EC connector's at DEBUG (tests and bench count loads)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s %(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}},
        "loggers": {
            "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
            "vllm.distributed.ec_transfer.ec_connector.example_connector": {"level": "DEBUG"},
        },
    }


def process_cmdline(pid: int) -> str:
    """A process's command line as one string ("" once it is gone)."""
    return " ".join(process_argv(pid))


def process_cpu_ticks(pid: int) -> int | None:
    """A process's user + system CPU time in clock ticks (None once it is gone)."""
    return cpu_ticks(pid)


def render_pages(
    prepared: PreparedDocument, settings: PrepareSettings, skip: set[int] | frozenset[int] = frozenset()
) -> Iterator[PageImage]:
    """Every page of a prepared document in order, as the daemon renders them one at a time."""
    for page_no in range(1, prepared.page_count + 1):
        if page_no not in skip:
            yield prepared.render(page_no, settings)


def publish_directory(staging_dir: Path, files: dict[str, bytes], target: Path) -> None:
    """Write ``files`` into ``staging_dir`` and rename it to ``target`` (which must not exist), as
    the daemon publishes a document."""
    stage_files(staging_dir, files)
    rename_dir_durably(staging_dir, target)


class ManualClock:
    """A wall clock (``time.time``'s stand-in) that a test moves by hand; it may step back, as NTP does.
    With ``tick``, every reading is that much later than the last (rows then order by time)."""

    def __init__(self, now: float = 1_700_000_000.0, tick: float = 0.0) -> None:
        self.now = now
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
