"""Hostile and broken input against the running daemon: each file ends published or in failed/
with a reason a person understands; the daemon keeps running with bounded memory; nothing is
read through a symlink and nothing is written outside outbox/archive/failed."""

from __future__ import annotations

import io
import json
import os
import stat
import time
import zipfile
from pathlib import Path

import pytest

from tests.reliability.chaoslib import (
    ChaosDaemon,
    Expect,
    assemble_pdf,
    check_accounted,
    corpus_bytes,
    drop_bytes,
    fake_tools,
    multi_frame_tiff,
    png_bomb,
    published_dirs,
    record_figures,
    simple_pdf,
    text_png,
    wait_for,
)

CONFIG = (
    "max_documents_in_flight = 2\nmax_attempts = 2\n"
    "[prepare]\nworkers = 2\nmax_file_mb = 12\nmax_pages = 200\nsubprocess_timeout_seconds = 20"
)
INBOX = "empty_settle_seconds = 1"


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width``×``height`` pixels, with almost no data behind it."""
    full = png_bomb(16, 16)
    ihdr_at = full.index(b"IHDR")
    import struct
    import zlib

    body = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = b"IHDR" + body
    return full[:ihdr_at] + chunk + struct.pack(">I", zlib.crc32(chunk) & 0xFFFFFFFF) + full[ihdr_at + 4 + 13 + 4:]


def hostile_pdfs() -> dict[str, bytes]:
    depth = 50_000
    deep_content = b"q " + b"[" * depth + b"]" * depth + b" Q"
    form = b"/X0 Do"
    return {
        # /Pages whose /Kids contain the /Pages node itself.
        "loop.pdf": assemble_pdf([
            b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 100 100] >>",
        ]),
        # A form XObject that draws itself: infinite recursion for a naive renderer.
        "xobject-loop.pdf": assemble_pdf([
            b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 100 100] /Contents 4 0 R "
            b"/Resources << /XObject << /X0 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(form) + form + b"\nendstream",
            b"<< /Type /XObject /Subtype /Form /BBox [0 0 100 100] /Resources << /XObject << /X0 5 0 R >> >> "
            b"/Length %d >>\nstream\n" % len(form) + form + b"\nendstream",
        ]),
        # 50 000 nested arrays in a page dictionary and in its content stream.
        "deep.pdf": assemble_pdf([
            b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 100 100] /Contents 4 0 R /Deep "
            + b"[" * depth + b"]" * depth + b" >>",
            b"<< /Length %d >>\nstream\n" % len(deep_content) + deep_content + b"\nendstream",
        ]),
        # Declares 100 000 pages, has one.
        "declares-100k.pdf": simple_pdf(1, label="declared", declared_pages=100_000),
        # Really has 100 000 (empty) pages.
        "has-100k.pdf": assemble_pdf(
            [b"<< /Type /Catalog /Pages 2 0 R >>",
             b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (3 + i) for i in range(100_000))
             + b"] /Count 100000 >>"]
            + [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 10 10] >>"] * 100_000
        ),
        # 200 × 200 inches (the largest page PDF allows): rendered with a pixel cap, not exploding.
        "huge-page.pdf": simple_pdf(1, size_pt=(14400, 14400), label="huge"),
    }


def zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("word/document.xml", "<w:document/>")
    return buffer.getvalue()


def corrupt_jpeg() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (400, 300), "white").save(buffer, format="JPEG")
    data = bytearray(buffer.getvalue())
    start = data.index(b"\xff\xda")  # start of scan: garble the entropy-coded data, then cut it short
    for i in range(start + 20, min(len(data), start + 400)):
        data[i] = 0xFF
    return bytes(data[: start + 420])


def test_hostile_and_broken_files_fail_with_reasons_and_the_daemon_survives(chaos_factory, tmp_path):
    root = tmp_path / "tree"
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    (outside / "lure.pdf").write_bytes(simple_pdf(1, label="outside lure"))
    daemon: ChaosDaemon = chaos_factory(root, extra_config=CONFIG, inbox_config=INBOX)
    daemon.start()
    daemon.sampler.start()

    half = corpus_bytes("multipage.pdf")
    inputs: dict[str, Expect] = {
        "empty.pdf": Expect(b"", reason="empty"),
        # Ghostscript repairs its structure, but the page images are gone: six blank pages.
        "truncated.pdf": Expect(half[: len(half) // 2], reason="damaged"),
        "really-a-pdf.png": Expect(simple_pdf(2, label="mislabelled pdf"), pages=2),
        "really-a-png.pdf": Expect(text_png("mislabelled png"), pages=1),
        "page.pdf": Expect(b"<!DOCTYPE html><html><body>hi</body></html>", reason="web page"),
        "archive.pdf": Expect(zip_bytes(), reason="ZIP"),
        "program.pdf": Expect(Path("/bin/true").read_bytes(), reason="executable"),
        "setup.pdf": Expect(b"MZ\x90\x00" + b"\x00" * 200, reason="Windows executable"),
        "encrypted.pdf": Expect(corpus_bytes("encrypted.pdf"), reason="password"),
        "password-is-test.pdf": Expect(corpus_bytes("password-is-test.pdf"), reason="password"),
        "bomb.png": Expect(header_only_png(100_000, 100_000), reason="pixels"),
        "big-image.png": Expect(png_bomb(12_000, 12_000), pages=1),
        "oversized.pdf": Expect(b"%PDF-1.4\n" + b"\0" * (13 * 1024 * 1024), reason="max_file_mb"),
        "frames-300.tiff": Expect(multi_frame_tiff(300), reason="300 frames"),
        "frames-40.tiff": Expect(multi_frame_tiff(40), pages=40),
        "corrupt.png": Expect(text_png("corrupt png")[:300], reason="could not be decoded"),
        "corrupt.jpg": Expect(corrupt_jpeg(), either=True),
        "-dNOSAFER.pdf": Expect(simple_pdf(1, label="option injection"), pages=1),
        "$(touch pwned).png": Expect(text_png("shell injection"), pages=1),
        "new\nline.png": Expect(text_png("newline name"), pages=1),
        "up..\\..\\escape.png": Expect(text_png("backslash escape"), pages=1),
        "x" * 240 + ".png": Expect(text_png("very long name"), pages=1),
    }
    for name, data in hostile_pdfs().items():
        inputs[name] = Expect(data, either=name in ("loop.pdf", "xobject-loop.pdf", "deep.pdf", "declares-100k.pdf"))
    inputs["has-100k.pdf"] = Expect(inputs["has-100k.pdf"].data, reason="100000 pages")
    inputs["huge-page.pdf"] = Expect(inputs["huge-page.pdf"].data, pages=1)
    for name, expect in inputs.items():
        drop_bytes(daemon.inbox, name, expect.data)
    latin1 = b"caf\xe9-latin1.png"
    latin1_data = text_png("latin-1 name")
    drop_bytes(daemon.inbox, latin1, latin1_data)
    # Things that are not files: refused without being opened.
    os.symlink("/etc/shadow", daemon.inbox / "shadow.pdf")
    os.symlink(secret, daemon.inbox / "secret.pdf")
    os.symlink(outside, daemon.inbox / "linked-folder")
    os.mkfifo(daemon.inbox / "pipe.pdf")
    specials = ["pipe.pdf"]
    try:  # a device node needs root (CAP_MKNOD)
        os.mknod(daemon.inbox / "device.pdf", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        specials.append("device.pdf")
    except PermissionError:
        pass
    # A folder named like a document is a folder: what is inside it is processed.
    inner_data = text_png("inside a folder named report.pdf")
    drop_bytes(daemon.inbox, "report.pdf/inner.png", inner_data)
    shadow_before = os.stat("/etc/shadow")
    expected_rows = len(inputs) + 1 + 3 + len(specials) + 1  # + latin-1 name, 3 links, fifo/device, inner.png

    wait_for(lambda: daemon.final_count() >= expected_rows or not daemon.alive, 400,
             "every hostile file to be published or failed")
    assert daemon.alive, f"the daemon must survive hostile input:\n{daemon.log_path.read_text()[-3000:]}"
    time.sleep(1)
    daemon.sampler.stop()
    states = daemon.states()
    rows = daemon.journal_rows("SELECT rel_path, state, error, output_dir, final_path FROM documents")
    assert len(rows) == expected_rows, sorted(r["rel_path"] for r in rows)

    # Every failure has a reason in words, written beside the original in failed/.
    for row in rows:
        if row["state"] == "failed":
            report = json.loads(Path(row["final_path"] + ".error.json").read_text())
            assert len(report["reason"]) > 15 and report["what_to_do"], report
            assert "TOP-SECRET" not in json.dumps(report)

    for name in ("shadow.pdf", "secret.pdf", "linked-folder"):
        assert states[name] == "failed" and (daemon.failed / name).is_symlink(), name
        assert "symbolic link" in json.loads((daemon.failed / f"{name}.error.json").read_text())["reason"]
    for name in specials:
        assert states[name] == "failed", name
        assert "not a regular file" in json.loads((daemon.failed / f"{name}.error.json").read_text())["reason"]
    assert states["report.pdf/inner.png"] == "published"
    assert (daemon.outbox / "report.pdf" / "inner" / "inner.md").exists()
    assert "report.pdf" not in states, "a folder named like a document is not a document"

    # The latin-1 (non-UTF-8) name is published under a visible, valid name.
    latin_rows = [r for r in rows if r["rel_path"].startswith("caf")]
    assert len(latin_rows) == 1 and latin_rows[0]["state"] == "published", latin_rows
    check_accounted(daemon, {**inputs, "latin": Expect(latin1_data, either=True),
                             "inner.png": Expect(inner_data, pages=1)}, allow_extra_failed=5)

    # Nothing escaped: the tree holds only the daemon's folders, the lure was not processed, no
    # shell ran, /etc/shadow was not touched, and no output contains the secret.
    assert sorted(p.name for p in root.iterdir()) == ["archive", "config.toml", "daemon.log", "failed", "inbox",
                                                     "outbox", "state"]
    assert (outside / "lure.pdf").exists() and sorted(p.name for p in outside.iterdir()) == ["lure.pdf", "secret.txt"]
    assert [hit for base in (root, tmp_path, Path.cwd()) for hit in base.rglob("pwned")] == [], "a shell ran"
    assert os.stat("/etc/shadow").st_mtime_ns == shadow_before.st_mtime_ns
    for folder in published_dirs(daemon.outbox):
        assert daemon.outbox in folder.parents
        for file in folder.rglob("*"):
            if file.is_file():
                assert b"TOP-SECRET" not in file.read_bytes()
    for folder in (daemon.outbox, daemon.archive, daemon.failed):
        for path in folder.rglob("*"):
            assert path.resolve(strict=False).is_relative_to(folder) or path.is_symlink(), path

    # Memory stayed bounded: the 12 000 × 12 000 image is the largest thing decoded (144 MB as
    # grayscale). Before prepare scaled it down in its own mode, the daemon peaked at 1144 MB here.
    record_figures("hostile input", inputs=expected_rows, states=dict(sorted(states.items())),
                   published=sum(s == "published" for s in states.values()),
                   failed=sum(s == "failed" for s in states.values()),
                   max_rss_mb=daemon.sampler.max_rss_mb, max_tree_rss_mb=daemon.sampler.max_tree_rss_mb,
                   max_fds=daemon.sampler.max_fds)
    assert daemon.sampler.max_rss_mb < 700, f"daemon RSS peaked at {daemon.sampler.max_rss_mb} MB"
    assert daemon.stop() == 0


# -- files that change under the daemon -------------------------------------------------------------


def grow(path: Path, data: bytes, seconds: float, step: float) -> None:
    """A slow scanner: the final name from the first byte, appended to every ``step`` seconds."""
    chunks = max(2, int(seconds / step))
    size = len(data) // chunks + 1
    with open(path, "wb") as handle:
        for offset in range(0, len(data), size):
            handle.write(data[offset:offset + size])
            handle.flush()
            time.sleep(step)


@pytest.mark.parametrize("seconds", [pytest.param(9, id="9s"),
                                     pytest.param(180, id="3min", marks=pytest.mark.soak)])
def test_a_file_that_keeps_growing_is_taken_once_when_complete(chaos_factory, tmp_path, seconds):
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", inbox_config="settle_seconds = 2")
    daemon.start()
    data = corpus_bytes("multipage.pdf")
    grow(daemon.inbox / "scan0001.pdf", data, seconds=seconds, step=min(1.5, seconds / 20))
    wait_for(lambda: daemon.final_count() == 1, 120, "the grown file")
    time.sleep(3)
    rows = daemon.journal_rows("SELECT state, size FROM documents")
    assert [(r["state"], r["size"]) for r in rows] == [("published", len(data))], "taken once, complete"
    assert (daemon.archive / "scan0001.pdf").read_bytes() == data
    assert daemon.stop() == 0


def test_files_deleted_while_settling_or_while_being_read_are_accounted_for(chaos_factory, tmp_path):
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", extra_config="max_documents_in_flight = 1",
                                        inbox_config="settle_seconds = 2")
    daemon.start()
    doomed = daemon.inbox / "cancelled.pdf"
    doomed.write_bytes(simple_pdf(1, label="cancelled"))
    time.sleep(0.5)
    doomed.unlink()  # the person changed their mind before it settled: it never existed for chandrad
    drop_bytes(daemon.inbox, "scan.pdf", corpus_bytes("multipage.pdf"))
    wait_for(lambda: daemon.journal_rows("SELECT 1 FROM pages"), 60, "the first page", interval=0.05)
    claimed = next((daemon.inbox / ".chandrad" / "claimed").rglob("scan.pdf"))
    claimed.unlink()  # someone deletes the original while it is being read
    wait_for(lambda: daemon.final_count() == 1, 60, "the scan to end")
    time.sleep(3)
    assert daemon.alive
    assert daemon.states() == {"scan.pdf": "failed"}
    report = json.loads((daemon.failed / "scan.pdf.error.json").read_text())
    assert "disappeared" in report["reason"], report
    assert published_dirs(daemon.outbox) == [] and daemon.leftovers_once_cleared() == []
    assert daemon.stop() == 0


def test_a_name_reused_while_the_first_file_is_queued_gives_two_documents(chaos_factory, tmp_path):
    """A scanner reuses ``scan.png`` while the first ``scan.png`` waits behind a long document: the
    first was claimed (moved out of the inbox) when it settled, so both are processed, each once,
    and neither output nor archive overwrites the other."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", extra_config="max_documents_in_flight = 1")
    first, second = text_png("first scan"), text_png("second scan, other content")
    daemon.start()
    drop_bytes(daemon.inbox, "long.pdf", corpus_bytes("multipage.pdf"))
    wait_for(lambda: daemon.count_rows("state = 'inferring'"), 60, "the long document", interval=0.05)
    drop_bytes(daemon.inbox, "scan.png", first)
    wait_for(lambda: daemon.count_rows("rel_path = 'scan.png' AND state = 'queued'"), 30, "the first scan queued",
             interval=0.05)
    drop_bytes(daemon.inbox, "scan.png", second)
    wait_for(lambda: daemon.final_count() == 3, 120, "all three")
    assert daemon.stop() == 0
    check_accounted(daemon, {"long.pdf": Expect(corpus_bytes("multipage.pdf"), pages=6),
                             "scan.png": Expect(first, pages=1), "scan (2).png": Expect(second, either=True)})
    archived = {p.read_bytes() for p in daemon.archive.glob("scan*.png")}
    assert archived == {first, second}
    assert sorted(p.name for p in daemon.outbox.iterdir() if not p.name.startswith(".")) == ["long", "scan", "scan (2)"]


