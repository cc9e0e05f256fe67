"""Scoring intent writes against what each shopper did next, from the events alone.

Pure and deterministic: given every shopper's events and the intents written for them
(:class:`IntentWrite`: the newest event time the intent covers, its labels, and which
template, model and source made it), :func:`evaluate` scores each write against the events
after it and groups the figures by (template, model, source). Every figure is given for
the model's answer alone, for the record the job stores for it (``grounding.reconcile``:
the rules' labels first), and for two baselines on the same writes: the rules-only intent
of the session at that point (``grounding.rules_intent``, recomputed here from the
events) and, for re-ranking, no intent.

A write's *session* is the shopper's run of events without a quiet gap longer than
``session_gap_s``, as the job cuts them; "after the write" means the events of that session
later than the write's ``version_ts``. A *product engagement* is a view, click, add to cart
or purchase.

Metrics (each over the writes it applies to; None when none do):

- ``next_category_top1`` / ``next_category_any``: for writes followed by a product
  engagement in the session, whether the engaged product's category is the intent's first
  category (most confident first) / any of its categories. Categories match as the
  re-ranker matches them (``intent_reader.rerank.category_matches``: whole, or one level
  of the product's path); an intent naming no category misses.
- ``purchase_auc``: ROC AUC of the summed confidence of the purchase labels
  (``PURCHASE_LABELS``) for "buys within the session after this write", by the rank
  formula with tied scores sharing their mean rank.
- ``post_purchase_consistency``: of writes whose newest covered event is a purchase, the
  share whose top label is ``post_purchase``.
- ``abandoning_cart_consistency``: of writes that cover the session's last event while the
  cart holds something, the share whose top label is ``abandoning_cart``.
- ``ndcg_at_10`` / ``recall_at_10``: for writes followed by a product engagement, that
  product's place among ``candidates`` products (it and others drawn from the products
  seen in the events, with a generator seeded by ``seed``, the shopper and how many of its
  events the write covers, so every arm, and every rerun, ranks the same candidates), each
  with a base score drawn from ``BASE_SCORES`` (a ranker that knows nothing of the
  shopper), re-ranked by ``intent_reader.rerank.rerank``. One product is relevant, so NDCG@10 is
  ``1 / log2(1 + rank)`` within the top ten, else 0.
- ``browsing_with_signal``: of writes whose session holds a cart, a purchase, or a
  category engaged twice or more, the share whose top label is ``browsing``.

Beside the metrics, each group counts ``next_category_offered``: of the writes followed by a
product engagement, how many engaged a category the model was offered
(``grounding.session_category_enum``). Its share is the ceiling of ``next_category_any``
for any intent held to the session's categories: a shopper's first step into a new
category is a miss for every arm.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from flink_jobs.config import SessionConfig, TriggerConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.grounding import (
    GroundedFacts,
    grounded_facts,
    reconcile,
    rules_intent,
    session_category_enum,
)
from flink_jobs.core.intents import Intent
from flink_jobs.core.session import SessionState, apply_event, new_session_state
from intent_reader.client import IntentLabel, ShopperIntent
from intent_reader.rerank import Candidate, category_matches, rerank

PURCHASE_LABELS: tuple[str, ...] = ("ready_to_buy",)
ENGAGEMENTS = ("view", "click", "add_to_cart", "purchase")
DEFAULT_CANDIDATES = 50
DEFAULT_SEED = 27
TOP_K = 10
#: The range of the base scores the candidates are drawn with.
BASE_SCORES = (0.5, 1.0)

METRICS = (
    "next_category_top1",
    "next_category_any",
    "purchase_auc",
    "post_purchase_consistency",
    "abandoning_cart_consistency",
    "ndcg_at_10",
    "recall_at_10",
    "browsing_with_signal",
)


#: Metrics where a lower share is the better one.
LOWER_IS_BETTER = frozenset({"browsing_with_signal"})


def better(metric: str, ours: float, theirs: float, tolerance: float = 1e-9) -> int:
    """1 when ``ours`` is the better figure of ``metric``, -1 when worse, 0 on a tie."""
    difference = (theirs - ours) if metric in LOWER_IS_BETTER else (ours - theirs)
    return 0 if abs(difference) <= tolerance else (1 if difference > 0 else -1)


# --- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntentWrite:
    """One intent that landed in Redis (or would have), as the eval needs it."""

    shopper_id: str
    version_ts: int  #: event time of the newest event the intent covers
    labels: tuple[IntentLabel, ...]  #: most confident first
    source: str = "model"  #: model | rules
    template: str = ""
    model: str = ""

    @property
    def top_label(self) -> str:
        return self.labels[0].label if self.labels else ""

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x.category for x in self.labels if x.category))

    @classmethod
    def from_record(cls, shopper_id: str, record: Mapping[str, Any]) -> IntentWrite:
        """From an intent hash's fields (``intent_reader.layout``): the model's ``answer``
        (the JSON body; ``intent`` when the record has none), ``version_ts``, ``template``,
        ``model``, and ``source`` when present. The labels are the model's own: the record's
        are recomputed in scoring (``grounding.reconcile``)."""
        body = record.get("answer") or record["intent"]
        if isinstance(body, str | bytes):
            body = orjson.loads(body)
        return cls(
            shopper_id=shopper_id,
            version_ts=int(record["version_ts"]),
            labels=labels_of(body),
            source=str(record.get("source") or "model"),
            template=str(record.get("template", "")),
            model=str(record.get("model", "")),
        )


def labels_of(body: Mapping[str, Any]) -> tuple[IntentLabel, ...]:
    """The labels of an intent body (``{"intents": [...], "summary": ...}``), most
    confident first (stable for equal confidences)."""
    items = [
        IntentLabel(str(i["label"]), float(i["confidence"]), i.get("category") or None)
        for i in body.get("intents", ())
    ]
    return tuple(sorted(items, key=lambda x: -x.confidence))


# --- outputs ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scores:
    """One arm's figures over a group's writes (see the module docstring)."""

    next_category_top1: float | None = None
    next_category_any: float | None = None
    purchase_auc: float | None = None
    post_purchase_consistency: float | None = None
    abandoning_cart_consistency: float | None = None
    ndcg_at_10: float | None = None
    recall_at_10: float | None = None
    browsing_with_signal: float | None = None


@dataclass(frozen=True, slots=True)
class Counts:
    """How many of a group's writes each metric applies to."""

    writes: int = 0
    followed_by_engagement: int = 0
    next_category_offered: int = 0  #: of those, the engaged category was in the enum
    purchase_after: int = 0
    just_purchased: int = 0
    cart_left: int = 0
    with_signal: int = 0


