"""Webhooks and hooks (chandrad/delivery.py): recorded with the final state, sent by their own task.

A real HTTP server on loopback receives the webhooks; the daemon tests run ``chandrad run`` as a
child process (tesseract engine, tiny PDFs rendered at a low DPI so that pages take milliseconds).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import os
import socket
import sqlite3
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from chandrad.cli import main
from chandrad.config import HookSettings, InboxSettings, Settings, WebhookSettings, load_settings
from chandrad.errors import ConfigError
from chandrad.metrics import Metrics
from chandrad.output import delivery
from chandrad.output.delivery import Deliverer
from chandrad.storage.journal import Delivery, Journal, NewDelivery
from tests.conftest import DaemonProcess, corpus_file, drop, wait_for
from tests.reliability.chaoslib import simple_pdf

SECRET = "test-secret-\u00e9"


# -- a webhook receiver on loopback -------------------------------------------------------------


class Receiver:
    """A ThreadingHTTPServer that records every POST (arrival time, headers, body) and answers what
    ``answer(n)`` says for the n-th request (0-based), after ``delay`` seconds. It counts the
    connections open at once. ``port`` may be chosen before it starts (a receiver that is down)."""

    def __init__(
        self,
        answer: Callable[[int], int] = lambda n: 200,
        delay: float = 0.0,
        port: int = 0,
        headers: Callable[[int], dict[str, str]] = lambda n: {},
    ) -> None:
        self.answer = answer
        self.headers = headers
        self.delay = delay
        self.port = port or free_port()
        self.requests: list[dict[str, Any]] = []
        self.open_connections = 0
        self.max_open_connections = 0
        self.in_progress = 0
        self.max_in_progress = 0  # requests being answered at once
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: one connection carries many requests

            def setup(self) -> None:
                super().setup()
                with receiver._lock:
                    receiver.open_connections += 1
                    receiver.max_open_connections = max(receiver.max_open_connections, receiver.open_connections)

            def finish(self) -> None:
                with receiver._lock:
                    receiver.open_connections -= 1
                super().finish()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    number = len(receiver.requests)
                    receiver.requests.append(
                        {"at": time.monotonic(), "path": self.path, "headers": dict(self.headers), "body": body}
                    )
                    receiver.in_progress += 1
                    receiver.max_in_progress = max(receiver.max_in_progress, receiver.in_progress)
                if receiver.delay:
                    time.sleep(receiver.delay)
                with receiver._lock:
                    receiver.in_progress -= 1
                status = receiver.answer(number)
                text = b"" if status < 300 else b"no thanks"
                self.send_response(status)
                for name, value in receiver.headers(number).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def bodies(self) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(request["body"]) for request in self.requests]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(**kwargs: Any) -> Receiver:
        receiver = Receiver(**kwargs)
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.stop()


def verify(request: dict[str, Any], secret: str = SECRET) -> bool:
    """What a receiver does: recompute the HMAC of the raw body and compare in constant time."""
    expected = "sha256=" + hmac.new(secret.encode(), request["body"], hashlib.sha256).hexdigest()
    return hmac.compare_digest(request["headers"].get("X-Chandrad-Signature", ""), expected)


# -- configuration helpers ----------------------------------------------------------------------


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"  # JSON strings are TOML strings


FAST_PAGES = "[prepare]\ndpi = 72\nmin_short_side_px = 0\n"


def delivery_config(
    webhooks: list[dict[str, Any]] = (),  # type: ignore[assignment]
    hooks: list[dict[str, Any]] = (),  # type: ignore[assignment]
    backoff: float = 0.2,
    backoff_max: float = 1.0,
    concurrency: int = 8,
    top: str = "",
) -> str:
    """The daemon's extra_config: fast pages, the [delivery] table, [[webhook]] and [[hook]] tables."""
    text = f"{top}\n{FAST_PAGES}\n[delivery]\nconcurrency = {concurrency}\nbackoff_seconds = {backoff}\n"
    text += f"backoff_max_seconds = {backoff_max}\n"
    for table, targets in (("webhook", webhooks), ("hook", hooks)):
        for target in targets:
            text += f"\n[[{table}]]\n"
            for key, value in target.items():
                text += f"{key} = {toml_list(value) if isinstance(value, list) else json.dumps(value)}\n"
    return text


def tiny_pdf(label: str) -> bytes:
    return simple_pdf(1, label=label)


