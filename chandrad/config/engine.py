"""``[engine]`` and ``[prepare]``: how pages are read and how documents become page images."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from chandrad.config.base import StrictModel, check_url


class EngineSettings(StrictModel):
    """Which OCR engine turns page images into Chandra HTML, and how it runs."""

    # "auto": vLLM when a CUDA GPU is visible, else tesseract (with a loud warning).
    kind: Literal["auto", "vllm", "tesseract"] = "auto"
    # A Hugging Face id (datalab-to/chandra-ocr-2, datalab-to/chandra) or a local model directory.
    model: str = "datalab-to/chandra-ocr-2"
    # Pages at the engine at once, across all documents; default: max_num_seqs (vLLM), cores (tesseract).
    max_pages_in_flight: int | None = Field(default=None, ge=1)
    page_timeout_seconds: float = Field(default=600.0, gt=0)
    tesseract_languages: str = "eng"

    # -- vLLM (see DESIGN.md "Engine facts"; defaults are Chandra 2's serving settings but the two
    # batch sizes, chosen from bench/NOTES-gpu.md's tuning table) --
    # A vLLM OpenAI-compatible server (".../v1") to use instead of an in-process engine, or a list of
    # them (a fleet: each health-checked, pages spread over those up, moved off one that fails).
    url: str | tuple[str, ...] | None = None
    api_key: str = "EMPTY"
    served_model_name: str | None = None
    # TLS for https:// servers: a CA bundle (PEM) to trust instead of the system's; extra HTTP
    # headers sent with every request (a router's routing or auth headers).
    ca_bundle: Path | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int = Field(default=18000, ge=256)
    # Twice Chandra's serving settings (96 / 8192): on an H200 the raw engine read 3.81 pages/s at
    # 192 against 3.22 at 96, and 384 added 4 % for twice the page latency (bench/NOTES-gpu.md §6).
    # On a smaller GPU vLLM simply admits the sequences its KV cache holds.
    max_num_seqs: int = Field(default=192, ge=1)
    max_num_batched_tokens: int | None = Field(default=16384, ge=256)
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=0.98)
    # KV cache size in GiB instead of a share of GPU memory (required on CPU).
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    enable_prefix_caching: bool = True
    min_pixels: int = Field(default=3136, ge=784)
    max_pixels: int = Field(default=6_291_456, ge=784)
    # vLLM's cache of processed images: every scanned page is new, so it only costs hashing and
    # memory; it must be 0 when renderer_workers > 1 (vLLM's cache is not thread-safe).
    mm_processor_cache_gb: float = Field(default=0.0, ge=0)
    # Threads that tokenise prompts and run the image processor off the event loop, per engine
    # front end (vLLM's renderer_num_workers); one thread does ~5 pages/s on an H200 host.
    renderer_workers: int = Field(default=4, ge=1)
    enforce_eager: bool = False
    speculative_config: dict[str, Any] | None = None
    # Anything else for vllm's AsyncEngineArgs, passed through as is (wins over the above).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Chandra's output limit and retry ladder: greedy first; on a repetition loop or an engine
    # error, retry with rising temperature, at most max_retries times.
    max_tokens: int = Field(default=12384, ge=1)
    max_retries: int = Field(default=6, ge=0)
    # vLLM's built-in loop detector (where the installed vLLM has it): stop a page whose output ends
    # in a pattern of up to this many tokens repeated repetition_min_count times; 0 turns it off.
    # Conservative on purpose: long runs of empty table cells are legitimate repetition.
    repetition_max_pattern_tokens: int = Field(default=32, ge=0)
    repetition_min_count: int = Field(default=40, ge=2)
    # Benchmarks only: generate exactly max_tokens tokens per page (random-weight stand-ins).
    bench_force_max_tokens: bool = False

    # -- GPUs --
    gpus: tuple[int, ...] = (0,)
    # "auto": "single" for one GPU, "replicas" for several (1.98x one GPU on two H200s, where vLLM's
    # data-parallel mode gave 1.33x: bench/results/gpu-2xh200-replicas-*, README "Performance").
    layout: Literal["auto", "single", "replicas", "data-parallel", "tensor-parallel", "encoder-split"] = "auto"

    # -- supervision --
    # Restart the engine after this many pages (planned recycle against slow memory growth).
    recycle_after_pages: int | None = Field(default=None, ge=1)
    # ...or when GPU memory in use (NVML; the engine processes' RSS on CPU) passes this many GiB.
    memory_watermark_gb: float | None = Field(default=None, gt=0)
    restart_backoff_seconds: float = Field(default=2.0, ge=0)
    restart_backoff_max_seconds: float = Field(default=60.0, ge=0)
    # A page in flight during this many engine deaths is then sent alone; if the engine dies with
    # it alone too, the page fails instead of crashing the engine forever.
    poison_page_deaths: int = Field(default=2, ge=1)
    health_check_seconds: float = Field(default=30.0, gt=0)
    start_timeout_seconds: float = Field(default=1800.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _resolve_layout(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("layout", "auto") == "auto":
            gpus = data.get("gpus", cls.model_fields["gpus"].default)
            data = {**data, "layout": "replicas" if isinstance(gpus, (list, tuple)) and len(gpus) > 1 else "single"}
        return data

    @field_validator("url")
    @classmethod
    def _http_urls(cls, url: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        if isinstance(url, tuple):
            if not url:
                raise ValueError("engine.url: give at least one server, or leave it out")
            if len(set(url)) != len(url):
                raise ValueError("engine.url names a server twice")
            return tuple(check_url(one) for one in url)
        return None if url is None else check_url(url)

    @property
    def urls(self) -> tuple[str, ...]:
        """The remote servers, as a list (empty: the engine runs in this process)."""
        if self.url is None:
            return ()
        return self.url if isinstance(self.url, tuple) else (self.url,)

    @model_validator(mode="after")
    def _check_pixels(self) -> EngineSettings:
        if self.min_pixels > self.max_pixels:
            raise ValueError("engine.min_pixels must not exceed engine.max_pixels")
        if self.renderer_workers > 1 and self.mm_processor_cache_gb > 0:
            raise ValueError(
                "engine.mm_processor_cache_gb > 0 needs engine.renderer_workers = 1 (vLLM's image cache is "
                "not thread-safe); scanned pages never repeat, so mm_processor_cache_gb = 0 is the better fix"
            )
        return self


class PrepareSettings(StrictModel):
    """How documents become page images."""

    dpi: int = Field(default=192, ge=50, le=600)
    min_short_side_px: int = Field(default=1024, ge=0)
    # Chandra scales every page to at most 3072x2048 px (6.3 MP): rendering larger is wasted work.
    max_page_pixels: int = Field(default=6_291_456, ge=100_000)
    # Below this DPI a page is so large that the text cannot survive: refuse it.
    min_dpi: int = Field(default=10, ge=1)
    max_pages: int = Field(default=2000, ge=1)
    max_file_mb: int = Field(default=1024, ge=1)
    # Images whose header claims more pixels than this are refused before decoding (pixel bombs).
    max_image_pixels: int = Field(default=400_000_000, ge=1_000_000)
    subprocess_timeout_seconds: float = Field(default=300.0, gt=0)
    # Address space each gs/pdftoppm/pdfinfo run may use (MiB; 0 = no limit): a hostile PDF fails
    # with a reason instead of waking the kernel's OOM killer on a GPU server.
    tool_memory_mb: int = Field(default=4096, ge=0)
    # Documents rewritten by Ghostscript at once (stages.prepare); a healthy scan, read as it is,
    # and every PDF's own text read wait for none of these slots (they take a reader thread, one
    # per core, as page renders do).
    workers: int = Field(default=2, ge=1)
    # A page is turned upright (an inbox's rotate_pages) only when tesseract's orientation
    # confidence reaches this. OCRmyPDF's default is 14, paperless-ngx's 12; measured on the
    # corpus (bench/orientation.py) a right answer scored 10.7 or more and a wrong one 1.8 or
    # less, so 14 would leave sideways pages sideways: see docs/scanners.md.
    orientation_min_confidence: float = Field(default=5.0, ge=0)
    # Leptonica's text-line test judges a page first (~20 ms); tesseract only the pages it cannot
    # decide. It counts ascenders against descenders: with text in scripts that have neither
    # (CJK, Devanagari's headline-hung letters...), turn it off and let tesseract judge every page.
    orientation_quick_check: bool = True
