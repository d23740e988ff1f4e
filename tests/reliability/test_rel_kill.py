"""kill -9 of the daemon at every stage of documents' lives; after restarts everything settles
exactly once: no loss, no duplicate, no half-written directory, no leftovers.

Two kinds of kill:
* from outside, at random moments and at moments picked by watching the journal (a document is
  settling, preparing, inferring or publishing), repeated over a multi-document batch;
* from inside, exactly at each filesystem step that matters (claim rename, publish rename, the
  fsyncs around it, the archive move, the failed/ report and move), using the ``CHAOS_KILL``
  hook of ``chaos/sitecustomize.py``: the daemon SIGKILLs itself at that call.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from tests.reliability.chaoslib import (
    ChaosDaemon,
    Expect,
    chaos_env,
    check_accounted,
    corpus_bytes,
    drop_bytes,
    record_figures,
    simple_pdf,
    text_png,
    wait_for,
)

SEED = int(os.environ.get("CHANDRAD_RELIABILITY_SEED", "0")) or random.randrange(1, 1 << 30)
CONFIG = "max_documents_in_flight = 2\nmax_attempts = 3\n[prepare]\nworkers = 2\nsubprocess_timeout_seconds = 60"


def batch(generation: int) -> dict[str, Expect]:
    """A mixed batch: scanned and generated PDFs, a TIFF, PNGs, one needing Ghostscript, failures, a duplicate."""
    tag = f"g{generation}"
    inputs = {
        f"{tag}-multipage.pdf": Expect(corpus_bytes("multipage.pdf"), pages=6),
        f"{tag}-cardinal.pdf": Expect(corpus_bytes("cardinal.pdf"), pages=4),
        f"{tag}-form.pdf": Expect(corpus_bytes("with-form.pdf"), pages=1),
        f"{tag}-frames.tiff": Expect(corpus_bytes("multi-page-images.tiff"), pages=3),
        f"{tag}-invalid.pdf": Expect(corpus_bytes("invalid.pdf"), reason="not a readable PDF"),
        f"{tag}-encrypted.pdf": Expect(corpus_bytes("encrypted.pdf"), reason="password"),
    }
    if generation > 0:  # corpus files again would be duplicates of generation 0: make them unique
        inputs = {name: Expect(e.data + f"\n% {tag}\n".encode(), e.pages, e.reason) for name, e in inputs.items()
                  if name.endswith(".pdf") and e.pages is not None}
    for n in range(4):
        inputs[f"{tag}-gen{n}.pdf"] = Expect(simple_pdf(1 + n, label=f"{tag} doc {n}"), pages=1 + n)
        inputs[f"{tag}-note{n}.png"] = Expect(text_png(f"{tag} note {n} {SEED}"), pages=1)
    return inputs


def kill_when(daemon: ChaosDaemon, state: str, timeout: float) -> bool:
    """kill -9 as soon as some document is in ``state`` (polled every 10 ms); False if none got there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and daemon.alive:
        if daemon.count_rows(f"state = '{state}'"):
            daemon.kill9()
            return True
        time.sleep(0.01)
    return False


def published_without_outputs(daemon: ChaosDaemon) -> list[str]:
    """Documents the journal calls published whose outputs (their JSON at least) are not in the outbox."""
    rows = daemon.journal_rows("SELECT rel_path, output_dir FROM documents WHERE state = 'published'")
    return [row["rel_path"] for row in rows
            if not row["output_dir"] or not list(Path(row["output_dir"]).glob("*.json"))]


