"""What travels between the keyed operator and the LLM calls: a prompt to answer and
its outcome.

Plain data, so the pure timeline can create tasks and the runtime can run them without
either importing the other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import orjson

from flink_jobs.core.events import DeadLetter, pickled_by_fields
from flink_jobs.core.prompting import RenderedPrompt


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class PromptTask:
    shopper_id: str
    seq: int
    version_ts: int  # newest event time covered by the prompt
    # Event time the trigger fired at: the event's own, or the end of the quiet period or
    # max wait that fired it. Freshness is measured from here.
    event_time_ms: int
    prompt: RenderedPrompt

    def audit_json(self) -> str:
        """The record of ``kafka.prompts_topic``: the rendered prompt and its digest."""
        text = orjson.dumps(self.prompt.messages)
        return orjson.dumps(
            {
                "shopper_id": self.shopper_id,
                "seq": self.seq,
                "version_ts": self.version_ts,
                "event_time_ms": self.event_time_ms,
                "template_hash": self.prompt.template_hash,
                "estimated_tokens": self.prompt.estimated_tokens,
                "sha256": hashlib.sha256(text).hexdigest(),
                "messages": self.prompt.messages,
            }
        ).decode()


@dataclass(frozen=True, slots=True)
class TaskResult:
    outcome: str  # written | stale | superseded | dead_letter
    dead_letter: DeadLetter | None = None
    attempts: int = 0
    llm_latency_s: float = 0.0
    prompt_tokens: int = 0
