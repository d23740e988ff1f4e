"""Shared fixtures: the real daemon as a subprocess, corpus access, and a polling helper."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from chandrad.engine.processes import kill_tree

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "corpus"


def pytest_configure(config: pytest.Config) -> None:
    """The session's figures file (see ``pytest_terminal_summary``), named in the environment that
    pytest-xdist's workers inherit; the main process makes it, a worker finds it set."""
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_CHANDRAD_FIGURES"):
        return
    figures = Path(tempfile.gettempdir()) / f"chandrad-test-figures-{os.getpid()}.jsonl"
    figures.unlink(missing_ok=True)
    os.environ["PYTEST_CHANDRAD_FIGURES"] = str(figures)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    """Print the figures the reliability scenarios recorded (``chaoslib.record_figures``), whichever
    worker ran them; CHANDRAD_RELIABILITY_FIGURES=FILE also appends them to FILE."""
    if hasattr(config, "workerinput"):
        return
    figures = Path(os.environ.get("PYTEST_CHANDRAD_FIGURES", "/nonexistent"))
    rows = figures.read_text(encoding="utf-8").splitlines() if figures.is_file() else []
    if not rows:
        return
    terminalreporter.section("reliability figures")
    for row in rows:
        terminalreporter.write_line(row)
    out = os.environ.get("CHANDRAD_RELIABILITY_FIGURES")
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write("\n".join(rows) + "\n")


