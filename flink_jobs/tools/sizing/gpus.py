"""The GPU throughputs the plan assumes when the command line gives none.

These are round planning figures, not measurements and not vendor figures: tokens per
second one GPU sustains for a small instruct model (about 1B parameters, 16-bit weights)
under vLLM with many requests batched together. Nothing in this project ran on a GPU, so
every figure here is an assumption to replace with a measurement on the model and GPU a
deployment uses (``--prefill-tokens-per-s``, ``--decode-tokens-per-s``). A larger model
lowers both roughly in proportion to its size.

Prefill (the prompt's uncached tokens) is bound by the GPU's arithmetic, decode (the
answer's tokens, one step per token for the whole batch) by its memory bandwidth, which
is why the two differ by about an order of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFigures:
    name: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


#: Round planning figures (assumed, see the module docstring), by GPU.
GPUS: dict[str, GpuFigures] = {
    g.name: g
    for g in (
        GpuFigures("L4", 20_000, 2_500),
        GpuFigures("A10G", 20_000, 4_000),
        GpuFigures("A100", 60_000, 15_000),
        GpuFigures("H100", 150_000, 30_000),
    )
}

DEFAULT_GPU = "A10G"

#: What every figure of ``GPUS`` is, wherever the plan cites one.
SOURCE = "flink_jobs/tools/sizing/gpus.py"


def gpu(name: str) -> GpuFigures:
    """The figures of GPU ``name`` (case-insensitive); ValueError naming the known ones."""
    for known, figures in GPUS.items():
        if known.lower() == name.lower():
            return figures
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give the throughputs)")
