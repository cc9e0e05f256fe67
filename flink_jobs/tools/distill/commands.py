"""``shopper-intents distill data|train``: build the examples, train the adapter.

``distill data`` makes (or reads) the event sources and writes every trigger point's
example (``dataset``) to ``<out>/examples.jsonl`` with a summary beside it:

- ``--sample-shoppers N --sample-seed S``: the sample generator's events
  (``sample_data``, no bad records) into ``<out>/sample_events.jsonl``;
- ``--cj-households N``: The Complete Journey's (``public_dataset``, the default week)
  into ``<out>/complete_journey_events.jsonl``;
- ``--recording PATH`` (repeatable): a recording of ``replay record``, or any events file.

``distill train`` runs ``train_worker`` in the vLLM venv (torch, transformers and peft
live there, not in the job's venv) and then writes the model card (``card``).

Every file under ``data/distill/`` is made by these commands from the package registry's
data and the seeds given, so the same command gives the same bytes.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from flink_jobs.paths import cache_dir
from flink_jobs.tools.distill import dataset

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
DATA_DIR = REPO / "data" / "distill"
ADAPTER_NAME = "si-compact-lora"
ADAPTER_DIR = REPO / "adapters" / ADAPTER_NAME
BASE_MODEL = "SmolLM2-135M-Instruct"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("distill", help="build training data from hindsight; train the adapter")
    dsub = p.add_subparsers(dest="distill_command", required=True)

    d = dsub.add_parser("data", help="trigger points, compact prompts and hindsight targets")
    d.add_argument("--out", type=Path, default=DATA_DIR, help="folder (default %(default)s)")
    d.add_argument("--sample-shoppers", type=int, default=3000, help="0: no sample source")
    d.add_argument("--sample-seed", type=int, default=11)
    d.add_argument("--cj-households", type=int, default=1000, help="0: no Complete Journey")
    d.add_argument("--cj-seed", type=int, default=7)
    d.add_argument(
        "--recording",
        type=Path,
        action="append",
        default=[],
        help="a recording of `replay record` (or an events file); repeatable",
    )

    t = dsub.add_parser("train", help="LoRA on the train split, early stopping on validation")
    t.add_argument("--data", type=Path, default=DATA_DIR / "examples.jsonl")
    t.add_argument("--out", type=Path, default=ADAPTER_DIR, help="adapter folder")
    t.add_argument("--work", type=Path, default=None, help="checkpoints (default: cache)")
    t.add_argument("--base-model", type=Path, default=None, help="default: the cache's model")
    t.add_argument("--max-examples", type=int, default=0, help="train examples used (0: all)")
    t.add_argument(
        "--per-source",
        type=str,
        default="sample:1500,complete_journey:150",
        help="train examples per source (default %(default)s; empty: all)",
    )
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--max-steps", type=int, default=0, help="0: from --epochs")
    t.add_argument("--max-minutes", type=float, default=45.0, help="stop training after this")
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--rank", type=int, default=8)
    t.add_argument("--layers-from", type=int, default=18, help="LoRA on this layer and up")
    t.add_argument("--eval-every", type=int, default=30, help="validation loss every N steps")
    t.add_argument("--val-examples", type=int, default=64)
    t.add_argument("--patience", type=int, default=3, help="evaluations without improvement")
    t.add_argument("--seed", type=int, default=44)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--no-card", action="store_true", help="skip the model card")

    c = dsub.add_parser("card", help="write the adapter's model card again (after an eval)")
    c.add_argument("--adapter", type=Path, default=ADAPTER_DIR)

    s = dsub.add_parser("serving", help="LoRA module or merged folder: which serves faster")
    s.add_argument("--adapter", type=Path, default=ADAPTER_DIR)
    s.add_argument("--data", type=Path, default=DATA_DIR / "examples.jsonl")
    s.add_argument("--calls", type=int, default=24, help="test-split prompts per way")

    k = dsub.add_parser("curve", help="test metrics against the number of training examples")
    k.add_argument(
        "--adapter",
        type=Path,
        action="append",
        required=True,
        help="an adapter folder (repeatable), e.g. one per --max-examples",
    )
    k.add_argument("--data", type=Path, default=DATA_DIR / "examples.jsonl")
    k.add_argument("--events", type=Path, default=DATA_DIR / "sample_events.jsonl")
    k.add_argument("--source", default="sample")
    k.add_argument("--points", type=int, default=200, help="test-split trigger points")


def run(args: argparse.Namespace) -> int:
    if args.distill_command == "data":
        return run_data(args)
    if args.distill_command == "serving":
        from flink_jobs.tools.distill import serving

        result = serving.run_serving(
            args.adapter, args.data, args.calls, cache_dir() / "distill-serving"
        )
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return 0
    if args.distill_command == "curve":
        from flink_jobs.tools.distill import curve

        adapters = {path.name: path for path in args.adapter}
        result = curve.run_curve(
            adapters,
            args.data,
            args.events,
            args.source,
            args.points,
            cache_dir() / "distill-curve",
        )
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return 0
    if args.distill_command == "card":
        from flink_jobs.tools.distill import card

        print(f"model card: {card.write_card(args.adapter)}")
        return 0
    return run_train(args)


def run_data(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    sources: list[tuple[str, Path]] = []
    if args.sample_shoppers:
        from flink_jobs.tools import sample_data

        path = args.out / "sample_events.jsonl"
        sample_data.main(
            [
                "--shoppers",
                str(args.sample_shoppers),
                "--seed",
                str(args.sample_seed),
                "--clean",
                "--out",
                str(path),
            ]
        )
        sources.append(("sample", path))
    if args.cj_households:
        from flink_jobs.tools import public_dataset

        path = args.out / "complete_journey_events.jsonl"
        code = public_dataset.main(
            ["--shoppers", str(args.cj_households), "--seed", str(args.cj_seed), "--out", str(path)]
        )
        if code:
            return code
        sources.append(("complete_journey", path))
    for recording in args.recording:
        sources.append((f"recording:{recording.stem}", recording))
    examples: list[dataset.Example] = []
    summary: dict[str, Any] = {"sources": {}}
    for name, path in sources:
        events, refused = dataset.load_source(path)
        found = dataset.build_examples(name, events)
        log.info(
            "%s: %d events (%d refused), %d trigger points", name, len(events), refused, len(found)
        )
        summary["sources"][name] = {
            "file": _relative(path),
            "events": len(events),
            "records_refused": refused,
        }
        examples.extend(found)
    dataset.write_examples(args.out / "examples.jsonl", examples)
    summary["splits"] = dataset.summarise(examples)
    summary["command"] = "shopper-intents distill data " + " ".join(sys.argv[3:])
    (args.out / "summary.json").write_bytes(
        orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    )
    print(orjson.dumps(summary["splits"], option=orjson.OPT_INDENT_2).decode())
    return 0


def run_train(args: argparse.Namespace) -> int:
    from inference_sidecar.workers import find_model_dir, find_vllm_python

    python = find_vllm_python()
    base = args.base_model or find_model_dir(BASE_MODEL)
    work = args.work or cache_dir() / "distill" / args.out.name
    argv = [
        str(python),
        "-m",
        "flink_jobs.tools.distill.train_worker",
        "--data",
        str(args.data),
        "--base-model",
        str(base),
        "--out",
        str(args.out),
        "--work",
        str(work),
        "--max-examples",
        str(args.max_examples),
        "--per-source",
        args.per_source,
        "--epochs",
        str(args.epochs),
        "--max-steps",
        str(args.max_steps),
        "--max-minutes",
        str(args.max_minutes),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--rank",
        str(args.rank),
        "--layers-from",
        str(args.layers_from),
        "--eval-every",
        str(args.eval_every),
        "--val-examples",
        str(args.val_examples),
        "--patience",
        str(args.patience),
        "--seed",
        str(args.seed),
        "--threads",
        str(args.threads),
    ]
    if args.resume:
        argv.append("--resume")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    log.info("training in the vLLM venv: %s", " ".join(argv[1:]))
    code = subprocess.run(argv, env=env, check=False).returncode
    if code or args.no_card:
        return code
    from flink_jobs.tools.distill import card

    path = card.write_card(args.out, command="shopper-intents " + " ".join(sys.argv[1:]))
    print(f"model card: {path}")
    return 0


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)
