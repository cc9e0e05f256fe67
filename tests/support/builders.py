"""Builders of the data the tests feed and expect, shared by every tier: catalogue products,
shopper events (decoded, and as raw JSON as they arrive on Kafka), sessions, prompt tasks,
chat-completion answers, intent records and a plan's unit costs. Real shapes (the sample
generator's catalogue, the event schema, vLLM's OpenAI-compatible answer); a test names
only what it is about.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import orjson

from flink_jobs.config import AppConfig, SessionConfig, TriggerConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.grounding import grounded_facts, rules_intent, session_category_enum
from flink_jobs.core.prompting import PromptRenderer, RenderedPrompt
from flink_jobs.core.session import SessionState, apply_event, new_session_state
from flink_jobs.core.tasks import PromptTask
from flink_jobs.runtime.intent_store import IntentRecord
from flink_jobs.tools.sizing.costs import MEASURED, Figure, UnitCosts

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z
SHOPPER = "shopper-00146"

HEADPHONES = {
    "product_id": "sku-737145",
    "title": "Sonique Studio Pro Wireless Noise-Cancelling Over-Ear Headphones, Midnight Black",
    "category": "Electronics > Audio > Headphones",
    "brand": "Sonique",
    "price": 108.99,
}
EARBUDS = {
    "product_id": "sku-149048",
    "title": "Auralis Studio Pro Sport Earbuds, IPX5 Sweatproof, Sand",
    "category": "Electronics > Audio > Headphones",
    "brand": "Auralis",
    "price": 299.99,
}

ESPRESSO = {
    "product_id": "sku-307045",
    "title": "Brewster House Blend Espresso Pods, 50 Count, Dark Roast",
    "category": "Grocery > Coffee & Tea",
    "brand": "Brewster",
    "price": 29.0,
}
GREEN_TEA = {
    "product_id": "sku-552310",
    "title": "Kyoto Leaf Organic Sencha Green Tea, 100 Bags",
    "category": "Grocery > Coffee & Tea",
    "brand": "Kyoto Leaf",
    "price": 12.49,
}

_event_ids = itertools.count(1)


def at(seconds: float) -> int:
    """Epoch milliseconds ``seconds`` after ``T0``."""
    return T0 + int(seconds * 1000)


# --- events ------------------------------------------------------------------------------


def shopper_event(
    event_type: str = "view",
    at_s: float = 0,
    product: dict | None = None,
    *,
    shopper_id: str = SHOPPER,
    n: int | None = None,
    event_id: str | None = None,
    **fields: Any,
) -> ShopperEvent:
    """A decoded event ``at_s`` seconds after ``T0``. Its id: ``event_id``, else
    ``ev-<shopper>-<n>`` when ``n`` is given, else a fresh one."""
    if event_id is None:
        event_id = f"ev-{shopper_id}-{n}" if n is not None else f"ev-{next(_event_ids):06d}"
    return ShopperEvent(
        event_id=event_id,
        shopper_id=shopper_id,
        event_type=event_type,
        event_time_ms=at(at_s),
        **(product or {}),
        **fields,
    )


def numbered_event(
    n: int, event_type: str, at_s: float, product: dict | None = None, **fields: Any
) -> ShopperEvent:
    """The ``n``-th event of ``SHOPPER`` (id ``ev-shopper-00146-<n>``), or of ``shopper_id``."""
    return shopper_event(event_type, at_s, product, n=n, **fields)


def session_of(
    *events: ShopperEvent,
    config: SessionConfig | None = None,
    high_signal: frozenset[str] | None = None,
    state: SessionState | None = None,
) -> SessionState:
    """The session state after ``events`` in order (default session and trigger settings)."""
    config = config or SessionConfig()
    high_signal = TriggerConfig().high_signal_types if high_signal is None else high_signal
    state = state or new_session_state(events[0].shopper_id)
    for e in events:
        state, _ = apply_event(state, e, config, high_signal)
    return state


def raw_event(
    shopper_id: str = "s1",
    at_s: float = 0.0,
    event_type: str = "search",
    *,
    event_id: str | None = None,
    start_ms: int = T0,
    **fields: Any,
) -> bytes:
    """An event as its producer sends it: JSON bytes with an ISO-8601 event time."""
    from flink_jobs.tools.sample_data import format_event_time

    t = start_ms + int(at_s * 1000)
    doc = {
        "event_id": event_id or f"e-{shopper_id}-{t}",
        "shopper_id": shopper_id,
        "event_type": event_type,
        "event_time": format_event_time(t),
        **fields,
    }
    return orjson.dumps(doc)


# --- prompts and answers -----------------------------------------------------------------


def prompt_task(
    shopper_id: str = SHOPPER,
    seq: int = 3,
    at_s: float = 95,
    *,
    user: str | None = None,
    estimated_tokens: int = 400,
    events_included: int = 6,
) -> PromptTask:
    """A rendered prompt's task, versioned by its event time; the user message names ``seq``
    unless ``user`` is given."""
    prompt = RenderedPrompt(
        messages=(
            {"role": "system", "content": "You infer a shopper's current shopping intent."},
            {
                "role": "user",
                "content": user or f"<events>\n+01:35 view seq={seq}\n</events>",
            },
        ),
        template="shopper_intent_v1.j2",
        template_hash="56171ff6b9a3",
        estimated_tokens=estimated_tokens,
        events_included=events_included,
        events_dropped=0,
    )
    time_ms = at(at_s)
    return PromptTask(shopper_id, seq, version_ts=time_ms, event_time_ms=time_ms, prompt=prompt)


def grounded_task(shopper_id: str = SHOPPER, seq: int = 2) -> PromptTask:
    """The task the timeline makes when a shopper's second view (headphones, then earbuds)
    fires a prompt: the default template's prompt with the grounded facts, the rules'
    intent and the categories the answer may name."""
    state = session_of(
        numbered_event(1, "view", 28.6, HEADPHONES, shopper_id=shopper_id),
        numbered_event(2, "view", 60.6, EARBUDS, shopper_id=shopper_id),
    )
    facts = grounded_facts(state)
    prompt = PromptRenderer(AppConfig().prompt).render(state)
    time_ms = T0 + 60_600
    return PromptTask(
        shopper_id,
        seq,
        time_ms,
        time_ms,
        prompt,
        facts_json=facts.to_json().decode(),
        rules=rules_intent(facts, state),
        categories=session_category_enum(facts),
    )


def completion_body(
    content: str,
    *,
    model: str = "SmolLM2-135M-Instruct",
    finish_reason: str | None = "stop",
    prompt_tokens: int = 412,
    completion_tokens: int = 30,
    **extra: Any,
) -> dict[str, Any]:
    """An OpenAI-compatible chat completion whose answer is ``content``."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content}}
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    return {
        "id": "cmpl-1",
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        **extra,
    }


