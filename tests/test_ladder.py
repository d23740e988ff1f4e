"""Chandra's retry ladder: the sampling of each attempt, what is tried again, and what ends a page
at once. The sampling is compared with Chandra's own client, ``chandra.model.vllm.generate_vllm``,
run against a stand-in for the OpenAI client it talks to (the model cannot run here)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import chandra.model.vllm
import pytest
from chandra.model.schema import BatchInputItem
from chandra.model.util import detect_repeat_token
from PIL import Image

from chandrad.engine.ladder import Completion, Sampling, chandra_is_repeating, read_with_retries, sampling_for
from chandrad.errors import EngineDied, PermanentError, TransientError

REPEATING = "<p>" + "the same line again " * 40 + "</p>"
CLEAN = '<div data-bbox="0 0 1000 1000" data-label="Text"><p>Invoice 4711, paid on time.</p></div>'


class Script:
    """A page's answers in order: a text, or an exception to raise. Records each attempt's sampling."""

    def __init__(self, *answers: str | BaseException, finish_reason: str = "stop") -> None:
        self.answers: Iterator[str | BaseException] = iter(answers)
        self.finish_reason = finish_reason
        self.calls: list[tuple[int, Sampling]] = []

    async def __call__(self, attempt: int, sampling: Sampling) -> Completion:
        self.calls.append((attempt, sampling))
        answer = next(self.answers)
        if isinstance(answer, BaseException):
            raise answer
        return Completion(answer, prompt_tokens=100, output_tokens=len(answer), finish_reason=self.finish_reason)


def test_the_first_attempt_is_greedy() -> None:
    assert sampling_for(0) == Sampling(temperature=0.0, top_p=0.1)


@pytest.mark.parametrize("attempt", range(1, 9))
def test_attempt_n_samples_at_temperature_min_0_2_n_0_8_and_top_p_0_95(attempt: int) -> None:
    assert sampling_for(attempt) == Sampling(temperature=min(0.2 * attempt, 0.8), top_p=0.95)


def chandras_client_sampling(monkeypatch: pytest.MonkeyPatch, answers: list[str], max_retries: int) -> list[Any]:
    """The (temperature, top_p) of each request Chandra's own client sends for one page, the
    answers served in order ("error" makes the request fail), and the text it settles on."""
    served = iter(answers)
    requests: list[tuple[float, float]] = []

    def create(**request: Any) -> Any:
        requests.append((request["temperature"], request["top_p"]))
        answer = next(served)
        if answer == "error":
            raise ConnectionError("the server went away")
        message = SimpleNamespace(content=answer)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=SimpleNamespace(completion_tokens=1))

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    monkeypatch.setattr(chandra.model.vllm, "OpenAI", lambda **_: client)
    monkeypatch.setattr(chandra.model.vllm, "time", SimpleNamespace(sleep=lambda _: None))
    item = BatchInputItem(image=Image.new("RGB", (64, 64), "white"), prompt_type="ocr_layout")
    (result,) = chandra.model.vllm.generate_vllm([item], max_retries=max_retries, max_workers=1)
    return [requests, result.raw]


@pytest.mark.parametrize(
    "answers",
    [
        ["clean"],
        ["repeating", "clean"],
        ["repeating", "repeating", "repeating", "clean"],
        ["error", "clean"],
        ["repeating", "error", "repeating", "clean"],
        ["repeating"] * 7,
        ["error"] * 7,
    ],
    ids=lambda answers: "-".join(answers),
)
async def test_the_ladder_samples_each_attempt_exactly_as_chandras_own_client(
    monkeypatch: pytest.MonkeyPatch, answers: list[str]
) -> None:
    texts = {"clean": CLEAN, "repeating": REPEATING, "error": "error"}
    requests, chandra_text = chandras_client_sampling(monkeypatch, [texts[a] for a in answers], max_retries=6)
    script = Script(*(TransientError("the server went away") if a == "error" else texts[a] for a in answers))
    try:
        result = await read_with_retries(script, max_retries=6, page_no=1)
        text = result.html
    except TransientError:
        text = ""  # Chandra's client gives up with an empty text where ours raises
    assert [(s.temperature, s.top_p) for _, s in script.calls] == requests
    assert [attempt for attempt, _ in script.calls] == list(range(len(requests)))
    assert text == chandra_text


async def test_a_clean_first_answer_is_the_result_with_no_retry() -> None:
    script = Script(CLEAN)
    result = await read_with_retries(script, max_retries=6, page_no=1)
    assert (result.html, result.retries, result.finish_reason) == (CLEAN, 0, "stop")
    assert (result.prompt_tokens, result.output_tokens) == (100, len(CLEAN))
    assert script.calls == [(0, Sampling(0.0, 0.1))]


async def test_a_repeating_answer_is_tried_again_warmer_until_one_is_clean() -> None:
    script = Script(REPEATING, REPEATING, CLEAN)
    result = await read_with_retries(script, max_retries=6, page_no=1)
    assert (result.html, result.retries, result.finish_reason) == (CLEAN, 2, "stop")
    assert [s for _, s in script.calls] == [sampling_for(0), sampling_for(1), sampling_for(2)]


async def test_an_answer_vllm_stopped_for_repetition_is_tried_again_however_it_reads() -> None:
    script = Script(CLEAN, CLEAN, finish_reason="repetition")
    result = await read_with_retries(script, max_retries=1, page_no=1)
    assert len(script.calls) == 2
    assert (result.retries, result.finish_reason) == (1, "repetition")


async def test_a_page_that_keeps_repeating_is_returned_after_max_retries_marked_as_repetition() -> None:
    script = Script(*[REPEATING] * 10)
    result = await read_with_retries(script, max_retries=3, page_no=1)
    assert [attempt for attempt, _ in script.calls] == [0, 1, 2, 3]
    assert (result.html, result.retries, result.finish_reason) == (REPEATING, 3, "repetition")


async def test_max_retries_zero_means_a_single_attempt() -> None:
    script = Script(REPEATING, CLEAN)
    result = await read_with_retries(script, max_retries=0, page_no=1)
    assert len(script.calls) == 1 and result.finish_reason == "repetition"


async def test_transient_errors_are_tried_again_and_the_last_one_raised_when_the_retries_run_out() -> None:
    last = TransientError("third failure")
    script = Script(TransientError("first failure"), TransientError("second failure"), last, CLEAN)
    with pytest.raises(TransientError) as raised:
        await read_with_retries(script, max_retries=2, page_no=1)
    assert raised.value is last
    assert len(script.calls) == 3


async def test_a_transient_error_then_a_clean_answer_is_a_result_with_one_retry() -> None:
    script = Script(TransientError("busy"), CLEAN)
    result = await read_with_retries(script, max_retries=6, page_no=1)
    assert (result.html, result.retries) == (CLEAN, 1)


@pytest.mark.parametrize(
    "error", [EngineDied("the engine process is gone"), PermanentError("the page does not fit the model")]
)
async def test_an_engine_that_died_or_a_permanent_error_ends_the_page_at_once(error: Exception) -> None:
    script = Script(error, CLEAN)
    with pytest.raises(type(error)) as raised:
        await read_with_retries(script, max_retries=6, page_no=1)
    assert raised.value is error
    assert len(script.calls) == 1, "no retry with retries left"


@pytest.mark.parametrize(
    "text",
    [
        CLEAN,
        REPEATING,
        "x" * 200,
        "ab" * 150 + "".join(f"{chr(65 + i % 26)}{i}" for i in range(40))[:40],  # a loop, then 40 fresh chars
        "short",
        "",
    ],
)
def test_chandra_is_repeating_is_chandras_own_loop_test(text: str) -> None:
    chandras = bool(detect_repeat_token(text) or (len(text) > 50 and detect_repeat_token(text, cut_from_end=50)))
    assert chandra_is_repeating(text) is chandras


def test_a_loop_followed_by_a_short_fresh_tail_counts_as_repeating() -> None:
    """Chandra also looks at all but the last 50 characters: a loop cut off by a few new ones."""
    text = "ab" * 150 + "".join(f"{chr(65 + i % 26)}{i}" for i in range(40))[:40]
    assert not detect_repeat_token(text)
    assert chandra_is_repeating(text)