def deliveries(daemon: DaemonProcess) -> list[sqlite3.Row]:
    return daemon.journal_rows(
        "SELECT d.*, doc.rel_path FROM deliveries d JOIN documents doc ON doc.id = d.doc_id ORDER BY d.id"
    )


def documents(daemon: DaemonProcess) -> dict[str, sqlite3.Row]:
    return {row["rel_path"]: row for row in daemon.journal_rows("SELECT * FROM documents")}


def status_json(daemon: DaemonProcess) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["status", "--json", "--config", str(daemon.config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    return dict(json.loads(result.stdout))


def outbox_files(daemon: DaemonProcess, stem: str) -> list[str]:
    folder = daemon.outbox / stem
    return sorted(path.relative_to(daemon.outbox).as_posix() for path in folder.rglob("*") if path.is_file())


# -- units: signature, the transaction, planning, settings ---------------------------------------


def test_the_signature_is_sha256_and_the_hex_hmac_of_the_body():
    body = b'{"event":"published"}'
    assert delivery.sign("k", body) == "sha256=" + hmac.new(b"k", body, hashlib.sha256).hexdigest()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened = Journal(tmp_path / "journal.sqlite3")
    yield opened
    opened.close()


@pytest.fixture
def reader(journal: Journal) -> Iterator[Journal]:
    """A second connection to the same journal, for the test to read while the delivery task runs:
    the daemon uses a connection from one thread only (``Journal.call``), and so must the test."""
    opened = Journal(journal.path)
    yield opened
    opened.close()


def test_publish_commits_the_state_and_its_deliveries_together_or_neither(journal: Journal):
    doc = journal.add_document("scans", "a.pdf", "sha-a", 1, 1)
    journal.set_state(doc.id, "publishing", claimed_path="/c/a.pdf", output_dir="/out/a")
    broken = NewDelivery("webhook", "erp", "published", None)  # type: ignore[arg-type]  # NOT NULL fails
    with pytest.raises(sqlite3.IntegrityError):
        journal.publish(doc.id, [NewDelivery("hook", "dms", "published", "{}"), broken])
    assert journal.get(doc.id).state == "publishing", "the state change was rolled back with the inserts"
    assert journal.deliveries() == []
    published = journal.publish(doc.id, [NewDelivery("webhook", "erp", "published", '{"x":1}')])
    assert published.state == "published"
    [row] = journal.deliveries()
    assert (row.doc_id, row.kind, row.target, row.state, row.attempts, row.payload) == (
        doc.id, "webhook", "erp", "pending", 0, '{"x":1}'
    )


def test_fail_appends_the_error_counts_the_attempt_and_records_the_deliveries(journal: Journal):
    doc = journal.add_document("scans", "b.pdf", "sha-b", 1, 1)
    entry = {"reason": "broken", "kind": "permanent", "stage": "prepare", "attempt": 1, "at": "now"}
    failed = journal.fail(doc.id, entry, [NewDelivery("hook", "notify", "failed", "{}")])
    assert (failed.state, failed.attempts, failed.error, failed.history) == ("failed", 1, entry, [entry])
    assert [(d.kind, d.target, d.event) for d in journal.deliveries(doc_id=doc.id)] == [("hook", "notify", "failed")]


def test_targets_follow_their_events_their_inboxes_and_the_list_an_inbox_or_rule_gives(tmp_path: Path):
    settings = Settings(
        state_dir=tmp_path,
        inbox=(
            InboxSettings.model_validate({"path": tmp_path / "a" / "in", "name": "scans"}),
            InboxSettings.model_validate({"path": tmp_path / "b" / "in", "name": "mail", "hooks": ["dms"],
                                          "rule": [{"match": "quiet/**", "webhooks": [], "hooks": []}]}),
        ),
        webhook=(
            WebhookSettings(url="http://127.0.0.1:1/all"),
            WebhookSettings(url="http://127.0.0.1:1/scans", name="scans-only", inboxes=("scans",), events=("failed",)),
        ),
        hook=(HookSettings(command=("/bin/true",), name="dms"), HookSettings(command=("/bin/false",), name="other")),
    )
    scans, mail = settings.inbox

    def names(inbox: InboxSettings, event: str) -> tuple[list[str], list[str]]:
        webhooks, hooks = delivery.targets(settings, inbox, event)
        return [w.name for w in webhooks], [h.name for h in hooks]

    assert names(scans, "published") == (["http://127.0.0.1:1/all"], ["dms", "other"])
    assert names(scans, "failed") == (["http://127.0.0.1:1/all", "scans-only"], ["dms", "other"])
    assert names(mail, "failed") == (["http://127.0.0.1:1/all"], ["dms"])
    assert names(mail.effective("quiet/x.pdf"), "published") == ([], [])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[webhook]]\nurl = "ftp://example.com/x"\n', "http:// or https://"),
        ('[[webhook]]\nurl = "http://example.com/x"\nretries = 3\n', "webhook.0.retries: unknown key"),
        ('[[webhook]]\nurl = "http://example.com/x"\nevents = ["done"]\n', "events"),
        ('[[hook]]\ncommand = "cp $CHANDRAD_FILES /dms"\n', "argument list"),
        ('[[hook]]\ncommand = ["/bin/true"]\nshell = true\n', "hook.0.shell: unknown key"),
        ('[[hook]]\ncommand = ["/bin/a"]\nname = "x"\n[[hook]]\ncommand = ["/bin/b"]\nname = "x"\n', "unique"),
        ('[delivery]\nconcurency = 3\n', "delivery.concurency: unknown key"),
        ('[[inbox]]\npath = "{tmp}/in"\nwebhooks = ["nope"]\n', "name no \\[\\[webhook\\]\\]"),
        ('[[webhook]]\nurl = "http://e.com/"\ninboxes = ["nope"]\n[[inbox]]\npath = "{tmp}/in"\n', "not configured"),
    ],
)
def test_webhook_hook_and_delivery_settings_are_refused_with_a_message_naming_the_problem(tmp_path, text, message):
    config = tmp_path / "config.toml"
    config.write_text(text.format(tmp=tmp_path))
    with pytest.raises(ConfigError, match=message):
        load_settings(config)


