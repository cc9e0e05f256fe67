"""A plan as text for the console, as markdown for the docs and as JSON (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any

from flink_jobs.tools.sizing.costs import ASSUMED, INPUT
from flink_jobs.tools.sizing.model import Plan, Resource, num

#: What each unit cost is, as the figures table names it.
LABELS = {
    "jvm_cpu_ms_per_event": "TaskManager CPU per event (ms)",
    "call_process_cpu_ms_per_call": "LLM call process CPU per call (ms)",
    "llm_calls_per_event": "LLM calls per event",
    "prompts_per_event": "prompts per event",
    "rules_writes_per_prompt": "rules-only upserts per prompt",
    "job_to_prompt_p99_s": "job's own p99, trigger to prompt sent (s)",
    "measuring_host_cores": "cores of the measuring host",
    "prompt_tokens_per_call": "prompt tokens per call",
    "output_tokens_per_call": "output tokens per call",
    "measured_output_tokens_per_call": "output tokens per call, measured mean",
    "prefix_cache_hit_ratio": "prefix-cache hit ratio",
    "redis_writes_per_node_per_s": "Redis upserts/s per node",
    "router_cpu_ms_per_request": "router CPU per request (ms)",
    "trigger_max_wait_s": "trigger's longest wait (s)",
    "freshness_target_s": "target freshness (s)",
    "max_parallelism": "max parallelism",
    "prefill_tokens_per_s": "GPU prefill tokens/s",
    "decode_tokens_per_s": "GPU decode tokens/s",
}

RATES = {
    "events": "events",
    "llm_calls": "LLM calls",
    "prefill_tokens": "prefill (uncached prompt) tokens",
    "decode_tokens": "decode (output) tokens",
    "redis_upserts": "Redis upserts",
}

NOT_SIZED = "not sized"


def headline(plan: Plan) -> str:
    inputs = plan.inputs
    assumed = any(
        (f := plan.figures.get(name)) is not None and f.kind == ASSUMED
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s")
    )
    gpu_text = (
        f"GPU {inputs.gpu} (assumed figures: override them)" if assumed else "GPU throughputs given"
    )
    freshness = (
        f"target freshness {num(plan.freshness.target_s)} s; " if plan.freshness is not None else ""
    )
    return (
        f"{num(inputs.events_per_s)} events/s; {freshness}{gpu_text};"
        f" every tier planned at {inputs.utilisation:.0%} utilisation"
    )


def _count(r: Resource) -> str:
    return NOT_SIZED if r.count is None else f"{r.count:,}"


def _freshness_text(plan: Plan) -> str | None:
    f = plan.freshness
    if f is None:
        return None
    return (
        f"target {num(f.target_s)} s - the trigger's longest wait {num(f.trigger_max_wait_s)} s"
        f" - the job's own p99 {num(f.job_p99_s)} s = {num(f.llm_budget_s)} s left for each"
        " LLM call at p99, its queue included; the GPU figures are throughputs and do not"
        " predict it: measure the calls' latency on the GPUs"
    )


def _trigger_text(plan: Plan) -> str | None:
    """The trigger rate in effect and where it came from; when it is the results' own, how
    far it moves with the traffic and how to give the traffic's own."""
    calls = plan.trigger_rate.get("llm_calls_per_event")
    prompts = plan.trigger_rate.get("prompts_per_event")
    given = [f for f in (calls, prompts) if f is not None]
    if not given:
        return None
    rates = " and ".join(
        f"{num(f.value)} {what}"
        for f, what in ((calls, "LLM calls"), (prompts, "prompts"))
        if f is not None
    )
    keys: dict[tuple[str, str], list[str]] = {}
    for f in given:
        keys.setdefault((f.source, f.kind), []).append(f.key)
    sources = "; ".join(
        f"{src} ({'; '.join(_widest(k))}; {kind})" for (src, kind), k in keys.items()
    )
    text = f"{rates} per accepted event, from {sources}"
    if any(f.kind == INPUT for f in given):
        return text
    spread = plan.trigger_rate_spread
    seen = (
        f": {num(spread.low)}-{num(spread.high)} prompts per event across the sample"
        f" generator's workloads ({spread.cite()})"
        if spread is not None
        else ""
    )
    return (
        f"{text}. It is a property of the traffic, not of the machine (how close together"
        f" each shopper's events come){seen}; --events-file FILE computes it from your own"
        " events (a recording of the topic), --prompts-per-event or --llm-calls-per-event"
        " gives a rate known otherwise"
    )


