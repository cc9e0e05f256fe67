"""The training loop: a LoRA adapter of the serving model on the hindsight examples.

Run in the vLLM venv, where torch, transformers and peft are installed (``distill train``
starts it there); it imports nothing else of the project, so the job's venv needs no
torch. Steps:

1. read the examples (``dataset.Example`` as JSON lines): the train split, capped per
   source if asked, shuffled with ``--seed``; the validation split for the loss that
   stops training; the test split is never read;
2. tokenize each as the server sees it: the chat template over the prompt's messages with
   the assistant turn opened, then the target's JSON and the end-of-turn token; the loss
   counts the target's tokens only;
3. train LoRA (every linear layer of the attention and MLP, rank ``--rank``) with AdamW,
   a short warm-up then linear decay, batches of similar length; a progress bar shows the
   loss, the validation loss and the time left;
4. every ``--eval-every`` steps: the validation loss; the best adapter so far is kept, a
   checkpoint (adapter, optimizer, scheduler, step, random states, history) is written so
   ``--resume`` continues where it stopped, and ``--patience`` evaluations without a new
   best stop training early; ``--max-minutes`` bounds the whole run;
5. write the best adapter in bf16 (``adapter_model.safetensors``, ``adapter_config.json``)
   and ``training.json``: data counts, settings, the loss history, tokens per second.

Seeded and repeatable: the data order, the initial LoRA weights and the batches follow
``--seed``; the same command on the same host gives the same losses (up to the order of
floating-point sums across threads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
END_OF_TURN = "<|im_end|>"
WARMUP_STEPS = 10
#: The learning rate decays linearly to this share of ``--lr`` by the last step.
FINAL_LR_SHARE = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--base-model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--max-examples", type=int, default=0)
    p.add_argument("--per-source", default="")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=80.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--layers-from", type=int, default=18, help="LoRA on this layer and up")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-examples", type=int, default=96)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=640, help="longer examples are left out")
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch")
    p.add_argument("--resume", action="store_true")
    return p.parse_args(argv)


# --- data ------------------------------------------------------------------------------------


def read_split(path: Path, split: str) -> list[dict[str, Any]]:
    with path.open("rb") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["split"] == split]


def per_source_caps(text: str) -> dict[str, int]:
    """``sample:1200,complete_journey:300`` -> {source: cap}; empty: no caps."""
    caps = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, n = part.rpartition(":")
        if not name or not n.isdigit():
            raise SystemExit(f"--per-source: {part!r} is not source:count")
        caps[name] = int(n)
    return caps


def choose(
    rows: list[dict[str, Any]], caps: dict[str, int], limit: int, seed: int
) -> list[dict[str, Any]]:
    """The rows to train on: shuffled with ``seed``, at most ``caps[source]`` per source
    (sources without a cap: all), at most ``limit`` in all (0: no limit)."""
    rng = random.Random(seed)
    rows = list(rows)
    rng.shuffle(rows)
    kept: list[dict[str, Any]] = []
    taken: dict[str, int] = {}
    for r in rows:
        cap = caps.get(r["source"])
        if cap is not None and taken.get(r["source"], 0) >= cap:
            continue
        taken[r["source"]] = taken.get(r["source"], 0) + 1
        kept.append(r)
    return kept[:limit] if limit else kept


#: An example as (input ids, labels).
Encoded = tuple[list[int], list[int]]


def encode(tokenizer: Any, row: dict[str, Any]) -> Encoded:
    """(input ids, labels): the prompt as the chat template renders it for generation,
    then the target and the end of the turn; labels -100 on the prompt."""
    prompt = tokenizer.apply_chat_template(
        list(row["messages"]), add_generation_prompt=True, tokenize=False
    )
    target = json.dumps(row["target"], separators=(",", ":"), ensure_ascii=False) + END_OF_TURN
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    return prompt_ids + target_ids, [-100] * len(prompt_ids) + target_ids


def batches(
    encoded: list[Encoded], batch_size: int, batch_tokens: int, seed: int
) -> list[list[int]]:
    """Index batches of similar length: shuffled, sorted by length within windows, cut so
    a batch holds at most ``batch_size`` examples and ``batch_tokens`` padded tokens (the
    attention's activations grow with the square of the longest), the batches shuffled
    again (all with ``seed``)."""
    rng = random.Random(seed)
    order = list(range(len(encoded)))
    rng.shuffle(order)
    window = batch_size * 16
    out: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(encoded[i][0]))
        current: list[int] = []
        for i in chunk:
            longest = len(encoded[i][0])  # sorted: the newest is the longest
            if current and (
                len(current) >= batch_size or (len(current) + 1) * longest > batch_tokens
            ):
                out.append(current)
                current = []
            current.append(i)
        if current:
            out.append(current)
    rng.shuffle(out)
    return out


def collate(
    torch: Any, encoded: list[Encoded], indices: list[int], pad_id: int
) -> tuple[Any, Any, Any]:
    """The batch of ``indices`` as tensors: input ids, labels and attention mask, padded."""
    longest = max(len(encoded[i][0]) for i in indices)
    ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(indices), longest), dtype=torch.long)
    for row, i in enumerate(indices):
        x, y = encoded[i]
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return ids, labels, mask


# --- training --------------------------------------------------------------------------------


def target_loss(model: Any, ids: Any, labels: Any, mask: Any) -> tuple[Any, int]:
    """Mean cross-entropy over the target's tokens, and their count. The vocabulary's
    logits are computed only where a target token is predicted: over every position they
    would take most of the memory (49,152 floats per token) for the prompt's tokens, whose
    loss is not counted."""
    import torch

    causal = model.get_base_model()
    hidden = causal.model(input_ids=ids, attention_mask=mask).last_hidden_state
    wanted = labels[:, 1:] != -100
    logits = causal.lm_head(hidden[:, :-1][wanted])
    n = int(wanted.sum())
    return torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:][wanted]), n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    started = time.monotonic()

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_rows = choose(
        read_split(args.data, "train"),
        per_source_caps(args.per_source),
        args.max_examples,
        args.seed,
    )
    val_rows = choose(read_split(args.data, "val"), {}, args.val_examples, args.seed + 1)
    if not train_rows or not val_rows:
        raise SystemExit(f"{args.data}: no train or no validation examples")
    encoded = [(r, encode(tokenizer, r)) for r in train_rows]
    too_long = sum(1 for _, x in encoded if len(x[0]) > args.max_tokens)
    train_rows = [r for r, x in encoded if len(x[0]) <= args.max_tokens]
    train = [x for _, x in encoded if len(x[0]) <= args.max_tokens]
    val = [x for x in (encode(tokenizer, r) for r in val_rows) if len(x[0]) <= args.max_tokens]
    plan = batches(train, args.batch_size, args.batch_tokens, args.seed)
    steps_per_epoch = len(plan)
    total_steps: int = args.max_steps or max(1, math.ceil(args.epochs * steps_per_epoch))

    model = AutoModelForCausalLM.from_pretrained(
        args.base_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        # Only the upper layers: the backward pass then stops there, and the lower
        # layers' activations are not kept (most of the time and memory on a CPU).
        layers_to_transform=list(range(args.layers_from, model.config.num_hidden_layers)),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )

    def lr_at(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        left = max(0.0, 1 - (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
        return FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * left

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    checkpoint = args.work / "checkpoint"
    best_dir = args.work / "best"
    state: dict[str, Any] = {
        "step": 0,
        "history": [],
        "best_val": None,
        "best_step": None,
        "evals_since_best": 0,
        "tokens": 0,
        "train_seconds": 0.0,
    }
    if args.resume and (checkpoint / "state.pt").exists():
        saved = torch.load(checkpoint / "state.pt", weights_only=False)
        set_peft_model_state_dict(model, saved["adapter"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["py_rng"])
        state = saved["state"]
        print(f"resumed at step {state['step']} from {checkpoint}", file=sys.stderr)

    def validation_loss() -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(val), args.batch_size):
                idx = list(range(start, min(start + args.batch_size, len(val))))
                ids, labels, mask = collate(torch, val, idx, pad_id)
                loss_t, n = target_loss(model, ids, labels, mask)
                total += float(loss_t) * n
                count += n
        model.train()
        return total / max(1, count)

    def save_checkpoint() -> None:
        tmp = args.work / "checkpoint.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "adapter": get_peft_model_state_dict(model),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate(),
                "state": state,
            },
            tmp / "state.pt",
        )
        shutil.rmtree(checkpoint, ignore_errors=True)
        tmp.rename(checkpoint)

    model.train()
    stopped_by = "steps"
    bar = tqdm(total=total_steps, initial=state["step"], desc="train", unit="step", file=sys.stderr)
    deadline = started + args.max_minutes * 60
    running = None
    while state["step"] < total_steps:
        if time.monotonic() > deadline:
            stopped_by = "time"
            break
        step_started = time.monotonic()
        idx = plan[state["step"] % steps_per_epoch]
        ids, labels, mask = collate(torch, train, idx, pad_id)
        loss_t, _ = target_loss(model, ids, labels, mask)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(loss_t)
        running = loss if running is None else 0.9 * running + 0.1 * loss
        state["step"] += 1
        state["tokens"] += int(mask.sum())
        state["train_seconds"] += time.monotonic() - step_started
        state["examples"] = state.get("examples", 0) + len(idx)
        entry: dict[str, Any] = {"step": state["step"], "loss": loss, "examples": state["examples"]}
        if state["step"] % args.eval_every == 0 or state["step"] == total_steps:
            val_loss = validation_loss()
            entry["val_loss"] = val_loss
            if state["best_val"] is None or val_loss < state["best_val"]:
                state["best_val"], state["best_step"] = val_loss, state["step"]
                state["evals_since_best"] = 0
                model.save_pretrained(best_dir)
            else:
                state["evals_since_best"] += 1
            bar.set_postfix(loss=f"{running:.3f}", val=f"{val_loss:.3f}", refresh=False)
        else:
            bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        state["history"].append(entry)
        if "val_loss" in entry:
            save_checkpoint()
        bar.update(1)
        if state["evals_since_best"] >= args.patience:
            stopped_by = "early_stopping"
            break
    bar.close()
    if state["best_step"] is None:  # stopped before the first evaluation
        state["history"][-1]["val_loss"] = state["best_val"] = validation_loss()
        state["best_step"] = state["step"]
        model.save_pretrained(best_dir)

    write_adapter(best_dir, args.out)
    report = {
        "base_model": args.base_model.name,
        "data": str(args.data),
        "train_examples": len(train),
        "train_examples_too_long": too_long,
        "train_by_source": _counts(train_rows),
        "val_examples": len(val_rows),
        "val_by_source": _counts(val_rows),
        "steps": state["step"],
        "examples_seen": sum(len(plan[i % steps_per_epoch]) for i in range(state["step"])),
        "steps_per_epoch": steps_per_epoch,
        "total_steps_planned": total_steps,
        "stopped_by": stopped_by,
        "best_step": state["best_step"],
        "best_val_loss": state["best_val"],
        "history": state["history"],
        "train_seconds": round(state["train_seconds"], 1),
        "tokens_per_second": round(state["tokens"] / max(1e-9, state["train_seconds"]), 1),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "resume"
        },
        "lora": {
            "rank": args.rank,
            "alpha": 2 * args.rank,
            "target_modules": list(TARGET_MODULES),
            "layers_from": args.layers_from,
        },
        "torch": torch.__version__,
        "threads": args.threads,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"done: {state['step']} steps ({stopped_by}), best validation loss {state['best_val']:.4f}"
        f" at step {state['best_step']}; adapter in {args.out}",
        file=sys.stderr,
    )
    return 0


def write_adapter(source: Path, out: Path) -> None:
    """The adapter of ``source`` in bf16 at ``out`` (config and safetensors)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((source / "adapter_config.json").read_text())
    # A relative name: the adapter is served on top of the cache's model folder, wherever.
    config["base_model_name_or_path"] = "SmolLM2-135M-Instruct"
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    return counts


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
