"""The outbox's filesystem fills up: documents wait (they are not failed for it), nothing
half-published is visible, and everything is published once space returns.

The outbox is a real, small tmpfs mounted for the test (``mount -t tmpfs -o size=...``; the test
is skipped where mounting is not allowed). ENOSPC then comes from the kernel, at whatever write
hits it: a page image, an output file in staging, the directory itself.
"""

from __future__ import annotations

import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.chaoslib import (
    ChaosDaemon,
    Expect,
    check_accounted,
    corpus_bytes,
    drop_bytes,
    published_dirs,
    record_figures,
    simple_pdf,
    text_png,
    wait_for,
)


def _mount_small(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir(parents=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); run as root with CAP_SYS_ADMIN")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def small_outbox(tmp_path: Path) -> Iterator[Path]:
    yield from _mount_small(tmp_path / "tree" / "outbox", "1m")


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    yield from _mount_small(tmp_path / "tree" / "state", "2m")


def fill(folder: Path) -> Path:
    """Fill the filesystem holding ``folder`` to the last byte; returns the filler file."""
    filler = folder / ".filler"
    with open(filler, "wb", buffering=0) as handle:  # unbuffered: ENOSPC must not resurface at close
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError as error:
                assert error.errno == errno.ENOSPC
    return filler



def publish_once_space_returns(daemon: ChaosDaemon, filler: Path, inputs: dict[str, Expect], scenario: str,
                               waited_full_s: int) -> None:
    """Free the space, then every document is published exactly once; record how long it took."""
    filler.unlink()
    freed_at = time.monotonic()
    wait_for(lambda: daemon.final_count() == len(inputs), 90, "every document to publish once space is back")
    resumed_after = time.monotonic() - freed_at
    assert daemon.stop() == 0
    figures = check_accounted(daemon, inputs)
    record_figures(scenario, inputs=len(inputs), **figures,
                   waited_full_s=waited_full_s, published_s_after_space_returned=round(resumed_after, 1))

def test_a_full_outbox_makes_documents_wait_and_they_publish_when_space_returns(chaos_factory, small_outbox):
    daemon: ChaosDaemon = chaos_factory(small_outbox.parent, extra_config="max_attempts = 3")
    daemon.start()
    filler = fill(daemon.outbox)
    inputs = {f"doc{n}.pdf": Expect(simple_pdf(2, label=f"disk full {n}"), pages=2) for n in range(3)}
    inputs["note.png"] = Expect(text_png("disk full png"), pages=1)
    for name, expect in inputs.items():
        drop_bytes(daemon.inbox, name, expect.data)
    # Long enough for max_attempts (3) retries at the test's 1 s backoff to have run out.
    wait_for(lambda: "disk is full" in daemon.log_path.read_text(), 30, "the disk-full condition to be met")
    time.sleep(10)
    states = daemon.states()
    assert set(states.values()) <= {"queued", "preparing", "inferring", "publishing"}, states
    assert list(daemon.failed.iterdir()) == [], "a full disk is not the documents' fault: none is failed"
    assert published_dirs(daemon.outbox) == [], "nothing half-published is visible"
    waiting = daemon.journal_rows("SELECT error FROM documents WHERE error IS NOT NULL")
    assert waiting and all("disk" in row["error"] for row in waiting)

    publish_once_space_returns(daemon, filler, inputs, "outbox filesystem full (tmpfs 1 MiB)", waited_full_s=10)


def test_a_full_state_disk_stalls_the_journal_until_space_returns_and_nothing_is_lost(chaos_factory, small_state):
    """The journal (SQLite, WAL) cannot commit while a document is being inferred and another
    arrives: the daemon waits instead of crashing or failing documents, and carries on once space
    returns."""
    daemon: ChaosDaemon = chaos_factory(small_state.parent, extra_config="max_attempts = 3")
    inputs = {"long.pdf": Expect(corpus_bytes("multipage.pdf"), pages=6),
              "later.pdf": Expect(simple_pdf(1, label="state full"), pages=1)}
    daemon.start()
    drop_bytes(daemon.inbox, "long.pdf", inputs["long.pdf"].data)
    wait_for(lambda: daemon.count_rows("state = 'inferring'"), 60, "inference to start", interval=0.05)
    filler = fill(daemon.state)
    drop_bytes(daemon.inbox, "later.pdf", inputs["later.pdf"].data)
    time.sleep(8)
    assert daemon.alive, "a full state disk must not crash the daemon"
    assert list(daemon.failed.iterdir()) == []
    assert published_dirs(daemon.outbox) == []
    publish_once_space_returns(daemon, filler, inputs, "state (journal) filesystem full (tmpfs 2 MiB)",
                               waited_full_s=8)