def _widest(keys: list[str]) -> list[str]:
    """``keys`` without those another one starts with (it says them already)."""
    return [k for k in keys if not any(o != k and o.startswith(k) for o in keys)]


def _notes(plan: Plan) -> list[str]:
    notes = []
    measured = plan.figures.get("measured_output_tokens_per_call")
    budgeted = plan.figures.get("output_tokens_per_call")
    if measured is not None and budgeted is not None and measured.value < budgeted.value:
        notes.append(
            f"output tokens per call: the plan budgets the answer's cap, {num(budgeted.value)}"
            f" ({budgeted.key}); the shipped template's answers averaged"
            f" {num(measured.value)} (--output-tokens-per-call to plan for that)"
        )
    notes += plan.caveats
    notes.append(
        f"unit costs measured on {plan.host}; a KPU's vCPU is taken as"
        f" {num(plan.inputs.cpu_speed)}x a core of that host (--cpu-speed)"
    )
    return notes


def text(plan: Plan) -> str:
    """The plan for the console: counts, then how each was reached, then the rest."""
    lines = [f"Plan: {headline(plan)}", ""]
    width = max(len(r.tier) for r in plan.resources)
    for r in plan.resources:
        unit = r.unit if r.count is not None else ""
        lines.append(f"  {r.tier:<{width}}  {_count(r):>10}  {unit}".rstrip())
    lines += ["", "How:"]
    for r in plan.resources:
        lines.append(f"  {r.tier}: {r.rule or r.missing}")
    lines += ["", "Per second: " + _rates(plan), "", "Cost drivers (largest count first):"]
    lines += [f"  - {d}" for d in plan.drivers]
    if (trigger := _trigger_text(plan)) is not None:
        lines += ["", f"Trigger rate: {trigger}"]
    if (fresh := _freshness_text(plan)) is not None:
        lines += ["", f"Freshness: {fresh}"]
    if plan.warnings:
        lines += ["", "Warnings:", *(f"  - {w}" for w in plan.warnings)]
    lines += ["", "Notes:", *(f"  - {n}" for n in _notes(plan))]
    lines += ["", "Figures used:"]
    for name, figure in plan.figures.items():
        lines.append(
            f"  {LABELS.get(name, name):<42} {num(figure.value):>10}  {figure.kind:<8}"
            f"  {figure.cite()}"
        )
    return "\n".join(lines)


def markdown(plan: Plan) -> str:
    """The plan for a document: the same parts as ``text``, as tables and lists."""
    lines = [
        f"Plan: {headline(plan)}.",
        "",
        "| tier | count | unit | how |",
        "| --- | --- | --- | --- |",
    ]
    for r in plan.resources:
        unit = r.unit if r.count is not None else ""
        lines.append(_row([r.tier, _count(r), unit, r.rule or r.missing]))
    lines += ["", f"Per second: {_rates(plan)}.", "", "Cost drivers (largest count first):", ""]
    lines += [f"- {d}" for d in plan.drivers]
    if (trigger := _trigger_text(plan)) is not None:
        lines += ["", f"Trigger rate: {trigger}."]
    if (fresh := _freshness_text(plan)) is not None:
        lines += ["", f"Freshness: {fresh}."]
    if plan.warnings:
        lines += ["", "Warnings:", "", *(f"- {w}" for w in plan.warnings)]
    lines += ["", "Notes:", "", *(f"- {n}" for n in _notes(plan))]
    lines += ["", "| figure | value | kind | source |", "| --- | --- | --- | --- |"]
    for name, figure in plan.figures.items():
        lines.append(
            _row([LABELS.get(name, name), num(figure.value), figure.kind, f"`{figure.cite()}`"])
        )
    return "\n".join(lines)


def as_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain data: inputs, resources, rates, drivers, freshness (with the LLM's
    budget), warnings, absent figures and every figure used with its source."""
    out = dataclasses.asdict(plan)
    if plan.freshness is not None:
        out["freshness"]["llm_budget_s"] = plan.freshness.llm_budget_s
    return out


def _rates(plan: Plan) -> str:
    return ", ".join(
        f"{num(plan.rates[key])} {label}" for key, label in RATES.items() if key in plan.rates
    )


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
