"""Chandra on a vLLM OpenAI-compatible server elsewhere (``engine.url``): same prompt, same rules.

For deployments whose inference runs on other hosts (a vLLM data-parallel deployment, a Ray
cluster). The page goes as a PNG data URL in one user message ``[image, prompt]``, as the chandra
CLI sends it; the retry ladder and repetition test are the in-process engine's.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

import structlog
from chandra.model.util import scale_to_fit
from chandra.prompts import PROMPT_MAPPING
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import PageRequest, PageResult
from chandrad.engine.vllm import chandra_is_repeating
from chandrad.errors import PermanentError, TransientError

log = structlog.get_logger("chandrad.engine.remote")


def _png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    scale_to_fit(image.convert("RGB")).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class RemoteEngine:
    name = "vllm-remote"

    def __init__(self, settings: EngineSettings) -> None:
        from openai import AsyncOpenAI

        assert settings.url is not None
        self.settings = settings
        self.model = settings.served_model_name or settings.model
        self._client = AsyncOpenAI(base_url=settings.url, api_key=settings.api_key,
                                   timeout=settings.page_timeout_seconds, max_retries=0)

    async def start(self) -> None:
        try:
            models = await self._client.models.list()
        except Exception as error:
            raise TransientError(f"the vLLM server at {self.settings.url} does not answer: {error}") from None
        served = [model.id for model in models.data]
        if self.settings.served_model_name is None and served:
            self.model = served[0]
        elif self.model not in served:
            raise PermanentError(f"the server at {self.settings.url} serves {served}, not {self.model!r}")
        log.info("remote engine ready", url=self.settings.url, model=self.model)

    async def ocr(self, request: PageRequest) -> PageResult:
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        url = await asyncio.to_thread(_png_data_url, request.image)  # resize + PNG: ~0.2 s, off the loop
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": PROMPT_MAPPING[request.prompt_type]},
        ]}]
        started = time.monotonic()
        attempt, temperature, top_p = 0, 0.0, 0.1
        while True:
            try:
                completion = await self._client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.settings.max_tokens,  # type: ignore[arg-type]
                    temperature=temperature, top_p=top_p,
                )
                text = completion.choices[0].message.content or ""
                error = None
            except APIStatusError as status_error:
                if 400 <= status_error.status_code < 500 and status_error.status_code != 429:
                    raise PermanentError(f"the server refused page {request.page_no}: {status_error.message}",
                                         stage="engine") from None
                completion, text, error = None, "", f"HTTP {status_error.status_code}"
            except (APIConnectionError, APITimeoutError) as network_error:
                completion, text, error = None, "", str(network_error)
            repeating = completion is not None and chandra_is_repeating(text)
            if (repeating or error) and attempt < self.settings.max_retries:
                attempt += 1
                temperature, top_p = min(0.2 * attempt, 0.8), 0.95
                continue
            if completion is None:
                raise TransientError(f"the vLLM server failed: {error}", stage="engine")
            usage = completion.usage
            return PageResult(
                html=text,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else 0,
                finish_reason="repetition" if repeating else str(completion.choices[0].finish_reason),
                retries=attempt,
                latency_s=time.monotonic() - started,
            )

    def stopping(self) -> None:
        return None

    async def aclose(self) -> None:
        await self._client.close()
