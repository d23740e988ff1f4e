"""Running as a service: unit files, sd_notify on a real socket, the watchdog, the installer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, corpus_file, drop, wait_for


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: make test installs Debian's systemd package for this")
    chandrad = Path(sys.executable).with_name("chandrad")
    for name, as_name in (("chandrad.service", "chandrad.service"), ("chandrad@.service", "chandrad@gpu01.service")):
        text = (REPO / "systemd" / name).read_text().replace("/opt/chandrad/venv/bin/chandrad", str(chandrad))
        (tmp_path / as_name).write_text(text)
        result = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / as_name)],
                                capture_output=True, text=True, timeout=60)
        problems = [
            line for line in (result.stdout + result.stderr).splitlines()
            # Keys of systemd >= 254 that Debian 12's 252 does not know yet: ignored there by design.
            if line.strip() and "RestartSteps" not in line and "RestartMaxDelaySec" not in line
        ]
        assert result.returncode == 0 and problems == [], problems
    unit = (REPO / "systemd" / "chandrad.service").read_text()
    for required in ("Type=notify", "WatchdogSec=", "ExecReload=/bin/kill -HUP $MAINPID", "ProtectSystem=strict",
                     "DevicePolicy=closed", "DeviceAllow=char-nvidia-uvm rw", "StateDirectory=chandrad",
                     "CacheDirectory=chandrad", "NoNewPrivileges=yes", "CapabilityBoundingSet=\n", "User=chandrad"):
        assert required in unit, required


def test_install_stages_units_sysusers_tmpfiles_and_keeps_an_existing_config(tmp_path):
    env = {**os.environ, "DESTDIR": str(tmp_path), "SKIP_VENV": "1"}
    subprocess.run([str(REPO / "scripts" / "install-service.sh")], check=True, env=env, capture_output=True)
    for path in ("etc/systemd/system/chandrad.service", "etc/systemd/system/chandrad@.service",
                 "etc/sysusers.d/chandrad.conf", "etc/tmpfiles.d/chandrad.conf", "etc/chandrad/config.toml"):
        assert (tmp_path / path).is_file(), path
    config = tmp_path / "etc/chandrad/config.toml"
    config.write_text("# edited by the admin\n")
    subprocess.run([str(REPO / "scripts" / "install-service.sh")], check=True, env=env, capture_output=True)
    assert config.read_text() == "# edited by the admin\n", "an upgrade never overwrites the admin's config"


class NotifyListener:
    """A real AF_UNIX datagram socket standing where systemd's would be."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, str]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self._stop = False
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def lines(self) -> list[str]:
        return [line for _, line in self.messages]

    def index(self, prefix: str, after: int = -1) -> int:
        return next((i for i, line in enumerate(self.lines()) if i > after and line.startswith(prefix)), -1)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    listener = NotifyListener(tmp_path / "notify.sock")
    yield listener
    listener.close()


def test_sd_notify_ready_status_watchdog_reload_and_stopping(daemon_factory, notify_socket):
    daemon = daemon_factory()
    daemon.start(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "2000000"})
    wait_for(lambda: notify_socket.index("READY=1") >= 0, 60, "READY=1")
    ready = notify_socket.index("READY=1")
    assert 0 <= notify_socket.index("EXTEND_TIMEOUT_USEC=") < ready, "the start timeout is extended while loading"
    assert 0 <= notify_socket.index("STATUS=loading") < ready
    first_ping = notify_socket.index("WATCHDOG=1")
    assert first_ping == -1 or first_ping > ready, "no watchdog ping before the daemon is ready"
    events = [e.get("event") for e in daemon.events()]
    assert events.index("engine ready") < events.index("chandrad ready"), "READY only after the engine answered"

    wait_for(lambda: notify_socket.lines().count("WATCHDOG=1") >= 3, 30, "three watchdog pings (one per second)")
    drop(corpus_file("trivial.pdf"), daemon.inbox)
    wait_for(lambda: daemon.settled_all(1), 120, "a document")
    statuses = [line for line in notify_socket.lines() if line.startswith("STATUS=")]
    assert any("in progress" in s and "pages/min" in s for s in statuses), statuses
    assert len(set(statuses)) >= 2, "STATUS follows the work"

    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: notify_socket.index("RELOADING=1") >= 0, 30, "RELOADING=1")
    reloading = notify_socket.index("RELOADING=1")
    assert notify_socket.lines()[reloading + 1].startswith("MONOTONIC_USEC=")
    wait_for(lambda: notify_socket.index("READY=1", after=reloading) > reloading, 30, "READY=1 after the reload")

    assert daemon.stop() == 0
    assert "STOPPING=1" in notify_socket.lines()


