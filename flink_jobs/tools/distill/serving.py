"""Which way of serving the adapter is faster here: a LoRA module on the base model, or
the adapter merged into a model folder (``merge_worker``).

For each way, one vLLM worker (one core, as the job's workers run) behind the router
answers the same compact prompts of test-split shoppers one at a time through the job's
own call path (``inference.ask``: guided decoding with the session's categories, label
scores); the figures are each call's latency and output tokens. The result goes to
``bench/results/distill_serving.json``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson

from flink_jobs.config import load_config
from flink_jobs.core.prompting import RenderedPrompt
from flink_jobs.core.tasks import PromptTask
from flink_jobs.runtime.inference import Answered, ask
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.tools.distill.dataset import Example, read_examples
from flink_jobs.tools.embedded_stack import ServedModel, start_llm_tier

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
RESULT = REPO / "bench" / "results" / "distill_serving.json"


def merge(adapter: Path, out: Path) -> Path:
    """The adapter merged into the cache's base model at ``out`` (in the vLLM venv)."""
    from inference_sidecar.workers import find_model_dir, find_vllm_python

    argv = [
        str(find_vllm_python()),
        "-m",
        "flink_jobs.tools.distill.merge_worker",
        "--base",
        str(find_model_dir()),
        "--adapter",
        str(adapter),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    subprocess.run(argv, env=env, check=True)
    return out


def merged_model(adapter: Path) -> Path:
    """The cache's merged model folder of ``adapter`` (``<cache>/models/<name>-merged``,
    what ``scripts/setup.sh`` makes), merged now when it is missing or older than the
    adapter's weights."""
    from flink_jobs.paths import cache_dir

    out = cache_dir() / "models" / f"{adapter.name}-merged"
    weights = adapter / "adapter_model.safetensors"
    done = out / "model.safetensors"
    if not done.exists() or done.stat().st_mtime < weights.stat().st_mtime:
        merge(adapter, out)
    return out


def task_of(x: Example, model: str) -> PromptTask:
    prompt = RenderedPrompt(
        messages=x.messages,
        template="shopper_intent_compact.j2",
        template_hash="",
        estimated_tokens=x.estimated_tokens,
        events_included=0,
        events_dropped=0,
        model=model,
    )
    return PromptTask(x.shopper_id, 1, x.version_ts, x.version_ts, prompt, categories=x.categories)


def measure(
    workdir: Path, served: ServedModel, model: str, examples: list[Example]
) -> dict[str, Any]:
    tier = start_llm_tier(workdir, workers=1, model=served)
    try:
        config = load_config({"llm": {**tier.job_settings(), "model": model}}, environ={})

        async def calls() -> list[tuple[float, Any]]:
            client = LlmClient(config.llm)
            out = []
            try:
                await ask(task_of(examples[0], model), client, 0)  # warm-up, not counted
                for x in examples:
                    started = time.monotonic()
                    result = await ask(task_of(x, model), client, 0)
                    out.append((time.monotonic() - started, result))
            finally:
                await client.aclose()
            return out

        results = asyncio.run(calls())
    finally:
        tier.stop()
    latencies = sorted(s for s, _ in results)
    answered = [r for _, r in results if isinstance(r, Answered)]
    return {
        "calls": len(results),
        "valid_answers": len(answered),
        "latency_s": {
            "p50": round(statistics.median(latencies), 3),
            "p90": round(latencies[int(0.9 * (len(latencies) - 1))], 3),
            "mean": round(statistics.fmean(latencies), 3),
        },
    }


def run_serving(adapter: Path, data: Path, calls: int, workdir: Path) -> dict[str, Any]:
    examples = [x for x in read_examples(data, ["test"]) if x.source == "sample"][:calls]
    name = adapter.name
    merged = merged_model(adapter)
    result: dict[str, Any] = {
        "adapter": str(adapter.relative_to(REPO)) if adapter.is_relative_to(REPO) else str(adapter),
        "prompts": len(examples),
        "how": "one vLLM worker (one core) behind the router, calls one at a time,"
        " guided decoding with the session's categories, label scores on",
        "lora": measure(
            workdir / "lora",
            ServedModel(lora=((name, adapter.resolve()),), max_lora_rank=8),
            name,
            examples,
        ),
        "merged": measure(
            workdir / "merged-tier", ServedModel(name=name, model_dir=merged), name, examples
        ),
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    result["faster"] = min(("lora", "merged"), key=lambda k: result[k]["latency_s"]["p50"])
    RESULT.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    return result
