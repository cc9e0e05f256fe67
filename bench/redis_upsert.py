"""Redis: the atomic versioned intent upsert against plain pipelined HSET, side by side.

One redis-server (no persistence) on a free loopback port; the same records written by:

* ``upsert``: the job's own store (``flink_jobs.runtime.intent_store``): ``EVALSHA`` of the Lua
  script that checks the version, writes every field and resets the expiry;
* ``hset``: the same fields with a plain ``HSET`` + ``PEXPIRE`` in a pipeline, no check.

in two shapes, each shape's two writers alternating in rounds so both see the same
machine (the ratio is the figure; absolute ops/s move with the shared machine's load):

* ``job``: how the job writes: the async store, one upsert (one round trip) per intent,
  ``llm.max_concurrency`` (8) upserts in flight on one event loop;
* ``batch``: the sync store's ``upsert_many`` (one pipeline per batch of 100).

``redis-benchmark`` (shipped with redis-server) is the reference: its own HSET of the same
eleven fields against ``EVALSHA`` of the same script with the same arguments (version
timestamps random, so about half the writes pass the check), pipelined 16 deep, 50
clients, no Python in the way.

``python -m bench.redis_upsert [--records 20000] [--rounds 3]``: prints a table, writes
``bench/results/redis_upsert.json``. Target, so that the version check and the expiry keep
a write within half the cost of a plain one: upsert >= 0.5x HSET throughput, in each shape
and in redis-benchmark's reference.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis
import redis.asyncio

from bench._common import RESULTS_DIR, percentile, ratio, result_doc, rounded, target, write_result
from flink_jobs.runtime.intent_store import (
    DEFAULT_TTL_MS,
    RECORD_FIELDS,
    UPSERT_SCRIPT,
    AsyncIntentStore,
    IntentRecord,
    IntentStore,
    intent_key,
    upsert_args,
)
from flink_jobs.tools.local_services import start_redis, stop_on_sigterm

BENCHMARK = "redis_upsert"
JOB_CONCURRENCY = 8  # LlmConfig.max_concurrency: upserts one async operator has in flight
BATCH = 100
TARGET_RATIO = 0.5
INTENT_JSON = (
    '{"intents":[{"label":"ready_to_buy","confidence":0.9,"category":"Running Shoes"},'
    '{"label":"comparing","confidence":0.4,"category":"Running Shoes"}],'
    '"summary":"Compared trail running shoes, then added a pair to the cart"}'
)


def make_records(
    count: int, shoppers: int, prefix_ms: int = 1_780_000_000_000
) -> list[IntentRecord]:
    """``count`` records over ``shoppers`` shoppers, each newer than that shopper's last,
    so every upsert passes the version check and writes (the costly path)."""
    return [
        IntentRecord(
            shopper_id=f"shopper-{i % shoppers:05d}",
            version_ts=prefix_ms + i,
            version_seq=i // shoppers,
            intent_json=INTENT_JSON,
            top_label="ready_to_buy",
            top_confidence=0.9,
            summary="Compared trail running shoes, then added a pair to the cart",
            event_time_ms=prefix_ms + i,
            template="shopper_intent_v1.j2",
            template_hash="3f2a9c0d1b7e",
            model="SmolLM2-135M-Instruct",
        )
        for i in range(count)
    ]


def hset_mapping(record: IntentRecord, ttl_ms: int) -> dict[str, str]:
    """The fields the upsert writes, for the plain HSET (written_at_ms from the client)."""
    args = upsert_args(record, ttl_ms)
    pairs = args[3:]
    mapping = dict(zip(pairs[0::2], pairs[1::2], strict=True))
    mapping["version_ts"] = args[0]
    mapping["version_seq"] = args[1]
    mapping["written_at_ms"] = str(int(time.time() * 1000))
    return mapping


# --- the four writers ------------------------------------------------------------------------


async def job_upsert(url: str, prefix: str, records: Sequence[IntentRecord]) -> float:
    client = redis.asyncio.Redis.from_url(url)
    store = AsyncIntentStore(client, prefix)
    await store.upsert(records[0])  # loads the script, opens a connection
    return await _concurrently(client, records, store.upsert)


async def job_hset(url: str, prefix: str, records: Sequence[IntentRecord]) -> float:
    client = redis.asyncio.Redis.from_url(url)

    async def write(record: IntentRecord) -> None:
        key = intent_key(record.shopper_id, prefix)
        async with client.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=hset_mapping(record, DEFAULT_TTL_MS))
            pipe.pexpire(key, DEFAULT_TTL_MS)
            await pipe.execute()

    await write(records[0])
    return await _concurrently(client, records, write)


async def _concurrently(client, records: Sequence[IntentRecord], write) -> float:
    queue = iter(records)

    async def lane() -> None:
        for record in queue:
            await write(record)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(JOB_CONCURRENCY)))
    elapsed = time.perf_counter() - started
    await client.aclose()
    return len(records) / elapsed


def batch_upsert(url: str, prefix: str, records: Sequence[IntentRecord]) -> float:
    client = redis.Redis.from_url(url)
    store = IntentStore(client, prefix)
    store.upsert(records[0])
    started = time.perf_counter()
    for i in range(0, len(records), BATCH):
        store.upsert_many(records[i : i + BATCH])
    elapsed = time.perf_counter() - started
    client.close()
    return len(records) / elapsed


def batch_hset(url: str, prefix: str, records: Sequence[IntentRecord]) -> float:
    client = redis.Redis.from_url(url)
    started = time.perf_counter()
    for i in range(0, len(records), BATCH):
        with client.pipeline(transaction=False) as pipe:
            for record in records[i : i + BATCH]:
                key = intent_key(record.shopper_id, prefix)
                pipe.hset(key, mapping=hset_mapping(record, DEFAULT_TTL_MS))
                pipe.pexpire(key, DEFAULT_TTL_MS)
            pipe.execute()
    elapsed = time.perf_counter() - started
    client.close()
    return len(records) / elapsed


# --- redis-benchmark ---------------------------------------------------------------------------

_ROW = re.compile(r'^"(.*?)","([\d.]+)"(?:,|$)', re.MULTILINE)


def parse_redis_benchmark_csv(text: str) -> float | None:
    """Requests per second (column ``rps``) of the last data row of ``redis-benchmark --csv``."""
    found = [float(m.group(2)) for m in _ROW.finditer(text)]
    return found[-1] if found else None


def redis_benchmark(port: int, requests: int) -> dict[str, float | None] | None:
    """HSET vs EVALSHA of the upsert script, by redis-benchmark; None when it is missing."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    client = redis.Redis(host="127.0.0.1", port=port)
    sha = client.script_load(UPSERT_SCRIPT)
    client.close()
    record = make_records(1, 1)[0]
    args = upsert_args(record, DEFAULT_TTL_MS)
    fields = [*args[3:], "version_ts", "1", "version_seq", "0", "written_at_ms", "1"]
    common = [binary, "-h", "127.0.0.1", "-p", str(port), "-n", str(requests), "-P", "16"]
    common += ["-c", "50", "-r", "10000", "--csv"]
    key = "rb:intent:__rand_int__"
    out: dict[str, float | None] = {}
    commands = {
        "hset": ["HSET", key, *fields],
        "upsert_evalsha": [
            *("EVALSHA", sha, "1", key, "__rand_int__", "0", str(DEFAULT_TTL_MS)),
            *args[3:],
        ],
    }
    for name, command in commands.items():
        proc = subprocess.run([*common, *command], capture_output=True, text=True, timeout=300)
        out[name] = parse_redis_benchmark_csv(proc.stdout)
    out["upsert_over_hset"] = rounded(ratio(out["upsert_evalsha"], out["hset"]))
    return out


