"""External programs that hang or die, and a journal locked by another process.

Fake ``gs``, ``chandrad-render-page`` (the PDF page renderer) and ``pdfinfo`` come first on the
daemon's PATH (only in that daemon's environment). They hang (``exec sleep``) or kill themselves (``kill -9 $$``) when their
arguments name a file whose name says so, and run the real program otherwise, so one daemon
meets every fault and healthy documents alongside them. The renderer, which the daemon keeps
between pages (``--serve``), does so when a page's request names such a file, and passes every
other request on to a real one.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.reliability.chaoslib import (
    ChaosDaemon,
    Expect,
    check_accounted,
    corpus_bytes,
    drop_bytes,
    fake_tools,
    record_figures,
    simple_pdf,
    text_png,
    wait_for,
)

HANG = "sleep 613"  # a duration no one else uses, to find leftovers
RENDERER = str(Path(sys.executable).with_name("chandrad-render-page"))  # the real one, in this venv


def wrapper(real: str, tag: str) -> str:
    return (f'case "$*" in *{tag}hang*) exec {HANG};; *{tag}crash*) kill -9 $$;; *{tag}segv*) kill -SEGV $$;; esac\n'
            f'exec {real} "$@"')


def serving_wrapper(folder: Path, real: str, tag: str) -> str:
    """``wrapper`` for a program run once a request (``--serve``, a JSON line each) as well as once a
    page: a Python relay, written beside the fake tools, that acts on each request as ``wrapper``
    acts on its arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    relay = folder / f"{tag}-relay.py"
    relay.write_text(
        "import json, os, signal, subprocess, sys\n"
        "def act(words):\n"
        f"    if '{tag}hang' in words: os.execvp('sleep', {HANG.split()!r})\n"
        f"    if '{tag}crash' in words: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"    if '{tag}segv' in words: os.kill(os.getpid(), signal.SIGSEGV)\n"
        "if sys.argv[1:] != ['--serve']:\n"
        "    act(' '.join(sys.argv[1:]))\n"
        f"    os.execv({real!r}, [{real!r}, *sys.argv[1:]])\n"
        f"real = subprocess.Popen([{real!r}, '--serve'], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
        "for request in sys.stdin.buffer:\n"
        "    act(request.decode())\n"
        "    real.stdin.write(request)\n"
        "    real.stdin.flush()\n"
        "    header = real.stdout.readline()\n"
        "    sys.stdout.buffer.write(header + real.stdout.read(json.loads(header)['bytes']))\n"
        "    sys.stdout.buffer.flush()\n"
    )
    return f'exec {sys.executable} {relay} "$@"'


