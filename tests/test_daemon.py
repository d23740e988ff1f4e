"""The running daemon, end to end: real watchdog, Ghostscript, poppler, tesseract and SQLite."""

from __future__ import annotations

import collections
import json
import os
import re
import time
from pathlib import Path

from tests.conftest import CORPUS, corpus_file, drop, wait_for


def word_overlap(truth: str, text: str) -> float:
    """Share of the truth's words (with multiplicity) that the text also contains."""
    expected = collections.Counter(re.findall(r"[a-z0-9]+", truth.lower()))
    got = collections.Counter(re.findall(r"[a-z0-9]+", text.lower()))
    return sum(min(count, got[word]) for word, count in expected.items()) / sum(expected.values())


def test_dropped_pdf_becomes_markdown_html_json_that_match_the_ground_truth(daemon_factory):
    daemon = daemon_factory().start()
    drop(corpus_file("linn.pdf"), daemon.inbox)
    out_dir = daemon.outbox / "linn"
    wait_for(lambda: (out_dir / "linn.json").exists(), 120, "linn's outputs")
    assert sorted(p.name for p in out_dir.iterdir()) == ["linn.html", "linn.json", "linn.md"]
    markdown = (out_dir / "linn.md").read_text()
    assert word_overlap(corpus_file("linn.txt").read_text(), markdown) >= 0.80
    document = json.loads((out_dir / "linn.json").read_text())
    assert document["num_pages"] == 1 and document["engine"] == "tesseract"
    assert document["pages"][0]["chunks"], "the JSON carries layout chunks with bboxes"
    wait_for(lambda: (daemon.archive / "linn.pdf").exists(), 30, "the original to be archived")
    assert not (daemon.inbox / "linn.pdf").exists()
    assert daemon.stop() == 0


# MANIFEST.md's expectations: file -> pages when published, or None when it must fail.
EXPECTED = {
    "linn.pdf": 1, "c02-22.pdf": 1, "skew.pdf": 1, "cardinal.pdf": 4, "multipage.pdf": 6, "ccitt.pdf": 1,
    "jbig2.pdf": 1, "lichtenstein.pdf": 1, "cmyk.pdf": 1, "francais.pdf": 1, "epson.pdf": 1, "kcs.pdf": 1,
    "blank.pdf": 1, "trivial.pdf": 1, "no_contents.pdf": 1, "enormous.pdf": 1, "hugemono.pdf": 1,
    "invalid.pdf": None, "junk-prefix.pdf": 2, "encrypted.pdf": None, "password-is-test.pdf": None,
    "signed.pdf": 1, "with-form.pdf": 1, "multi-page-digital.pdf": 3, "multi-page-images.tiff": 3,
    "typewriter.png": 1, "baiona.png": 1, "simple-no-dpi.png": 1, "mathfuncs.pdf": 1, "multi_column_miss.pdf": 1,
}
FAILURE_WORDS = {"invalid.pdf": "not a readable PDF", "encrypted.pdf": "password", "password-is-test.pdf": "password"}


def test_every_corpus_file_ends_in_outbox_or_failed_as_the_manifest_says(daemon_factory):
    corpus = sorted(p.name for p in CORPUS.iterdir() if p.suffix not in (".md", ".txt"))
    assert set(corpus) == set(EXPECTED), "MANIFEST changed: update EXPECTED"
    daemon = daemon_factory(extra_config="max_documents_in_flight = 2").start()
    for name in corpus:
        drop(CORPUS / name, daemon.inbox)
    wait_for(lambda: daemon.settled_all(len(corpus)) or not daemon.alive, 600, "every corpus file to finish")
    assert daemon.alive, "the daemon must survive the whole corpus"
    states = daemon.states()
    for name, pages in EXPECTED.items():
        stem = Path(name).stem
        if pages is None:
            assert states[name] == "failed", name
            report = json.loads((daemon.failed / f"{name}.error.json").read_text())
            assert FAILURE_WORDS[name] in report["reason"], report
            assert (daemon.failed / name).exists() and not (daemon.outbox / stem).exists()
        else:
            assert states[name] == "published", (name, states[name])
            document = json.loads((daemon.outbox / stem / f"{stem}.json").read_text())
            assert document["num_pages"] == pages, name
            assert (daemon.archive / name).exists() and not (daemon.failed / name).exists()
    assert [p for p in daemon.inbox.iterdir() if p.name != ".chandrad"] == [], "the inbox is empty when done"
    assert daemon.leftovers_once_cleared() == []
    assert daemon.stop() == 0