def test_check_fails_a_hook_whose_program_is_missing_and_lists_the_webhooks(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        f'state_dir = "{tmp_path}/state"\n[engine]\nkind = "tesseract"\n[[inbox]]\npath = "{tmp_path}/in"\n'
        '[[hook]]\nname = "gone"\ncommand = ["/nonexistent/to-dms"]\n'
        '[[hook]]\nname = "ok"\ncommand = ["true"]\nevents = ["failed"]\n'
        '[[webhook]]\nurl = "https://erp.example.com/in"\nname = "erp"\nsecret = "x"\n'
    )
    result = CliRunner().invoke(main, ["check", "--config", str(config)])
    assert "[FAIL] hook gone: /nonexistent/to-dms is not an executable program" in result.stdout
    assert "[ok] hook ok: " in result.stdout and "(failed)" in result.stdout
    assert "[ok] webhook erp: published, failed, signed" in result.stdout
    assert result.exit_code == 1


def test_the_secret_is_not_in_the_settings_repr():
    assert SECRET not in repr(WebhookSettings(url="https://example.com/", secret=SECRET))


# -- the delivery task in this process, against a real receiver ------------------------------------


def settings_for(tmp_path: Path, receiver_url: str, **webhook: Any) -> Settings:
    return Settings(
        state_dir=tmp_path,
        webhook=(WebhookSettings(url=receiver_url, name="r", **webhook),),
        delivery={"backoff_seconds": 0.1, "backoff_max_seconds": 0.5, "concurrency": 8},  # type: ignore[arg-type]
    )


def published_with(journal: Journal, rel_path: str, *deliveries: NewDelivery) -> str:
    doc = journal.add_document("scans", rel_path, f"sha-{rel_path}", 1, 1)
    journal.publish(doc.id, list(deliveries))
    return doc.id


async def deliver_until(
    deliverer: Deliverer, done: Callable[[], bool], within: float = 60, probe: Callable[[], None] = lambda: None
) -> None:
    task = asyncio.create_task(deliverer.run())
    try:
        deadline = time.monotonic() + within
        while not done():
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, "deliveries did not finish in time"
            probe()
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def states(journal: Journal) -> list[str]:
    return [d.state for d in journal.deliveries(limit=10_000)]