@dataclass(frozen=True, slots=True)
class GroupReport:
    template: str
    model: str
    source: str
    counts: Counts
    answer: Scores  #: the model's answers, as the writes carry them
    record: Scores  #: the records the job stores for them (``grounding.reconcile``)
    rules: Scores  #: the rules-only intent of the same writes
    no_intent: Scores  #: re-ranking without an intent (its other figures are None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "template": self.template,
            "model": self.model,
            "source": self.source,
            "counts": asdict(self.counts),
            "answer": asdict(self.answer),
            "record": asdict(self.record),
            "rules": asdict(self.rules),
            "no_intent": asdict(self.no_intent),
        }


@dataclass(frozen=True, slots=True)
class EvalResult:
    groups: tuple[GroupReport, ...]
    unmatched_writes: int  #: writes covering none of the shopper's events (not scored)
    candidates: int
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "candidates": self.candidates,
            "seed": self.seed,
            "unmatched_writes": self.unmatched_writes,
            "groups": [g.as_dict() for g in self.groups],
        }


# --- the pure pieces -------------------------------------------------------------------------


def roc_auc(scores: Sequence[float], positives: Sequence[bool]) -> float | None:
    """ROC AUC by the rank formula (Mann-Whitney U / (n+ x n-)); tied scores share their
    mean rank. None when either class is empty."""
    n_pos = sum(1 for p in positives if p)
    n_neg = len(positives) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        mean_rank = (i + j) / 2 + 1  # ranks are 1-based
        for k in range(i, j + 1):
            ranks[order[k]] = mean_rank
        i = j + 1
    rank_sum = sum(r for r, p in zip(ranks, positives, strict=True) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def ndcg_at(rank: int, k: int = TOP_K) -> float:
    """NDCG@k of a ranking whose one relevant item is at ``rank`` (1-based)."""
    return 1.0 / math.log2(rank + 1) if 1 <= rank <= k else 0.0


def purchase_score(
    labels: Iterable[IntentLabel], purchase_labels: tuple[str, ...] = PURCHASE_LABELS
) -> float:
    return sum(x.confidence for x in labels if x.label in purchase_labels)


def as_shopper_intent(shopper_id: str, labels: tuple[IntentLabel, ...]) -> ShopperIntent:
    """A fresh ``ShopperIntent`` carrying ``labels``, for ``rerank`` (which reads only
    the labels and staleness)."""
    top = labels[0] if labels else IntentLabel("browsing", 0.0)
    return ShopperIntent(
        shopper_id=shopper_id,
        labels=labels,
        summary="",
        top_label=top.label,
        top_confidence=top.confidence,
        version_ts=0,
        version_seq=0,
        event_time_ms=0,
        written_at_ms=0,
        template="",
        template_hash="",
        model="",
        age_ms=0,
        written_age_ms=0,
        stale=False,
        intent_json="",
    )


def draw_candidates(
    engaged: str,
    catalogue: Mapping[str, str],
    n: int,
    rng: random.Random,
) -> list[Candidate]:
    """``engaged`` and ``n - 1`` other products of ``catalogue`` (product id -> category),
    in a random order, each with a random base score."""
    others = sorted(p for p in catalogue if p != engaged)
    chosen = [engaged, *rng.sample(others, min(n - 1, len(others)))]
    rng.shuffle(chosen)
    return [Candidate(p, rng.uniform(*BASE_SCORES), catalogue.get(p) or None) for p in chosen]


def rank_of(
    product_id: str,
    candidates: Sequence[Candidate],
    labels: Iterable[IntentLabel] | None,
    shopper_id: str,
) -> int:
    """The 1-based place of ``product_id`` once ``candidates`` are re-ranked by an intent
    with ``labels`` (None: no intent)."""
    intent = None if labels is None else as_shopper_intent(shopper_id, tuple(labels))
    ranked = rerank(candidates, intent)
    return next(i for i, r in enumerate(ranked, 1) if r.candidate.product_id == product_id)


# --- evaluation ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Point:
    """What the events say about one write: the session so far and what came next."""

    write: IntentWrite
    facts: GroundedFacts
    rules: Intent
    newest_type: str
    events_covered: int  #: the shopper's events up to the write: a run-independent position
    next_engagement: ShopperEvent | None
    purchase_after: bool
    session_ends: bool


@dataclass(slots=True)
class _Tally:
    hits: int = 0
    total: int = 0

    def add(self, hit: bool) -> None:
        self.hits += bool(hit)
        self.total += 1

    @property
    def share(self) -> float | None:
        return self.hits / self.total if self.total else None


@dataclass(slots=True)
class _Mean:
    values: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


def evaluate(
    events: Iterable[ShopperEvent],
    writes: Iterable[IntentWrite],
    *,
    candidates: int = DEFAULT_CANDIDATES,
    seed: int = DEFAULT_SEED,
    session_gap_s: float = SessionConfig().gap_s,
    purchase_labels: tuple[str, ...] = PURCHASE_LABELS,
) -> EvalResult:
    """Score ``writes`` against ``events`` (any order; see the module docstring)."""
    matched = _matched(events, writes, session_gap_s)
    reports = tuple(
        _score_group(key, group, matched.catalogue, candidates, seed, purchase_labels)
        for key, group in sorted(matched.groups.items())
    )
    return EvalResult(reports, matched.unmatched, candidates, seed)


@dataclass(frozen=True, slots=True)
class _Matched:
    """Every write that found its place in its shopper's events, grouped by (template,
    model, source) in shopper order, with the products seen and the writes left over."""

    groups: dict[tuple[str, str, str], list[_Point]]
    catalogue: dict[str, str]
    unmatched: int


def _matched(
    events: Iterable[ShopperEvent], writes: Iterable[IntentWrite], session_gap_s: float
) -> _Matched:
    """Each shopper's events in time order (stable: arrival order on ties), walked once
    with that shopper's writes."""
    by_shopper: dict[str, list[ShopperEvent]] = defaultdict(list)
    for e in events:
        by_shopper[e.shopper_id].append(e)
    for shopper_events in by_shopper.values():
        shopper_events.sort(key=lambda e: e.event_time_ms)
    session = SessionConfig(gap_s=session_gap_s)

    writes_by_shopper: dict[str, list[IntentWrite]] = defaultdict(list)
    for w in writes:
        writes_by_shopper[w.shopper_id].append(w)
    groups: dict[tuple[str, str, str], list[_Point]] = defaultdict(list)
    unmatched = 0
    for shopper_id, shopper_writes in sorted(writes_by_shopper.items()):
        found = _points(by_shopper.get(shopper_id, []), shopper_writes, session)
        unmatched += len(shopper_writes) - len(found)
        for p in found:
            groups[(p.write.template, p.write.model, p.write.source)].append(p)
    return _Matched(groups, _catalogue(by_shopper.values()), unmatched)


def _catalogue(shoppers: Iterable[Sequence[ShopperEvent]]) -> dict[str, str]:
    """Every product seen in the events, with its newest category."""
    seen: dict[str, str] = {}
    for shopper_events in shoppers:
        for e in shopper_events:
            if e.product_id:
                seen[e.product_id] = e.category or seen.get(e.product_id, "")
    return seen


def _points(
    events: list[ShopperEvent], writes: list[IntentWrite], session: SessionConfig
) -> list[_Point]:
    """Walk one shopper's events once, stopping at each write (in version order)."""
    if not events:
        return []
    high_signal = TriggerConfig().high_signal_types
    gap_ms = session.gap_s * 1000
    state: SessionState = new_session_state(events[0].shopper_id)
    applied = 0
    points = []
    for w in sorted(writes, key=lambda w: w.version_ts):
        while applied < len(events) and events[applied].event_time_ms <= w.version_ts:
            state, _ = apply_event(state, events[applied], session, high_signal)
            applied += 1
        if applied == 0:
            continue
        after = []
        previous = events[applied - 1].event_time_ms
        for e in events[applied:]:
            if e.event_time_ms - previous > gap_ms:
                break
            after.append(e)
            previous = e.event_time_ms
        facts = grounded_facts(state)
        points.append(
            _Point(
                write=w,
                facts=facts,
                rules=rules_intent(facts, state),
                newest_type=state.events[-1].event_type if state.events else "",
                events_covered=applied,
                next_engagement=next(
                    (e for e in after if e.event_type in ENGAGEMENTS and e.product_id), None
                ),
                purchase_after=any(e.event_type == "purchase" for e in after),
                session_ends=not after,
            )
        )
    return points


def record_labels(p: _Point) -> tuple[IntentLabel, ...]:
    """The labels of the record the job stores for the point's write: the model's answer
    held to the cart's facts (``grounding.reconcile``); a rules write's own labels."""
    if p.write.source != "model":
        return p.write.labels
    items = [
        {"label": x.label, "confidence": x.confidence}
        | ({"category": x.category} if x.category else {})
        for x in p.write.labels
    ]
    top = p.write.labels[0] if p.write.labels else IntentLabel("browsing", 0.0)
    answer = Intent({"intents": items, "summary": ""}, top.label, top.confidence, "")
    return labels_of(reconcile(answer, p.rules).body)


@dataclass(frozen=True, slots=True)
class PointScores:
    """One write's figures for one arm; None where the metric does not apply to it."""

    shopper_id: str
    version_ts: int
    purchase_after: bool
    purchase_score: float | None = None  #: None: the arm has no purchase foresight (no intent)
    next_category_top1: float | None = None
    next_category_any: float | None = None
    post_purchase_consistency: float | None = None
    abandoning_cart_consistency: float | None = None
    ndcg_at_10: float | None = None
    recall_at_10: float | None = None
    browsing_with_signal: float | None = None


def aggregate(points: Sequence[PointScores]) -> Scores:
    """An arm's figures over ``points``: each metric's mean where it applies, and the ROC AUC
    of the purchase scores."""
    values: dict[str, float | None] = {}
    for name in METRICS:
        if name == "purchase_auc":
            scored = [
                (p.purchase_score, p.purchase_after) for p in points if p.purchase_score is not None
            ]
            values[name] = (
                roc_auc([s for s, _ in scored], [b for _, b in scored]) if scored else None
            )
            continue
        applicable = [getattr(p, name) for p in points if getattr(p, name) is not None]
        values[name] = sum(applicable) / len(applicable) if applicable else None
    return Scores(**values)


ARMS = ("answer", "record", "rules", "no_intent")


def _arm_labels(arm: str, p: _Point) -> tuple[IntentLabel, ...] | None:
    if arm == "answer":
        return p.write.labels
    if arm == "record":
        return record_labels(p)
    if arm == "rules":
        return labels_of(p.rules.body)
    return None  # no intent


def _point_scores(
    p: _Point,
    catalogue: Mapping[str, str],
    n_candidates: int,
    seed: int,
    purchase_labels: tuple[str, ...],
) -> dict[str, PointScores]:
    """Every arm's figures for one write (the same candidates for every arm)."""
    shopper = p.write.shopper_id
    engaged = p.next_engagement
    candidates = None
    if engaged is not None:
        # Seeded by the write's place in the shopper's events, not its time: the eval moves
        # event times to the wall clock, and a rerun must draw the same candidates.
        rng = random.Random(f"{seed}|{shopper}|{p.events_covered}")
        candidates = draw_candidates(engaged.product_id, catalogue, n_candidates, rng)
    signal = bool(
        p.facts.cart or p.facts.last_purchase or any(c.count >= 2 for c in p.facts.categories)
    )
    cart_left = p.session_ends and bool(p.facts.cart)
    out: dict[str, PointScores] = {}
    for arm in ARMS:
        labels = _arm_labels(arm, p)
        figures: dict[str, Any] = {}
        if engaged is not None and candidates is not None:
            rank = rank_of(engaged.product_id, candidates, labels, shopper)
            figures["ndcg_at_10"] = ndcg_at(rank)
            figures["recall_at_10"] = float(rank <= TOP_K)
        if labels is not None:
            top = labels[0].label if labels else ""
            categories = tuple(dict.fromkeys(x.category for x in labels if x.category))
            if engaged is not None and candidates is not None:
                figures["next_category_top1"] = float(
                    bool(categories) and category_matches(engaged.category, categories[0])
                )
                figures["next_category_any"] = float(
                    any(category_matches(engaged.category, c) for c in categories)
                )
            if p.newest_type == "purchase":
                figures["post_purchase_consistency"] = float(top == "post_purchase")
            if cart_left:
                figures["abandoning_cart_consistency"] = float(top == "abandoning_cart")
            if signal:
                figures["browsing_with_signal"] = float(top == "browsing")
            figures["purchase_score"] = purchase_score(labels, purchase_labels)
        out[arm] = PointScores(shopper, p.write.version_ts, p.purchase_after, **figures)
    return out


def _score_group(
    key: tuple[str, str, str],
    points: Sequence[_Point],
    catalogue: Mapping[str, str],
    n_candidates: int,
    seed: int,
    purchase_labels: tuple[str, ...],
) -> GroupReport:
    template, model, source = key
    per_arm = _per_arm(points, catalogue, n_candidates, seed, purchase_labels)
    counts: dict[str, int] = defaultdict(int)
    for p in points:
        engaged = p.next_engagement
        counts["followed_by_engagement"] += engaged is not None
        counts["next_category_offered"] += engaged is not None and any(
            category_matches(engaged.category, c) for c in session_category_enum(p.facts)
        )
        counts["purchase_after"] += p.purchase_after
        counts["just_purchased"] += p.newest_type == "purchase"
        counts["cart_left"] += p.session_ends and bool(p.facts.cart)
        counts["with_signal"] += bool(
            p.facts.cart or p.facts.last_purchase or any(c.count >= 2 for c in p.facts.categories)
        )
    return GroupReport(
        template=template,
        model=model,
        source=source,
        counts=Counts(writes=len(points), **counts),
        answer=aggregate(per_arm["answer"]),
        record=aggregate(per_arm["record"]),
        rules=aggregate(per_arm["rules"]),
        no_intent=aggregate(per_arm["no_intent"]),
    )


def _per_arm(
    points: Iterable[_Point],
    catalogue: Mapping[str, str],
    n_candidates: int,
    seed: int,
    purchase_labels: tuple[str, ...],
) -> dict[str, list[PointScores]]:
    per_arm: dict[str, list[PointScores]] = {arm: [] for arm in ARMS}
    for p in points:
        for arm, scores in _point_scores(p, catalogue, n_candidates, seed, purchase_labels).items():
            per_arm[arm].append(scores)
    return per_arm


def point_scores(
    events: Iterable[ShopperEvent],
    writes: Iterable[IntentWrite],
    *,
    candidates: int = DEFAULT_CANDIDATES,
    seed: int = DEFAULT_SEED,
    session_gap_s: float = SessionConfig().gap_s,
    purchase_labels: tuple[str, ...] = PURCHASE_LABELS,
) -> dict[tuple[str, str, str], dict[str, list[PointScores]]]:
    """Per (template, model, source) group and arm, every write's figures (what
    :func:`evaluate` aggregates), for intervals over shoppers (:func:`bootstrap_difference`)."""
    matched = _matched(events, writes, session_gap_s)
    return {
        key: _per_arm(group, matched.catalogue, candidates, seed, purchase_labels)
        for key, group in sorted(matched.groups.items())
    }


@dataclass(frozen=True, slots=True)
class Difference:
    """``a - b`` of one metric over the same writes, with a 95 % bootstrap interval."""

    metric: str
    a_value: float | None
    b_value: float | None
    difference: float | None
    low: float | None
    high: float | None
    writes: int
    resamples: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_difference(
    a: Sequence[PointScores],
    b: Sequence[PointScores],
    metric: str,
    *,
    resamples: int = 1000,
    seed: int = DEFAULT_SEED,
) -> Difference:
    """``metric`` of arm ``a`` minus arm ``b`` over the writes both scored (paired by
    shopper and version), with the 2.5th and 97.5th percentiles of the difference over
    ``resamples`` resamples of the shoppers with replacement (a shopper's writes move
    together: they are not independent of each other)."""
    b_by_point = {(p.shopper_id, p.version_ts): p for p in b}
    pairs = [
        (p, b_by_point[(p.shopper_id, p.version_ts)])
        for p in a
        if (p.shopper_id, p.version_ts) in b_by_point
    ]

    def value(scores: Sequence[PointScores]) -> float | None:
        figure: float | None = getattr(aggregate(scores), metric)
        return figure

    va, vb = value([x for x, _ in pairs]), value([y for _, y in pairs])
    diff = None if va is None or vb is None else va - vb
    by_shopper: dict[str, list[tuple[PointScores, PointScores]]] = defaultdict(list)
    for pair in pairs:
        by_shopper[pair[0].shopper_id].append(pair)
    shoppers = sorted(by_shopper)
    rng = random.Random(f"bootstrap|{seed}|{metric}")
    samples = []
    for _ in range(resamples if diff is not None else 0):
        chosen = [pair for s in rng.choices(shoppers, k=len(shoppers)) for pair in by_shopper[s]]
        x, y = value([p for p, _ in chosen]), value([q for _, q in chosen])
        if x is not None and y is not None:
            samples.append(x - y)
    samples.sort()
    low = samples[int(0.025 * (len(samples) - 1))] if samples else None
    high = samples[math.ceil(0.975 * (len(samples) - 1))] if samples else None
    return Difference(metric, va, vb, diff, low, high, len(pairs), len(samples))


# --- reporting -------------------------------------------------------------------------------


def format_table(result: EvalResult) -> str:
    """A markdown table: one row per group and arm, one column per metric."""
    header = ["template", "model", "source", "arm", "writes", *METRICS]
    rows = [header, ["---"] * len(header)]
    for g in result.groups:
        arms = (("answer", g.answer), ("record", g.record), ("rules", g.rules))
        for arm, scores in (*arms, ("none", g.no_intent)):
            cells = [_cell(getattr(scores, m)) for m in METRICS]
            rows.append([g.template, g.model, g.source, arm, str(g.counts.writes), *cells])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
