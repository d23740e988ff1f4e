"""Model files: fetching them (no network, a full disk, resuming), their facts, stop ids, GPU fit.

Nothing here reaches the Hugging Face hub. Downloads go over real HTTP to ``FakeHub``, a local
server answering the few endpoints huggingface_hub and chandrad call (model info, tree listing,
resolve with HEAD and ranged GET), so the code under test is the real one end to end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import filelock
import huggingface_hub
import pytest
from click.testing import CliRunner
from huggingface_hub import constants
from structlog.testing import capture_logs

from chandrad.cli import EXIT_FAILED, main
from chandrad.config import EngineSettings
from chandrad.model.cache import PARTIAL_SUFFIX, hub_cache_for_admin, service_owner
from chandrad.model.download import FetchCancelled
from chandrad.model.facts import read_model_facts, stop_tokens, text_dims
from chandrad.model.fetch import fetch_model
from chandrad.model.fit import ACTIVATION_BYTES, MemoryNeeds, gpu_fit, memory_needs
from chandrad.model.gpus import GpuInfo, parse_nvidia_smi
from chandrad.model.progress import FetchProgress
from chandrad.model.report import check_model
from tests.conftest import REPO, wait_for
from tests.test_systemd import NotifyListener

REPO_ID = "chandrad-test/tiny"
MIB = 2**20


# -- a hub on localhost ------------------------------------------------------------------------


class FakeHub:
    """The hub's model-info, tree and resolve endpoints for one repository, over real HTTP.

    ``rate``: bytes per second for file bodies; ``pause``: (offset, seconds) where each body of a
    weight file stops sending for a while; ``drop_at``: the first body of a weight file is cut
    (connection closed) after this many bytes.
    """

    def __init__(
        self,
        files: dict[str, bytes],
        *,
        rate: float | None = None,
        pause: tuple[int, float] | None = None,
        drop_at: int | None = None,
        parameters: int | None = None,
    ) -> None:
        self.files = files
        self.parameters = parameters
        self.commit = hashlib.sha1("\0".join(sorted(files)).encode()).hexdigest()
        self.rate = rate
        self.pause = pause
        self.drop_at = drop_at
        self.requests: list[tuple[str, str, str]] = []  # method, path, Range header
        self.paused_at: list[tuple[float, float]] = []  # monotonic start and end of each pause
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that hangs up mid-body (a stopped download) is expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def lfs(path: str) -> bool:
        return path.endswith(".safetensors")

    def blob_id(self, data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def gets(self, path: str) -> list[str]:
        """The Range headers of the GETs of one file."""
        return [rng for method, p, rng in self.requests if method == "GET" and p.endswith("/" + path)]

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = handler.path.split("?")[0]
        with self._lock:
            self.requests.append((handler.command, path, handler.headers.get("Range", "")))
        api = re.fullmatch(rf"/api/models/{REPO_ID}(?:/revision/[^/]+)?", path)
        tree = re.fullmatch(rf"/api/models/{REPO_ID}/tree/[^/]+", path)
        resolve = re.fullmatch(rf"/{REPO_ID}/resolve/[^/]+/(.+)", path)
        if api:
            self.send_json(handler, self.model_info(), body)
        elif tree:
            self.send_json(handler, self.tree(), body)
        elif resolve and resolve.group(1) in self.files:
            self.send_file(handler, resolve.group(1), body)
        else:
            self.send_json(handler, {"error": "not found"}, body, status=404)

    def model_info(self) -> dict[str, object]:
        siblings = []
        for name, data in self.files.items():
            sibling: dict[str, object] = {"rfilename": name, "size": len(data), "blobId": self.blob_id(data)}
            if self.lfs(name):
                sibling["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(sibling)
        info = {"id": REPO_ID, "modelId": REPO_ID, "sha": self.commit, "siblings": siblings, "private": False}
        if self.parameters is not None:
            info["safetensors"] = {"parameters": {"BF16": self.parameters}, "total": self.parameters}
        return info

    def tree(self) -> list[dict[str, object]]:
        entries = []
        for name, data in self.files.items():
            entry: dict[str, object] = {"type": "file", "path": name, "size": len(data), "oid": self.blob_id(data)}
            if self.lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries

    @staticmethod
    def send_json(handler: BaseHTTPRequestHandler, payload: object, body: bool, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    def send_file(self, handler: BaseHTTPRequestHandler, name: str, body: bool) -> None:
        data = self.files[name]
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range", ""))
        if match and body:
            start = int(match.group(1))
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", self.commit)
        handler.send_header("ETag", f'"{self.blob_id(data)}"')
        if self.lfs(name):
            handler.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            handler.send_header("X-Linked-Size", str(len(data)))
        handler.send_header("Accept-Ranges", "bytes")
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.send_header("Content-Length", str(len(data) - start))
        handler.end_headers()
        if not body:
            return
        drop_at = None
        if self.lfs(name) and self.drop_at is not None:
            drop_at, self.drop_at = self.drop_at, None  # the first body only
        position = start
        paused = False
        while position < len(data):
            step = 16 * 1024
            if drop_at is not None and position + step > drop_at:
                handler.wfile.write(data[position:drop_at])
                handler.wfile.flush()
                handler.close_connection = True  # cut mid-body: the client sees a short read
                return
            if self.pause and self.lfs(name) and not paused and position >= self.pause[0]:
                paused = True
                began = time.monotonic()
                time.sleep(self.pause[1])
                self.paused_at.append((began, time.monotonic()))
            handler.wfile.write(data[position : position + step])
            position += step
            if self.rate:
                time.sleep(step / self.rate)


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite runs with HF_HUB_OFFLINE=1 (nothing may reach the hub); FakeHub is not the hub."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def model_files(size: int = 4 * MIB) -> dict[str, bytes]:
    weights = os.urandom(size)
    return {
        "config.json": json.dumps({"architectures": ["X"], "model_type": "x"}).encode(),
        "tokenizer.json": json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": []}).encode(),
        "model.safetensors": weights,
        "README.md": b"# fetched: vLLM snapshots every non-weight file\n",
        "logo.png": b"\x89PNG not fetched: vLLM never reads it",
    }


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub(model_files())
    yield server
    server.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chandrad", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


# -- fetch-model -------------------------------------------------------------------------------


def test_without_network_fetch_model_fails_in_one_clear_line(tmp_path):
    port = closed_port()
    result = run_cli(
        "fetch-model", REPO_ID, "--hf-home", str(tmp_path / "hf"), env=cli_env(HF_ENDPOINT=f"http://127.0.0.1:{port}")
    )
    assert result.returncode == EXIT_FAILED
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"chandrad: cannot download {REPO_ID}: cannot reach http://127.0.0.1:{port} (")
    assert "Connection refused" in lines[0] and "check the network" in lines[0]
    assert not list((tmp_path / "hf").rglob("*.safetensors*")), "nothing was written"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (tmpfs), as tests/reliability/test_rel_disk.py mounts them."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); run as root with CAP_SYS_ADMIN")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_fetch_model_refuses_a_disk_too_small_before_downloading_anything(tiny_disk, hub):
    result = run_cli("fetch-model", REPO_ID, "--hf-home", str(tiny_disk / "hf"), env=cli_env(HF_ENDPOINT=hub.url))
    assert result.returncode == EXIT_FAILED
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(
        rf"chandrad: not enough disk space for {REPO_ID}: it needs 4\.2 MB more and {tiny_disk}/hf/hub has "
        r"1\.0 MB free; free some space there or point HF_HOME \(fetch-model --hf-home\) at a larger disk",
        lines[0],
    ), lines[0]
    assert not [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]], "no file was downloaded"


def test_fetch_model_fills_the_hub_cache_that_huggingface_hub_and_vllm_read(tmp_path, hub):
    result = run_cli("fetch-model", REPO_ID, "--hf-home", str(tmp_path / "hf"), env=cli_env(HF_ENDPOINT=hub.url))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "hf" / "hub" / "models--chandrad-test--tiny" / "snapshots" / hub.commit
    assert result.stdout.strip() == f"{REPO_ID}: {folder}"
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert (folder / "README.md").is_file() and not (folder / "logo.png").exists(), "what vLLM reads"
    cached = huggingface_hub.try_to_load_from_cache(REPO_ID, "model.safetensors", cache_dir=tmp_path / "hf" / "hub")
    assert cached == str(folder / "model.safetensors")
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events if e["event"].startswith("model files")] == [
        "model files downloaded",
        "model files in the cache",
    ]
    again = run_cli("fetch-model", REPO_ID, "--hf-home", str(tmp_path / "hf"), env=cli_env(HF_ENDPOINT=hub.url))
    assert again.returncode == 0 and again.stdout == result.stdout
    assert "downloading model files" not in again.stderr, "nothing is downloaded twice"


def test_an_interrupted_download_resumes_where_it_stopped(tmp_path, hub, online):
    cache = tmp_path / "hub"
    stop = threading.Event()
    weights = hub.files["model.safetensors"]

    def stop_after_a_mebibyte(progress: FetchProgress) -> None:
        if progress.done >= MIB:
            stop.set()

    with pytest.raises(FetchCancelled):
        fetch_model(
            REPO_ID,
            cache,
            endpoint=hub.url,
            progress=FetchProgress(update_seconds=0, on_update=stop_after_a_mebibyte),
            stop=stop,
        )
    # Files download side by side, so other blobs may also have stopped half-way: look at the weights' blob.
    blobs = cache / "models--chandrad-test--tiny" / "blobs"
    partial = blobs / (hashlib.sha256(weights).hexdigest() + PARTIAL_SUFFIX)
    kept = partial.stat().st_size
    assert MIB // 2 <= kept < len(weights), "about the first mebibyte was kept (the small files share the count)"

    hub.requests.clear()
    folder = fetch_model(REPO_ID, cache, endpoint=hub.url)
    assert hub.gets("model.safetensors") == [f"bytes={kept}-"], "the second run asked only for the rest"
    assert (folder / "model.safetensors").read_bytes() == weights
    assert not list(cache.rglob("*" + PARTIAL_SUFFIX))
    # huggingface_hub, offline, sees complete snapshots where vLLM with HF_HUB_OFFLINE=1 asks for them:
    # the weights, and every non-weight file (vllm/transformers_utils/repo_utils.py).
    for patterns in ({"allow_patterns": ["*.safetensors"]}, {"ignore_patterns": ["*.safetensors", "*.png"]}):
        assert huggingface_hub.snapshot_download(REPO_ID, cache_dir=cache, local_files_only=True, **patterns) == str(
            folder
        )


def test_a_dropped_connection_is_resumed_within_the_same_run(tmp_path, online):
    hub = FakeHub(model_files(), drop_at=int(1.5 * MIB))
    try:
        with capture_logs() as logs:
            folder = fetch_model(REPO_ID, tmp_path / "hub", endpoint=hub.url)
        ranges = hub.gets("model.safetensors")
        assert ranges[0] == "" and len(ranges) == 2 and re.fullmatch(r"bytes=\d+-", ranges[1]), ranges
        assert 0 < int(ranges[1][6:-1]) <= 1.5 * MIB
        assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
        assert [e["file"] for e in logs if e["event"] == "the model download was interrupted; resuming"] == [
            "model.safetensors"
        ]
    finally:
        hub.close()


WAITING = "waiting for another download of the same file to finish"


def weights_lock(cache: Path, weights: bytes) -> Path:
    """huggingface_hub's lock file for the weights' blob (its name is the LFS SHA-256, the ETag)."""
    return cache / ".locks" / "models--chandrad-test--tiny" / f"{hashlib.sha256(weights).hexdigest()}.lock"


def test_a_second_fetch_waits_for_the_first_ones_lock_and_downloads_nothing_again(tmp_path, online):
    hub = FakeHub(model_files(), rate=1_000_000)  # the weights take ~4 s
    cache = tmp_path / "hub"
    folders: dict[str, Path] = {}

    def fetch(name: str) -> None:
        folders[name] = fetch_model(REPO_ID, cache, endpoint=hub.url)

    first = threading.Thread(target=fetch, args=("first",))
    second = threading.Thread(target=fetch, args=("second",))
    try:
        with capture_logs() as logs:
            first.start()
            wait_for(lambda: hub.gets("model.safetensors"), 30, "the first fetch to ask for the weights")
            second.start()
            wait_for(lambda: any(e["event"] == WAITING for e in logs), 30, "the second fetch to wait")
            assert first.is_alive(), "the second waits while the first downloads"
            first.join(60)
            second.join(60)
        assert sorted(folders) == ["first", "second"] and folders["first"] == folders["second"]
        assert hub.gets("model.safetensors") == [""], "the weights came once, whole, to the first fetch"
        assert (folders["second"] / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    finally:
        hub.close()


def test_a_fetch_waiting_for_huggingface_hubs_lock_ends_at_a_stop(tmp_path, hub, online):
    cache = tmp_path / "hub"
    lock_path = weights_lock(cache, hub.files["model.safetensors"])
    lock_path.parent.mkdir(parents=True)
    stop = threading.Event()
    raised: list[BaseException] = []

    def fetch() -> None:
        try:
            fetch_model(REPO_ID, cache, endpoint=hub.url, stop=stop)
        except BaseException as error:
            raised.append(error)

    worker = threading.Thread(target=fetch)
    # As an hf_hub_download of the same blob holds it (huggingface_hub's WeakFileLock is a filelock).
    with filelock.FileLock(lock_path), capture_logs() as logs:
        worker.start()
        wait_for(lambda: any(e["event"] == WAITING for e in logs), 30, "the fetch to wait for the lock")
        stopped_at = time.monotonic()
        stop.set()
        worker.join(10)
        assert time.monotonic() - stopped_at < 3, "the stop ends the wait"
    assert [type(e) for e in raised] == [FetchCancelled]
    assert not hub.gets("model.safetensors"), "nothing of the weights is downloaded without their lock"
    folder = fetch_model(REPO_ID, cache, endpoint=hub.url)
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]


def test_root_without_hf_home_fetches_into_the_units_cache_directory():
    # systemd/chandrad.service and chandrad@.service: CacheDirectory=chandrad, HF_HOME=%C/chandrad/huggingface.
    units = [(REPO / "systemd" / name).read_text() for name in ("chandrad.service", "chandrad@.service")]
    assert all("CacheDirectory=chandrad\n" in unit and "HF_HOME=%C/chandrad/huggingface" in unit for unit in units)
    assert hub_cache_for_admin(environ={}, euid=0) == Path("/var/cache/chandrad/huggingface/hub")
    assert hub_cache_for_admin(environ={"HF_HOME": "/srv/hf"}, euid=0) == Path("/srv/hf/hub")
    assert hub_cache_for_admin(Path("/x"), environ={"HF_HOME": "/srv/hf"}, euid=0) == Path("/x/hub")


def test_roots_download_into_the_services_cache_is_handed_to_the_services_user(tmp_path, hub, online):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    nobody = (65534, 65534)
    fetch_model(REPO_ID, tmp_path / "hf" / "hub", endpoint=hub.url, owner=nobody)
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in [tmp_path / "hf", *(tmp_path / "hf").rglob("*")]}
    assert owners == {nobody}, "blobs, links, refs and huggingface_hub's lock files alike"
    assert service_owner(tmp_path / "hf" / "hub", euid=0) is None, "only the unit's cache directory is handed over"
    assert service_owner(Path("/var/cache/chandrad/huggingface/hub"), euid=1000) is None, "only root's downloads"


# -- progress during the daemon's start --------------------------------------------------------


def test_progress_tells_the_log_each_tenth_and_the_callback_only_while_bytes_arrive(tmp_path):
    now = [100.0]
    updates: list[str] = []
    progress = FetchProgress(on_update=lambda p: updates.append(p.line()), clock=lambda: now[0])
    with capture_logs() as logs:
        progress.begin("org/model", total=10_000_000_000, present=1_000_000_000, folder=tmp_path)
        for _ in range(4):
            now[0] += 10
            progress.advance(500_000_000)  # 50 MB/s
        progress.finish()
    assert updates[0] == "downloading org/model: 1.0 GB of 10.0 GB (10 %), 0.0 MB/s"
    assert updates[-1] == "downloading org/model: 3.0 GB of 10.0 GB (30 %), 50.0 MB/s, about 2 min left"
    assert len(updates) == 5, "begin, then at most every update_seconds while bytes arrive"
    assert [(e["event"], e.get("percent")) for e in logs] == [
        ("downloading model files", None),
        ("model download progress", 20.0),
        ("model download progress", 30.0),
        ("model files downloaded", None),
    ]
    assert not progress.receiving and progress.seconds_since_bytes() == 0


def test_the_daemon_downloads_a_missing_model_showing_progress_and_extending_its_start(
    daemon_factory, tmp_path, tiny_model_files
):
    """The start-up download over real HTTP: progress in the log and STATUS, EXTEND_TIMEOUT_USEC while
    bytes arrive and none while the download stalls, then the engine load begins."""
    hub = FakeHub(tiny_model_files, rate=200_000, pause=(600_000, 6.0))
    notify = NotifyListener(tmp_path / "notify.sock")
    try:
        daemon = daemon_factory(engine_config=f'kind = "vllm"\nmodel = "{REPO_ID}"')
        daemon.start(
            # start() adds to the test's own environment: HF_HUB_OFFLINE=1 is overridden, not dropped.
            env={
                "HF_HUB_OFFLINE": "0",
                "HF_ENDPOINT": hub.url,
                "HF_HOME": str(tmp_path / "hf"),
                "NOTIFY_SOCKET": str(notify.path),
            },
            wait_until_watching=False,
        )
        wait_for(
            lambda: any(e["event"] == "model files in the cache" for e in daemon.events()) or not daemon.alive,
            180,
            "the start-up download to finish",
        )
        events = daemon.events()
        assert any(e["event"] == "model files in the cache" for e in events), daemon.log_path.read_text()[-3000:]
        done = [e["done_bytes"] for e in events if e["event"] == "model download progress"]
        assert len(done) >= 3 and done == sorted(done), done

        # The second "loading" STATUS follows the log line by moments, through another socket
        # (a fresh clone's run read the messages in between, 2026-12-04): wait for it.
        loading_line = f"STATUS=loading the vllm engine ({REPO_ID})"
        wait_for(
            lambda: sum(line == loading_line for _, line in list(notify.messages)) >= 2 or not daemon.alive,
            30,
            "the engine load's STATUS after the download",
        )
        messages = list(notify.messages)
        statuses = [line for _, line in messages if line.startswith(f"STATUS=downloading {REPO_ID}: ")]
        assert len(statuses) >= 3, messages
        total = f"{sum(map(len, tiny_model_files.values())) / 1e6:.1f} MB"
        line = rf"STATUS=downloading {REPO_ID}: [\d.]+ MB of {total} \(\d+ %\), [\d.]+ MB/s.*"
        assert re.fullmatch(line, statuses[-1]), statuses[-1]
        loading = [i for i, (_, line) in enumerate(messages) if line == loading_line]
        assert len(loading) == 2 and any(line in statuses for _, line in messages[loading[0] : loading[1]])

        extensions = [at for at, line in messages if line.startswith("EXTEND_TIMEOUT_USEC=")]
        ((stall_began, stall_ended),) = hub.paused_at
        during = [at for at in extensions if stall_began + 2.5 < at < stall_ended]
        assert not during, "a stalled download does not extend the start"
        assert len([at for at in extensions if at < stall_began]) >= 2, "bytes arriving extend it"
        assert [at for at in extensions if at > stall_ended], "and again once they arrive again"

        snapshot = tmp_path / "hf" / "hub" / "models--chandrad-test--tiny" / "snapshots" / hub.commit
        assert (snapshot / "model.safetensors").read_bytes() == tiny_model_files["model.safetensors"]
        # What vLLM makes of it is not this test's: a stop during the load waits for the CPU build's
        # load thread (tests/test_vllm.py covers that).
        daemon.kill9()
    finally:
        notify.close()
        hub.close()


def test_a_stop_during_the_start_up_download_ends_it_at_once_and_keeps_what_arrived(
    daemon_factory, tmp_path, tiny_model_files
):
    hub = FakeHub(tiny_model_files, rate=50_000)
    try:
        daemon = daemon_factory(engine_config=f'kind = "vllm"\nmodel = "{REPO_ID}"')
        daemon.start(
            env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")},
            wait_until_watching=False,
        )
        blobs = tmp_path / "hf" / "hub" / "models--chandrad-test--tiny" / "blobs"
        wait_for(
            lambda: any(_size(p) > 100_000 for p in blobs.glob("*" + PARTIAL_SUFFIX)) or not daemon.alive,
            120,
            "the weights' download to get going",
        )
        stopped_at = time.monotonic()
        assert daemon.stop(timeout=30) == 0
        assert time.monotonic() - stopped_at < 10, "the stop did not wait for the download"
        events = [e["event"] for e in daemon.events()]
        assert "stopped while the engine was loading" in events and "model files in the cache" not in events
        (partial,) = blobs.glob("*" + PARTIAL_SUFFIX)
        assert 100_000 < partial.stat().st_size < len(tiny_model_files["model.safetensors"]), "kept for a resume"
    finally:
        hub.close()


# -- facts and check ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    target = tmp_path_factory.mktemp("model") / "tiny-qwen3vl"
    made = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(target), "--arch", "tiny-qwen3vl"],
        capture_output=True,
        text=True,
        check=True,
    )
    return target, json.loads(made.stdout.strip().splitlines()[-1])


@pytest.fixture
def tiny_model_files(tiny_model: tuple[Path, dict[str, object]]) -> dict[str, bytes]:
    folder, _ = tiny_model
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_check_reports_the_models_architecture_dtype_parameters_and_stop_ids(tmp_path, tiny_model):
    folder, made = tiny_model
    config = tmp_path / "c.toml"
    config.write_text(
        f'state_dir = "{tmp_path}/state"\n[engine]\nmodel = "{folder}"\n[[inbox]]\npath = "{tmp_path}/in"\n'
    )
    result = CliRunner().invoke(main, ["check", "--config", str(config)], catch_exceptions=False)
    lines = result.stdout.splitlines()
    assert f"[ok] model: local folder {folder}" in lines
    facts = next(line for line in lines if line.startswith("[ok] model facts: "))
    assert facts.startswith(
        f"[ok] model facts: Qwen3VLForConditionalGeneration (qwen3_vl), bfloat16, {made['params']:,} parameters, "
    )
    assert (
        "[ok] stop tokens: 2 <|im_end|> (chandrad, generation config, tokenizer eos), "
        "0 <|endoftext|> (chandrad, generation config)"
    ) in lines
    fit = next(line for line in lines if " GPU fit: " in line)
    if shutil.which("nvidia-smi") is None:
        assert fit.startswith("[warn] GPU fit: no GPU visible, nothing to check; at max_num_seqs = 192 and ")
    assert result.exit_code == 0, result.stdout


def test_check_reports_a_model_before_and_after_it_is_downloaded(tmp_path, tiny_model, tiny_model_files, online):
    _, made = tiny_model
    hub = FakeHub(tiny_model_files, parameters=int(made["params"]))
    cache = tmp_path / "hf" / "hub"
    try:
        before = check_model(
            EngineSettings(model=REPO_ID), cache, [GpuInfo(0, "NVIDIA H200", H200)], will_use_gpu=True, endpoint=hub.url
        )
        assert [(line.level, line.what) for line in before] == [
            ("warn", "model"),
            ("ok", "model facts"),
            ("ok", "stop tokens"),
            ("ok", "GPU fit"),
        ]
        assert before[0].detail.startswith(f"{REPO_ID} is not downloaded to {cache} yet (1.2 MB of weights): ")
        assert f"{made['params']:,} parameters" in before[1].detail, "the hub's count, the weights not being here"
        assert before[3].detail.startswith("GPU 0 (NVIDIA H200, 140.4 GiB): weights 0.0 GiB, KV cache ")
        assert not list(cache.rglob("*.safetensors")), "only the small files were fetched for it"

        fetch_model(REPO_ID, cache, endpoint=hub.url)
        config = tmp_path / "c.toml"
        config.write_text(
            f'state_dir = "{tmp_path}/state"\n[engine]\nmodel = "{REPO_ID}"\n[[inbox]]\npath = "{tmp_path}/in"\n'
        )
        result = CliRunner().invoke(
            main, ["check", "--config", str(config), "--hf-home", str(tmp_path / "hf")], catch_exceptions=False
        )
        snapshot = cache / "models--chandrad-test--tiny" / "snapshots" / hub.commit
        assert f"[ok] model: {REPO_ID} in {snapshot}" in result.stdout.splitlines()
        assert f"{made['params']:,} parameters, 1.2 MB of weights" in result.stdout
    finally:
        hub.close()


def test_stop_ids_include_im_end_when_the_generation_config_lists_only_endoftext(tmp_path, tiny_model):
    folder, _ = tiny_model
    model = tmp_path / "chandra2-like"
    shutil.copytree(folder, model)
    # As Chandra 2 ships: its generation config's eos is <|endoftext|> alone.
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 0}))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|endoftext|>"}))

    stops = {token.token: (token.id, token.sources) for token in stop_tokens(model)}
    assert stops == {
        "<|im_end|>": (2, ("chandrad",)),
        "<|endoftext|>": (0, ("chandrad", "generation config", "tokenizer eos")),
    }
    assert sorted(read_model_facts(model).stop_ids) == [0, 2]


# -- GPU fit -----------------------------------------------------------------------------------

H200 = 143_771 * MIB  # nvidia-smi's memory.total for an H200 (the "141 GB" GPU)
# Chandra 2's shape (shared/device/make_model.py chandra2-like: the real config in every dimension
# that matters here): a Qwen3.5 hybrid, 32 layers, a full-attention layer every 4th.
CHANDRA2_TEXT = {
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_size": 2560,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)],
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
}
CHANDRA1_TEXT = {  # Qwen3-VL-8B's text model: 36 full-attention layers
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "dtype": "bfloat16",
}


def test_gpu_fit_worked_example_chandra_2_on_an_h200_at_192_sequences():
    dims = text_dims({"text_config": CHANDRA2_TEXT})
    assert (dims.full_attention_layers, dims.kv_heads, dims.head_dim) == (8, 4, 256)
    needs = memory_needs(dims, weight_bytes=10_000_000_000)
    # KV cache: K and V × 8 full-attention layers × 4 KV heads × 256 dims × 2 bytes (bf16) a token.
    assert needs.kv_bytes_per_token == 2 * 8 * 4 * 256 * 2 == 32_768
    # Gated DeltaNet state, per sequence whatever its length: 24 linear layers × (recurrent state
    # 32 value heads × 128 × 128 × 4 bytes (float32) + conv state 3 × (2 × 16 × 128 + 32 × 128) × 2 bytes).
    assert needs.state_bytes_per_sequence == 24 * (32 * 128 * 128 * 4 + 3 * 8192 * 2) == 51_511_296

    fit = gpu_fit(needs, H200, max_num_seqs=192, max_model_len=18000, gpu_memory_utilization=0.85)
    # vLLM's share: 0.85 × 150.75 GB = 128.14 GB; less 10 GB of weights and 3 GiB of activations.
    assert fit.kv_room_bytes == int(0.85 * H200 - ACTIVATION_BYTES) - 10_000_000_000 == 114_920_371_609
    # One sequence of 18 000 tokens: 18 000 × 32 768 + 51 511 296 = 641 335 296 bytes.
    assert fit.sequences_at_max_len == 114_920_371_609 // 641_335_296 == 179
    # A typical page (~6 500 tokens): 6 500 × 32 768 + 51 511 296 = 264 503 296 bytes.
    assert fit.sequences_typical == 114_920_371_609 // 264_503_296 == 434
    assert fit.fits and fit.setting is None, "192 pages at once fit; 179 of them could even run to 18 000 tokens"
    assert round(fit.min_gpu_bytes / 2**30, 1) == 70.1  # the smallest GPU for 192 typical pages at 0.85


def test_gpu_fit_names_the_setting_to_change_and_its_value():
    chandra1 = memory_needs(text_dims(CHANDRA1_TEXT), weight_bytes=17_500_000_000)
    assert chandra1.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    # Chandra 1 on an H200: 40 full-length sequences, 112 typical pages: 192 would preempt all the time.
    fit = gpu_fit(chandra1, H200, max_num_seqs=192, max_model_len=18000, gpu_memory_utilization=0.85)
    assert (fit.fits, fit.sequences_at_max_len, fit.sequences_typical) == (True, 40, 112)
    assert (fit.setting, fit.value) == ("engine.max_num_seqs", "112")

    chandra2 = memory_needs(text_dims({"text_config": CHANDRA2_TEXT}), weight_bytes=10_000_000_000)
    rtx4090 = 24_564 * MIB
    fit = gpu_fit(chandra2, rtx4090, max_num_seqs=192, max_model_len=18000, gpu_memory_utilization=0.85)
    assert (fit.fits, fit.setting, fit.value) == (True, "engine.max_num_seqs", "32")

    # 16 GB: the weights and one 18 000-token sequence need more than 0.85 of it, but under 0.95.
    t4 = 15_360 * MIB
    fit = gpu_fit(chandra2, t4, max_num_seqs=8, max_model_len=18000, gpu_memory_utilization=0.85)
    assert not fit.fits and (fit.setting, fit.value) == ("engine.gpu_memory_utilization", "0.87")

    # Chandra 1 cannot start on it at all: two GPUs, tensor-parallel.
    fit = gpu_fit(chandra1, t4, max_num_seqs=8, max_model_len=18000, gpu_memory_utilization=0.85)
    assert not fit.fits and fit.setting == "engine.layout" and fit.value.startswith('"tensor-parallel" with 2 GPUs')

    # With a fixed KV cache too small for one sequence, max_model_len comes down to what it holds.
    fit = gpu_fit(
        chandra2, H200, max_num_seqs=8, max_model_len=18000, gpu_memory_utilization=0.85, kv_cache_bytes=400 * MIB
    )
    assert not fit.fits and (fit.setting, fit.value) == ("engine.max_model_len", "11008")


def test_memory_needs_of_a_plain_transformer_have_no_per_sequence_state():
    needs = memory_needs(text_dims(CHANDRA1_TEXT), weight_bytes=1, kv_cache_dtype="fp8")
    assert needs == MemoryNeeds(1, 2 * 36 * 8 * 128 * 1, 0)


def test_nvidia_smi_memory_is_read_in_mib():
    gpus = parse_nvidia_smi("0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n")
    assert [(gpu.index, gpu.name, gpu.memory_bytes) for gpu in gpus] == [
        (0, "NVIDIA H200", H200),
        (1, "NVIDIA H200", H200),
    ]


def _size(path: Path) -> int:
    """A partial file's size, 0 once it is gone: a small file finishes (renamed to its blob) between
    the glob that found it and this look (seen under load in a fresh clone's run)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
