"""One vLLM worker launched two ways, side by side: prompts per second before and after.

* ``before``: ``python -m vllm.entrypoints.openai.api_server`` (the deprecated module
  path) with nothing preloaded: the plain launch;
* ``after``: ``vllm serve`` with TCMalloc and Intel OpenMP preloaded, as
  ``inference_sidecar.workers`` starts them (the launch vLLM's CPU guide asks for).

Both run the same plan (``plan_workers``: one worker pinned to one core, the project's
flags) and get the same prompts: ``--prompts`` shopper sessions of generated sample
events, rendered by the job's renderer and sent as the job sends them (the job's request
body, the intent JSON Schema as ``response_format``), ``--concurrency`` in flight. Each
launch first answers ``--warmup`` prompts that are not counted (grammar compilation and
first-call costs). ``--rounds`` repeats the pair, alternating which goes first, so a
drift of the host's speed shows up instead of favouring one side.

Prints a table and writes ``bench/results/worker_launch.json``.

    python -m bench.worker_launch [--prompts 32] [--concurrency 4] [--rounds 2] [--core N]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench._common import result_doc as make_doc
from bench._common import rounded, write_result
from bench._workload import WORKLOAD_TEMPLATE, event_streams, sample_events, shopper_history
from flink_jobs.config import LlmConfig, PromptConfig
from flink_jobs.core.intents import Intent, parse_intent
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.session import SessionState
from flink_jobs.runtime.llm_client import build_request
from flink_jobs.tools.local_services import http_ok, stop_on_sigterm
from inference_sidecar.processes import SupervisedProcess
from inference_sidecar.workers import (
    ClusterConfig,
    WorkerSpec,
    available_cores,
    find_free_port_range,
    plan_workers,
)

# Named, not __name__: run with -m, the module is __main__.
log = logging.getLogger("bench.worker_launch")

LAUNCHES = ("before", "after")
#: What vLLM writes when a launch is not the one its CPU guide asks for.
WARNINGS = {
    "tcmalloc_missing": "libtcmalloc is not found in LD_PRELOAD",
    "iomp_missing": "libiomp is not found in LD_PRELOAD",
    "api_server_deprecated": "vllm.entrypoints.openai.api_server",
}


@dataclass(frozen=True, slots=True)
class Prompt:
    shopper: str
    headers: dict[str, str]
    body: bytes


def build_prompts(count: int, events_per_prompt: int, seed: int) -> list[Prompt]:
    """``count`` shopper sessions of ``events_per_prompt`` events each, one per shopper,
    as the job's LLM client would send them."""
    import random

    rng = random.Random(f"worker-launch:{seed}")
    shoppers = [f"shopper-{i + 1:03d}" for i in range(count)]
    pool = sample_events(max(60, count * 3), seed)
    streams = event_streams(pool, shoppers, events_per_prompt, start_ms=1_780_000_000_000)
    renderer = PromptRenderer(PromptConfig(WORKLOAD_TEMPLATE))
    llm = LlmConfig()
    prompts = []
    for shopper in shoppers:
        events = tuple(streams[shopper])
        state = SessionState(
            shopper_id=shopper,
            events=events,
            history=shopper_history(rng, events),
            session_started_ms=events[0].event_time_ms,
        )
        headers, body = build_request(renderer.render(state), shopper, llm)
        prompts.append(Prompt(shopper, headers, body))
    return prompts


def launch_spec(spec: WorkerSpec, launch: str) -> WorkerSpec:
    """The planned worker (``after``), or the same worker started the old way (``before``)."""
    if launch == "after":
        return spec
    python, dash_c, _cli, serve, model, *rest = spec.argv
    assert (dash_c, serve) == ("-c", "serve"), spec.argv[:4]
    argv = (python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *rest)
    env = {k: v for k, v in spec.env.items() if k != "LD_PRELOAD"}
    return replace(spec, argv=argv, env=env, log_path=spec.log_path.with_name("before.log"))


def wait_healthy(proc: SupervisedProcess, url: str, timeout_s: float) -> float:
    started = time.monotonic()
    proc.wait_ready(lambda: http_ok(f"{url}/health"), timeout_s=timeout_s, interval_s=0.5)
    return time.monotonic() - started


async def send_all(url: str, prompts: Sequence[Prompt], concurrency: int) -> list[dict[str, Any]]:
    """Send every prompt with ``concurrency`` in flight; one outcome per prompt."""
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    outcomes: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as client:

        async def lane() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                started = time.perf_counter()
                reply = await client.post(
                    f"{url}/v1/chat/completions", content=prompt.body, headers=prompt.headers
                )
                outcome: dict[str, Any] = {
                    "latency_s": time.perf_counter() - started,
                    "status": reply.status_code,
                    "valid": False,
                    "completion_tokens": 0,
                }
                if reply.status_code == 200:
                    doc = reply.json()
                    outcome["completion_tokens"] = doc["usage"]["completion_tokens"]
                    text = doc["choices"][0]["message"]["content"] or ""
                    outcome["valid"] = _is_intent(text)
                outcomes.append(outcome)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return outcomes