def test_hung_and_killed_ghostscript_and_poppler_time_out_or_fall_back_and_the_daemon_stays_well(
    chaos_factory, tmp_path
):
    env = fake_tools(
        tmp_path / "bin",
        gs=wrapper("/usr/bin/gs", "gs"),
        pdfinfo=wrapper("/usr/bin/pdfinfo", "info"),
        **{"chandrad-render-page": serving_wrapper(tmp_path / "relays", RENDERER, "ppm")},
    )
    daemon: ChaosDaemon = chaos_factory(
        tmp_path / "tree", env=env,
        extra_config="max_attempts = 2\ndrain_seconds = 2\n[prepare]\nsubprocess_timeout_seconds = 3",
    )
    form = corpus_bytes("with-form.pdf")  # has form fields: Ghostscript flattens it
    inputs = {
        "gshang-form.pdf": Expect(form, reason="gs took longer than 3 s"),
        # SIGKILL is what the OOM killer sends: not the file's fault, so retried, then failed.
        "gscrash-form.pdf": Expect(form + b"\n% 2\n", reason="gs was killed by SIGKILL"),
        # Ghostscript crashes on it (SIGSEGV): the original is rendered without the rewrite.
        "gssegv-form.pdf": Expect(form + b"\n% 3\n", pages=1),
        "ppmhang-plain.pdf": Expect(simple_pdf(1, label="ppm hang"), reason="took longer than 3 s"),
        "ppmcrash-plain.pdf": Expect(simple_pdf(1, label="ppm crash"), reason="the PDF renderer was killed by SIGKILL"),
        # The renderer crashes on the original: Ghostscript's repair rewrites it and the rewrite renders.
        "ppmsegv-plain.pdf": Expect(simple_pdf(1, label="ppm segv"), pages=1),
        "infohang-plain.pdf": Expect(simple_pdf(1, label="info hang"), reason="pdfinfo took longer than 3 s"),
        "infocrash-plain.pdf": Expect(simple_pdf(1, label="info crash"), reason="pdfinfo was killed by SIGKILL"),
        "healthy.pdf": Expect(simple_pdf(2, label="healthy"), pages=2),
        "note.png": Expect(text_png("healthy png"), pages=1),
    }
    daemon.start()
    daemon.sampler.start()
    for name, expect in inputs.items():
        drop_bytes(daemon.inbox, name, expect.data)
    wait_for(lambda: daemon.final_count() >= len(inputs) or not daemon.alive, 120, "every document to finish")
    assert daemon.alive
    wait_for(lambda: not _hung_children(), 10, "hung programs to be killed")
    daemon.sampler.stop()
    started = time.monotonic()
    assert daemon.stop(timeout=30) == 0, "SIGTERM still stops the daemon promptly"
    stop_seconds = time.monotonic() - started
    figures = check_accounted(daemon, inputs)
    for name in ("gshang-form.pdf", "ppmhang-plain.pdf", "infohang-plain.pdf", "gscrash-form.pdf",
                 "ppmcrash-plain.pdf", "infocrash-plain.pdf"):
        report = json.loads((daemon.failed / f"{name}.error.json").read_text())
        assert report["kind"] == "transient" and len(report["history"]) == 2, "a timeout is retried, then failed"
    record_figures("gs/renderer/pdfinfo hung or killed", runs=1, inputs=len(inputs), **figures,
                   stop_seconds=round(stop_seconds, 1), max_rss_mb=daemon.sampler.max_rss_mb,
                   max_fds=daemon.sampler.max_fds)


def _hung_children() -> list[psutil.Process]:
    return [proc for proc in psutil.process_iter(["cmdline"]) if proc.info["cmdline"] == HANG.split()]



def hold_journal_lock(db: Path, seconds: int) -> subprocess.Popen[str]:
    """Another process holding an exclusive write lock on the journal; prints "locked" once it has it."""
    return subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"db = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE')\n"
        "db.execute(\"UPDATE documents SET updated_at = updated_at\")\n"
        "print('locked', flush=True)\n"
        f"time.sleep({seconds})\n"
    )], stdout=subprocess.PIPE, text=True)

def test_a_journal_locked_by_another_process_stops_startup_with_a_clear_error_and_no_damage(chaos_factory, tmp_path):
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree")
    daemon.start()
    drop_bytes(daemon.inbox, "before.pdf", simple_pdf(1, label="before"))
    wait_for(lambda: daemon.final_count() == 1, 60, "a first document")
    assert daemon.stop() == 0
    db = daemon.state / "journal.sqlite3"
    holder = hold_journal_lock(db, seconds=60)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        daemon.start(wait=False)
        code = daemon.wait_dead(60)
        waited = time.monotonic() - started
        output = daemon.log_path.read_text(errors="replace")
        assert code != 0, "a locked journal stops the start"
        assert "journal" in output and "locked" in output, output[-2000:]
    finally:
        holder.kill()
        holder.wait()
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()
    daemon.start()
    drop_bytes(daemon.inbox, "after.pdf", simple_pdf(1, label="after"))
    wait_for(lambda: daemon.final_count() == 2, 60, "work to resume once the lock is gone")
    assert daemon.stop() == 0
    assert daemon.states() == {"before.pdf": "published", "after.pdf": "published"}
    record_figures("journal locked at startup", exit_code=code, seconds_to_exit=round(waited, 1),
                   integrity="ok", resumed=True)


