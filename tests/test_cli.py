"""``chandrad once``, ``status`` and ``check`` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import corpus_file


def chandrad(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chandrad", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_once_publishes_and_exits_zero(tmp_path):
    result = chandrad("once", str(corpus_file("trivial.pdf")), "-o", str(tmp_path / "out"), "--engine", "tesseract")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "trivial" / "trivial.json").read_text())["num_pages"] == 1
    assert corpus_file("trivial.pdf").exists(), "once never moves the originals"
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["trivial"], "no working folders left"


def test_once_reports_each_failed_document_in_one_line_without_a_traceback(tmp_path):
    empty = tmp_path / "empty.pdf"
    empty.write_bytes(b"")
    result = chandrad("once", str(corpus_file("trivial.pdf")), str(corpus_file("encrypted.pdf")), str(empty),
                      str(tmp_path / "missing.pdf"), "-o", str(tmp_path / "out"), "--engine", "tesseract")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    failures = [line for line in lines if ": failed: " in line or "no such file" in line]
    assert len(failures) == 3, result.stderr
    assert any("encrypted.pdf: failed: the PDF is password-protected" in line for line in failures)
    assert any("empty.pdf: failed: the file is empty" in line for line in failures)
    assert "Traceback" not in result.stderr
    assert (tmp_path / "out" / "trivial" / "trivial.md").exists()


def test_status_summarises_the_journal(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\n[[inbox]]\npath = "{tmp_path}/in"\n')
    assert chandrad("status", "--config", str(config)).returncode == 1  # no journal yet: says so
    from chandrad.journal import Journal

    (tmp_path / "state").mkdir()
    journal = Journal(tmp_path / "state" / "journal.sqlite3")
    doc = journal.add_document("in", "a.pdf", "ff", 1, 1)
    journal.set_state(doc.id, "failed", error={"reason": "the PDF is password-protected"})
    journal.close()
    result = chandrad("status", "--config", str(config), "--json")
    report = json.loads(result.stdout)
    assert report["counts"] == {"failed": 1}
    assert report["recent_failures"][0]["reason"] == "the PDF is password-protected"


def test_check_reports_tools_and_folders(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\n[engine]\nkind = "tesseract"\n[[inbox]]\npath = "{tmp_path}/in"\n')
    result = chandrad("check", "--config", str(config))
    assert result.returncode == 0, result.stdout
    assert "[ok] gs" in result.stdout and "[ok] pdftoppm" in result.stdout and "[ok] engine: tesseract" in result.stdout
