"""``shopper-intents eval``: the real job, bounded, with the real model, once per template
arm over the same events; every intent write scored against what the shopper did next.

Steps, in the order :func:`run_eval` takes them:

1. read the events file, keep the first ``--shoppers`` shoppers, and move every event
   time by one delta so the newest lands on the wall clock (spacing and order kept, so
   sessions and trigger points are those of the file);
2. start the embedded stack (broker, Redis, vLLM workers on the CPU, the router) and
   write the events to one topic;
3. per arm: run the job bounded (``kafka.bounded``) from the topic's start with the
   arm's template, its own key prefix and notification stream, ``llm.latest_wins`` off
   (every trigger point gets a model answer whatever the model's speed) and
   ``llm.rules_first`` off (so the next prompt's rules-only record does not outrank the
   model's answer to the one before: the rules intent is recomputed in scoring); read
   every landed write from the stream, and the cost from the counters (the job's LLM
   calls, vLLM's prompt, output and prefix-cache tokens);
4. score with :func:`flink_jobs.tools.intent_eval.evaluate`: every arm's model writes
   beside the rules-only intent and no intent on the same writes, both over each arm's
   own writes and over the trigger points every arm answered (like with like);
5. write ``bench/results/intent_quality.json`` (one entry per dataset, with the commit the
   run started on, as the benchmarks record theirs), a markdown report beside it and a
   plot.

Greedy decoding (``llm.temperature`` 0) and seeded candidates make a rerun on the same
host give the same figures, up to the order in which a worker batches requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson
import redis

from flink_jobs.config import load_config
from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.paths import cache_dir, resource_dir
from flink_jobs.tools import intent_eval
from flink_jobs.tools.embedded_stack import ServedModel
from flink_jobs.tools.provenance import git_state
from flink_jobs.tools.run_summary import (
    latency_summary,
    read_samples,
    read_stats,
    read_vllm_totals,
)
from intent_reader.client import IntentLabel

log = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
DEFAULT_TEMPLATES = ("shopper_intent_v1.j2", "shopper_intent_v2.j2", "shopper_intent_v3.j2")
DEFAULT_SHOPPERS = 24
#: Prompts queued or in flight per arm (``llm.capacity``): above any run's trigger points.
EVAL_LLM_CAPACITY = 4096
#: vLLM's counters read per arm (their deltas are the arm's cost).
VLLM_COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
)


@dataclass
class ArmRun:
    template: str  #: the arm: ``template[@model]`` (core.arms)
    prefix: str
    writes: list[intent_eval.IntentWrite]
    stats: dict[str, int]
    cost: dict[str, Any]  #: counts and ratios (None without data), the latency summary
    elapsed_s: float
    dead_letters: dict[str, int] = field(default_factory=dict)
    #: The answers the job refused (stage llm or intent): reason, detail and the answer's text.
    refused_answers: list[dict[str, Any]] = field(default_factory=list)


# --- the events ------------------------------------------------------------------------------


def select_records(path: Path, shoppers: int, split: str = "") -> list[bytes]:
    """The records of the first ``shoppers`` shoppers of the file (0: all), bad ones dropped:
    the eval scores intents, the bad records have their own tests. ``split``: only the
    shoppers of that distillation split (``distill.splits``; the test split for a model
    trained on the others)."""
    from flink_jobs.tools.cli import first_shoppers
    from flink_jobs.tools.distill.splits import split_of
    from flink_jobs.tools.replay import read_records

    records = read_records(path)
    if split:
        records = [
            r
            for r in records
            if (doc := _parsed(r.value)) is not None
            and isinstance(doc.get("shopper_id"), str)
            and split_of(doc["shopper_id"]) == split
        ]
    kept = first_shoppers(records, shoppers)
    return [r.value for r in kept if _parsed(r.value) is not None]


def _parsed(value: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def moved_to_now(values: Sequence[bytes], now_ms: int) -> tuple[list[bytes], list[ShopperEvent]]:
    """The records with every event time moved by one delta so the newest is ``now_ms``,
    and the events they decode to (what the job will see, for scoring)."""
    from flink_jobs.tools.replay import plan_replay

    planned = plan_replay(list(values), rebase_to_ms=now_ms, rebase_anchor="last")
    records = [p.value for p in planned]
    events = []
    for raw in records:
        decoded = decode_event(raw, None, now_ms=now_ms, max_bytes=len(raw) + 1)
        if isinstance(decoded, ShopperEvent):
            events.append(decoded)
    return records, events


# --- one arm -----------------------------------------------------------------------------------


def read_vllm_counters(worker_urls: Sequence[str]) -> dict[str, float]:
    return read_vllm_totals(worker_urls, VLLM_COUNTERS)


def read_writes(client: redis.Redis, stream: str) -> list[intent_eval.IntentWrite]:
    """Every landed write announced on the arm's notification stream, oldest first."""
    writes: list[intent_eval.IntentWrite] = []
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream))
    for _entry_id, fields in entries:
        record = {k.decode(): v.decode() for k, v in fields.items()}
        if "intent" not in record:
            raise RuntimeError(
                f"{stream}: notification entries carry no intent; the job's writer predates"
                " the eval's needs"
            )
        writes.append(intent_eval.IntentWrite.from_record(record["shopper_id"], record))
    return writes


