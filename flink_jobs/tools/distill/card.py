"""The adapter's model card: what it was trained on, how, and how it scores.

:func:`write_card` reads the adapter folder's ``training.json`` (``train_worker``), the
data summary (``data/distill/summary.json``) and, when present, the eval's figures for the
adapter's arm (``bench/results/intent_quality.json``), and writes ``README.md`` in the
adapter folder with its loss curve (``loss_curve.png``). It is rewritten after each
training run and each eval, so the card always carries the figures of the adapter it
sits beside.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "bench" / "results" / "intent_quality.json"
SUMMARY = REPO / "data" / "distill" / "summary.json"
#: Metrics the card shows for each arm.
CARD_METRICS = (
    "ndcg_at_10",
    "purchase_auc",
    "next_category_top1",
    "post_purchase_consistency",
    "abandoning_cart_consistency",
    "browsing_with_signal",
)


def plot_loss(training: dict[str, Any], path: Path) -> bool:
    """The training loss (a moving mean over 10 steps) and the validation loss against the
    examples seen; False when matplotlib is missing (``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return False
    history = training["history"]
    xs = [h["examples"] for h in history]
    losses = [h["loss"] for h in history]
    smooth = [
        sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
        for i in range(len(losses))
    ]
    val = [(h["examples"], h["val_loss"]) for h in history if "val_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, losses, color="#bbbbbb", linewidth=0.8, label="train loss (per step)")
    ax.plot(xs, smooth, color="#1f77b4", label="train loss (mean of 10 steps)")
    if val:
        ax.plot(
            [x for x, _ in val], [v for _, v in val], "o-", color="#d62728", label="validation loss"
        )
    ax.set_xlabel("training examples seen")
    ax.set_ylabel("cross-entropy per target token")
    ax.set_title(f"{training['base_model']} + LoRA r={training['lora']['rank']}: hindsight targets")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_card(adapter_dir: Path, command: str = "") -> Path:
    training = orjson.loads((adapter_dir / "training.json").read_bytes())
    if command:
        training["command"] = command
        (adapter_dir / "training.json").write_bytes(
            orjson.dumps(training, option=orjson.OPT_INDENT_2) + b"\n"
        )
    # Without matplotlib here, the curve drawn when the adapter was trained still shows it.
    curve = adapter_dir / "loss_curve.png"
    plotted = plot_loss(training, curve) or curve.exists()
    summary = orjson.loads(SUMMARY.read_bytes()) if SUMMARY.exists() else None
    results = orjson.loads(RESULTS.read_bytes()) if RESULTS.exists() else None
    lines = _card_lines(adapter_dir.name, training, summary, results, plotted)
    path = adapter_dir / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _card_lines(
    name: str,
    training: dict[str, Any],
    summary: dict[str, Any] | None,
    results: dict[str, Any] | None,
    plotted: bool,
) -> list[str]:
    lora = training["lora"]
    settings = training["settings"]
    history = training["history"]
    first_val = next((h["val_loss"] for h in history if "val_loss" in h), None)
    lines = [
        f"# {name}: a LoRA adapter of {training['base_model']} for shopper intents",
        "",
        "What it does: answers the compact prompt (`prompts/shopper_intent_compact.j2`) with an",
        "intent learned from what shoppers did next (`flink_jobs/tools/distill/hindsight.py`).",
        f"Served by vLLM under the name `{name}`: merged into a model folder by",
        "`scripts/setup.sh` (`<cache>/models/<name>-merged`; on a CPU twice as fast as a LoRA",
        "module, `bench/results/distill_serving.json`), or as a LoRA module (`eval --serve lora`).",
        f"Arms: `shopper-intents eval --templates shopper_intent_compact.j2@{name}`,",
        f"`demo --adapter adapters/{name}`, or `prompt.arms` in the job.",
        "",
        "## Training",
        "",
        f"- Command: `{training.get('command', 'shopper-intents distill train')}`",
        f"- LoRA rank {lora['rank']}, alpha {lora['alpha']}, on {', '.join(lora['target_modules'])}"
        f" of layers {lora.get('layers_from', 0)} and up; weights stored in bf16.",
        f"- Examples: {training['train_examples']} train"
        f" (drawn: {_by(training['train_by_source'])}),"
        f" {training['val_examples']} validation ({_by(training['val_by_source'])});"
        f" {training.get('train_examples_too_long', 0)} train examples over"
        f" {settings.get('max_tokens', '?')} tokens left out. The test split is never read.",
        f"- Steps: {training['steps']} of {training['total_steps_planned']} planned"
        f" ({training['steps_per_epoch']} per epoch), batch up to {settings['batch_size']}"
        f" examples / {settings.get('batch_tokens', '?')} tokens, AdamW at {settings['lr']},"
        f" seed {settings['seed']}; {training.get('examples_seen', '?')} examples seen;"
        f" stopped by: {training['stopped_by']}.",
        f"- Validation loss: {_num(first_val)} at the first evaluation, best"
        f" {_num(training['best_val_loss'])} at step {training['best_step']} (the adapter kept).",
        f"- Time: {training['train_seconds'] / 60:.1f} min of training steps,"
        f" {training['tokens_per_second']:.0f} tokens/s on {training['threads']} threads"
        f" (torch {training['torch']}, CPU, float32 compute).",
        "",
    ]
    if plotted:
        lines += ["![loss curve](loss_curve.png)", ""]
    if summary is not None:
        lines += [
            "## Data (`data/distill/summary.json`)",
            "",
            f"Built by `{summary.get('command', '')}`.",
            "",
        ]
        lines += ["| source | split | trigger points | shoppers |", "| --- | --- | --- | --- |"]
        for source, splits in sorted(summary["splits"].items()):
            for split, entry in sorted(splits.items()):
                lines.append(f"| {source} | {split} | {entry['examples']} | {entry['shoppers']} |")
        lines.append("")
    lines += _eval_lines(name, results)
    return lines


def _eval_lines(name: str, results: dict[str, Any] | None) -> list[str]:
    if not results:
        return ["## Evaluation", "", "Not run yet: `shopper-intents eval --split test ...`.", ""]
    lines = ["## Evaluation (`bench/results/intent_quality.md`, test split)", ""]
    for dataset, doc in sorted(results["datasets"].items()):
        arms = [a["template"] for a in doc.get("arms", ())]
        if not any(name in a for a in arms):
            continue
        lines += [
            f"### {dataset}: {doc['scores']['common_points']} trigger points answered by every arm"
            f" (split {doc.get('split')}, run {doc['when']})",
            "",
            "| arm | " + " | ".join(CARD_METRICS) + " |",
            "| --- |" + " --- |" * len(CARD_METRICS),
        ]
        for g in doc["scores"]["same_writes"]["groups"]:
            for arm in ("answer", "record", "rules"):
                cells = [_num(g[arm].get(m)) for m in CARD_METRICS]
                lines.append(f"| {g['template']} {g['model']} {arm} | " + " | ".join(cells) + " |")
        lines.append("")
        for t in doc.get("targets", ()):
            lines.append(
                f"- {t['name']}: {_num(t['value'])} ({t['op']} {t['limit']}):"
                f" {'met' if t['met'] else 'missed'}"
            )
        lines.append("")
    return lines


def _by(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _num(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)