@pytest.mark.soak
def test_soak_a_real_500_mb_file_is_refused_or_read_with_bounded_memory(chaos_factory, tmp_path):
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", extra_config="[prepare]\nmax_file_mb = 400")
    daemon.start()
    daemon.sampler.start()
    big = daemon.inbox / "huge.pdf.part"
    with open(big, "wb") as handle:  # real blocks (not sparse): a PDF header, then 500 MB of noise
        handle.write(b"%PDF-1.4\n")
        for _ in range(500):
            handle.write(os.urandom(1 << 20))
    os.replace(big, daemon.inbox / "huge.pdf")
    wait_for(lambda: daemon.final_count() == 1, 300, "the 500 MB file")
    daemon.sampler.stop()
    report = json.loads((daemon.failed / "huge.pdf.error.json").read_text())
    assert "max_file_mb" in report["reason"]
    assert daemon.sampler.max_rss_mb < 700
    record_figures("500 MB file (soak)", state="failed", reason=report["reason"],
                   max_rss_mb=daemon.sampler.max_rss_mb, max_fds=daemon.sampler.max_fds)
    assert daemon.stop() == 0


def test_a_tesseract_killed_once_is_retried_and_the_document_published(chaos_factory, tmp_path):
    flag = tmp_path / "kill-next-tesseract"
    flag.touch()
    env = fake_tools(tmp_path / "bin", tesseract=(
        f'case "$*" in *--version*|*--list*|*"--dpi 70"*) exec /usr/bin/tesseract "$@";; esac\n'
        f'if rm {flag} 2>/dev/null; then kill -9 $$; fi\nexec /usr/bin/tesseract "$@"'))
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", env=env)
    daemon.start()
    drop_bytes(daemon.inbox, "note.png", text_png("engine killed once"))
    wait_for(lambda: daemon.final_count() == 1, 60, "the document")
    assert daemon.stop() == 0
    assert daemon.states() == {"note.png": "published"}