def run_kill_loop(
    daemon: ChaosDaemon, kills: int, generations: int, rng: random.Random
) -> tuple[dict[str, Expect], list[str]]:
    inputs: dict[str, Expect] = {}
    points: list[str] = []
    daemon.start()
    daemon.sampler.start()
    per_generation = max(1, kills // generations)
    for number in range(kills):
        if number % per_generation == 0 and len(inputs) < generations * 100:
            generation = number // per_generation
            fresh = batch(generation)
            for name, expect in fresh.items():
                drop_bytes(daemon.inbox, name, expect.data)
            inputs.update(fresh)
            if generation == 0:  # a copy under another name: processed once, the other copy failed as duplicate
                drop_bytes(daemon.inbox, "g0-copy-of-gen0.pdf", inputs["g0-gen0.pdf"].data)
                inputs["g0-copy-of-gen0.pdf"] = Expect(inputs["g0-gen0.pdf"].data, either=True)
                inputs["g0-gen0.pdf"] = Expect(inputs["g0-gen0.pdf"].data, either=True)
            daemon.kill9()  # the new files are settling (settle_seconds = 1): the first kill hits them there
            points.append("settling")
        else:
            target = ("preparing", "inferring", "publishing", "random")[number % 4]
            if target == "random" or not kill_when(daemon, target, timeout=rng.uniform(2, 6)):
                time.sleep(rng.uniform(0.05, 2.5))
                daemon.kill9()
                target = "random"
            points.append(target)
        assert published_without_outputs(daemon) == [], f"after the kill at {points[-1]}"
        daemon.start()
    wait_for(lambda: daemon.final_count() >= len(inputs) - 1 and not daemon.count_rows(
        "state NOT IN ('published', 'failed')") and not daemon.leftovers(), 300, "everything to settle after the kills")
    # The inbox watcher may still be settling the last files: wait for each input to have a final row.
    wait_for(lambda: daemon.final_count() >= len(inputs), 120, "every input to be final")
    time.sleep(1.5)
    daemon.sampler.stop()
    assert daemon.stop() == 0
    return inputs, points


def _check_duplicate_pair(daemon: ChaosDaemon) -> None:
    states = daemon.states()
    pair = sorted([states.get("g0-gen0.pdf"), states.get("g0-copy-of-gen0.pdf")], key=str)
    assert pair == ["failed", "published"], f"exactly one copy of a duplicate is published: {pair}"


def test_kill_9_at_random_points_of_a_batch_loses_and_duplicates_nothing(chaos_factory):
    rng = random.Random(SEED)
    daemon = chaos_factory(extra_config=CONFIG)
    inputs, points = run_kill_loop(daemon, kills=5, generations=1, rng=rng)
    figures = check_accounted(daemon, inputs)
    _check_duplicate_pair(daemon)
    assert [p for p in daemon.inbox.iterdir() if p.name != ".chandrad"] == []
    record_figures("kill -9 loop (bounded)", seed=SEED, kills=daemon.kills, points=points, inputs=len(inputs),
                   **figures, max_rss_mb=daemon.sampler.max_rss_mb, max_fds=daemon.sampler.max_fds)


@pytest.mark.soak
def test_soak_kill_9_fifty_times_over_several_batches(chaos_factory):
    rng = random.Random(SEED)
    daemon = chaos_factory(extra_config=CONFIG)
    inputs, points = run_kill_loop(daemon, kills=50, generations=5, rng=rng)
    figures = check_accounted(daemon, inputs)
    _check_duplicate_pair(daemon)
    record_figures("kill -9 loop (soak)", seed=SEED, kills=daemon.kills, points=sorted(set(points)),
                   inputs=len(inputs), **figures, max_rss_mb=daemon.sampler.max_rss_mb,
                   max_fds=daemon.sampler.max_fds)


# -- kills at exact filesystem steps -----------------------------------------------------------

# (name, CHAOS_KILL spec, the input, what it must become). Substrings select the call's path.
STEPS = [
    ("journal row written, claim rename not done", "rename:/.chandrad/claimed/:before:1", "ok"),
    ("claimed, journal not yet 'queued'", "rename:/.chandrad/claimed/:after:1", "ok"),
    ("non-UTF-8 name: journal row written, claim not done", "rename:/.chandrad/claimed/:before:1", "latin"),
    ("staging written, publish rename not done", "rename:/.chandrad/staging/:before:1", "ok"),
    ("publish rename done, parent not fsynced", "rename:/.chandrad/staging/:after:1", "ok"),
    ("outbox parent fsynced, original not archived", "fsync:/outbox$:after:1", "ok"),
    ("original archived, journal not 'published'", "rename:/archive/:after:1", "ok"),
    ("journal 'published', staging not removed", "rmdir:/.chandrad/staging/:before:1", "ok"),
    ("journal 'published', claimed folder not removed", "rmdir:/.chandrad/claimed/:before:1", "ok"),
    ("error report written, original not moved", "replace:.error.json:after:1", "fail"),
    ("journal 'failed', work folder not removed", "rmdir:/state/work/:before:1", "fail"),
    ("original moved to failed/, journal not 'failed'", "rename:/failed/:after:1", "fail"),
    ("duplicate claimed, not yet checked", "rename:/.chandrad/claimed/:after:1", "dup"),
    ("duplicate's report written, not moved", "replace:.error.json:after:1", "dup"),
    ("duplicate moved to failed/, journal not 'failed'", "rename:/failed/:after:1", "dup"),
]


@pytest.mark.parametrize(("step", "spec", "kind"), STEPS, ids=[s[0] for s in STEPS])
def test_kill_9_exactly_at_a_filesystem_step_recovers_to_one_outcome(chaos_factory, tmp_path, step, spec, kind):
    daemon = chaos_factory(extra_config="max_documents_in_flight = 1")
    hits = tmp_path / "chaos.log"
    daemon.env.update(chaos_env(hits))
    inputs: dict[str, Expect] = {}
    if kind == "dup":
        first = simple_pdf(1, label="dup")
        daemon.start()
        drop_bytes(daemon.inbox, "first.pdf", first)
        wait_for(lambda: daemon.final_count() == 1, 60, "the first copy")
        daemon.stop()
        inputs["first.pdf"] = Expect(first, pages=1)
        inputs["second.pdf"] = Expect(first, reason="identical to first.pdf")
        drop_bytes(daemon.inbox, "second.pdf", first)
    elif kind == "fail":
        inputs["broken.pdf"] = Expect(corpus_bytes("invalid.pdf"), reason="not a readable PDF")
        drop_bytes(daemon.inbox, "broken.pdf", inputs["broken.pdf"].data)
    elif kind == "latin":  # a Latin-1 name (not UTF-8): the journal stores it escaped, recovery must find it
        inputs["latin"] = Expect(simple_pdf(1, label="latin"), either=True)
        drop_bytes(daemon.inbox, b"re\xe7u.pdf", inputs["latin"].data)
    else:
        inputs["doc.pdf"] = Expect(simple_pdf(2, label="step"), pages=2)
        drop_bytes(daemon.inbox, "doc.pdf", inputs["doc.pdf"].data)
    daemon.start(env={"CHAOS_KILL": spec}, wait=False)
    assert daemon.wait_dead(60) == -9, "the injected kill must fire"
    assert hits.exists() and hits.read_text().strip(), f"chaos point {spec} was not reached"
    daemon.start(env={"CHAOS_KILL": ""})
    wait_for(lambda: daemon.final_count() == len(inputs) and not daemon.leftovers(), 60, "recovery after the kill")
    assert daemon.stop() == 0
    check_accounted(daemon, inputs)
    if kind == "latin":
        assert daemon.states() == {"re\\xe7u.pdf": "published"}
    if kind in ("fail", "dup"):
        name = "broken.pdf" if kind == "fail" else "second.pdf"
        report = (daemon.failed / f"{name}.error.json").read_text()
        assert inputs[name].reason in report, f"the true reason survives the crash: {report}"


@pytest.mark.soak
def test_soak_kill_9_after_every_fsync_and_rename_of_a_document_life(chaos_factory, tmp_path):
    """Kill after the 1st, 2nd, ... fsync (then rename) the daemon makes for one document in a
    sub-folder, until a run completes without reaching the point: every prefix of the document's
    filesystem history must recover to exactly one outcome."""
    figures: dict[str, int] = {}
    for call in ("fsync", "rename", "mkdir"):
        nth = 0
        while True:
            nth += 1
            root = tmp_path / f"{call}-{nth}"
            daemon = chaos_factory(root, extra_config="max_documents_in_flight = 1")
            hits = root / "chaos.log"
            daemon.env.update(chaos_env(hits))
            inputs = {"sub/doc.pdf": Expect(simple_pdf(2, label=f"{call} {nth}"), pages=2)}
            drop_bytes(daemon.inbox, "sub/doc.pdf", inputs["sub/doc.pdf"].data)
            daemon.start(env={"CHAOS_KILL": f"{call}::after:{nth}"}, wait=False)
            wait_for(lambda daemon=daemon: not daemon.alive or daemon.final_count() == 1, 60, "the kill or the end")
            reached = not daemon.alive
            if daemon.alive:
                daemon.stop()
            else:
                daemon.start(env={"CHAOS_KILL": ""})
                wait_for(lambda daemon=daemon: daemon.final_count() == 1 and not daemon.leftovers(), 60, "recovery")
                assert daemon.stop() == 0
            check_accounted(daemon, inputs)
            if not reached:
                break
        figures[call] = nth - 1
    record_figures("kill -9 after every fsync/rename/mkdir (soak)", kills_per_call=figures, losses=0, duplicates=0)


def test_a_resumed_publish_never_adopts_another_documents_folder(chaos_factory, tmp_path):
    """Killed after the journal named ``outbox/doc/`` but before the rename; then the outbox is wiped
    (staging with it) and another ``doc/`` appears there. On restart the document must be redone
    and published beside it, not marked published with the other one's outputs."""
    daemon = chaos_factory(extra_config="max_documents_in_flight = 1")
    daemon.env.update(chaos_env(tmp_path / "chaos.log"))
    data = simple_pdf(2, label="adopt")
    drop_bytes(daemon.inbox, "doc.pdf", data)
    daemon.start(env={"CHAOS_KILL": "rename:/.chandrad/staging/:before:1"}, wait=False)
    assert daemon.wait_dead(60) == -9
    for child in daemon.outbox.iterdir():
        shutil.rmtree(child)
    foreign = daemon.outbox / "doc"
    foreign.mkdir()
    (foreign / "doc.json").write_text('{"doc_id": "someone-else"}')
    (foreign / "doc.md").write_text("not this document\n")
    daemon.start(env={"CHAOS_KILL": ""})
    wait_for(lambda: daemon.final_count() == 1, 60, "the document")
    assert daemon.stop() == 0
    row = daemon.journal_rows("SELECT output_dir, state FROM documents")[0]
    assert row["state"] == "published" and Path(row["output_dir"]).name == "doc (2)", dict(row)
    assert (foreign / "doc.md").read_text() == "not this document\n"
    assert json.loads((daemon.outbox / "doc (2)" / "doc.json").read_text())["num_pages"] == 2
