"""Chandra on vLLM OpenAI-compatible servers elsewhere (``engine.url``): same prompt, same rules.

For deployments whose inference runs on other hosts (a vLLM data-parallel deployment, a Ray
cluster, several ``vllm serve``). The page goes as a PNG data URL in one user message
``[image, prompt]``, as the chandra CLI sends it; the retry ladder and repetition test are the
in-process engine's. Which server reads it, and what happens when one fails, is ``fleet.py``'s.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from chandra.model.util import scale_to_fit
from chandra.prompts import PROMPT_MAPPING
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import EngineStatus, PageRequest, PageResult
from chandrad.engine.fleet import Fleet
from chandrad.engine.ladder import Completion, Sampling, read_with_retries

if TYPE_CHECKING:
    from openai import AsyncOpenAI

# A page that finds no server up gives up this long before the pipeline's page timeout would end
# it, with a WaitError, so that its document waits instead of using up an attempt.
WAIT_MARGIN_SECONDS = 2.0


# PNG is lossless at every level: level 1 sends the same pixels as Pillow's default (6), 2-3.4 x
# faster (a 192 dpi page of the corpus: 99-165 ms instead of 239-412 ms), in 20 % fewer to 15 %
# more bytes.
PNG_COMPRESS_LEVEL = 1


def _png_data_url(image: Image.Image) -> str:
    scaled = scale_to_fit(image.convert("RGB"))
    if _is_grey(scaled):
        # A grey page goes as a grey PNG: ~40 % fewer bytes and about half the PNG's encoding for a
        # 192 dpi scan; the whole step, scale_to_fit included, 0.71-0.97 x (bench/remote_png.py,
        # five grey corpus scans on one core). The model sees the same pixels:
        # the server turns it into RGB by copying each value into the three channels, and Pillow's
        # RGB -> L of three equal channels gives that value back exactly (its weights sum to 1).
        scaled = scaled.convert("L")
    buffer = io.BytesIO()
    scaled.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _is_grey(image: Image.Image) -> bool:
    """Whether every pixel of the RGB ``image`` has three equal channels (~6 ms for a page; a
    colour page is mostly told by every 16th row first)."""
    pixels = np.asarray(image)
    for rows in (pixels[::16], pixels):
        if not ((rows[..., 0] == rows[..., 1]).all() and (rows[..., 1] == rows[..., 2]).all()):
            return False
    return True


def _encoder_threads() -> int:
    # Enough to refill a server's batch in seconds (~12 pages/s a thread), few enough to leave the
    # cores to the daemon's other work.
    return max(2, min(8, (os.cpu_count() or 2) // 2))


class RemoteEngine:
    name = "vllm-remote"

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.fleet = Fleet(settings)
        # Its own threads, not the loop's default executor: when a server's batch ends, the next
        # 192 pages are encoded at once, and on the shared executor that queue sits in front of
        # intake's hashes and moves and the publish step. On an H200 with the shared executor,
        # intake p50 was 27 s instead of 13 s in process and publish p90 18 s instead of 1 s
        # (bench/NOTES-gpu.md section 9; this is the likeliest cause, not yet re-measured there).
        self._encoder = ThreadPoolExecutor(_encoder_threads(), thread_name_prefix="chandrad-png")

    @property
    def model(self) -> str:
        return self.fleet.model

    async def start(self) -> None:
        await self.fleet.start()

    async def ocr(self, request: PageRequest) -> PageResult:
        started = time.monotonic()
        timeout = self.settings.page_timeout_seconds
        deadline = started + timeout - min(WAIT_MARGIN_SECONDS, timeout / 10)
        url = await asyncio.get_running_loop().run_in_executor(self._encoder, _png_data_url, request.image)
        messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT_MAPPING[request.prompt_type]},
                ],
            }
        ]

        async def attempt_once(attempt: int, sampling: Sampling) -> Completion:
            return await self.fleet.call(
                partial(self._complete, messages=messages, sampling=sampling),
                request.doc_id,
                request.page_no,
                deadline,
            )

        return await read_with_retries(attempt_once, self.settings.max_retries, request.page_no, started=started)

    async def _complete(self, client: AsyncOpenAI, *, messages: list[dict[str, Any]], sampling: Sampling) -> Completion:
        completion = await client.chat.completions.create(
            model=self.model,
            messages=messages,  # type: ignore[arg-type]  # plain dicts, as Chandra sends
            max_tokens=self.settings.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            # vLLM's own field: only benchmarks on random weights force every page to max_tokens.
            extra_body={"ignore_eos": True} if self.settings.bench_force_max_tokens else None,
        )
        usage = completion.usage
        return Completion(
            completion.choices[0].message.content or "",
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
            str(completion.choices[0].finish_reason),
        )

    def status(self) -> EngineStatus:
        return EngineStatus(state=self.fleet.state, restarts=self.fleet.recoveries)

    async def memory_in_use(self) -> int | None:
        return None  # the servers' GPUs are other hosts'

    def stopping(self) -> None:
        return None

    async def aclose(self) -> None:
        await self.fleet.aclose()
        self._encoder.shutdown(wait=False, cancel_futures=True)
