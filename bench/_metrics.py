"""Reading vLLM's own counters and summarising what a phase measured. Pure functions.

Token figures come from the workers' Prometheus counters (deltas over a phase), never
from the client: ``vllm:prompt_tokens_total`` and ``vllm:prefix_cache_hits_total`` are
repeatable where times on a shared 2-core machine are not.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Counters summed over label sets (``_total`` samples only), per worker.
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
)
#: Gauges whose sum is a worker's in-flight requests.
INFLIGHT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_KV_TOKENS = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")


def parse_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of every sample named in ``names`` (all label sets) in Prometheus text."""
    wanted = set(names)
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in wanted:
            try:
                out[m.group(1)] += float(m.group(3))
            except ValueError:
                continue
    return out


def parse_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Samples named ``name`` summed per value of ``label``, e.g. routing decisions."""
    pattern = re.compile(rf'{re.escape(label)}="([^"]*)"')
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        found = pattern.search(m.group(2) or "")
        key = found.group(1) if found else ""
        try:
            out[key] = out.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def counters_delta(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Per worker, per counter: ``after - before``."""
    return {w: {k: after[w][k] - before[w].get(k, 0.0) for k in after[w]} for w in after}


def kv_cache_tokens(log_text: str) -> int | None:
    """The KV cache size in tokens that vLLM printed at start-up (last one in the log)."""
    found = _KV_TOKENS.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


@dataclass(frozen=True, slots=True)
class TokenSummary:
    requests: int
    prompt_tokens: float
    cache_hits: float
    computed: float
    hit_ratio: float
    computed_per_request: float


def token_summary(delta: Mapping[str, Mapping[str, float]], requests: int) -> TokenSummary:
    """Totals over workers: computed = prompt tokens - prefix-cache hits."""
    prompt = sum(d.get("vllm:prompt_tokens_total", 0.0) for d in delta.values())
    hits = sum(d.get("vllm:prefix_cache_hits_total", 0.0) for d in delta.values())
    computed = prompt - hits
    return TokenSummary(
        requests=requests,
        prompt_tokens=prompt,
        cache_hits=hits,
        computed=computed,
        hit_ratio=hits / prompt if prompt else math.nan,
        computed_per_request=computed / requests if requests else math.nan,
    )


def sample_weights(times: Sequence[float], end: float | None = None) -> list[float]:
    """Seconds each sample stands for: the time until the next sample (a sample holds
    until the next one is taken), the last one until ``end`` (or the median interval).

    Weighting by the actual intervals keeps the average time-weighted even when a poll
    is slow (the workers' ``/metrics`` answers late on a loaded machine)."""
    if not times:
        return []
    gaps = [b - a for a, b in itertools.pairwise(times)]
    median_gap = sorted(gaps)[len(gaps) // 2] if gaps else 1.0
    tail = end - times[-1] if end is not None else median_gap
    return [max(0.0, g) for g in [*gaps, tail]]


def inflight_balance(
    samples: Sequence[Sequence[float]], weights: Sequence[float] | None = None
) -> dict[str, float]:
    """Load balance from periodic in-flight samples (one row per sample, one column per worker).

    ``max_over_mean``: the busiest worker's time-averaged in-flight over the mean of all
    workers' (1.0 is perfect balance; 3.0 with three workers is everything on one). Each
    sample counts for ``weights`` seconds (``sample_weights``); equal weights without.
    ``peak_max_over_mean``: the same ratio per sample, time-averaged over the samples
    where anything was in flight, i.e. the typical instantaneous imbalance. ``peak``:
    the most in flight on one worker at any sample.
    """
    if not samples:
        return {"max_over_mean": math.nan, "peak_max_over_mean": math.nan, "peak": math.nan}
    if weights is None:
        weights = [1.0] * len(samples)
    if len(weights) != len(samples):
        raise ValueError("one weight per sample")
    span = sum(weights)
    if span <= 0:
        return {"max_over_mean": math.nan, "peak_max_over_mean": math.nan, "peak": math.nan}
    workers = len(samples[0])
    per_worker = [
        sum(row[w] * dt for row, dt in zip(samples, weights, strict=True)) / span
        for w in range(workers)
    ]
    mean = sum(per_worker) / workers
    busy = [(row, dt) for row, dt in zip(samples, weights, strict=True) if sum(row) > 0]
    busy_span = sum(dt for _, dt in busy)
    inst = sum(max(row) / (sum(row) / workers) * dt for row, dt in busy)
    return {
        "max_over_mean": max(per_worker) / mean if mean else math.nan,
        "peak_max_over_mean": inst / busy_span if busy_span else math.nan,
        "peak": max(max(row) for row in samples),
        "mean_per_worker": [round(v, 3) for v in per_worker],
        "span_s": round(span, 2),
    }
