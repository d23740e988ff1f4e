"""Chandra on a vLLM OpenAI-compatible server elsewhere (``engine.url``): same prompt, same rules.

For deployments whose inference runs on other hosts (a vLLM data-parallel deployment, a Ray
cluster). The page goes as a PNG data URL in one user message ``[image, prompt]``, as the chandra
CLI sends it; the retry ladder and repetition test are the in-process engine's.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import structlog
from chandra.model.util import scale_to_fit
from chandra.prompts import PROMPT_MAPPING
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import EngineStatus, PageRequest, PageResult
from chandrad.engine.ladder import Completion, Sampling, read_with_retries
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
        self._client = AsyncOpenAI(
            base_url=settings.url, api_key=settings.api_key, timeout=settings.page_timeout_seconds, max_retries=0
        )

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
            try:
                completion = await self._client.chat.completions.create(
                    model=self.model,
                    messages=messages,  # type: ignore[arg-type]  # plain dicts, as Chandra sends
                    max_tokens=self.settings.max_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                )
            except APIStatusError as status_error:
                if 400 <= status_error.status_code < 500 and status_error.status_code != 429:
                    raise PermanentError(
                        f"the server refused page {request.page_no}: {status_error.message}", stage="engine"
                    ) from None
                raise TransientError(
                    f"the vLLM server failed: HTTP {status_error.status_code}", stage="engine"
                ) from None
            except (APIConnectionError, APITimeoutError) as network_error:
                raise TransientError(f"the vLLM server failed: {network_error}", stage="engine") from None
            usage = completion.usage
            return Completion(
                completion.choices[0].message.content or "",
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
                str(completion.choices[0].finish_reason),
            )

        return await read_with_retries(attempt_once, self.settings.max_retries, request.page_no)

    def status(self) -> EngineStatus:
        return EngineStatus()

    async def memory_in_use(self) -> int | None:
        return None  # the server's GPUs are another host's

    def stopping(self) -> None:
        return None

    async def aclose(self) -> None:
        await self._client.close()
