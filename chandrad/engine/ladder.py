"""Chandra's retry ladder, one implementation for every engine that runs the Chandra model.

As in Chandra's own client (``chandra.model.vllm.generate_vllm``): the first attempt is greedy
(temperature 0, top_p 0.1); while the answer repeats itself (``detect_repeat_token`` on the whole
text or on all but its last 50 characters) or the engine reports a recoverable error, the page is
tried again warmer, attempt n at temperature min(0.2 n, 0.8) and top_p 0.95, at most
``max_retries`` times.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from chandra.model.util import detect_repeat_token

from chandrad.engine.base import PageResult
from chandrad.errors import EngineDied, TransientError

log = structlog.get_logger("chandrad.engine.ladder")


def chandra_is_repeating(text: str) -> bool:
    """Chandra's own loop test, as its vLLM client applies it."""
    return bool(detect_repeat_token(text) or (len(text) > 50 and detect_repeat_token(text, cut_from_end=50)))


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float


def sampling_for(attempt: int) -> Sampling:
    """The sampling of attempt 0 (greedy), 1, 2, ... of one page."""
    if attempt == 0:
        return Sampling(0.0, 0.1)
    return Sampling(min(0.2 * attempt, 0.8), 0.95)


@dataclass(frozen=True)
class Completion:
    """One attempt's answer, whatever the engine."""

    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # the engine's own: "stop", "length", or vLLM's "repetition"


async def read_with_retries(
    generate: Callable[[int, Sampling], Awaitable[Completion]],
    max_retries: int,
    page_no: int,
    is_repeating: Callable[[str], bool] = chandra_is_repeating,
    started: float | None = None,
) -> PageResult:
    """Run ``generate(attempt, sampling)`` up the ladder. ``generate`` raises ``TransientError`` for a
    recoverable failure (tried again), ``EngineDied`` or ``PermanentError`` to end the page at once."""
    started = time.monotonic() if started is None else started
    attempt = 0
    while True:
        completion: Completion | None = None
        error: TransientError | None = None
        try:
            completion = await generate(attempt, sampling_for(attempt))
        except EngineDied:
            raise
        except TransientError as recoverable:
            error = recoverable
        repeating = completion is not None and (
            completion.finish_reason == "repetition" or is_repeating(completion.text)
        )
        if (repeating or error is not None) and attempt < max_retries:
            attempt += 1
            log.info(
                "retrying page",
                page=page_no,
                attempt=attempt,
                why="repetition" if repeating or error is None else error.reason,
            )
            continue
        if completion is None:
            assert error is not None
            raise error
        return PageResult(
            html=completion.text,
            prompt_tokens=completion.prompt_tokens,
            output_tokens=completion.output_tokens,
            finish_reason="repetition" if repeating else completion.finish_reason,
            retries=attempt,
            latency_s=time.monotonic() - started,
        )