async def test_408_and_429_are_retried_until_the_receiver_takes_it(tmp_path, journal, reader, receivers):
    receiver = receivers(answer=lambda n: [408, 429, 200][n]).start()
    published_with(journal, "a.pdf", NewDelivery("webhook", "r", "published", '{"a":1}'))
    metrics = Metrics()
    deliverer = Deliverer(lambda: settings_for(tmp_path, receiver.url), journal, metrics)

    def counted(outcome: str) -> float | None:
        return metrics.registry.get_sample_value("chandrad_deliveries_total", {"kind": "webhook", "outcome": outcome})

    # The counter follows the journal's commit by a turn of the loop (failed once under load when
    # only the journal was waited for).
    await deliver_until(deliverer, lambda: states(reader) == ["delivered"] and counted("delivered") is not None)
    [row] = journal.deliveries()
    assert (row.attempts, row.last_status, len(receiver.requests)) == (3, 200, 3)
    totals = {outcome: counted(outcome) for outcome in ("retried", "delivered", "failed")}
    assert totals == {"retried": 2.0, "delivered": 1.0, "failed": None}


async def test_a_429_with_retry_after_waits_at_least_that_long(tmp_path, journal, reader, receivers):
    receiver = receivers(answer=lambda n: 429 if n == 0 else 204, headers=lambda n: {"Retry-After": "1"}).start()
    published_with(journal, "b.pdf", NewDelivery("webhook", "r", "published", "{}"))
    settings = settings_for(tmp_path, receiver.url)
    settings = settings.model_copy(update={"delivery": settings.delivery.model_copy(update={"backoff_max_seconds": 5})})
    await deliver_until(Deliverer(lambda: settings, journal), lambda: states(reader) == ["delivered"])
    first, second = (request["at"] for request in receiver.requests)
    assert second - first >= 0.95, "Retry-After: 1 wins over the 0.1 s backoff"


async def test_a_delivery_past_max_age_hours_is_given_up_after_its_failed_attempt(tmp_path, journal, reader):
    published_with(journal, "c.pdf", NewDelivery("webhook", "r", "published", "{}"))
    down = f"http://127.0.0.1:{free_port()}/"
    later = time.time() + 2 * 3600  # the delivery is two hours old by this clock
    deliverer = Deliverer(lambda: settings_for(tmp_path, down, max_age_hours=1), journal, clock=lambda: later)
    await deliver_until(deliverer, lambda: states(reader) == ["failed"])
    [row] = journal.deliveries()
    assert row.attempts == 1 and "ConnectError" in (row.last_error or "")


async def test_a_target_removed_from_the_configuration_ends_its_deliveries(tmp_path, journal, reader, receivers):
    receiver = receivers().start()
    published_with(journal, "d.pdf", NewDelivery("webhook", "gone-from-config", "published", "{}"))
    deliverer = Deliverer(lambda: settings_for(tmp_path, receiver.url), journal)
    await deliver_until(deliverer, lambda: states(reader) == ["failed"])
    assert "any more" in (journal.deliveries()[0].last_error or "")
    assert receiver.requests == []