def hung_tesseract_path(tmp_path) -> str:
    """A PATH whose tesseract answers --version and reads the engine's blank page (start-up, at 70
    dpi) and judges a page's orientation (--psm 0, before the engine), but as the engine never
    finishes a page."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    real = shutil.which("tesseract")
    (fake_bin / "tesseract").write_text(
        f'#!/bin/sh\n[ "$1" = "--version" ] && exec {real} --version\n'
        f'case " $* " in *" --psm 0 "*|*" --dpi 70 "*) exec {real} "$@";; esac\nexec sleep 600\n'
    )
    (fake_bin / "tesseract").chmod(0o755)
    return f"{fake_bin}:{os.environ['PATH']}"


def test_a_hung_engine_stops_the_watchdog_pings(daemon_factory, notify_socket, tmp_path):
    daemon = daemon_factory(extra_config="watchdog_stall_seconds = 3")
    daemon.start(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "1000000",
                      "PATH": hung_tesseract_path(tmp_path)})
    wait_for(lambda: notify_socket.lines().count("WATCHDOG=1") >= 2, 60, "pings while idle")
    drop(corpus_file("trivial.pdf"), daemon.inbox)
    wait_for(lambda: any(e.get("event", "").startswith("pipeline looks hung") for e in daemon.events()), 60,
             "the daemon to notice the hung page")
    pings_then = notify_socket.lines().count("WATCHDOG=1")
    time.sleep(3)
    assert notify_socket.lines().count("WATCHDOG=1") == pings_then, "no pings while the pipeline is hung"
    assert daemon.alive


def test_sigusr1_logs_where_every_task_waits_and_the_daemon_goes_on(daemon_factory, tmp_path):
    daemon = daemon_factory(extra_config="drain_seconds = 1").start(env={"PATH": hung_tesseract_path(tmp_path)})
    drop(corpus_file("trivial.pdf"), daemon.inbox)

    def latest_dump() -> dict[str, str] | None:
        # Asked again each time: on a busy machine the page may reach the (hung) engine late.
        dumps = [e["tasks"] for e in daemon.events() if e.get("event") == "tasks"]
        if dumps and any("engine/tesseract.py" in stack for stack in dumps[-1].values()):
            return dumps[-1]
        daemon.proc.send_signal(signal.SIGUSR1)
        return None

    tasks = wait_for(latest_dump, 60, "a task dump with the page at the engine", interval=1)
    assert {"intake-0", "retry", "hosts", "delivery", "tick", "watch:inbox"} <= set(tasks), sorted(tasks)
    # The document's worker is seen reading its pages, and the page's task waiting on the engine's program.
    assert any(name.startswith("worker-") and "in read_pages" in stack for name, stack in tasks.items()), tasks
    assert any("engine/tesseract.py" in stack and stack.endswith("awaiting a future") for stack in tasks.values()), tasks
    assert daemon.alive
    assert daemon.stop() == 0


def test_metrics_are_served_on_the_configured_address(daemon_factory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = daemon_factory(extra_config=f'metrics_address = "127.0.0.1:{port}"').start()
    drop(corpus_file("trivial.pdf"), daemon.inbox)
    wait_for(lambda: daemon.settled_all(1), 120, "a document")

    def metrics() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    # The worker counts a document once its journey has returned, a moment after the journal says
    # published (its folders are cleared in between): the count comes, not necessarily first.
    published = 'chandrad_documents_total{inbox="inbox",outcome="published"} 1.0'
    wait_for(lambda: published in metrics(), 30, "the published document counted")
    body = metrics()
    assert published in body
    assert 'chandrad_pages_total{outcome="ok"} 1.0' in body
    assert 'chandrad_stage_seconds_count{stage="page"} 1.0' in body
    assert "chandrad_queue_depth" in body and "chandrad_engine_restarts" in body
    assert "chandrad_ready 1.0" in body


def test_under_systemd_log_events_reach_journald_with_filterable_fields(daemon_factory, tmp_path):
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(str(tmp_path / "journal.sock"))
    journal.settimeout(0.5)
    daemon = daemon_factory(extra_config=f'journal_socket = "{tmp_path / "journal.sock"}"')
    daemon.config.write_text(daemon.config.read_text().replace('log_format = "json"', 'log_format = "auto"'))
    daemon.log_path.touch()
    st = daemon.log_path.stat()  # the daemon's stderr is this file: as if systemd had connected it
    proc_env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    entries: list[dict[str, str]] = []

    def read_entries() -> list[dict[str, str]]:
        while True:
            try:
                data = journal.recv(65536)
            except (TimeoutError, BlockingIOError):
                return entries
            entries.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))

    with open(daemon.log_path, "ab") as log:  # the child has its own copy of the descriptor
        daemon.proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(daemon.config)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **proc_env},
        )
    try:
        wait_for(lambda: any(e.get("MESSAGE") == "watching inbox" for e in read_entries()), 60, "journald entries")
        drop(corpus_file("trivial.pdf"), daemon.inbox)
        wait_for(lambda: any(e.get("MESSAGE") == "document published" for e in read_entries()), 120, "a document")
    finally:
        daemon.stop()
        journal.close()
    published = next(e for e in entries if e.get("MESSAGE") == "document published")
    assert published["INBOX"] == "inbox" and published["FILE"] == "trivial.pdf" and len(published["DOC"]) == 16
    assert published["PRIORITY"] == "6" and published["SYSLOG_IDENTIFIER"] == "chandrad"
    assert json.loads(published["CHANDRAD_JSON"])["doc"] == published["DOC"]
    pages = [e for e in entries if e.get("MESSAGE") == "page done"]
    assert pages and pages[0]["PAGE"] == "1"