def run_arm(
    arm_name: str,
    index: int,
    topic: str,
    expected_events: int,
    overrides: dict[str, dict[str, Any]],
    workers: list[str],
) -> ArmRun:
    """One arm (``template[@model]``) run bounded over ``topic``; ``overrides["llm"]`` says
    which LLM tier serves it."""
    from flink_jobs.core.arms import parse_arms
    from flink_jobs.job import create_job

    (arm,) = parse_arms(f"{arm_name}:1", arm_name)
    template = arm.template
    prefix = f"eval{index}-{time.strftime('%H%M%S')}"
    settings = {
        **overrides,
        "kafka": {
            **overrides["kafka"],
            "events_topic": topic,
            "dead_letter_topic": f"{prefix}-dlq",
            "group_id": prefix,
            "starting_offsets": "earliest",
            "bounded": True,
        },
        "redis": {**overrides["redis"], "key_prefix": prefix, "notify_stream": f"{prefix}:updates"},
        "prompt": {"template": template},
        "llm": {
            **overrides["llm"],
            "latest_wins": False,
            "rules_first": False,
            # Room for every trigger point's prompt: with every prompt answered and a slow
            # model, a full outbox back-pressures the operator, its checkpoint barrier waits
            # behind the model, and expired checkpoints fail the bounded job, which then
            # reads the topic again (seen on a loaded 2-core host).
            "capacity": max(overrides["llm"].get("capacity", 0), EVAL_LLM_CAPACITY),
            **({"model": arm.model} if arm.model else {}),
        },
    }
    config = load_config(overrides=settings)
    before = read_vllm_counters(workers)
    started = time.monotonic()
    log.info("arm %s: running the job bounded over %s", template, topic)
    create_job(config).execute(f"eval-{prefix}")
    elapsed = time.monotonic() - started
    after = read_vllm_counters(workers)
    client = redis.Redis.from_url(config.redis.url)
    try:
        stats = read_stats(client, prefix)
        writes = one_write_per_point(
            w for w in read_writes(client, config.redis.notify_stream) if w.source == "model"
        )
        latency = latency_summary(read_samples(client, prefix, "llm_latency_ms"))
    finally:
        client.close()
    if stats.get("events_in", 0) < expected_events:
        raise RuntimeError(
            f"arm {template}: the bounded job read {stats.get('events_in', 0)} of the"
            f" {expected_events} events on {topic} (docs/event_time.md: the broker's end offsets)"
        )
    delta = {name.removeprefix("vllm:"): after[name] - before[name] for name in VLLM_COUNTERS}
    cost = {
        "llm_calls": stats.get("llm_calls", 0),
        "prompt_tokens": delta["prompt_tokens"],
        "output_tokens": delta["generation_tokens"],
        "prefix_cache_hit_ratio": (
            delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
            if delta["prefix_cache_queries"]
            else None
        ),
        "prompt_tokens_per_call": delta["prompt_tokens"] / max(1.0, delta["request_success"]),
        "computed_prompt_tokens_per_call": (delta["prompt_tokens"] - delta["prefix_cache_hits"])
        / max(1.0, delta["request_success"]),
        "output_tokens_per_call": delta["generation_tokens"] / max(1.0, delta["request_success"]),
        "llm_latency_s": latency,
    }
    dead = {k: v for k, v in stats.items() if k.startswith("dead_letter")}
    refused = refused_answers(config, stats)
    log.info("arm %s: %d model writes in %.0f s", arm_name, len(writes), elapsed)
    return ArmRun(arm_name, prefix, writes, stats, cost, elapsed, dead, refused)


