"""The learning curve: the test metrics against the number of training examples.

Adapters trained on growing numbers of examples (``distill train --max-examples N``, the
same seed, so each set holds the smaller ones) answer the same test-split prompts, served
together as LoRA modules of one vLLM tier, through the job's own call path
(``inference.ask``: guided decoding with the session's categories, label scores). Each
adapter's answers are scored like the eval's writes (``intent_eval.evaluate`` against the
source's events), beside the rules-only intent of the same points. Without the stream
job: the prompts are the ones the job renders (``dataset``), so the answers are the same.

The result goes to ``bench/results/distill_curve.{json,png}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import orjson

from flink_jobs.config import load_config
from flink_jobs.runtime.inference import Answered, ask
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.tools import intent_eval
from flink_jobs.tools.distill.dataset import Example, load_source, read_examples
from flink_jobs.tools.distill.serving import task_of
from flink_jobs.tools.embedded_stack import ServedModel, start_llm_tier
from flink_jobs.tools.provenance import git_state

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
RESULT = REPO / "bench" / "results" / "distill_curve.json"
CURVE_METRICS = ("ndcg_at_10", "purchase_auc", "next_category_top1", "post_purchase_consistency")


def answers(
    adapters: dict[str, Path], examples: list[Example], workdir: Path, workers: int
) -> dict[str, list[intent_eval.IntentWrite]]:
    served = ServedModel(lora=tuple((n, p.resolve()) for n, p in adapters.items()), max_lora_rank=8)
    tier = start_llm_tier(workdir, workers=workers, model=served)
    try:
        config = load_config({"llm": tier.job_settings()}, environ={})

        async def run_all() -> dict[str, list[intent_eval.IntentWrite]]:
            client = LlmClient(config.llm)
            limit = asyncio.Semaphore(config.llm.max_concurrency)

            async def one(name: str, x: Example) -> intent_eval.IntentWrite | None:
                async with limit:
                    result = await ask(task_of(x, name), client, 0)
                if not isinstance(result, Answered):
                    return None
                labels = intent_eval.labels_of(result.intent.body)
                return intent_eval.IntentWrite(
                    x.shopper_id, x.version_ts, labels, "model", "shopper_intent_compact.j2", name
                )

            try:
                out = {}
                for name in adapters:
                    found = await asyncio.gather(*(one(name, x) for x in examples))
                    out[name] = [w for w in found if w is not None]
                    log.info("%s: %d of %d answered", name, len(out[name]), len(examples))
                return out
            finally:
                await client.aclose()

        return asyncio.run(run_all())
    finally:
        tier.stop()


def run_curve(
    adapters: dict[str, Path],
    data: Path,
    events_file: Path,
    source: str,
    points: int,
    workdir: Path,
    workers: int = 2,
) -> dict[str, Any]:
    code = git_state()  # now: the files may change while the run goes on
    examples = [x for x in read_examples(data, ["test"]) if x.source == source][:points]
    events, _ = load_source(events_file)
    shoppers = {x.shopper_id for x in examples}
    events = [e for e in events if e.shopper_id in shoppers]
    writes = answers(adapters, examples, workdir, workers)
    rows = []
    for name, path in adapters.items():
        training = orjson.loads((path / "training.json").read_bytes())
        [group] = intent_eval.evaluate(events, writes[name]).groups or [None]
        if group is None:
            continue
        rows.append(
            {
                "adapter": name,
                "train_examples": training["train_examples"],
                "examples_seen": training.get("examples_seen"),
                "best_val_loss": training["best_val_loss"],
                "writes": group.counts.writes,
                "answer": {m: getattr(group.answer, m) for m in CURVE_METRICS},
                "rules": {m: getattr(group.rules, m) for m in CURVE_METRICS},
            }
        )
    rows.sort(key=lambda r: examples_seen(r))
    result = {
        "source": source,
        "test_points": len(examples),
        "rows": rows,
        "git": code,
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    RESULT.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    _plot(result, RESULT.with_suffix(".png"))
    return result


def examples_seen(row: dict[str, Any]) -> int:
    """The examples an adapter's training saw: fewer than it drew when it stopped early."""
    return int(row.get("examples_seen") or row["train_examples"])


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ndcg_at_10", "purchase_auc"), strict=True):
        xs = [examples_seen(r) for r in rows]
        ax.plot(xs, [r["answer"][metric] or 0 for r in rows], "o-", label="adapter's answers")
        ax.plot(xs, [r["rules"][metric] or 0 for r in rows], "--", color="grey", label="rules-only")
        ax.set_xscale("log")
        ax.set_xlabel("training examples seen")
        ax.set_title(f"{result['source']} test split: {metric}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
