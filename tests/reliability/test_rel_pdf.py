"""The searchable PDF through the real daemon: published with the other outputs in one rename,
copied into ``pdf_to`` once and never over another file, and whole after a ``kill -9`` at any step
of its writing (the chaos hook of ``chaos/sitecustomize.py`` kills the daemon at exactly that call).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.reliability.chaoslib import ChaosDaemon, chaos_env, corpus_bytes, drop_bytes, text_png, wait_for

PDF_INBOX = 'formats = ["md", "json", "pdf"]\npdf_to = "{pdf_to}"\n'


def pdf_daemon(chaos_factory, tmp_path: Path) -> tuple[ChaosDaemon, Path]:  # type: ignore[no-untyped-def]
    pdf_to = tmp_path / "consume"
    daemon: ChaosDaemon = chaos_factory(
        tmp_path / "tree", extra_config="max_documents_in_flight = 1", inbox_config=PDF_INBOX.format(pdf_to=pdf_to)
    )
    return daemon, pdf_to


def qpdf_clean(pdf: Path) -> bool:
    return subprocess.run(["qpdf", "--check", str(pdf)], capture_output=True).returncode == 0


def text_of(pdf: Path) -> str:
    return subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True, check=True).stdout


def test_pdf_in_formats_publishes_a_searchable_pdf_beside_the_markdown_and_a_copy_in_pdf_to(chaos_factory, tmp_path):
    daemon, pdf_to = pdf_daemon(chaos_factory, tmp_path)
    daemon.start()
    drop_bytes(daemon.inbox, "linn.pdf", corpus_bytes("linn.pdf"))
    drop_bytes(daemon.inbox, "note.png", text_png("searchable note 42"))
    wait_for(lambda: daemon.final_count() == 2, 120, "both documents")
    # Another document of the same name: its copy in pdf_to gets a free name, never the first's.
    drop_bytes(daemon.inbox / "again", "linn.pdf", corpus_bytes("linn.pdf") + b"\n% again\n")
    wait_for(lambda: daemon.final_count() == 3, 120, "the second linn.pdf")
    assert daemon.stop() == 0
    assert set(daemon.states().values()) == {"published"}, daemon.states()
    outputs = daemon.outbox / "linn"
    assert sorted(p.name for p in outputs.iterdir()) == ["linn.json", "linn.md", "linn.pdf"]
    pdf = outputs / "linn.pdf"
    assert qpdf_clean(pdf)
    assert "LinnSequencer" in text_of(pdf), "the text layer is there"
    report = json.loads((outputs / "linn.json").read_text())["pdf"]
    assert report["text_pages"] == [1] and report["words"] > 100 and report["pdfa"] is True, report
    assert "searchable" in text_of(daemon.outbox / "note" / "note.pdf")
    copies = sorted(p.name for p in pdf_to.iterdir() if not p.name.startswith("."))
    assert copies == ["linn (2).pdf", "linn.pdf", "note.pdf"], copies
    assert (pdf_to / "linn.pdf").read_bytes() == pdf.read_bytes()
    assert list((pdf_to / ".chandrad").iterdir()) == [], "no partial copy is left behind"


# (what is being written when the daemon dies, CHAOS_KILL spec)
KILLS = [
    ("the PDF written by pikepdf, not yet fsynced", "fsync:/doc/linn.pdf$:before:1"),
    ("the PDF fsynced, the outputs not yet renamed", "rename:/.chandrad/staging/:before:1"),
    ("the pdf_to copy written, not yet linked in", "fsync:linn.pdf.part$:after:1"),
]


@pytest.mark.parametrize(("step", "spec"), KILLS, ids=[k[0] for k in KILLS])
def test_a_kill_9_while_the_pdf_is_written_leaves_one_whole_pdf_and_one_copy(chaos_factory, tmp_path, step, spec):
    daemon, pdf_to = pdf_daemon(chaos_factory, tmp_path)
    hits = tmp_path / "chaos.log"
    daemon.env.update(chaos_env(hits))
    drop_bytes(daemon.inbox, "linn.pdf", corpus_bytes("linn.pdf"))
    daemon.start(env={"CHAOS_KILL": spec}, wait=False)
    assert daemon.wait_dead(120) == -9, "the injected kill must fire"
    assert hits.read_text().strip(), f"chaos point {spec} was not reached"
    assert not (daemon.outbox / "linn").exists() or qpdf_clean(daemon.outbox / "linn" / "linn.pdf"), (
        "what is in the outbox is whole"
    )
    daemon.start(env={"CHAOS_KILL": ""})
    wait_for(lambda: daemon.final_count() == 1 and not daemon.leftovers(), 120, "recovery after the kill")
    assert daemon.stop() == 0
    assert daemon.states() == {"linn.pdf": "published"}
    assert sorted(p.name for p in daemon.outbox.iterdir() if not p.name.startswith(".")) == ["linn"]
    assert qpdf_clean(daemon.outbox / "linn" / "linn.pdf")
    assert sorted(p.name for p in pdf_to.iterdir() if not p.name.startswith(".")) == ["linn.pdf"], "one copy"
    assert (pdf_to / "linn.pdf").read_bytes() == (daemon.outbox / "linn" / "linn.pdf").read_bytes()