def one_write_per_point(
    writes: Iterable[intent_eval.IntentWrite],
) -> list[intent_eval.IntentWrite]:
    """The newest write of each trigger point (shopper, version): a bounded job whose task
    restarts reads the topic again and answers some prompts twice, and a point is scored
    once."""
    latest: dict[tuple[str, int], intent_eval.IntentWrite] = {}
    for w in writes:
        latest[(w.shopper_id, w.version_ts)] = w
    return list(latest.values())


def refused_answers(config: Any, stats: dict[str, int]) -> list[dict[str, Any]]:
    """The arm's dead letters of the model's answers, read back from its dead-letter topic,
    so the report shows what the model said when the job refused it."""
    from flink_jobs.tools.run_summary import read_json_topic

    if not any(v for k, v in stats.items() if k.startswith("dead_letter")):
        return []
    records = read_json_topic(
        config.kafka.bootstrap_servers, config.kafka.dead_letter_topic, timeout_s=15
    )
    return [
        {
            "reason": r["reason"],
            "detail": r["detail"],
            "shopper_id": r.get("shopper_id"),
            "answer": (r.get("context") or {}).get("answer"),
        }
        for r in records
        if r.get("stage") in ("llm", "intent")
    ]


# --- the result --------------------------------------------------------------------------------


def common_points(arms: Sequence[ArmRun]) -> set[tuple[str, int]]:
    """The (shopper, version) points every arm wrote a model intent for."""
    sets = [{(w.shopper_id, w.version_ts) for w in arm.writes} for arm in arms]
    return set.intersection(*sets) if sets else set()


def score(
    events: Sequence[ShopperEvent], arms: Sequence[ArmRun], session_gap_s: float
) -> dict[str, Any]:
    arms = [dataclasses.replace(a, writes=one_write_per_point(a.writes)) for a in arms]
    common = common_points(arms)
    every = [w for arm in arms for w in arm.writes]
    shared = [w for w in every if (w.shopper_id, w.version_ts) in common]
    all_writes = intent_eval.evaluate(events, every, session_gap_s=session_gap_s)
    like = intent_eval.evaluate(events, shared, session_gap_s=session_gap_s)
    return {
        "differences": differences(events, arms, shared, session_gap_s),
        "common_points": len(common),
        "own_writes": all_writes.as_dict(),
        "same_writes": like.as_dict(),
        "table_own": intent_eval.format_table(all_writes),
        "table_same": intent_eval.format_table(like),
        "grounded_categories": grounded_share(arms),
        "browsing_with_signal": {g.template: g.answer.browsing_with_signal for g in like.groups},
    }


def arm_key(arm: ArmRun) -> tuple[str, str, str] | None:
    """The (template, model, source) group its writes are scored under."""
    w = next(iter(arm.writes), None)
    return None if w is None else (w.template, w.model, w.source)


def differences(
    events: Sequence[ShopperEvent],
    arms: Sequence[ArmRun],
    shared: Sequence[intent_eval.IntentWrite],
    session_gap_s: float,
    resamples: int = 1000,
) -> list[dict[str, Any]]:
    """Over the trigger points every arm answered, each metric's difference with a 95 %
    bootstrap interval over shoppers: every arm's answer and record against the rules-only
    intent (and the answer against no intent, for re-ranking), and every later arm's answer
    and record against the first arm's."""
    per_group = intent_eval.point_scores(events, shared, session_gap_s=session_gap_s)
    keyed: list[tuple[str, tuple[str, str, str]]] = []
    for run in arms:
        key = arm_key(run)
        if key is not None and key in per_group:
            keyed.append((run.template, key))
    out: list[dict[str, Any]] = []

    def add(
        name_a: str,
        arm_a: str,
        pa: Sequence[intent_eval.PointScores],
        name_b: str,
        arm_b: str,
        pb: Sequence[intent_eval.PointScores],
    ) -> None:
        for metric in intent_eval.METRICS:
            d = intent_eval.bootstrap_difference(pa, pb, metric, resamples=resamples)
            if d.difference is None:
                continue
            out.append({"a": f"{name_a} {arm_a}", "b": f"{name_b} {arm_b}", **d.as_dict()})

    for name, key in keyed:
        scores = per_group[key]
        for arm in ("answer", "record"):
            add(name, arm, scores[arm], name, "rules", scores["rules"])
        add(name, "answer", scores["answer"], name, "no_intent", scores["no_intent"])
    if keyed:
        first_name, first_key = keyed[0]
        for name, key in keyed[1:]:
            for arm in ("answer", "record"):
                add(name, arm, per_group[key][arm], first_name, arm, per_group[first_key][arm])
    return out


