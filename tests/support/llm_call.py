"""One LLM call's pieces, as the client and inference tests of every tier send and answer
them: a rendered prompt, the model's answer, and the client's settings.

- ``PROMPT`` / ``INTENT_TEXT`` / :func:`llm_completion`: a one-event prompt of ``SHOPPER``
  and vLLM's answer to it, for the LLM client's tests.
- ``CLIENT_CONFIG``: the client with retries (three attempts, backoff from 0.5 s to 8 s).
- ``COMPARING_INTENT`` and ``ONE_ATTEMPT_LLM``: the intent a shopper comparing headphones
  gets, and a client that tries once, for the tests of one prompt's trip to Redis.
"""

from __future__ import annotations

from typing import Any

import httpx

from flink_jobs.config import LlmConfig
from flink_jobs.core.prompting import RenderedPrompt
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
    "llm_completion",
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


ONE_ATTEMPT_LLM = LlmConfig(base_url="http://llm.test/v1", model=MODEL, max_attempts=1)
COMPARING_INTENT = {
    "intents": [
        {"label": "researching_product", "confidence": 0.3},
        {"label": "comparing_options", "confidence": 0.65, "category": "headphones"},
    ],
    "summary": "Comparing over-ear headphones from Sonique and Auralis.",
}
