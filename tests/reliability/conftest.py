"""Fixtures of the reliability suite; the helpers live in ``chaoslib`` (one module object, so the
figures recorded by tests and printed here are the same list)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reliability.chaoslib import FIGURES, ChaosDaemon


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for row in FIGURES:
        terminalreporter.write_line(json.dumps(row, default=str))
    out = os.environ.get("CHANDRAD_RELIABILITY_FIGURES")
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            for row in FIGURES:
                handle.write(json.dumps(row, default=str) + "\n")


@pytest.fixture
def chaos_factory(tmp_path: Path) -> Iterator[Callable[..., ChaosDaemon]]:
    made: list[ChaosDaemon] = []

    def make(root: Path | None = None, **kwargs: object) -> ChaosDaemon:
        daemon = ChaosDaemon(root or tmp_path, **kwargs)  # type: ignore[arg-type]
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.sampler.stop()
        if daemon.alive:
            daemon.kill9()


