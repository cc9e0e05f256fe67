"""What travels between the keyed operator and the LLM calls: a prompt to answer and
its outcome.

Plain data, so the pure timeline can create tasks and the runtime can run them without
either importing the other. A task carries everything its writes need that the session
knows exactly (the grounded facts, the rules-only intent, the categories the model may
name), computed when the prompt fired: the runtime computes nothing from the session.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import orjson

from flink_jobs.core.events import DeadLetter, pickled_by_fields
from flink_jobs.core.intents import Intent
from flink_jobs.core.prompting import RenderedPrompt


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class PromptTask:
    shopper_id: str
    seq: int
    version_ts: int  #: newest event time covered by the prompt
    #: Event time the trigger fired at: the event's own, or the end of the quiet period or
    #: max wait that fired it. Freshness is measured from here.
    event_time_ms: int
    prompt: RenderedPrompt
    # The rest defaults, so a task pickled by an earlier version (keyed state) still loads.

    #: ``grounding.GroundedFacts.to_json()`` of the session the prompt covers.
    facts_json: str = ""
    #: The intent ``grounding.rules_intent`` gives that session: written the moment the prompt
    #: fires (the outbox's rules lane), replaced by the model's answer. None: no rules write.
    rules: Intent | None = None
    #: ``grounding.session_category_enum``: the categories the model's answer may name (the
    #: request's response_format enum, checked again when the answer returns). Empty: any.
    categories: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        """The model to ask: the prompt's A/B arm's; empty: ``llm.model``."""
        return self.prompt.model

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
    outcome: str  #: written | stale | superseded | dead_letter
    dead_letter: DeadLetter | None = None
    attempts: int = 0
    llm_latency_s: float = 0.0
    prompt_tokens: int = 0
    #: Which write this is the outcome of: the model's answer, or the rules-only record.
    source: str = "model"