def test_a_file_written_slowly_in_chunks_is_processed_once_complete(daemon_factory):
    daemon = daemon_factory(inbox_config="settle_seconds = 2").start()
    data = corpus_file("multipage.pdf").read_bytes()
    target = daemon.inbox / "scan0001.pdf"
    chunk = len(data) // 8 + 1
    with open(target, "wb") as handle:  # a scanner: the final name from the first byte, written over ~6 s
        for offset in range(0, len(data), chunk):
            handle.write(data[offset:offset + chunk])
            handle.flush()
            time.sleep(0.75)
    wait_for(lambda: daemon.settled_all(1), 180, "the slowly written scan to finish")
    rows = daemon.journal_rows("SELECT * FROM documents")
    assert len(rows) == 1, "processed exactly once"
    assert rows[0]["state"] == "published" and rows[0]["size"] == len(data)
    document = json.loads((daemon.outbox / "scan0001" / "scan0001.json").read_text())
    assert document["num_pages"] == 6
    assert (daemon.archive / "scan0001.pdf").read_bytes() == data


def test_kill_9_mid_document_then_restart_publishes_exactly_once(daemon_factory):
    daemon = daemon_factory(extra_config="max_documents_in_flight = 1\n[prepare]\nworkers = 1").start()
    drop(corpus_file("multipage.pdf"), daemon.inbox)
    wait_for(lambda: daemon.journal_rows("SELECT 1 FROM pages"), 120, "the first page to be recorded")
    daemon.kill9()
    assert not (daemon.outbox / "multipage").exists(), "killed before publishing"

    daemon.start()
    wait_for(lambda: daemon.settled_all(1), 180, "the interrupted document to finish after restart")
    assert daemon.states() == {"multipage.pdf": "published"}
    assert [p.name for p in daemon.outbox.iterdir() if not p.name.startswith(".")] == ["multipage"]
    assert json.loads((daemon.outbox / "multipage" / "multipage.json").read_text())["num_pages"] == 6
    resumed = [e for e in daemon.events() if e.get("event") == "document prepared"][-1]
    assert resumed["done_before"] >= 1, "pages finished before the kill are not redone"
    assert (daemon.archive / "multipage.pdf").exists()
    assert daemon.leftovers_once_cleared() == []
    assert daemon.stop() == 0


def test_the_same_file_dropped_twice_is_processed_once(daemon_factory):
    daemon = daemon_factory(inbox_config='duplicates = "skip"').start()
    drop(corpus_file("trivial.pdf"), daemon.inbox, "first.pdf")
    wait_for(lambda: daemon.settled_all(1), 120, "the first copy")
    drop(corpus_file("trivial.pdf"), daemon.inbox, "second.pdf")
    wait_for(lambda: daemon.settled_all(2), 120, "the second copy")
    assert daemon.states() == {"first.pdf": "published", "second.pdf": "failed"}
    assert not (daemon.outbox / "second").exists()
    report = json.loads((daemon.failed / "second.pdf.error.json").read_text())
    assert report["kind"] == "duplicate" and "first.pdf" in report["reason"]


def test_sigterm_exits_zero_and_a_restart_resumes_queued_work(daemon_factory):
    daemon = daemon_factory(extra_config="drain_seconds = 0\nmax_documents_in_flight = 1").start()
    drop(corpus_file("multipage.pdf"), daemon.inbox)
    wait_for(lambda: daemon.journal_rows("SELECT 1 FROM documents WHERE state = 'inferring'"), 60, "inference")
    assert daemon.stop() == 0
    daemon.start()
    wait_for(lambda: daemon.settled_all(1), 180, "the document to finish after restart")
    assert daemon.states() == {"multipage.pdf": "published"}
    assert daemon.leftovers_once_cleared() == []


def test_symlinks_and_fifos_in_the_inbox_are_refused_without_reading_them(daemon_factory, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read me")
    daemon = daemon_factory().start()
    os.symlink(secret, daemon.inbox / "link.pdf")
    os.mkfifo(daemon.inbox / "pipe.pdf")
    wait_for(lambda: daemon.settled_all(2), 60, "both to be refused")
    assert daemon.states() == {"link.pdf": "failed", "pipe.pdf": "failed"}
    assert "symbolic link" in json.loads((daemon.failed / "link.pdf.error.json").read_text())["reason"]
    assert (daemon.failed / "link.pdf").is_symlink(), "the link itself is moved, its target untouched"
    assert secret.read_text() == "do not read me"
    assert daemon.alive


def test_sighup_reloads_the_config_and_a_new_inbox_is_watched(daemon_factory):
    import signal

    daemon = daemon_factory().start()
    second = daemon.root / "second"
    config = daemon.config.read_text()
    daemon.config.write_text(config + f'\n[[inbox]]\npath = "{second}/in"\nsettle_seconds = 1\n')
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event") == "configuration reloaded" for e in daemon.events()), 30, "the reload")
    drop(corpus_file("trivial.pdf"), second / "in")
    wait_for(lambda: (second / "outbox" / "trivial" / "trivial.md").exists(), 120, "the new inbox's output")

    daemon.config.write_text(config + "\nnot valid toml [[[\n")
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event", "").startswith("reload refused") for e in daemon.events()), 30, "refusal")
    assert daemon.alive, "a broken config on reload keeps the daemon running on the old one"
    assert daemon.stop() == 0
