"""Fixtures of the reliability suite; the helpers live in ``chaoslib``. Its figures are printed
at the end of the session by tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reliability.chaoslib import ChaosDaemon


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