def test_twenty_identical_files_dropped_together_are_published_once(chaos_factory, tmp_path):
    """Intake runs several files at once: copies that settle together must still be recognised,
    exactly one published and every other one failed as a duplicate naming it."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", inbox_config="settle_seconds = 0.5")
    data = text_png("the same scan, twenty times")
    daemon.start()
    for n in range(20):
        drop_bytes(daemon.inbox, f"copy{n:02d}.png", data)
    wait_for(lambda: daemon.final_count() == 20, 60, "all twenty copies")
    assert daemon.stop() == 0
    states = daemon.states()
    assert sorted(states.values()).count("published") == 1, states
    reports = [json.loads(p.read_text()) for p in daemon.failed.glob("*.error.json")]
    assert len(reports) == 19 and all(r["kind"] == "duplicate" for r in reports)
    assert len(published_dirs(daemon.outbox)) == 1 and daemon.leftovers_once_cleared() == []
    assert len(daemon.journal_rows("SELECT 1 FROM documents")) == 20, "no phantom rows"


def test_a_document_and_a_folder_of_the_same_name_never_mix_their_outputs(chaos_factory, tmp_path):
    """``invoices.pdf`` and a folder ``invoices/`` side by side in the inbox: each document gets a
    folder of its own; nothing is ever written into another document's published folder."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree")
    daemon.start()
    drop_bytes(daemon.inbox, "invoices.png", text_png("the invoices summary"))
    wait_for(lambda: daemon.final_count() == 1, 30, "invoices.png")
    published = sorted(p.name for p in (daemon.outbox / "invoices").iterdir())
    drop_bytes(daemon.inbox, "invoices/march.png", text_png("march invoice"))
    drop_bytes(daemon.inbox, "invoices/april.png", text_png("april invoice"))
    wait_for(lambda: daemon.final_count() == 3, 30, "the folder's documents")
    assert daemon.stop() == 0
    assert sorted(p.name for p in (daemon.outbox / "invoices").iterdir()) == published, \
        "the published folder of invoices.png was not changed afterwards"
    for row in daemon.journal_rows("SELECT rel_path, output_dir FROM documents"):
        others = [p for p in Path(row["output_dir"]).parents
                  if daemon.outbox in p.parents and any(child.is_file() for child in p.iterdir())]
        assert not others, f"{row['rel_path']} was published inside another document's folder {others}"
    assert (daemon.outbox / "invoices (2)" / "march" / "march.md").exists()
