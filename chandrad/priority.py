"""The CPU priority of the children that read documents (renders, probes, Ghostscript, tesseract).

When they fill every core, the daemon's own threads (intake, the loop, the engine's input
processing) and an in-process vLLM's engine core must still get theirs at once: the children run
``CHILD_NICENESS`` below the daemon (relative to its own: a unit's ``Nice=`` moves both).
"""

from __future__ import annotations

import os

# On a 16-core host a burst of 1 000 drops was taken in at 92-122 files/s while the documents
# already taken in were rendered and read beside it, against 205-210 files/s while preparation
# still let only a few of them through at once (bench/NOTES-overhead.md).
CHILD_NICENESS = 10


def lower_priority(pid: int) -> None:
    """``pid`` (a child just started) to ``CHILD_NICENESS`` below this process. Set from outside
    right after the start (no preexec_fn: unsafe in a threaded daemon); a child gone already, or a
    system that refuses, costs nothing but the priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICENESS))
    except OSError:
        pass