# --- the run ---------------------------------------------------------------------------------


def run(records_count: int, shoppers: int, rounds: int) -> dict:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="si-bench-redis-"))
    server = start_redis(workdir=workdir)
    try:
        url = server.url
        records = make_records(records_count, shoppers)
        rates: dict[str, list[float]] = {k: [] for k in ("job", "batch")}
        per_round: list[dict[str, float]] = []
        for r in range(rounds):
            # A fresh prefix per writer and round: every key starts empty, so the upsert
            # writes on every call and both writers create the same number of hashes.
            row = {
                "job_upsert": asyncio.run(job_upsert(url, f"u{r}", records)),
                "job_hset": asyncio.run(job_hset(url, f"h{r}", records)),
                "batch_upsert": batch_upsert(url, f"bu{r}", records),
                "batch_hset": batch_hset(url, f"bh{r}", records),
            }
            redis.Redis.from_url(url).flushdb()
            per_round.append({k: round(v) for k, v in row.items()})
            rates["job"].append(row["job_upsert"] / row["job_hset"])
            rates["batch"].append(row["batch_upsert"] / row["batch_hset"])
            print(
                f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in row.items())
            )
        reference = redis_benchmark(server.port, 200_000)
    finally:
        server.stop()
    shapes = {}
    for shape in ("job", "batch"):
        ups = [row[f"{shape}_upsert"] for row in per_round]
        hs = [row[f"{shape}_hset"] for row in per_round]
        shapes[shape] = {
            "upsert_ops_per_s": round(percentile(ups, 50)),
            "hset_ops_per_s": round(percentile(hs, 50)),
            "upsert_over_hset": rounded(percentile(rates[shape], 50)),
            "upsert_over_hset_per_round": [rounded(x) for x in rates[shape]],
        }
    targets = judge(shapes, reference)
    notes = []
    if reference is None:
        notes.append("redis-benchmark is not installed: no reference figures")
    return result_doc(
        BENCHMARK,
        started,
        targets,
        notes,
        workload={
            "records": records_count,
            "shoppers": shoppers,
            "rounds": rounds,
            "job_concurrency": JOB_CONCURRENCY,
            "batch_size": BATCH,
            "fields": ["version_ts", "version_seq", "written_at_ms", *RECORD_FIELDS],
            "intent_json_bytes": len(INTENT_JSON),
        },
        shapes=shapes,
        rounds=per_round,
        redis_benchmark=reference,
    )


