"""``shopper-intents plan``: read the results files, print the plan.

``shopper-intents plan --events-per-s 200000 [--gpu L4 | --prefill-tokens-per-s N
--decode-tokens-per-s N] [--freshness-s S] [--events-file FILE] [--json]``

The unit costs come from ``--results`` (default: the checkout's ``bench/results``); every
figure printed says where it came from. The trigger rate (prompts and LLM calls per
accepted event) depends on the traffic: by default it is the capacity drain's;
``--events-file`` computes it from a file of events through the job's own session and
trigger code (``trigger_rate``), ``--prompts-per-event`` and ``--llm-calls-per-event``
give it. Exit status 0 when every tier is sized, 1 when a tier's figure is absent (the
output names the file and key), 2 on a bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from flink_jobs.config import AppConfig
from flink_jobs.tools.sizing import gpus, model, render, trigger_rate
from flink_jobs.tools.sizing.costs import (
    TRIGGER_RATE,
    ConfigDefaults,
    Figure,
    UnitCosts,
    read_unit_costs,
)

REPO = Path(__file__).resolve().parents[3]
DEFAULT_RESULTS = REPO / "bench" / "results"


def add_parser(sub: Any) -> None:
    table = ", ".join(
        f"{g.name} {g.prefill_tokens_per_s:,.0f}/{g.decode_tokens_per_s:,.0f}"
        for g in gpus.GPUS.values()
    )
    p = sub.add_parser(
        "plan",
        help="the KPUs, GPUs, router replicas and Redis shards a rate of events needs",
        description="Size every tier for a rate of events from the measured unit costs in"
        " bench/results; each figure used is printed with its source.",
    )
    p.add_argument("--events-per-s", type=float, required=True, help="events per second")
    p.add_argument(
        "--freshness-s",
        type=float,
        default=None,
        help="target from a qualifying event to its intent in Redis (default: the freshness"
        " benchmark's staleness target)",
    )
    p.add_argument(
        "--gpu",
        default=gpus.DEFAULT_GPU,
        help=f"GPU of the assumed throughput table, prefill/decode tokens/s: {table}"
        f" (default %(default)s; round planning figures, not measurements)",
    )
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, help="one GPU's")
    p.add_argument("--decode-tokens-per-s", type=float, default=None, help="one GPU's")
    p.add_argument(
        "--prompt-tokens-per-call",
        type=float,
        default=None,
        help="default: the shipped template's, measured",
    )
    p.add_argument(
        "--output-tokens-per-call",
        type=float,
        default=None,
        help="default: llm.max_tokens, the answer's cap",
    )
    p.add_argument(
        "--prefix-cache-hit-ratio",
        type=float,
        default=None,
        help="default: measured under the router's default policy",
    )
    p.add_argument(
        "--events-file",
        type=Path,
        default=None,
        help="events whose trigger rate to plan for: JSON Lines or CSV of event records, or a"
        " recording (`python -m flink_jobs.tools.replay record`), replayed offline in file"
        " order through the job's session and trigger code under the default trigger policy"
        " (default: the capacity drain's rate)",
    )
    p.add_argument(
        "--llm-calls-per-event",
        type=float,
        default=None,
        help="LLM calls per accepted event, in (0, 1] (default: the capacity drain's, under"
        " the default trigger policy; given alone, prompts per event too)",
    )
    p.add_argument(
        "--prompts-per-event",
        type=float,
        default=None,
        help="prompts the trigger fires per accepted event, in (0, 1] (default: the capacity"
        " drain's; given alone, LLM calls per event too)",
    )
    p.add_argument("--router-cpu-ms-per-request", type=float, default=None)
    p.add_argument("--redis-writes-per-node-per-s", type=float, default=None)
    p.add_argument(
        "--utilisation",
        type=float,
        default=model.DEFAULT_UTILISATION,
        help="share of each tier's capacity planned (default %(default)s)",
    )
    p.add_argument("--parallelism-per-kpu", type=int, default=1)
    p.add_argument(
        "--cpu-speed",
        type=float,
        default=1.0,
        help="a KPU's vCPU speed over a core of the host that measured the costs (default 1)",
    )
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="the results folder")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def inputs_of(args: argparse.Namespace) -> model.PlanInputs:
    return model.PlanInputs(
        events_per_s=args.events_per_s,
        freshness_s=args.freshness_s,
        gpu=args.gpu,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        prompt_tokens_per_call=args.prompt_tokens_per_call,
        output_tokens_per_call=args.output_tokens_per_call,
        prefix_cache_hit_ratio=args.prefix_cache_hit_ratio,
        llm_calls_per_event=args.llm_calls_per_event,
        prompts_per_event=args.prompts_per_event,
        router_cpu_ms_per_request=args.router_cpu_ms_per_request,
        redis_writes_per_node_per_s=args.redis_writes_per_node_per_s,
        utilisation=args.utilisation,
        parallelism_per_kpu=args.parallelism_per_kpu,
        cpu_speed=args.cpu_speed,
    )


def load_costs(results: Path) -> UnitCosts:
    """The unit costs of the results folder ``results`` (every ``*.json`` in it)."""
    documents = {p.stem: orjson.loads(p.read_bytes()) for p in sorted(results.glob("*.json"))}
    return read_unit_costs(documents, ConfigDefaults.from_code(), where=_label(results))


def events_file_rate(path: Path) -> dict[str, Figure]:
    """The trigger rate of the events in ``path`` (any format the replay tool reads), as
    the plan's figures; ValueError saying what is wrong with the file."""
    from flink_jobs.tools.replay import ReplayError, read_records

    try:
        records = read_records(path)
    except (OSError, ReplayError) as exc:
        raise ValueError(f"--events-file: cannot read {path}: {exc}") from exc
    config = AppConfig()
    decoded = trigger_rate.decode_records((r.value for r in records), config.job.max_event_bytes)
    replay = trigger_rate.replay_trigger(decoded, config)
    try:
        figures = trigger_rate.rate_figures(replay, _label(path))
    except ValueError as exc:
        raise ValueError(f"--events-file {exc}") from exc
    for name, figure in figures.items():
        model.check_trigger_rate(f"--events-file {_label(path)}: {name}", figure.value)
    return figures


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run(args: argparse.Namespace) -> int:
    if not args.results.is_dir():
        print(f"plan: no results folder {args.results}", file=sys.stderr)
        return 2
    try:
        costs = load_costs(args.results)
        if args.events_file is not None:
            given = [name for name in TRIGGER_RATE if getattr(args, name) is not None]
            if given:
                flags = " and ".join("--" + name.replace("_", "-") for name in given)
                raise ValueError(f"--events-file gives the trigger rate: leave out {flags}")
            for name, figure in events_file_rate(args.events_file).items():
                costs = costs.with_figure(name, figure)
        plan = model.plan(inputs_of(args), costs)
    except ValueError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(render.as_json(plan), option=orjson.OPT_INDENT_2).decode())
    else:
        print(render.text(plan))
    for tier, reason in plan.absent.items():
        print(f"plan: {tier}: {reason}", file=sys.stderr)
    return 1 if any(r.count is None for r in plan.resources) else 0
