"""kill -9 while a burst is being taken in (intake journals and claims files in batches, one
transaction for a batch's rows before any of its files is claimed, one to queue them after): every
file ends up either still in the inbox, unclaimed, or claimed with its journal row, never claimed
without one; after restarts each is taken in exactly once.

Intake is what is proven here, not OCR: once every file is queued the daemon is stopped, and what
the journal and the claim folders hold is checked against what was dropped.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections import Counter
from pathlib import Path

from tests.reliability.chaoslib import ChaosDaemon, chaos_env, record_figures, simple_pdf, wait_for

SEED = int(os.environ.get("CHANDRAD_RELIABILITY_SEED", "0")) or random.randrange(1, 1 << 30)
# Two documents at a time: the workers' OCR stays out of the way of what is measured.
CONFIG = "max_documents_in_flight = 2\n[prepare]\nworkers = 1"


def burst(count: int, tag: str) -> dict[str, bytes]:
    return {f"{tag}-{n:03d}.pdf": simple_pdf(1, label=f"{tag} {n} {SEED}") for n in range(count)}


def drop_at_once(daemon: ChaosDaemon, files: dict[str, bytes]) -> None:
    """Written beside the inbox, then renamed in one after the other: a burst, as a copy makes it."""
    beside = daemon.root / "incoming"
    beside.mkdir(exist_ok=True)
    daemon.inbox.mkdir(exist_ok=True)
    for name, data in files.items():
        (beside / name).write_bytes(data)
    for name in files:
        os.rename(beside / name, daemon.inbox / name)


def in_inbox(daemon: ChaosDaemon) -> set[str]:
    return {p.name for p in daemon.inbox.iterdir() if p.name != ".chandrad"}


def claimed_files(daemon: ChaosDaemon) -> dict[str, Path]:
    """doc id → the original in its claim folder (records and temporary files left out)."""
    found: dict[str, Path] = {}
    for host in (daemon.inbox / ".chandrad" / "claimed").glob("*"):
        for folder in host.iterdir() if host.is_dir() else ():
            for path in folder.iterdir() if folder.is_dir() else ():
                if not path.name.startswith(".") and path.suffix == ".pdf":
                    found[folder.name] = path
    return found


def assert_claimed_ones_are_journaled(daemon: ChaosDaemon, files: dict[str, bytes]) -> int:
    """At any moment, even right after a kill: each file is in the inbox or claimed, never both
    and never neither; a claimed one has its journal row, with its name. Returns how many are claimed."""
    rows = {row["id"]: row for row in daemon.journal_rows("SELECT id, rel_path, state FROM documents")}
    claimed = claimed_files(daemon)
    for doc_id, path in claimed.items():
        assert doc_id in rows, f"{path} is claimed, but the journal has no row for it"
        assert rows[doc_id]["rel_path"] == path.name
        assert path.read_bytes() == files[path.name], f"{path} holds another file's content"
    names_claimed = Counter(path.name for path in claimed.values())
    assert [n for n, times in names_claimed.items() if times > 1] == [], "a file claimed twice"
    waiting = in_inbox(daemon)
    assert waiting.isdisjoint(names_claimed)
    published = {row["rel_path"] for row in rows.values() if row["state"] == "published"}
    lost = set(files) - waiting - set(names_claimed) - published
    assert lost == set(), f"neither in the inbox, nor claimed, nor published: {sorted(lost)[:5]}"
    return len(claimed)


def all_taken_in(daemon: ChaosDaemon, files: dict[str, bytes]) -> bool:
    return not (in_inbox(daemon) & set(files)) and daemon.count_rows("state != 'settled'") >= len(files)


def assert_taken_in_once(daemon: ChaosDaemon, files: dict[str, bytes]) -> None:
    """After a clean stop: one journal row for each file, queued or further on and never failed,
    its original claimed (or published), and no claim folder the journal does not know."""
    rows = daemon.journal_rows("SELECT id, rel_path, state, sha256, claimed_path FROM documents")
    assert sorted(Counter(row["rel_path"] for row in rows).items()) == sorted((name, 1) for name in files)
    assert {row["state"] for row in rows} <= {"queued", "preparing", "inferring", "publishing", "published"}, (
        Counter(row["state"] for row in rows)
    )
    for row in rows:
        assert row["sha256"] == hashlib.sha256(files[row["rel_path"]]).hexdigest()
        if row["state"] != "published":
            assert row["claimed_path"] and Path(row["claimed_path"]).is_file(), dict(row)
    assert set(claimed_files(daemon)) <= {row["id"] for row in rows}
    assert in_inbox(daemon) & set(files) == set()


def test_kill_9_during_a_300_file_burst_takes_each_file_in_exactly_once(chaos_factory):
    rng = random.Random(SEED)
    daemon = chaos_factory(extra_config=CONFIG)
    files = burst(300, "burst")
    daemon.start()
    drop_at_once(daemon, files)
    claimed_at_kills = []
    for _ in range(3):
        # Past the 1 s settle time, while intake is at work: on 2 cores the 300 are claimed
        # about 1 s later (bench/results/intake-burst-1000-batched-cpu-20261205.json).
        time.sleep(rng.uniform(1.0, 1.8))
        daemon.kill9()
        claimed_at_kills.append(assert_claimed_ones_are_journaled(daemon, files))
        daemon.start()
    wait_for(lambda: all_taken_in(daemon, files), 240, "every file of the burst to be taken in")
    assert daemon.stop() == 0
    assert_taken_in_once(daemon, files)
    record_figures("kill -9 during a burst", seed=SEED, files=len(files), claimed_at_kills=claimed_at_kills)


def test_a_crash_between_a_batchs_claims_and_its_commit_leaves_no_claim_unjournaled(chaos_factory, tmp_path):
    daemon = chaos_factory(extra_config=CONFIG)
    files = burst(40, "batch")
    drop_at_once(daemon, files)  # there before the start: the first scan settles them together
    hits = tmp_path / "chaos.log"
    daemon.start(env={**chaos_env(hits), "CHAOS_KILL": "rename:/.chandrad/claimed/:after:10"}, wait=False)
    assert daemon.wait_dead(60) == -9, "the injected kill must fire"
    assert hits.read_text().strip(), "the kill after the 10th claim rename was not reached"
    claimed = assert_claimed_ones_are_journaled(daemon, files)
    assert 10 <= claimed < len(files)
    # Between the claims and the batch's queueing commit: claimed rows not queued yet.
    assert daemon.count_rows("state = 'settled'") >= claimed
    assert daemon.count_rows("state = 'queued'") == 0
    daemon.start(env={"CHAOS_KILL": ""})
    wait_for(lambda: all_taken_in(daemon, files), 120, "every file to be taken in after the crash")
    assert daemon.stop() == 0
    assert_taken_in_once(daemon, files)