def judge(shapes: dict[str, dict], reference: dict[str, float | None] | None) -> list[dict]:
    """The upsert over HSET throughput against ``TARGET_RATIO``, per shape and, when
    redis-benchmark ran, server-side: the same ratio with no Python client in the way."""
    targets = [
        target(
            "job shape: upsert / HSET throughput",
            shapes["job"]["upsert_over_hset"],
            ">=",
            TARGET_RATIO,
            "median over rounds of the ratio measured in the same round",
        ),
        target(
            "batch shape: upsert / HSET throughput",
            shapes["batch"]["upsert_over_hset"],
            ">=",
            TARGET_RATIO,
        ),
    ]
    if reference is not None:
        targets.append(
            target(
                "redis-benchmark: EVALSHA upsert / HSET throughput",
                reference["upsert_over_hset"],
                ">=",
                TARGET_RATIO,
                "server side: pipelined 16 deep, 50 clients, no Python client",
            )
        )
    return targets


def table(doc: dict) -> str:
    lines = [f"{'shape':<8} {'upsert ops/s':>13} {'HSET ops/s':>11} {'ratio':>6}"]
    for shape, s in doc["shapes"].items():
        lines.append(
            f"{shape:<8} {s['upsert_ops_per_s']:>13,} {s['hset_ops_per_s']:>11,}"
            f" {s['upsert_over_hset']:>6}"
        )
    ref = doc.get("redis_benchmark")
    if ref:
        lines.append(
            f"{'r-bench':<8} {ref['upsert_evalsha'] or 0:>13,.0f} {ref['hset'] or 0:>11,.0f}"
            f" {ref['upsert_over_hset']:>6}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    stop_on_sigterm()
    p = argparse.ArgumentParser(
        prog="python -m bench.redis_upsert", description=__doc__.split("\n")[0]
    )
    p.add_argument("--records", type=int, default=20_000, help="writes per writer per round")
    p.add_argument("--shoppers", type=int, default=2_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    doc = run(args.records, args.shoppers, args.rounds)
    print(table(doc))
    print(f"written {write_result(doc, args.out)}")
    return 0 if doc["all_targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
