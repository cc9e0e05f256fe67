"""Merge a LoRA adapter into its base model: a model folder vLLM serves like any other.

Run in the vLLM venv (torch, transformers, peft): ``scripts/setup.sh`` runs it when an
adapter is in the repository, and ``distill serving`` to measure both ways of serving.
The merged folder holds the base's config, tokenizer and chat template, and the merged
weights in the base's dtype (bf16).

CLI::

    python -m flink_jobs.tools.distill.merge_worker --base BASE_DIR --adapter ADAPTER_DIR \\
        --out OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

#: Files of the base model folder copied beside the merged weights.
BASE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def merge(base: Path, adapter: Path, out: Path) -> Path:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    for name in BASE_FILES:
        if (base / name).exists():
            shutil.copy2(base / name, tmp / name)
    # The architecture is the base's: its config (with the top-level rope_theta older
    # loaders read) describes the merged weights too.
    shutil.copy2(base / "config.json", tmp / "config.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="merge_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--adapter", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    print(f"merged into {merge(args.base, args.adapter, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