async def test_a_burst_of_1000_deliveries_to_a_slow_receiver_all_arrive_with_connections_and_memory_bounded(
    tmp_path, journal, reader, receivers
):
    receiver = receivers(delay=0.01).start()
    payload = json.dumps({"event": "published", "files": [f"doc/page-{n}.md" for n in range(20)]})
    for n in range(1000):
        published_with(journal, f"burst/{n:04d}.pdf", NewDelivery("webhook", "r", "published", payload))
    concurrency = 8
    settings = settings_for(tmp_path, receiver.url).model_copy(
        update={"delivery": Settings().delivery.model_copy(update={"concurrency": concurrency})}
    )
    deliverer = Deliverer(lambda: settings, journal)
    in_hand: list[int] = []
    tracemalloc.start()
    try:
        await deliver_until(
            deliverer,
            lambda: reader.delivery_counts() == {"delivered": 1000},
            within=150,
            probe=lambda: in_hand.append(deliverer.in_hand),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(receiver.requests) == 1000
    assert len({json.loads(r["body"])["event"] for r in receiver.requests}) == 1
    assert max(in_hand) <= concurrency, "never more deliveries in hand than delivery.concurrency"
    assert receiver.max_in_progress <= concurrency, "never more requests at once than delivery.concurrency"
    assert receiver.max_open_connections <= concurrency, "never more connections than delivery.concurrency"
    assert peak < 40 * 2**20, f"memory grew with the backlog: {peak / 2**20:.1f} MiB traced at the peak"


async def test_a_hook_gets_its_variables_and_its_output_is_logged(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")  # the daemon's, not the hook's
    out = tmp_path / "env.json"
    script = "import json, os, sys; json.dump({k: v for k, v in os.environ.items() if k.startswith('CHANDRAD_') "
    script += "or k == 'NOTIFY_SOCKET'}, "
    script += "open(sys.argv[1], 'w')); print('copied', os.environ['CHANDRAD_SOURCE'])"
    hook = HookSettings(command=(sys.executable, "-c", script, str(out)), name="dms")
    environment = {"CHANDRAD_EVENT": "published", "CHANDRAD_SOURCE": "in voice/é.pdf", "CHANDRAD_FILES": "/a\n/b c"}
    row = Delivery(1, "doc", "hook", "dms", "published", json.dumps(environment), "pending", 0, 0, None, None, 0, 0)
    import structlog.testing

    with structlog.testing.capture_logs() as logs:
        attempt = await delivery.run_hook(hook, row)
    assert attempt.ok and attempt.status == 0
    assert json.loads(out.read_text()) == environment
    assert {"event": "hook output", "hook": "dms", "line": "copied in voice/é.pdf", "log_level": "info"} in logs


async def test_a_hook_past_its_timeout_has_its_whole_process_group_ended(tmp_path):
    pidfile = tmp_path / "child.pid"
    hook = HookSettings(command=("sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"), name="hangs", timeout_seconds=1)
    row = Delivery(1, "doc", "hook", "hangs", "failed", "{}", "pending", 0, 0, None, None, 0, 0)
    attempt = await delivery.run_hook(hook, row)
    assert not attempt.ok and "still running after 1 s" in (attempt.error or "")
    wait_for(lambda: not process_alive(int(pidfile.read_text())), 10, "the hook's child to be ended too")


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- the real daemon ----------------------------------------------------------------------------


def test_three_documents_and_an_invalid_pdf_give_three_published_and_one_failed_signed_deliveries(
    daemon_factory, receivers
):
    receiver = receivers().start()
    daemon = daemon_factory(
        extra_config=delivery_config(webhooks=[{"url": receiver.url, "name": "erp", "secret": SECRET}])
    ).start()
    names = ["linn.pdf", "trivial.pdf", "c02-22.pdf", "invalid.pdf"]
    for name in names:
        drop(corpus_file(name), daemon.inbox)
    wait_for(lambda: len(receiver.requests) >= 4 or not daemon.alive, 180, "four deliveries")
    assert daemon.alive
    docs = documents(daemon)
    bodies = {body["source"]: body for body in receiver.bodies()}
    assert sorted(bodies) == sorted(names) and len(receiver.requests) == 4
    assert all(verify(request) for request in receiver.requests), "every signature verifies with the secret"
    assert not any(verify(request, "another secret") for request in receiver.requests)
    for name in names:
        body, doc = bodies[name], docs[name]
        assert body["doc_id"] == doc["id"] and body["inbox"] == "inbox" and body["sha256"] == doc["sha256"]
        assert body["engine"] == "tesseract" and body["model"] and body["finished_at"].endswith("Z")
        stem = Path(name).stem
        if name == "invalid.pdf":
            assert (body["event"], doc["state"]) == ("failed", "failed")
            assert "not a readable PDF" in body["reason"] and body["kind"] == "permanent"
            assert body["failed_file"] == "invalid.pdf" and (daemon.failed / "invalid.pdf").exists()
            assert body["output_dir"] is None and body["files"] == []
        else:
            assert (body["event"], doc["state"], body["pages"]) == ("published", "published", 1)
            assert body["output_dir"] == stem and body["reason"] is None
            assert body["files"] == outbox_files(daemon, stem), "the body names the document's files"
            assert {f"{stem}/{stem}.md", f"{stem}/{stem}.json"} <= set(body["files"])
    headers = receiver.requests[0]["headers"]
    assert headers["Content-Type"] == "application/json" and headers["X-Chandrad-Event"] in ("published", "failed")
    wait_for(lambda: {row["state"] for row in deliveries(daemon)} == {"delivered"}, 30, "all marked delivered")
    assert daemon.stop() == 0


def test_a_receiver_that_is_down_while_documents_publish_gets_every_delivery_once_it_is_up(
    daemon_factory, receivers
):
    receiver = receivers()  # not started: connections are refused
    daemon = daemon_factory(extra_config=delivery_config(webhooks=[{"url": receiver.url, "name": "erp"}])).start()
    for n in range(3):
        (daemon.inbox / f"scan{n}.pdf").write_bytes(tiny_pdf(f"scan {n}"))
    wait_for(
        lambda: list(documents(daemon)) and {row["state"] for row in documents(daemon).values()} == {"published"}
        and len(documents(daemon)) == 3,
        120,
        "three documents published while the receiver is down",
    )
    wait_for(lambda: len(deliveries(daemon)) == 3 and all(r["attempts"] >= 2 for r in deliveries(daemon)), 60,
             "each delivery tried and retried")
    assert {row["state"] for row in deliveries(daemon)} == {"pending"}
    assert all("ConnectError" in row["last_error"] for row in deliveries(daemon))
    receiver.start()
    wait_for(lambda: {row["state"] for row in deliveries(daemon)} == {"delivered"}, 60, "every delivery")
    ids = {row["id"] for row in documents(daemon).values()}
    assert {body["doc_id"] for body in receiver.bodies()} == ids
    assert daemon.stop() == 0


def test_kill_9_after_the_final_commit_and_before_delivery_sends_it_after_the_restart(daemon_factory, receivers):
    receiver = receivers()  # down: the delivery cannot be sent before the kill
    daemon = daemon_factory(extra_config=delivery_config(webhooks=[{"url": receiver.url, "name": "erp"}])).start()
    (daemon.inbox / "contract.pdf").write_bytes(tiny_pdf("contract"))
    wait_for(lambda: any(row["attempts"] >= 1 for row in deliveries(daemon)), 120, "the delivery tried once")
    [doc] = documents(daemon).values()
    assert doc["state"] == "published"
    daemon.kill9()
    assert [row["state"] for row in deliveries(daemon)] == ["pending"]
    receiver.start()
    daemon.start()
    wait_for(lambda: [row["state"] for row in deliveries(daemon)] == ["delivered"], 60, "delivery after the restart")
    assert [body["doc_id"] for body in receiver.bodies()] == [doc["id"]], "sent once, with the same doc_id"
    assert len(documents(daemon)) == 1, "the document itself was not processed again"
    assert daemon.stop() == 0


def test_a_410_gets_one_request_and_a_500_gets_retries_with_growing_gaps(daemon_factory, receivers):
    gone = receivers(answer=lambda n: 410).start()
    flaky = receivers(answer=lambda n: 500 if n < 4 else 200).start()
    base = 0.5
    daemon = daemon_factory(
        extra_config=delivery_config(
            webhooks=[{"url": gone.url, "name": "gone"}, {"url": flaky.url, "name": "flaky"}],
            backoff=base,
            backoff_max=8.0,
        )
    ).start()
    (daemon.inbox / "memo.pdf").write_bytes(tiny_pdf("memo"))
    wait_for(lambda: len(flaky.requests) >= 5, 120, "the flaky receiver's fifth request")
    times = [request["at"] for request in flaky.requests]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    for number, gap in enumerate(gaps):
        # Lower bounds only: a loaded machine makes gaps longer, never shorter than the backoff.
        assert gap >= 0.9 * base * 2**number, f"gap {number + 1} was {gap:.2f} s: {gaps}"
    rows = {row["target"]: row for row in deliveries(daemon)}
    wait_for(lambda: {r["target"]: r["state"] for r in deliveries(daemon)} == {"gone": "failed", "flaky": "delivered"},
             30, "both deliveries settled")
    rows = {row["target"]: row for row in deliveries(daemon)}
    assert (rows["gone"]["attempts"], rows["gone"]["last_status"]) == (1, 410)
    assert (rows["flaky"]["attempts"], rows["flaky"]["last_status"]) == (5, 200)
    assert len(gone.requests) == 1, "a 410 is never retried"
    report = status_json(daemon)
    assert [(d["target"], d["status"]) for d in report["failed_deliveries"]] == [("gone", 410)]
    assert report["deliveries"] == {"delivered": 1, "failed": 1}
    logged = [e for e in daemon.events() if e.get("event") == "delivery given up"]
    assert logged and logged[0]["status"] == 410 and logged[0]["target"] == "gone"
    assert daemon.stop() == 0


def test_a_failing_and_a_hanging_hook_leave_documents_where_they_went_and_show_as_failed_hooks(
    daemon_factory, tmp_path
):
    envs = tmp_path / "envs"
    envs.mkdir()
    record = (
        "import json, os, sys; json.dump({k: v for k, v in os.environ.items() if k.startswith('CHANDRAD_')}, "
        "open(os.path.join(sys.argv[1], os.environ['CHANDRAD_DOC_ID'] + '.json'), 'w'))"
    )
    hooks = [
        {"name": "fails", "command": ["sh", "-c", 'echo "hook says $CHANDRAD_EVENT $CHANDRAD_SOURCE"; exit 1']},
        {"name": "hangs", "command": ["sh", "-c", f"sleep 300 & echo $! > {envs}/$CHANDRAD_DOC_ID.pid; wait"],
         "timeout_seconds": 1},
        {"name": "records", "command": [sys.executable, "-c", record, str(envs)]},
    ]
    daemon = daemon_factory(extra_config=delivery_config(hooks=hooks)).start()
    (daemon.inbox / "letter.pdf").write_bytes(tiny_pdf("letter"))
    drop(corpus_file("invalid.pdf"), daemon.inbox)
    wait_for(lambda: len(deliveries(daemon)) == 6 and all(r["state"] != "pending" for r in deliveries(daemon)), 120,
             "every hook run for both documents")
    docs = documents(daemon)
    assert (docs["letter.pdf"]["state"], docs["invalid.pdf"]["state"]) == ("published", "failed")
    assert (daemon.outbox / "letter" / "letter.md").exists() and (daemon.archive / "letter.pdf").exists()
    assert (daemon.failed / "invalid.pdf").exists()
    outcome = {(r["rel_path"], r["target"]): (r["state"], r["last_status"]) for r in deliveries(daemon)}
    for name in ("letter.pdf", "invalid.pdf"):
        assert outcome[(name, "fails")] == ("failed", 1)
        assert outcome[(name, "hangs")][0] == "failed"
        assert outcome[(name, "records")] == ("delivered", 0)
    failed = status_json(daemon)["failed_deliveries"]
    assert sorted((d["file"], d["target"]) for d in failed) == [
        ("invalid.pdf", "fails"), ("invalid.pdf", "hangs"), ("letter.pdf", "fails"), ("letter.pdf", "hangs")
    ]
    assert {d["error"] for d in failed if d["target"] == "hangs"} == {
        "still running after 1 s (timeout_seconds); ended"
    }
    text = CliRunner().invoke(main, ["status", "--config", str(daemon.config)]).stdout
    assert "failed hook fails (published)" in text and "failed hook hangs (failed)" in text
    for pidfile in envs.glob("*.pid"):
        wait_for(lambda pidfile=pidfile: not process_alive(int(pidfile.read_text())), 10, "the hang's child ended")
    said = [e["line"] for e in daemon.events() if e.get("event") == "hook output" and e.get("hook") == "fails"]
    assert sorted(said) == ["hook says failed invalid.pdf", "hook says published letter.pdf"]
    published = json.loads((envs / f"{docs['letter.pdf']['id']}.json").read_text())
    assert published["CHANDRAD_EVENT"] == "published" and published["CHANDRAD_SOURCE"] == "letter.pdf"
    assert published["CHANDRAD_OUTPUT_DIR"] == str(daemon.outbox / "letter") and published["CHANDRAD_REASON"] == ""
    assert all(Path(path).is_file() for path in published["CHANDRAD_FILES"].splitlines())
    assert str(daemon.outbox / "letter" / "letter.md") in published["CHANDRAD_FILES"].splitlines()
    failure = json.loads((envs / f"{docs['invalid.pdf']['id']}.json").read_text())
    assert "not a readable PDF" in failure["CHANDRAD_REASON"] and failure["CHANDRAD_KIND"] == "permanent"
    assert failure["CHANDRAD_FAILED_FILE"] == str(daemon.failed / "invalid.pdf") and failure["CHANDRAD_FILES"] == ""
    assert daemon.stop() == 0


# 300 documents through the whole daemon: the delivery task alone takes 1 000 in the test above;
# here the point is that a burst through intake, engine and delivery stays bounded end to end.
@pytest.mark.timeout(600)  # ~35 s on two cores; more under load
def test_a_burst_of_300_small_documents_with_a_slow_receiver_is_all_delivered_with_memory_and_connections_bounded(
    daemon_factory, receivers
):
    import psutil

    DOCUMENTS = 300
    receiver = receivers(delay=0.2).start()
    concurrency = 4
    daemon = daemon_factory(
        extra_config=delivery_config(webhooks=[{"url": receiver.url, "name": "slow"}], concurrency=concurrency),
        inbox_config="settle_seconds = 0.5\n",
    ).start()
    for n in range(DOCUMENTS):
        path = daemon.inbox / f"b{n:04d}.pdf"
        path.with_suffix(".part").write_bytes(tiny_pdf(f"burst {n}"))
        os.replace(path.with_suffix(".part"), path)
    process = psutil.Process(daemon.proc.pid)  # type: ignore[union-attr]
    peak_rss = 0

    def all_delivered() -> bool:
        nonlocal peak_rss
        peak_rss = max(peak_rss, process.memory_info().rss)
        rows = daemon.journal_rows("SELECT state, COUNT(*) AS n FROM deliveries GROUP BY state")
        return {row["state"]: row["n"] for row in rows} == {"delivered": DOCUMENTS}

    wait_for(all_delivered, 540, f"{DOCUMENTS} deliveries", interval=1.0)
    assert len({body["doc_id"] for body in receiver.bodies()}) == DOCUMENTS
    assert receiver.max_in_progress <= concurrency, "never more requests at once than delivery.concurrency"
    # Kept-alive connections idle past httpx's expiry are replaced: the receiver may see a new one
    # before it notices the old one's close. Bounded, not one per document.
    assert receiver.max_open_connections <= 2 * concurrency
    assert peak_rss < 600 * 2**20, f"the daemon grew to {peak_rss / 2**20:.0f} MiB"
    assert daemon.stop() == 0


# -- docs/integrations.md's examples work as written ---------------------------------------------


def doc_block(language: str, containing: str) -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    blocks = [block.split("\n", 1)[1] for block in text.split("```")[1::2] if block.startswith(language + "\n")]
    return next(block for block in blocks if containing in block)


async def test_the_receiver_in_the_integrations_doc_takes_signed_deliveries_and_refuses_bad_signatures(
    tmp_path, journal, reader
):
    script = tmp_path / "receiver.py"
    script.write_text(doc_block("python", "X-Chandrad-Signature"))
    port = free_port()
    env = {**os.environ, "CHANDRAD_WEBHOOK_SECRET": SECRET, "PORT": str(port)}
    process = await asyncio.create_subprocess_exec(sys.executable, str(script), env=env, stdout=asyncio.subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/chandrad"
        wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 10, "the receiver to listen")
        body = json.dumps({"event": "published", "doc_id": "d1", "inbox": "scans", "source": "a.pdf",
                           "output_dir": "a", "reason": None})
        published_with(journal, "a.pdf", NewDelivery("webhook", "signed", "published", body))
        published_with(journal, "b.pdf", NewDelivery("webhook", "forged", "published", body))
        settings = Settings(
            state_dir=tmp_path,
            webhook=(WebhookSettings(url=url, name="signed", secret=SECRET),
                     WebhookSettings(url=url, name="forged", secret="not the secret")),
        )
        await deliver_until(Deliverer(lambda: settings, journal), lambda: "pending" not in states(reader))
        outcome = {d.target: (d.state, d.last_status) for d in journal.deliveries()}
        assert outcome == {"signed": ("delivered", 204), "forged": ("failed", 401)}
        assert process.stdout is not None
        assert await asyncio.wait_for(process.stdout.readline(), 10) == b"published: scans/a.pdf -> a\n"
    finally:
        process.kill()
        await process.wait()


def test_the_dms_hook_in_the_integrations_doc_copies_the_searchable_pdf(tmp_path):
    script = tmp_path / "chandrad-to-dms"
    script.write_text(doc_block("sh", "CHANDRAD_FILES"))
    script.chmod(0o755)
    outputs, consume = tmp_path / "out" / "scan", tmp_path / "consume"
    outputs.mkdir(parents=True)
    consume.mkdir()
    (outputs / "scan.pdf").write_bytes(b"%PDF-1.7 searchable")
    (outputs / "scan.md").write_text("text")
    env = {**os.environ, "CHANDRAD_EVENT": "published", "CHANDRAD_DOC_ID": "d1", "CHANDRAD_SOURCE": "scan.pdf",
           "CHANDRAD_FILES": f"{outputs / 'scan.md'}\n{outputs / 'scan.pdf'}"}
    import subprocess

    done = subprocess.run([str(script), str(consume)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in consume.iterdir()] == ["d1-scan.pdf"]
    assert (consume / "d1-scan.pdf").read_bytes() == b"%PDF-1.7 searchable"
    without = subprocess.run([str(script), str(consume)], env={**env, "CHANDRAD_FILES": str(outputs / "scan.md")},
                             capture_output=True, text=True, timeout=30)
    assert without.returncode == 1 and "add \"pdf\"" in without.stderr