def completion(content: str, **body: Any) -> httpx.Response:
    """``completion_body`` as a 200 response."""
    return httpx.Response(200, content=orjson.dumps(completion_body(content, **body)))


# --- intent records ----------------------------------------------------------------------


def intent_record(
    shopper_id: str = "shopper-1",
    version_ts: int = 1_000,
    seq: int = 0,
    *,
    intent: dict[str, Any] | None = None,
    top_label: str | None = None,
    top_confidence: float | None = None,
    summary: str | None = None,
    event_time_ms: int | None = None,
    template: str = "shopper_intent_v1.j2",
    template_hash: str = "56171ff6b9a3",
    model: str = "SmolLM2-135M-Instruct",
) -> IntentRecord:
    """The record the job writes for an intent; top label, confidence and summary come from
    ``intent`` (a one-intent browsing intent by default) unless given."""
    intent = intent or {
        "intents": [{"label": "browsing", "confidence": 0.5}],
        "summary": "summary",
    }
    top = max(intent["intents"], key=lambda i: i["confidence"])
    return IntentRecord(
        shopper_id=shopper_id,
        version_ts=version_ts,
        version_seq=seq,
        intent_json=orjson.dumps(intent).decode(),
        top_label=top["label"] if top_label is None else top_label,
        top_confidence=top["confidence"] if top_confidence is None else top_confidence,
        summary=intent["summary"] if summary is None else summary,
        event_time_ms=version_ts if event_time_ms is None else event_time_ms,
        template=template,
        template_hash=template_hash,
        model=model,
    )


#: Round figures: 0.75 ms of job CPU per event; 500 uncached prompt tokens and 200 output
#: tokens per call; 0.3 upserts per event.
UNIT_COSTS = {
    "jvm_cpu_ms_per_event": 0.5,
    "call_process_cpu_ms_per_call": 1.0,
    "llm_calls_per_event": 0.25,
    "prompts_per_event": 0.05,
    "rules_writes_per_prompt": 1.0,
    "job_to_prompt_p99_s": 1.0,
    "prompt_tokens_per_call": 2000.0,
    "output_tokens_per_call": 200.0,
    "prefix_cache_hit_ratio": 0.75,
    "redis_writes_per_node_per_s": 10_000.0,
    "router_cpu_ms_per_request": 0.5,
    "trigger_max_wait_s": 2.0,
    "freshness_target_s": 5.0,
    "max_parallelism": 128.0,
}


def unit_costs(**changes: float | None) -> UnitCosts:
    """``UNIT_COSTS`` with ``changes``, each from ``test.json``; None: absent, with that
    reason."""
    values = {**UNIT_COSTS, **changes}
    return UnitCosts(
        **{
            name: Figure(v, "test.json", name, MEASURED)
            for name, v in values.items()
            if v is not None
        },
        absent={name: f"test.json: no {name}" for name, v in values.items() if v is None},
    )


def versioned_record(shopper_id: str = "shopper-1", ts: int = 1_000, seq: int = 0) -> IntentRecord:
    """A record whose payload names its version (``"<ts>.<seq>"`` as the summary), so the
    stored payload can be checked."""
    tag = f"{ts}.{seq}"
    intent = {"intents": [{"label": "compare", "confidence": 0.8}], "summary": tag}
    return intent_record(
        shopper_id,
        ts,
        seq,
        intent=intent,
        template="intent_v1",
        template_hash="abc123",
        model="smollm2-135m",
    )
