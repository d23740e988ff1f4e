"""``chandrad retry FILE|DOC_ID`` and ``chandrad status --failed``, beside a stopped and a running daemon."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from typing import Any

from click.testing import CliRunner

from chandrad.cli import EXIT_FAILED, main
from tests.conftest import DaemonProcess, corpus_file, drop, wait_for

NAME = "password-is-test.pdf"  # fails without pdf_password = "test", publishes with it


def chandrad(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """The command line in a process of its own, as an admin runs it beside the daemon."""
    return subprocess.run(
        [sys.executable, "-m", "chandrad", *args, "--config", str(daemon.config)],
        capture_output=True, text=True, timeout=60, cwd=daemon.root,
    )


def row(daemon: DaemonProcess) -> dict[str, Any]:
    [found] = daemon.journal_rows("SELECT * FROM documents")
    values = dict(found)
    values["history"] = json.loads(values["history"])
    return values


def test_retry_puts_a_failed_document_back_whether_the_daemon_is_stopped_or_running(daemon_factory):
    daemon = daemon_factory(extra_config="[prepare]\ndpi = 72\nmin_short_side_px = 0\n").start()
    drop(corpus_file(NAME), daemon.inbox)
    wait_for(lambda: daemon.states().get(NAME) == "failed", 120, "the encrypted PDF to fail")
    doc = row(daemon)
    report = daemon.failed / f"{NAME}.error.json"
    assert report.exists() and "password" in doc["history"][-1]["reason"]

    listed = CliRunner().invoke(main, ["status", "--failed", "--json", "--config", str(daemon.config)]).stdout
    [entry] = json.loads(listed)["failed"]
    assert (entry["doc"], entry["file"], entry["kind"]) == (doc["id"], NAME, "permanent")
    assert "password" in entry["reason"] and entry["original"] == str(daemon.failed / NAME)
    text = CliRunner().invoke(main, ["status", "--failed", "--config", str(daemon.config)]).stdout
    assert doc["id"] in text and "password" in text

    # Stopped: the original goes back to its claim folder, the document is queued with no attempt used.
    assert daemon.stop() == 0
    done = chandrad(daemon, "retry", doc["id"])
    assert done.returncode == 0, done.stderr
    assert "queued again" in done.stdout
    claimed = daemon.inbox / ".chandrad" / "claimed" / socket.gethostname() / doc["id"] / NAME  # the default host_id
    assert claimed.exists() and not (daemon.failed / NAME).exists() and not report.exists()
    queued = row(daemon)
    assert (queued["state"], queued["attempts"], queued["claimed_path"], queued["final_path"]) == (
        "queued", 0, str(claimed), None
    )
    assert [e["kind"] for e in queued["history"]] == ["permanent", "retry"], "the error stays in the history"

    # Started again, it is processed anew: still no password, so it fails once more, one attempt used.
    daemon.start()
    wait_for(lambda: row(daemon)["state"] == "failed" and len(row(daemon)["history"]) == 3, 120, "the second failure")
    again = row(daemon)
    assert again["attempts"] == 1, "attempts were counted anew (max_attempts applies again)"
    assert [e["kind"] for e in json.loads(report.read_text())["history"]] == ["permanent", "retry", "permanent"]

    # Running: the password arrives by a reload, and a retry by the file's path in failed/ publishes it.
    with daemon.config.open("a") as config:
        config.write('pdf_password = "test"\n')  # the [[inbox]] table is the file's last
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event") == "configuration reloaded" for e in daemon.events()), 30, "the reload")
    done = chandrad(daemon, "retry", str(daemon.failed / NAME))
    assert done.returncode == 0, done.stderr
    wait_for(lambda: daemon.states().get(NAME) == "published", 120, "the retried document published")
    stem = NAME.removesuffix(".pdf")
    assert json.loads((daemon.outbox / stem / f"{stem}.json").read_text())["num_pages"] >= 1
    assert (daemon.archive / NAME).exists() and not (daemon.failed / NAME).exists() and not report.exists()
    assert [e["kind"] for e in row(daemon)["history"]] == ["permanent", "retry", "permanent", "retry"]
    assert len(daemon.journal_rows("SELECT id FROM documents")) == 1, "the same document, not a new one"

    refused = chandrad(daemon, "retry", doc["id"])
    assert refused.returncode == EXIT_FAILED and "is published, not failed" in refused.stderr
    unknown = chandrad(daemon, "retry", "never-seen.pdf")
    assert unknown.returncode == EXIT_FAILED and "no failed document" in unknown.stderr
    assert "no failed documents" in chandrad(daemon, "status", "--failed").stdout
    assert daemon.leftovers_once_cleared() == []
    assert daemon.stop() == 0


def test_retry_by_the_name_in_the_inbox_and_a_missing_original_is_refused(daemon_factory):
    daemon = daemon_factory().start()
    drop(corpus_file("invalid.pdf"), daemon.inbox, "scans/broken.pdf")
    wait_for(lambda: daemon.states().get("scans/broken.pdf") == "failed", 120, "the invalid PDF to fail")
    assert daemon.stop() == 0
    (daemon.failed / "scans" / "broken.pdf").unlink()  # someone cleaned failed/ up by hand
    refused = chandrad(daemon, "retry", "scans/broken.pdf")
    assert refused.returncode == EXIT_FAILED and "no longer in failed/" in refused.stderr
    assert daemon.states() == {"scans/broken.pdf": "failed"}, "nothing changed"
