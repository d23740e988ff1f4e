"""The engine contract: a page image in, Chandra-format HTML out.

Chandra HTML is a sequence of top-level layout ``div``s, each with ``data-label`` (Text,
Section-Header, Table, Image, ...) and ``data-bbox="x0 y0 x1 y1"`` normalised to 0–1000 of the
page. ``chandra.output`` turns it into Markdown, HTML and JSON chunks, whichever engine made it.
Engines know nothing about files or folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from PIL import Image


@dataclass(frozen=True)
class PageRequest:
    doc_id: str
    page_no: int
    image: Image.Image
    prompt_type: str = "ocr_layout"


@dataclass(frozen=True)
class PageResult:
    html: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = "stop"
    retries: int = 0
    latency_s: float = 0.0


@dataclass(frozen=True)
class EngineStatus:
    """Everything the daemon shows about an engine, read once a second (must not block)."""

    state: str = "up"  # "starting" | "up" | "restarting" | "up (1 of 2 replicas; ...)"
    restarts: int = 0  # unplanned restarts since the daemon started
    recycles: int = 0  # planned recycles since the daemon started
    peak_running: int | None = None  # the most sequences its scheduler ran at once, where it reports it


class Engine(Protocol):
    """What the daemon needs from an OCR engine; every engine implements all of it.

    ``ocr`` raises ``TransientError`` when the engine failed (worth retrying, maybe after a restart)
    and ``PermanentError`` when this page can never succeed (e.g. it does not fit the model).
    """

    @property
    def name(self) -> str:
        """Which engine: "vllm", "vllm-remote", "tesseract"."""

    @property
    def model(self) -> str:
        """The model it reads pages with (known once started, for a remote server)."""

    async def start(self) -> None:
        """Load the model and answer a warm-up request; the daemon reports ready only after this."""

    async def ocr(self, request: PageRequest) -> PageResult: ...

    def status(self) -> EngineStatus: ...

    async def memory_in_use(self) -> int | None:
        """Accelerator memory the engine's devices have in use, in bytes; None where it has none."""

    def stopping(self) -> None:
        """The daemon is draining for a stop: begin no planned work of the engine's own (a recycle)."""

    async def aclose(self) -> None: ...