#: The base model's v3 arm and the adapter's arm (a ``template@model`` arm) the targets
#: compare; the targets, each judged per dataset.
V3_ARM = "shopper_intent_v3.j2"
MIN_POINTS = 200
MAX_PROMPT_TOKEN_RATIO = 0.3
MAX_LATENCY_P50_RATIO = 0.5
MIN_AUC_GAIN = 0.05


def judge_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the adapter's arm on one dataset as name, value, limit, op (the
    comparison, the key every results file uses) and met (empty without both a v3 arm and
    a ``template@model`` arm)."""
    arms = {a["template"]: a for a in document["arms"]}
    adapter = next((name for name in arms if "@" in name), None)
    if V3_ARM not in arms or adapter is None:
        return []
    diffs = {(d["a"], d["b"], d["metric"]): d for d in document["scores"]["differences"]}
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, limit: float, comparison: str) -> None:
        met = value is not None and (value >= limit if comparison == ">=" else value > limit)
        if comparison == "<=":
            met = value is not None and value <= limit
        targets.append({"name": name, "value": value, "limit": limit, "op": comparison, "met": met})

    for metric in intent_eval.METRICS:
        d = diffs.get((f"{adapter} answer", f"{adapter} rules", metric))
        if d is None:
            continue
        sign = -1 if metric in intent_eval.LOWER_IS_BETTER else 1
        target(
            f"adapter answer - rules, {metric} (better is positive)",
            sign * d["difference"],
            0.0,
            ">=",
        )
    for metric in ("ndcg_at_10", "purchase_auc"):
        d = diffs.get((f"{adapter} answer", f"{adapter} rules", metric))
        target(f"adapter answer - rules, {metric}", d and d["difference"], 0.0, ">")
        target(
            f"adapter answer - rules, {metric}: 95 % interval's low end", d and d["low"], 0.0, ">"
        )
    d = diffs.get((f"{adapter} record", f"{V3_ARM} record", "ndcg_at_10"))
    target("adapter record - v3 record, ndcg_at_10", d and d["difference"], 0.0, ">")
    d = diffs.get((f"{adapter} answer", f"{adapter} rules", "purchase_auc"))
    target("adapter answer - rules, purchase_auc gain", d and d["difference"], MIN_AUC_GAIN, ">=")
    v3, ours = arms[V3_ARM]["cost"], arms[adapter]["cost"]
    target(
        "prompt tokens per call, adapter arm / v3 arm",
        _ratio(ours["prompt_tokens_per_call"], v3["prompt_tokens_per_call"]),
        MAX_PROMPT_TOKEN_RATIO,
        "<=",
    )
    target(
        "LLM latency p50, adapter arm / v3 arm",
        _ratio(ours["llm_latency_s"]["p50"], v3["llm_latency_s"]["p50"]),
        MAX_LATENCY_P50_RATIO,
        "<=",
    )
    target(
        "trigger points answered by every arm",
        document["scores"]["common_points"],
        MIN_POINTS,
        ">=",
    )
    return targets


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def grounded_share(arms: Sequence[ArmRun]) -> dict[str, dict[str, int]]:
    """Per arm: model writes, and how many named a category outside the session's (the job
    dead-letters those, so they show as ``dead_letter`` counts, never as writes)."""
    return {
        arm.template: {
            "model_writes": len(arm.writes),
            "ungrounded_dead_letters": arm.stats.get("dead_letter_intent_ungrounded_category", 0),
        }
        for arm in arms
    }


def write_results(dataset: str, document: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "intent_quality.json"
    existing = orjson.loads(path.read_bytes()) if path.exists() else {"datasets": {}}
    existing["datasets"][dataset] = document
    path.write_bytes(orjson.dumps(existing, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    (out_dir / "intent_quality.md").write_text(render_markdown(existing))
    _plot(existing, out_dir / "intent_quality.png")
    return path


def render_markdown(results: dict[str, Any]) -> str:
    lines = ["# Intent quality (`shopper-intents eval`)", ""]
    for name, doc in sorted(results["datasets"].items()):
        lines += [
            f"## {name}: {doc['events']} events of {doc['shoppers']} shoppers, "
            f"{doc['scores']['common_points']} trigger points answered by every arm",
            "",
            _run_line(doc),
            "",
            "Like with like (the points every arm answered):",
            "",
            doc["scores"]["table_same"],
            "",
            *_ceiling_lines(doc["scores"]["same_writes"]["groups"]),
            *_verdict_lines(doc["scores"]["same_writes"]["groups"]),
            "Each arm's own writes:",
            "",
            doc["scores"]["table_own"],
            "",
            "| arm | model writes | LLM calls | prompt tokens/call | computed/call"
            " | output tokens/call | LLM latency p50 / p90 s | prefix-cache hit ratio"
            " | answers naming a category not engaged | dead letters |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for arm in doc["arms"]:
            c = arm["cost"]
            ratio = c["prefix_cache_hit_ratio"]
            output = c.get("output_tokens_per_call", c["output_tokens"] / max(1, c["llm_calls"]))
            latency = c.get("llm_latency_s") or {}
            lines.append(
                f"| {arm['template']} | {arm['model_writes']} | {c['llm_calls']} "
                f"| {c['prompt_tokens_per_call']:.0f} | {c['computed_prompt_tokens_per_call']:.0f} "
                f"| {output:.1f} | {_seconds(latency.get('p50'))} / {_seconds(latency.get('p90'))} "
                f"| {'' if ratio is None else f'{ratio:.3f}'} "
                f"| {arm['stats'].get('answers_ungrounded', 0)} | {arm['dead_letters']} |"
            )
        lines.append("")
        lines += _difference_lines(doc["scores"].get("differences", ()))
        lines += _target_lines(doc.get("targets", ()))
        for arm in doc["arms"]:
            for refused in arm.get("refused_answers", ()):
                lines.append(
                    f"- {arm['template']} refused `{refused['reason']}`: {refused['detail']}"
                    + (f" Answer: `{refused['answer']}`" if refused.get("answer") else "")
                )
        lines.append("")
    return "\n".join(lines)


def _run_line(doc: dict[str, Any]) -> str:
    """When and where the run was, and on which commit when it was recorded."""
    git = doc.get("git") or {}
    commit = ""
    if git.get("commit"):
        dirty = " with uncommitted changes" if git.get("dirty") else ""
        commit = f", commit {git['commit'][:10]}{dirty}"
    return f"Run {doc['when']} on {doc['host']}{commit}; {doc['elapsed_s']:.0f} s."


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _difference_lines(diffs: Sequence[dict[str, Any]]) -> list[str]:
    if not diffs:
        return []
    lines = [
        "Differences over the points every arm answered, a minus b, with a 95 % bootstrap"
        " interval (shoppers resampled with replacement, 1,000 times; for"
        " browsing_with_signal lower is better):",
        "",
        "| a | b | metric | a | b | a - b | 95 % interval |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in diffs:
        lines.append(
            f"| {d['a']} | {d['b']} | {d['metric']} | {_cell3(d['a_value'])} "
            f"| {_cell3(d['b_value'])} | {_cell3(d['difference'])} "
            f"| [{_cell3(d['low'])}, {_cell3(d['high'])}] |"
        )
    return [*lines, ""]


def _cell3(value: float | None) -> str:
    return "" if value is None else f"{value:+.3f}" if value < 0 else f"{value:.3f}"


def _target_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    if not targets:
        return []
    lines = [
        "Targets of the distilled adapter (against the rules-only intent and the v3 arm), "
        "this dataset:",
        "",
        "| target | value | limit | met |",
    ]
    lines.append("| --- | --- | --- | --- |")
    for t in targets:
        value = t["value"]
        shown = "" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
        met = "yes" if t["met"] else "no"
        lines.append(f"| {t['name']} | {shown} | {t['op']} {t['limit']} | {met} |")
    return [*lines, ""]


def _verdict_lines(groups: Sequence[dict[str, Any]]) -> list[str]:
    """Plain sentences from the like-with-like figures: each template's record, and the
    model's answer alone, against the rules-only intent on every metric; and each later
    template's answers against the first's on next-engagement top-1 and NDCG@10."""
    lines = []
    for g in groups:
        for arm, name in (("record", "the record"), ("answer", "the model's answer alone")):
            wins: list[str] = []
            ties: list[str] = []
            losses: list[str] = []
            for metric in intent_eval.METRICS:
                ours, rules = g[arm].get(metric), g["rules"].get(metric)
                if ours is None or rules is None:
                    continue
                sign = intent_eval.better(metric, ours, rules)
                bucket = wins if sign > 0 else losses if sign < 0 else ties
                bucket.append(f"{metric} {ours:.3f} vs {rules:.3f}")
            lines.append(
                f"- {g['template']}: {name} beats the rules-only intent on "
                f"{_listed(wins)}; ties on {_listed(ties)}; loses on {_listed(losses)}."
            )
    for later in groups[1:]:
        first = groups[0]
        for metric in ("next_category_top1", "ndcg_at_10"):
            a, b = first["answer"].get(metric), later["answer"].get(metric)
            if a is None or b is None:
                continue
            sign = intent_eval.better(metric, b, a)
            verdict = "beats" if sign > 0 else "loses to" if sign < 0 else "ties"
            lines.append(
                f"- {metric}, the model's answers: {later['template']} {verdict}"
                f" {first['template']} ({b:.3f} vs {a:.3f})."
            )
    return [*lines, ""] if lines else []


def _listed(items: Sequence[str]) -> str:
    return ", ".join(items) if items else "none"


def _ceiling_lines(groups: Sequence[dict[str, Any]]) -> list[str]:
    """The share of next engagements in a category the model was offered: the most
    ``next_category_any`` can reach when answers are held to the session's categories."""
    if not groups:
        return []
    counts = groups[0]["counts"]
    followed = counts["followed_by_engagement"]
    offered = counts.get("next_category_offered")
    if offered is None or not followed:
        return []
    return [
        f"Ceiling of next_category_any: {offered} of the {followed} next engagements"
        f" ({offered / followed:.3f}) were in a category the session offered the model.",
        "",
    ]


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed (make bench installs it): no plot")
        return
    names = sorted(results["datasets"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        groups = results["datasets"][name]["scores"]["same_writes"]["groups"]
        labels, values = [], []
        for g in groups:
            for arm in ("answer", "record", "rules", "no_intent"):
                labels.append(f"{g['template'].removeprefix('shopper_intent_')}\n{arm}")
                values.append(g[arm].get("ndcg_at_10") or 0.0)
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(f"{name}: re-ranking NDCG@10 (same writes)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the writes, kept for scoring again ---------------------------------------------------------


def writes_path(out_dir: Path, dataset: str) -> Path:
    return out_dir / f"intent_writes_{dataset}.json"


def save_writes(args: argparse.Namespace, now_ms: int, arms: Sequence[ArmRun]) -> Path:
    """Every arm's model writes, with what it takes to rebuild the same events (the file,
    the shopper cut, the split and the wall-clock time their newest event was moved to), so
    a change to the scoring is measured on the same answers without running the model again
    (``--rescore``)."""
    path = writes_path(args.out, args.dataset)
    document = {
        "dataset": args.dataset,
        "events_file": _from_repo(args.events),
        "shoppers": args.shoppers,
        "split": args.split or "",
        "now_ms": now_ms,
        "arms": {a.template: [asdict(w) for w in a.writes] for a in arms},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return path


_REPO = RESULTS.parents[1]


def _from_repo(path: Path) -> str:
    """The events file's path relative to the repository when it is inside it (so a saved
    run rescores on any clone), else as given."""
    try:
        return path.resolve().relative_to(_REPO).as_posix()
    except ValueError:
        return str(path)


def load_writes(path: Path) -> tuple[dict[str, Any], dict[str, list[intent_eval.IntentWrite]]]:
    document = orjson.loads(path.read_bytes())
    arms = {
        template: [
            intent_eval.IntentWrite(**{**w, "labels": tuple(IntentLabel(**x) for x in w["labels"])})
            for w in writes
        ]
        for template, writes in document["arms"].items()
    }
    return document, arms


def rescore(dataset: str, out_dir: Path) -> int:
    """Score the saved writes of ``dataset`` again (the model is not run) and rewrite its
    entry in the results, keeping the run's cost figures."""
    path = writes_path(out_dir, dataset)
    results_path = out_dir / "intent_quality.json"
    if not path.exists() or not results_path.exists():
        raise SystemExit(f"{path} or {results_path} is missing: run the eval on {dataset} first")
    saved, writes = load_writes(path)
    document = orjson.loads(results_path.read_bytes())["datasets"][dataset]
    # A writes file saved before the split was recorded: the results entry names it.
    split = saved.get("split", document.get("split") or "")
    values = select_records(_REPO / saved["events_file"], saved["shoppers"], split)
    _, events = moved_to_now(values, saved["now_ms"])
    arms = [
        ArmRun(a["template"], "", writes[a["template"]], a["stats"], a["cost"], a["elapsed_s"])
        for a in document["arms"]
    ]
    document["scores"] = score(events, arms, load_config(environ={}).session.gap_s)
    document["targets"] = judge_targets(document)
    # The answers are the run's (its ``git``); the scores are this code's.
    document["rescored"] = {"when": time.strftime("%Y-%m-%d %H:%M"), "git": git_state()}
    write_results(dataset, document, out_dir)
    print(document["scores"]["table_same"])
    return 0


# --- the command -------------------------------------------------------------------------------


def run_eval(args: argparse.Namespace) -> int:
    from flink_jobs.tools.embedded_stack import start_embedded_stack, start_llm_tier
    from flink_jobs.tools.replay import replay_records

    if args.rescore:
        return rescore(args.dataset, args.out)
    code = git_state()  # now: the files may change while the run goes on
    values = select_records(args.events, args.shoppers, args.split)
    now_ms = int(time.time() * 1000)
    records, events = moved_to_now(values, now_ms)
    shoppers = len({e.shopper_id for e in events})
    log.info("eval over %d events of %d shoppers from %s", len(events), shoppers, args.events)
    workdir = args.workdir or cache_dir() / "eval"
    topic = "eval-events"
    started = time.monotonic()
    served = served_model(args.templates, args.adapter, args.serve)
    base_first = served if args.serve == "lora" else None
    with start_embedded_stack(
        workdir, [topic], llm_workers=args.llm_workers, llm_model=base_first
    ) as stack:
        # One record per batch: the embedded broker (Tansu) reports a partition's end as its
        # last batch's first offset + 1, and a bounded job stops there (docs/event_time.md).
        one_per_batch = {"batch.num.messages": 1, "linger.ms": 0}
        summary = replay_records(stack.bootstrap, topic, records, extra_config=one_per_batch)
        if not summary.ok:
            raise RuntimeError(summary.describe(topic))
        arms = []
        tier = stack.llm
        for i, name in enumerate(args.templates):
            if args.serve == "merged" and "@" in name and tier is stack.llm:
                # The merged model is its own model folder: the same number of workers on
                # the same cores serve it, once the base model's are stopped.
                stack.llm.stop()
                tier = start_llm_tier(workdir / "llm-merged", args.llm_workers, model=served)
            overrides = {**stack.config_overrides(), "llm": tier.job_settings()}
            arms.append(run_arm(name, i, topic, len(records), overrides, tier.worker_urls))
        if tier is not stack.llm:
            tier.stop()
    config = load_config(environ={})
    scores = score(events, arms, config.session.gap_s)
    document = eval_document(
        args, len(events), shoppers, arms, scores, code, time.monotonic() - started
    )
    save_writes(args, now_ms, arms)
    path = write_results(args.dataset, document, args.out)
    print(document["scores"]["table_same"])
    print(f"\nwritten to {path} and {path.with_suffix('.md')}")
    return 0


def eval_document(
    args: argparse.Namespace,
    events: int,
    shoppers: int,
    arms: Sequence[ArmRun],
    scores: dict[str, Any],
    code: dict[str, Any],
    elapsed_s: float,
) -> dict[str, Any]:
    """One dataset's entry of ``intent_quality.json``: what ran (``code``: the commit and
    whether the tree had changes, :func:`~flink_jobs.tools.provenance.git_state`), what it
    cost, its scores and the targets judged on them."""
    document = {
        "dataset": args.dataset,
        "events_file": str(args.events),
        "split": args.split or None,
        "served": {
            "adapter": _from_repo(args.adapter) if any("@" in a for a in args.templates) else None,
            "how": (
                "the adapter as a LoRA module of the base model, one vLLM tier for every arm"
                if args.serve == "lora"
                else "the adapter merged into a model folder (merge_worker), served by the same"
                " number of workers on the same cores after the base model's arms"
            ),
        },
        "events": events,
        "shoppers": shoppers,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "git": code,
        "host": platform.processor() or platform.machine(),
        "elapsed_s": elapsed_s,
        "arms": [
            {
                "template": a.template,
                "model_writes": len(a.writes),
                "cost": a.cost,
                "stats": a.stats,
                "dead_letters": a.dead_letters,
                "refused_answers": a.refused_answers,
                "elapsed_s": a.elapsed_s,
            }
            for a in arms
        ],
        "scores": scores,
    }
    document["targets"] = judge_targets(document)
    return document


def served_model(arms: Sequence[str], adapter: Path, serve: str = "merged") -> ServedModel:
    """What serves the ``template@model`` arms: ``adapter`` merged into a model folder under
    the arm's model name (made in the cache by ``distill.merge_worker`` when missing), or
    ``lora``: the base model with ``adapter`` as a LoRA module of that name. The arms'
    models must all be that adapter."""
    from flink_jobs.core.arms import parse_arms

    models = {a.model for name in arms for a in parse_arms(f"{name}:1", name) if a.model}
    if not models:
        return ServedModel()
    if len(models) > 1:
        raise SystemExit(
            f"arms name several models ({', '.join(sorted(models))}); one adapter is served"
        )
    if not (adapter / "adapter_config.json").exists():
        raise SystemExit(
            f"{adapter}: no adapter_config.json (shopper-intents distill train writes one)"
        )
    name = models.pop()
    if serve == "merged":
        from flink_jobs.tools.distill.serving import merged_model

        return ServedModel(name=name, model_dir=merged_model(adapter))
    rank = orjson.loads((adapter / "adapter_config.json").read_bytes()).get("r", 16)
    return ServedModel(lora=((name, adapter.resolve()),), max_lora_rank=max(8, int(rank)))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="score intents against what shoppers did next (real model)")
    p.add_argument(
        "--events",
        type=Path,
        default=resource_dir("sample") / "sample_sessions.jsonl",
        help="events file (JSONL/CSV)",
    )
    p.add_argument("--dataset", default="sample", help="the name its figures are filed under")
    p.add_argument(
        "--shoppers",
        type=int,
        default=DEFAULT_SHOPPERS,
        help="the first N shoppers (default %(default)s; 0: all)",
    )
    p.add_argument(
        "--templates",
        type=lambda s: tuple(t for t in s.split(",") if t),
        default=DEFAULT_TEMPLATES,
        help="comma-separated arms, template[@model] (a model: the --adapter, served as a"
        " LoRA module under that name; default %(default)s)",
    )
    p.add_argument(
        "--split",
        choices=("train", "val", "test"),
        default="",
        help="only the shoppers of this distillation split (distill.splits)",
    )
    p.add_argument(
        "--adapter",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "adapters" / "si-compact-lora",
        help="LoRA adapter served for a template@model arm (default %(default)s)",
    )
    p.add_argument(
        "--serve",
        choices=("merged", "lora"),
        default="merged",
        help="how the adapter is served: merged into a model folder (faster on a CPU:"
        " bench/results/distill_serving.json) or as a LoRA module (default %(default)s)",
    )
    p.add_argument("--llm-workers", type=int, default=2, help="vLLM workers (one core each)")
    p.add_argument("--workdir", type=Path, default=None, help="logs (default: <cache>/eval)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (bench/results)")
    p.add_argument(
        "--rescore",
        action="store_true",
        help="score the writes a run on --dataset saved again, without running the model",
    )
