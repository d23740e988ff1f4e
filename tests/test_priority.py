"""The children that read documents run at a lower CPU priority than the daemon (``priority.py``):
when renders and tesseract fill every core, intake, the loop and an engine core still get theirs."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from chandrad.config import PrepareSettings
from chandrad.engine.tesseract import TesseractEngine
from chandrad.priority import CHILD_NICENESS
from chandrad.tools import run_tool

# A child that waits (up to 10 s) for its priority to be lowered from outside, then says what it is:
# the parent sets it right after the start, so the child's very first instant may still be at the
# parent's. With "parent" it looks at its parent's instead (a wrapper script that ran it).
REPORT_NICENESS = (
    "import os, sys, time\n"
    "base, deadline = int(sys.argv[1]), time.monotonic() + 10\n"
    "whose = os.getppid() if sys.argv[2:] == ['parent'] else 0\n"
    "while os.getpriority(os.PRIO_PROCESS, whose) == base and time.monotonic() < deadline:\n"
    "    time.sleep(0.01)\n"
    "print(os.getpriority(os.PRIO_PROCESS, whose))\n"
)


def expected_niceness() -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICENESS)


def test_a_tool_run_for_a_document_runs_below_the_daemons_cpu_priority() -> None:
    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this process already runs at the lowest priority: nothing can be lower")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    done = run_tool([sys.executable, "-c", REPORT_NICENESS, str(base)], PrepareSettings(), "inspect")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == expected_niceness()
    assert os.getpriority(os.PRIO_PROCESS, 0) == base, "the daemon's own priority is left as it was"


async def test_the_tesseract_engines_runs_are_below_the_daemons_cpu_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this process already runs at the lowest priority: nothing can be lower")
    real = shutil.which("tesseract")
    assert real is not None, "make test installs tesseract"
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = tmp_path / "niceness"
    probe = tmp_path / "report_niceness.py"
    probe.write_text(REPORT_NICENESS)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "tesseract"  # the real tesseract, once its priority is written down
    wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "{probe}" {base} parent > "{seen}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    engine = TesseractEngine()
    await engine.start()  # runs `tesseract --version`, then a blank page
    assert engine.model.startswith("tesseract 5"), engine.model
    assert int(seen.read_text()) == expected_niceness()