DAEMON_LOG_LINES_ON_FAILURE = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    """A failed test that ran real daemons shows the end of each one's log in its report: CI keeps
    only what pytest printed, and "timed out waiting for ..." alone does not say what the daemon did."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    factory = getattr(item, "funcargs", {}).get("daemon_factory")
    for number, daemon in enumerate(getattr(factory, "made", ()), 1):
        if not daemon.log_path.exists():
            continue
        lines = daemon.log_path.read_text(errors="replace").splitlines()[-DAEMON_LOG_LINES_ON_FAILURE:]
        report.sections.append((f"daemon {number}: its log's last {len(lines)} lines", "\n".join(
            line if len(line) <= 400 else line[:400] + " …" for line in lines
        )))


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """Undo ``configure_logging`` after each test: a command run in-process (``CliRunner``) points
    structlog at its captured stderr, which is gone once the command returns."""
    yield
    structlog.reset_defaults()


def corpus_file(name: str) -> Path:
    path = CORPUS / name
    if not path.exists():
        pytest.fail(f"test corpus file {path} is missing: the shared corpus must sit beside the repository")
    return path


def once_with_tesseract(folder: Path, files: list[Path], config: str = "", formats: str = "md,json,pdf") -> Path:
    """``chandrad once`` as a person runs it (its own process, the tesseract engine) with an inbox
    configured by ``config`` (TOML lines of the [[inbox]] table); the output folder."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.toml"
    config_path.write_text(f'state_dir = "{folder}/state"\n[[inbox]]\npath = "{folder}/in"\n{config}')
    out = folder / "out"
    done = subprocess.run(
        [sys.executable, "-m", "chandrad", "once", "--engine", "tesseract", "--formats", formats,
         "--config", str(config_path), "-o", str(out), *map(str, files)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return out


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    """Poll until ``predicate`` is truthy; fail the test naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


# Two vLLM engines starting side by side on the CPU build (replicas) took over 60 s while another
# test file ran beside them (make test runs two at a time): a generous bound, only spent on failure.
START_TIMEOUT_SECONDS = 180


def _walk(base: Path) -> Iterator[tuple[Path, bool]]:
    """Every path below ``base`` and whether it is a folder. os.walk, not rglob: the daemon clears a
    document's folders while a test polls, and rglob raised on a folder removed mid-walk."""
    for folder, dirnames, filenames in os.walk(base):
        yield from ((Path(folder) / name, True) for name in dirnames)
        yield from ((Path(folder) / name, False) for name in filenames)


class DaemonProcess:
    """``chandrad run`` in a child process, on a throwaway inbox/outbox/archive/failed tree."""

    def __init__(
        self, root: Path, extra_config: str = "", inbox_config: str = "", engine_config: str = 'kind = "tesseract"'
    ) -> None:
        self.root = root
        self.inbox = root / "inbox"
        self.outbox = root / "outbox"
        self.archive = root / "archive"
        self.failed = root / "failed"
        self.state = root / "state"
        self.config = root / "config.toml"
        self.log_path = root / "daemon.log"
        self.config.write_text(
            f'state_dir = "{self.state}"\nlog_format = "json"\nretry_backoff_seconds = 1\n'
            + ("" if "metrics_address" in extra_config else 'metrics_address = ""\n')
            + f"{extra_config}\n"
            + f'[engine]\n{engine_config}\n\n'
            f'[[inbox]]\npath = "{self.inbox}"\nrescan_seconds = 5\n{inbox_config}\n'
            + ("" if "settle_seconds" in inbox_config else "settle_seconds = 1\n")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None, wait_until_watching: bool = True) -> DaemonProcess:
        # PYTHONFAULTHANDLER: a daemon that does not stop is sent SIGABRT (``stop``), and every
        # thread's stack lands in its log: a rare hang at SIGTERM was seen without any.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
        with open(self.log_path, "ab") as log:  # the child has its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chandrad", "run", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
            )
        if not wait_until_watching:
            return self
        wait_for(lambda: any(e.get("event") == "watching inbox" for e in self.events()) or self._died(),
                 START_TIMEOUT_SECONDS, "the daemon to start watching")
        assert self.alive, f"daemon exited at start:\n{self.log_path.read_text()[-3000:]}"
        return self

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def events(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    def stop(self, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # What its tasks wait on (if the event loop still turns), then its threads' stacks (faulthandler).
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            tasks = [e.get("tasks") for e in self.events() if e.get("event") == "tasks"]
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(10)
            stacks = self.log_path.read_text(errors="replace").rpartition("Fatal Python error")[2]
            pytest.fail(f"the daemon did not stop within {timeout:.0f} s of SIGTERM; its tasks:\n"
                        f"{json.dumps(tasks[-1:], indent=1)[-8000:]}\nits threads:\n{stacks[-6000:]}")

    def kill9(self, leave_children: bool = False) -> None:
        """SIGKILL the daemon and its children, as systemd ends a unit's cgroup; with
        ``leave_children``, the daemon alone, as a crash of a daemon started by hand does."""
        assert self.proc is not None
        if leave_children:
            self.proc.send_signal(signal.SIGKILL)
        else:
            kill_tree(self.proc.pid)  # children first, while the daemon lives: their pids cannot be reused yet
        self.proc.wait(10)

    def journal_rows(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        db_path = self.state / "journal.sqlite3"
        if not db_path.exists():
            return []
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        db.row_factory = sqlite3.Row
        try:
            return db.execute(sql, params).fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            db.close()

    def states(self) -> dict[str, str]:
        return {row["rel_path"]: row["state"] for row in self.journal_rows("SELECT rel_path, state FROM documents")}

    def settled_all(self, count: int) -> bool:
        final = [s for s in self.states().values() if s in ("published", "failed")]
        return len(final) >= count

    def leftovers_once_cleared(self, timeout: float = 10.0) -> list[Path]:
        """``leftovers()`` after giving the daemon up to ``timeout`` s to clear them: a document's
        folders are removed just after its final state is committed, so a test that has just seen
        every row final can look in between (seen once in CI). What is still there then is left."""
        deadline = time.monotonic() + timeout
        while (found := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return found

    def leftovers(self) -> list[Path]:
        """Anything the daemon left half-done: staging dirs, claimed files, temp files."""
        found = []
        for base in (self.outbox / ".chandrad" / "staging", self.inbox / ".chandrad" / "claimed"):
            for path, is_dir in _walk(base):
                within = path.relative_to(base).parts
                if len(within) == 1 and is_dir:
                    continue  # a host's own folder (claims, staging): it stays
                if len(within) == 2 and within[1] == "heartbeat":
                    continue  # a host's heartbeat
                found.append(path)
        for base in (self.outbox, self.archive, self.failed):
            found += [path for path, _ in _walk(base) if path.name.endswith(".tmp")]
        return found


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(**kwargs: str) -> DaemonProcess:
        daemon = DaemonProcess(tmp_path, **kwargs)
        made.append(daemon)
        return daemon

    make.made = made  # type: ignore[attr-defined]  # for pytest_runtest_makereport's log tail
    yield make
    for daemon in made:
        if daemon.alive:
            daemon.kill9()


def drop(source: Path, inbox: Path, name: str | None = None) -> Path:
    """Copy a file into the inbox the way a person does: write under a temp name, then rename."""
    target = inbox / (name or source.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)
    return target
