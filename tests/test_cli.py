"""``chandrad once``, ``status``, ``check`` and ``run``'s refusals, called in-process as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from click.testing import CliRunner, Result

from chandrad.cli import EXIT_CONFIG, EXIT_FAILED, main
from chandrad.storage.journal import Journal
from tests.conftest import corpus_file


def chandrad(*args: str) -> Result:
    """The command line, in this process: exit code, stdout and stderr as a user would see them."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write_config(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "c.toml"
    config.write_text(text)
    return config


def test_once_publishes_and_exits_zero(tmp_path):
    result = chandrad("once", str(corpus_file("trivial.pdf")), "-o", str(tmp_path / "out"), "--engine", "tesseract")
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "out" / "trivial" / "trivial.json").read_text())["num_pages"] == 1
    assert f"{corpus_file('trivial.pdf')}: {tmp_path / 'out' / 'trivial'}" in result.stdout
    assert corpus_file("trivial.pdf").exists(), "once never moves the originals"
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["trivial"], "no working folders left"


def test_once_reports_each_failed_document_in_one_line_without_a_traceback(tmp_path):
    empty = tmp_path / "empty.pdf"
    empty.write_bytes(b"")
    missing = tmp_path / "missing.pdf"
    result = chandrad("once", str(corpus_file("trivial.pdf")), str(corpus_file("encrypted.pdf")), str(empty),
                      str(missing), "-o", str(tmp_path / "out"), "--engine", "tesseract")
    assert result.exit_code == EXIT_FAILED
    failures = [line for line in result.stderr.splitlines() if ": failed: " in line]
    assert len(failures) == 3, result.stderr
    assert any("encrypted.pdf: failed: the PDF is password-protected" in line for line in failures)
    assert any(line.startswith(f"{empty}: failed: the file is empty") for line in failures)
    assert f"{missing}: failed: no such file" in failures
    assert "Traceback" not in result.stderr
    assert (tmp_path / "out" / "trivial" / "trivial.md").exists()


def test_status_without_a_journal_says_so_and_exits_one(tmp_path):
    config = write_config(tmp_path, f'state_dir = "{tmp_path}/state"\n[[inbox]]\npath = "{tmp_path}/in"\n')
    result = chandrad("status", "--config", str(config))
    assert result.exit_code == EXIT_FAILED
    assert f"no journal at {tmp_path}/state/journal.sqlite3" in result.stderr


def test_status_summarises_the_journal(tmp_path):
    config = write_config(tmp_path, f'state_dir = "{tmp_path}/state"\n[[inbox]]\npath = "{tmp_path}/in"\n')
    (tmp_path / "state").mkdir()
    journal = Journal(tmp_path / "state" / "journal.sqlite3")
    failed = journal.add_document("in", "a.pdf", "ff", 1, 1)
    journal.set_state(failed.id, "failed", error={"reason": "the PDF is password-protected"})
    working = journal.add_document("in", "b.pdf", "ee", 1, 1)
    journal.set_state(working.id, "inferring", page_count=4)
    journal.close()

    result = chandrad("status", "--config", str(config), "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["counts"] == {"failed": 1, "inferring": 1}
    assert [(item["file"], item["state"], item["pages"]) for item in report["in_flight"]] == [("b.pdf", "inferring", 4)]
    assert [(item["file"], item["reason"]) for item in report["recent_failures"]] == [
        ("a.pdf", "the PDF is password-protected")]

    text = chandrad("status", "--config", str(config)).stdout.splitlines()
    assert text[0] == "documents: failed 1, inferring 1"
    assert "  in flight: b.pdf (in) — inferring" in text
    assert any(line.startswith("  failed ") and line.endswith("a.pdf — the PDF is password-protected") for line in text)


def test_check_reports_tools_and_folders(tmp_path):
    config = write_config(
        tmp_path, f'state_dir = "{tmp_path}/state"\n[engine]\nkind = "tesseract"\n[[inbox]]\npath = "{tmp_path}/in"\n'
    )
    result = chandrad("check", "--config", str(config))
    assert result.exit_code == 0, result.stdout
    assert "[ok] gs" in result.stdout and "[ok] engine: tesseract" in result.stdout
    assert "pdftoppm" not in result.stdout, "chandrad renders PDF pages with PDFium, not pdftoppm"
    assert "[ok] pdf renderer: PDFium" in result.stdout and "1632×2112 px at 192 dpi" in result.stdout, result.stdout
    assert f"[ok] folders: {tmp_path}/in" in result.stdout and (tmp_path / "in").is_dir()


def test_check_fails_with_exit_one_when_a_folder_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = write_config(tmp_path, f'state_dir = "{tmp_path}/state"\n[[inbox]]\npath = "{blocker}/inbox"\n')
    result = chandrad("check", "--config", str(config))
    assert result.exit_code == EXIT_FAILED
    assert "[FAIL] folders: " in result.stdout and "cannot create folder" in result.stdout


def test_check_fails_when_the_pdf_renderer_cannot_render_a_page(tmp_path, monkeypatch):
    """The renderer is found on PATH first (an admin's wrapper): one that fails is reported."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    broken = bin_dir / "chandrad-render-page"
    broken.write_text("#!/bin/sh\necho 'libpdfium.so: cannot open shared object file' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    config = write_config(
        tmp_path, f'state_dir = "{tmp_path}/state"\n[engine]\nkind = "tesseract"\n[[inbox]]\npath = "{tmp_path}/in"\n'
    )
    result = chandrad("check", "--config", str(config))
    assert result.exit_code == EXIT_FAILED
    assert f"[FAIL] pdf renderer: {broken}: page 1 could not be rendered" in result.stdout, result.stdout
    assert "libpdfium.so" in result.stdout


def test_run_exits_two_with_one_clear_line_per_config_problem(tmp_path):
    config = write_config(tmp_path, f'[[inbox]]\npath = "{tmp_path}/in"\noutbox = "{tmp_path}/in/out"\nbogus = 1\n')
    result = chandrad("run", "--config", str(config))
    assert result.exit_code == EXIT_CONFIG
    assert "bogus: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_exits_two_when_a_folder_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = write_config(tmp_path, f'state_dir = "{tmp_path}/state"\n[[inbox]]\npath = "{blocker}/inbox"\n')
    result = chandrad("run", "--config", str(config))
    assert result.exit_code == EXIT_CONFIG
    assert "cannot create folder" in result.stderr and "Traceback" not in result.stderr


def test_a_run_whose_start_was_refused_leaves_its_caller_running_and_its_signals_as_they_were(tmp_path):
    # In this process, as CliRunner runs it: the stop that follows a refused start armed the
    # backstop, and it used to end this very process (a pytest worker) stop_timeout_seconds later.
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = write_config(tmp_path, f'state_dir = "{tmp_path}/state"\n[[inbox]]\npath = "{blocker}/inbox"\n')
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    assert chandrad("run", "--config", str(config)).exit_code == EXIT_CONFIG
    armed = [thread.name for thread in threading.enumerate() if thread.name == "stop-backstop"]
    assert armed == [], "a backstop is still armed to end this process"
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
