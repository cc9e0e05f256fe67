"""The routing benchmark's workload: who asks when, and with which prompt. Pure, seeded.

* Shoppers arrive in random order with Zipf-skewed activity (``zipf_schedule``): each
  request draws its shopper independently, so hot shoppers come back often and cold ones
  rarely, with no rounds.
* Each shopper's context is a stream of real-looking events from ``flink_jobs.tools.sample_data``
  rendered by the project's own prompt renderer (``flink_jobs.core.prompting``): a short shared
  instruction prefix (the system message), then the shopper's history and events. The
  first prompt starts at ``initial_events``; each later prompt adds ``growth`` events.
* ``minimum_new_tokens`` says how many prompt tokens an ideal cache must still compute:
  a prompt's tokens past its longest common prefix with any earlier prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from flink_jobs.config import PromptConfig
from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.session import History, SessionState
from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample

#: The benchmarks' prompts use the v1 template, which their recorded figures (docs/lab_notebook.md)
#: were measured with; the job's default is v2 since the intent eval chose it.
WORKLOAD_TEMPLATE = "shopper_intent_v1.j2"
EVENT_SPACING_MS = 15_000


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What the main phase sends; defaults sized for three SmolLM2 workers on 2 cores."""

    shoppers: int = 31
    """Prime on purpose: not a multiple of the worker count."""
    requests: int = 150
    zipf_exponent: float = 0.8
    initial_events: tuple[int, int] = (25, 55)
    """Events in a shopper's first prompt (uniform range): about 1.2-2.6k tokens."""
    growth: tuple[int, int] = (1, 3)
    """Events added between two prompts of the same shopper (uniform range)."""
    max_events: int = 64
    """A shopper's first prompt is shortened so its last stays within this many events
    (~3.5k tokens): past the renderer's budget it drops the oldest events, which changes
    the prompt's start and defeats any prefix cache, whatever the router."""
    min_initial_events: int = 12
    max_prompt_tokens: int = 3500
    """The renderer's budget (estimated tokens); past it the oldest events are dropped."""
    seed: int = 11

    def __post_init__(self) -> None:
        if self.shoppers < 1 or self.requests < 1:
            raise ValueError("shoppers and requests must be >= 1")
        if self.zipf_exponent < 0:
            raise ValueError("zipf_exponent must be >= 0")
        for name in ("initial_events", "growth"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)}")


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt to send: ``seq`` is its place in the schedule."""

    seq: int
    shopper: str
    messages: tuple[dict[str, str], ...]
    events: int
    dropped: int = 0
    """Oldest events the renderer dropped to fit its budget (the prompt's start moved)."""


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Normalised weights ``1 / rank**exponent`` for ranks 1..n."""
    raw = [1.0 / (rank**exponent) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def zipf_schedule(
    shoppers: Sequence[str], requests: int, exponent: float, rng: random.Random
) -> list[str]:
    """``requests`` shopper ids drawn independently with Zipf weights.

    Popularity ranks are assigned to a shuffled copy of ``shoppers``, so the hottest
    shopper is not simply the first id.
    """
    ranked = list(shoppers)
    rng.shuffle(ranked)
    return rng.choices(ranked, weights=zipf_weights(len(ranked), exponent), k=requests)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def minimum_new_tokens(
    prompts: Iterable[Sequence[int]], block_size: int = 1, held: Sequence[int] = ()
) -> list[int]:
    """Per prompt, in order: tokens an ideal prefix cache would still compute.

    That is the prompt's length minus its longest common prefix with any earlier prompt
    (the shopper's previous prompt, or the shared instruction prefix of anyone's), the
    reused part rounded down to whole ``block_size`` blocks (vLLM caches whole blocks),
    and at least one token (vLLM always computes the last one). ``held``, per prompt:
    tokens of it some cache held before the first prompt (``CacheWatch``), also reusable.
    """
    seen: list[Sequence[int]] = []
    out = []
    for i, tokens in enumerate(prompts):
        reused = max((common_prefix_len(tokens, p) for p in seen), default=0)
        reused = max(reused, held[i] if i < len(held) else 0)
        reused -= reused % block_size
        out.append(max(1, len(tokens) - reused))
        seen.append(tokens)
    return out


def shared_prefix_tokens(shoppers: Sequence[str], prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every shopper's prompt shares (the instruction prefix and chat template head):
    the shortest common prefix between consecutive prompts of different shoppers."""
    pairs = [
        common_prefix_len(prompts[i], prompts[i + 1])
        for i in range(len(prompts) - 1)
        if shoppers[i] != shoppers[i + 1]
    ]
    return min(pairs, default=0)


def sample_events(shoppers: int, seed: int) -> list[ShopperEvent]:
    """Valid events of a generated sample (no bad records), in event-time order."""
    sample = generate_sample(SampleConfig(shoppers=shoppers, seed=seed, bad=BadRecords.none()))
    out = []
    for raw in sample.records:
        event = decode_event(raw, None, now_ms=2**62, max_bytes=1 << 20)
        if isinstance(event, ShopperEvent):
            out.append(event)
    return out


def event_streams(
    pool: Sequence[ShopperEvent], shoppers: Sequence[str], length: int, start_ms: int
) -> dict[str, list[ShopperEvent]]:
    """``length`` events per shopper, dealt from ``pool`` in turn and re-timed.

    The pool's shoppers are cycled through so each benchmark shopper gets contiguous runs
    of real sessions (queries, views, add-to-cart...), re-labelled as its own and spaced
    ``EVENT_SPACING_MS`` apart.
    """
    if not pool:
        raise ValueError("empty event pool")
    by_source: dict[str, list[ShopperEvent]] = {}
    for event in pool:
        by_source.setdefault(event.shopper_id, []).append(event)
    flat = [e for events in by_source.values() for e in events]
    streams: dict[str, list[ShopperEvent]] = {}
    stride = max(1, len(flat) // max(1, len(shoppers)))
    for i, shopper in enumerate(shoppers):
        offset = i * stride
        chosen = [flat[(offset + k) % len(flat)] for k in range(length)]
        streams[shopper] = [
            replace(
                e,
                event_id=f"{shopper}-{k}",
                shopper_id=shopper,
                event_time_ms=start_ms + k * EVENT_SPACING_MS,
            )
            for k, e in enumerate(chosen)
        ]
    return streams


def shopper_history(rng: random.Random, events: Sequence[ShopperEvent]) -> History:
    categories = sorted({e.category for e in events if e.category})
    brands = sorted({e.brand for e in events if e.brand})
    return History(
        sessions=rng.randint(1, 40),
        purchases=rng.randint(0, 12),
        top_categories=tuple(rng.sample(categories, min(3, len(categories)))),
        top_brands=tuple(rng.sample(brands, min(3, len(brands)))),
    )


def build_requests(
    config: WorkloadConfig, prefix: str = "shopper", pool: Sequence[ShopperEvent] | None = None
) -> list[Request]:
    """The main phase's requests, in schedule order."""
    rng = random.Random(f"routing-bench:{config.seed}")
    shoppers = [f"{prefix}-{i + 1:03d}" for i in range(config.shoppers)]
    schedule = zipf_schedule(shoppers, config.requests, config.zipf_exponent, rng)
    # Event counts per prompt, drawn up front so a hot shopper can start shorter.
    growths: dict[str, list[int]] = {s: [] for s in shoppers}
    for shopper in schedule[::-1]:
        growths[shopper].append(rng.randint(*config.growth))
    sizes: dict[str, list[int]] = {}
    for shopper, steps in growths.items():
        if not steps:
            continue
        later = sum(steps[1:])
        first = rng.randint(*config.initial_events)
        first = max(config.min_initial_events, min(first, config.max_events - later))
        sizes[shopper] = [first + sum(steps[1 : k + 1]) for k in range(len(steps))]
    longest = max(n for counts in sizes.values() for n in counts)
    pool = pool if pool is not None else sample_events(max(60, config.shoppers * 3), config.seed)
    streams = event_streams(pool, shoppers, longest, start_ms=1_780_000_000_000)
    renderer = PromptRenderer(
        PromptConfig(WORKLOAD_TEMPLATE, max_prompt_tokens=config.max_prompt_tokens)
    )
    histories = {s: shopper_history(rng, streams[s]) for s in shoppers}
    sent: dict[str, int] = {}
    requests = []
    for seq, shopper in enumerate(schedule):
        k = sent.get(shopper, 0)
        sent[shopper] = k + 1
        events = tuple(streams[shopper][: sizes[shopper][k]])
        requests.append(_render_request(renderer, seq, shopper, events, histories[shopper]))
    return requests


def build_skewed_lanes(
    hot: int,
    lanes_per_hot: int,
    per_hot: int,
    background_lanes: int,
    per_background: int,
    seed: int,
    max_prompt_tokens: int = 3500,
    tag: str = "",
) -> list[list[Request]]:
    """The skewed phase as closed-loop lanes (each lane sends its requests one after the
    other; all lanes run at once).

    Each hot shopper has ``lanes_per_hot`` lanes, so it always has that many requests in
    flight; its ``per_hot`` requests grow its context by one event each and are dealt to
    its lanes in turn. ``background_lanes`` lanes send one request each for fresh cold
    shoppers. ``seq`` numbers follow the shoppers' own order (for the minimum). ``tag``
    prefixes the shopper ids, so repeats are new shoppers to a router that saw earlier ones.
    """
    rng = random.Random(f"routing-bench-hot:{seed}")
    hot_ids = [f"{tag}hot-{i + 1:02d}" for i in range(hot)]
    cold_ids = [f"{tag}cold-{i + 1:03d}" for i in range(background_lanes * per_background)]
    pool = sample_events(60, seed + 1)
    streams = event_streams(pool, hot_ids + cold_ids, 40 + per_hot, start_ms=1_790_000_000_000)
    renderer = PromptRenderer(PromptConfig(WORKLOAD_TEMPLATE, max_prompt_tokens=max_prompt_tokens))
    histories = {s: shopper_history(rng, streams[s]) for s in streams}
    seq = 0

    def request(shopper: str, n: int) -> Request:
        nonlocal seq
        seq += 1
        return _render_request(
            renderer, seq - 1, shopper, tuple(streams[shopper][:n]), histories[shopper]
        )

    lanes: list[list[Request]] = [[] for _ in range(hot * lanes_per_hot + background_lanes)]
    start = {s: rng.randint(30, 40) for s in hot_ids}
    for step in range(per_hot):
        for h, shopper in enumerate(hot_ids):
            lanes[h * lanes_per_hot + step % lanes_per_hot].append(
                request(shopper, start[shopper] + step)
            )
    for k, shopper in enumerate(cold_ids):
        lanes[hot * lanes_per_hot + k % background_lanes].append(
            request(shopper, rng.randint(30, 50))
        )
    return lanes


def _render_request(renderer, seq: int, shopper: str, events: tuple, history) -> Request:
    """One benchmark request: the shopper's session so far, rendered by the job's renderer."""
    state = SessionState(
        shopper_id=shopper,
        events=events,
        history=history,
        session_started_ms=events[0].event_time_ms,
    )
    rendered = renderer.render(state)
    return Request(
        seq, shopper, rendered.messages, rendered.events_included, rendered.events_dropped
    )