def test_a_renderer_killed_on_every_page_fails_the_document_with_a_reason_after_retries(chaos_factory, tmp_path):
    # The renderer dies by SIGKILL (what the OOM killer sends) on every page, Ghostscript's rewrite included.
    env = fake_tools(tmp_path / "bin", **{"chandrad-render-page": "kill -9 $$"})
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", env=env, extra_config="max_attempts = 2")
    inputs = {"plain.pdf": Expect(simple_pdf(1, label="killed renderer"), reason="the PDF renderer"),
              "note.png": Expect(text_png("png needs no renderer"), pages=1)}
    daemon.start()
    for name, expect in inputs.items():
        drop_bytes(daemon.inbox, name, expect.data)
    wait_for(lambda: daemon.final_count() >= len(inputs) or not daemon.alive, 90, "both documents to finish")
    assert daemon.alive
    report = json.loads((daemon.failed / "plain.pdf.error.json").read_text())
    assert "killed" in report["reason"] and report["kind"] == "transient", report
    assert len(report["history"]) == 2, "a killed renderer is an outside event: retried before giving up"
    assert daemon.stop() == 0
    check_accounted(daemon, inputs)


def test_a_journal_locked_for_longer_than_the_busy_timeout_while_running_loses_nothing(chaos_factory, tmp_path):
    """Someone leaves a ``sqlite3`` shell in a write transaction for 14 s (busy timeout: 10 s) while
    a document is being inferred and two more arrive: the daemon waits, then finishes all of them,
    without a crash, a phantom journal row or a duplicate."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", extra_config="max_documents_in_flight = 1")
    inputs = {"first.pdf": Expect(corpus_bytes("multipage.pdf"), pages=6),
              "second.pdf": Expect(simple_pdf(2, label="second"), pages=2),
              "third.png": Expect(text_png("third"), pages=1)}
    daemon.start()
    drop_bytes(daemon.inbox, "first.pdf", inputs["first.pdf"].data)
    wait_for(lambda: daemon.count_rows("state = 'inferring'"), 60, "the first document to be inferred",
             interval=0.05)
    db = daemon.state / "journal.sqlite3"
    holder = hold_journal_lock(db, seconds=14)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    drop_bytes(daemon.inbox, "second.pdf", inputs["second.pdf"].data)
    drop_bytes(daemon.inbox, "third.png", inputs["third.png"].data)
    holder.wait(30)
    # systemd restarts a daemon that exited non-zero (Restart=on-failure); do the same here.
    restarts = 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and daemon.final_count() < 3:
        if not daemon.alive:
            restarts += 1
            daemon.start()
        time.sleep(0.5)
    assert daemon.final_count() >= 3, daemon.states()
    time.sleep(1)
    assert daemon.stop() == 0
    check_accounted(daemon, inputs)
    record_figures("journal locked 14 s while running", restarts_needed=restarts, losses=0, duplicates=0,
                   journal_rows=daemon.count_rows())
    assert restarts == 0, "a long lock on the journal must not crash the daemon"


def test_sigterm_while_ghostscript_hangs_exits_promptly_and_the_document_resumes(chaos_factory, tmp_path):
    """A stop must not wait for a hung tool's timeout (300 s by default): systemd would SIGKILL the
    daemon at TimeoutStopSec. The interrupted document resumes at the next start."""
    env = fake_tools(tmp_path / "bin", gs=wrapper("/usr/bin/gs", "gs"))
    daemon: ChaosDaemon = chaos_factory(
        tmp_path / "tree", env=env,
        extra_config="drain_seconds = 1\n[prepare]\nsubprocess_timeout_seconds = 120",
    )
    daemon.start()
    form = corpus_bytes("with-form.pdf")
    drop_bytes(daemon.inbox, "gshang-form.pdf", form)
    wait_for(lambda: _hung_children(), 30, "Ghostscript to hang")
    started = time.monotonic()
    code = daemon.stop(timeout=60)
    stop_seconds = time.monotonic() - started
    wait_for(lambda: not _hung_children(), 10, "the hung Ghostscript to be killed with the daemon")
    record_figures("SIGTERM while gs hangs", exit_code=code, stop_seconds=round(stop_seconds, 1))
    assert code == 0 and stop_seconds < 15, f"stopped in {stop_seconds:.0f} s with {code}"
    assert daemon.count_rows("state IN ('published', 'failed')") == 0, "interrupted, not failed"
    daemon.env = {}  # Ghostscript works again
    daemon.start()
    wait_for(lambda: daemon.final_count() == 1, 60, "the interrupted document to resume")
    assert daemon.stop() == 0
    assert daemon.states() == {"gshang-form.pdf": "published"} and daemon.leftovers_once_cleared() == []
