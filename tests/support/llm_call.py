"""One LLM call's pieces, as the client and inference tests of every tier send and answer
them: a rendered prompt, the model's answer, and the client's settings.

- ``PROMPT`` / ``INTENT_TEXT`` / :func:`llm_completion`: a one-event prompt of ``SHOPPER``
  and vLLM's answer to it, for the LLM client's tests.
- ``CLIENT_CONFIG``: the client with retries (three attempts, backoff from 0.5 s to 8 s).
- ``COMPARING_INTENT`` and ``ONE_ATTEMPT_LLM``: the intent a shopper comparing headphones
  gets, and a client that tries once, for the tests of one prompt's trip to Redis.
- :func:`recorded_backoff_sleeps`: the client's backoff sleeps recorded, not slept.
- :func:`ask_all`: prompts asked at once through the job's own call path, for the model
  tier's tests of what a served model answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from flink_jobs.config import LlmConfig
from flink_jobs.core.prompting import RenderedPrompt
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.runtime import llm_client
from flink_jobs.runtime.inference import Answered, ask
from flink_jobs.runtime.llm_client import LlmClient
from tests.support import builders
from tests.support.builders import SHOPPER

__all__ = [
    "CLIENT_CONFIG",
    "COMPARING_INTENT",
    "INTENT_TEXT",
    "MODEL",
    "ONE_ATTEMPT_LLM",
    "PROMPT",
    "SHOPPER",
    "ask_all",
    "llm_completion",
    "recorded_backoff_sleeps",
]

MODEL = "SmolLM2-135M-Instruct"

PROMPT = RenderedPrompt(
    messages=(
        {"role": "system", "content": "You infer a shopper's current shopping intent."},
        {"role": "user", "content": '<events>\n+00:00 search query="over ear headhones"\n'},
    ),
    template="shopper_intent_v1.j2",
    template_hash="56171ff6b9a3",
    estimated_tokens=40,
    events_included=1,
    events_dropped=0,
)
INTENT_TEXT = (
    '{"intents": [{"label": "researching_product", "confidence": 0.8}], '
    '"summary": "Looking for over-ear headphones."}'
)
CLIENT_CONFIG = LlmConfig(
    base_url="http://llm.test/v1",
    model=MODEL,
    max_attempts=3,
    backoff_initial_s=0.5,
    backoff_max_s=8.0,
    request_timeout_s=5.0,
)


def llm_completion(text: str = INTENT_TEXT, **extra: Any) -> httpx.Response:
    """vLLM's answer to ``PROMPT`` (40 prompt tokens, 21 completion tokens)."""
    return builders.completion(
        text, finish_reason=None, prompt_tokens=40, completion_tokens=21, **extra
    )


def recorded_backoff_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The LLM client's sleeps (its backoff between attempts) from now on, each noted in the
    returned list and not slept: a retry test takes no time."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay: float, *args: Any) -> Any:
        slept.append(delay)
        return await real_sleep(0, *args)

    monkeypatch.setattr(llm_client.asyncio, "sleep", fake_sleep)
    return slept


ONE_ATTEMPT_LLM = LlmConfig(base_url="http://llm.test/v1", model=MODEL, max_attempts=1)
COMPARING_INTENT = {
    "intents": [
        {"label": "researching_product", "confidence": 0.3},
        {"label": "comparing_options", "confidence": 0.65, "category": "headphones"},
    ],
    "summary": "Comparing over-ear headphones from Sonique and Auralis.",
}


def ask_all(tasks: Sequence[PromptTask], llm: LlmConfig) -> list[Answered | TaskResult]:
    """Each task's prompt asked at once by one client of ``llm`` (``inference.ask``, no
    re-ask of an invalid answer): the answers, or the dead letters, in task order."""

    async def go() -> list[Answered | TaskResult]:
        client = LlmClient(llm)
        try:
            return await asyncio.gather(*(ask(t, client, 0) for t in tasks))
        finally:
            await client.aclose()

    return asyncio.run(go())