def _is_intent(text: str) -> bool:
    return isinstance(parse_intent(text), Intent)


def measure(
    spec: WorkerSpec, launch: str, prompts: Sequence[Prompt], warmup: int, concurrency: int
) -> dict[str, Any]:
    run = launch_spec(spec, launch)
    run.log_path.unlink(missing_ok=True)
    proc = SupervisedProcess(f"worker-{launch}", run.argv, run.log_path, env=run.env)
    with proc:
        ready_s = wait_healthy(proc, run.url, timeout_s=600)
        asyncio.run(send_all(run.url, prompts[:warmup], min(warmup, concurrency)))
        started = time.perf_counter()
        outcomes = asyncio.run(send_all(run.url, prompts, concurrency))
        wall_s = time.perf_counter() - started
    worker_log = run.log_path.read_text(errors="replace")
    latencies = sorted(o["latency_s"] for o in outcomes)
    return {
        "launch": launch,
        "prompts": len(outcomes),
        "ok": sum(o["status"] == 200 for o in outcomes),
        "valid_intents": sum(o["valid"] for o in outcomes),
        "wall_s": rounded(wall_s, 2),
        "prompts_per_s": rounded(len(outcomes) / wall_s, 3),
        "output_tokens_per_s": rounded(sum(o["completion_tokens"] for o in outcomes) / wall_s, 1),
        "latency_p50_s": rounded(statistics.median(latencies), 2),
        "latency_max_s": rounded(latencies[-1], 2),
        "ready_s": rounded(ready_s, 1),
        "ld_preload": run.env.get("LD_PRELOAD", ""),
        "command": "vllm serve" if launch == "after" else "-m vllm.entrypoints.openai.api_server",
        "warnings": {name: text in worker_log for name, text in WARNINGS.items()},
    }


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out = {}
    for launch in LAUNCHES:
        mine = [r for r in runs if r["launch"] == launch]
        out[launch] = {
            "prompts_per_s": rounded(statistics.mean(r["prompts_per_s"] for r in mine), 3),
            "output_tokens_per_s": rounded(
                statistics.mean(r["output_tokens_per_s"] for r in mine), 1
            ),
            "latency_p50_s": rounded(statistics.median(r["latency_p50_s"] for r in mine), 2),
        }
    return out


def table(runs: Sequence[dict[str, Any]], totals: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{'round':<6}{'launch':<8}{'prompts/s':>10}{'out tok/s':>10}{'p50 s':>7}"
        f"{'valid':>7}{'ready s':>9}  warnings"
    ]
    for r in runs:
        warned = ",".join(k for k, v in r["warnings"].items() if v) or "-"
        valid = f"{r['valid_intents']}/{r['prompts']}"
        lines.append(
            f"{r['round']:<6}{r['launch']:<8}{r['prompts_per_s']:>10}"
            f"{r['output_tokens_per_s']:>10}{r['latency_p50_s']:>7}{valid:>7}"
            f"{r['ready_s']:>9}  {warned}"
        )
    ratio = totals["after"]["prompts_per_s"] / totals["before"]["prompts_per_s"]
    lines.append(
        f"mean: before {totals['before']['prompts_per_s']} prompts/s, "
        f"after {totals['after']['prompts_per_s']} prompts/s (x{ratio:.2f})"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--events", type=int, default=12, help="events per shopper session")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--core", type=int, default=None, help="core to pin to (default: the last)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="results folder")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop_on_sigterm()
    args = parse_args(argv)
    t0 = time.monotonic()
    core = args.core if args.core is not None else available_cores()[-1]
    config = ClusterConfig(workers=1, cores=(core,), base_port=find_free_port_range(1)).resolved()
    config = replace(
        config, log_dir=(config.cache_dir or Path(".cache")) / "logs" / "worker-launch"
    )
    (spec,) = plan_workers(config)
    prompts = build_prompts(args.prompts, args.events, args.seed)
    runs = []
    for round_no in range(1, args.rounds + 1):
        order = LAUNCHES if round_no % 2 else LAUNCHES[::-1]
        for launch in order:
            log.info("round %d: %s", round_no, launch)
            result = measure(spec, launch, prompts, args.warmup, args.concurrency)
            runs.append({"round": round_no, **result})
            log.info("%s", orjson.dumps(runs[-1]).decode())
    totals = summary(runs)
    text = table(runs, totals)
    print(text)
    doc = make_doc(
        "worker_launch",
        t0,
        [],
        notes=[
            f"one worker pinned to core {core}, {args.prompts} prompts of {args.events} "
            f"events each, {args.concurrency} in flight, {args.warmup} warm-up prompts per "
            "launch not counted; guided JSON (the intent schema) as the job sends it",
        ],
        core=core,
        dtype=next((a for a in spec.argv if a in ("float32", "bfloat16")), "auto"),
        prompts=args.prompts,
        events_per_prompt=args.events,
        concurrency=args.concurrency,
        summary=totals,
        ratio_after_to_before=rounded(
            totals["after"]["prompts_per_s"] / totals["before"]["prompts_per_s"], 3
        ),
        runs=runs,
        table=text,
    )
    path = write_result(doc) if args.out is None else write_result(doc, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
