"""What a run did, read back from where its results land: Redis, the dead-letter topic and
the vLLM workers' own metrics. Shared by the demo's console and the integration tests.

The accounting identity every run must satisfy (see ``runtime/counters.py`` for the counters)::

    events_in = events_accepted + events_late_folded + events_duplicate
              + events_late_dropped + events_held_overflow + dead_letter_decode

and every prompt sent ends as exactly one of: an intent written, a stale write skipped
(a newer intent was already there), superseded by a newer prompt (before it was sent,
or while it waited for the LLM), or a dead letter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import httpx
import orjson
import redis
from prometheus_client.parser import text_string_to_metric_families

from intent_reader.layout import KeyLayout

EVENT_OUTCOMES = (
    "events_accepted",
    "events_late_folded",
    "events_duplicate",
    "events_late_dropped",
    "events_held_overflow",
    "dead_letter_decode",
)
PROMPT_OUTCOMES = (
    "intents_written",
    "intents_stale",
    "prompts_superseded",
    "dead_letter_inference",
)


def read_stats(client: redis.Redis, prefix: str, shards: int = 0) -> dict[str, int]:
    """The job's counters: the stats hash, or in the cluster layout over ``shards`` slot
    groups the sum of every group's hash, field by field."""
    totals: dict[str, int] = {}
    for fields in _each(client, "hgetall", KeyLayout(prefix, shards).stats_keys()):
        for k, v in fields.items():
            totals[_text(k)] = totals.get(_text(k), 0) + int(v)
    return totals


def read_samples(client: redis.Redis, prefix: str, name: str, shards: int = 0) -> list[int]:
    """The timing samples ``name``: the list, or in the cluster layout every group's."""
    keys = KeyLayout(prefix, shards).samples_keys(name)
    return [int(v) for values in _each(client, "lrange", keys, 0, -1) for v in values]


def _each(client: redis.Redis, command: str, keys: tuple[str, ...], *args: object) -> list[Any]:
    """``command`` on each of ``keys``: one call for one key, else one pipeline (grouped by
    node on a cluster)."""
    if len(keys) == 1:
        return [getattr(client, command)(keys[0], *args)]
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            getattr(pipe, command)(key, *args)
        return pipe.execute()


def wait_for_task_starts(
    client: redis.Redis,
    prefix: str,
    count: int,
    timeout_s: float,
    alive: Callable[[], bool] = lambda: True,
    poll_s: float = 0.2,
) -> bool:
    """Until the job has counted ``count`` source subtask starts (``task_starts``, counted as
    its decode operator opens): whether they came within ``timeout_s`` while ``alive()``
    held. Replays and measurements wait for it so they time the running job, not its
    start-up."""
    deadline = time.monotonic() + timeout_s
    while read_stats(client, prefix).get("task_starts", 0) < count:
        if not alive() or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def events_accounted(stats: dict[str, int]) -> int:
    return sum(stats.get(name, 0) for name in EVENT_OUTCOMES)


def prompts_settled(stats: dict[str, int]) -> int:
    return sum(stats.get(name, 0) for name in PROMPT_OUTCOMES)


def is_settled(stats: dict[str, int], events_produced: int) -> bool:
    """Every produced event has an outcome and every prompt sent has finished."""
    return (
        stats.get("events_in", 0) >= events_produced
        and events_accounted(stats) == stats.get("events_in", 0)
        and prompts_settled(stats) == stats.get("prompts_sent", 0)
    )


@dataclass(frozen=True)
class IntentRow:
    shopper_id: str
    top_label: str
    summary: str
    event_time_ms: int
    written_at_ms: int
    intent: dict[str, Any]

    @property
    def latency_ms(self) -> int:
        return self.written_at_ms - self.event_time_ms


def read_intents(
    client: redis.Redis,
    prefix: str,
    shopper_ids: Iterable[str] | None = None,
    shards: int = 0,
) -> list[IntentRow]:
    """The intents of ``shopper_ids``, or of every shopper (a ``SCAN``, of every primary on
    a cluster), under the layout of ``shards`` slot groups (0: single node)."""
    layout = KeyLayout(prefix, shards)
    if shopper_ids is None:
        keys = client.scan_iter(match=layout.intent_pattern(), count=1000)
        ids = [s for s in map(layout.shopper_id, keys) if s is not None]
    else:
        ids = list(shopper_ids)
    pipe = client.pipeline(transaction=False)
    for shopper_id in ids:
        pipe.hgetall(layout.intent_key(shopper_id))
    rows = []
    for shopper_id, fields in zip(ids, pipe.execute(), strict=True):
        if not fields:
            continue
        f = {_text(k): _text(v) for k, v in fields.items()}
        rows.append(
            IntentRow(
                shopper_id=shopper_id,
                top_label=f.get("top_label", ""),
                summary=f.get("summary", ""),
                event_time_ms=int(f.get("event_time_ms", 0)),
                written_at_ms=int(f.get("written_at_ms", 0)),
                intent=orjson.loads(f["intent"]) if "intent" in f else {},
            )
        )
    return rows


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(values_ms: list[int]) -> dict[str, float]:
    """How many samples, and their p50, p90, p99 and max in seconds."""
    seconds = [v / 1000 for v in values_ms]
    summary: dict[str, float] = {"n": len(seconds)}
    for q in (50, 90, 99):
        summary[f"p{q}"] = round(percentile(seconds, q), 2)
    summary["max"] = round(max(seconds), 2) if seconds else math.nan
    return summary


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: float
    hits: float
    prompt_tokens: float
    requests: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.queries if self.queries else math.nan


def read_vllm_totals(worker_urls: Iterable[str], names: Iterable[str]) -> dict[str, float]:
    """Each of vLLM's counters ``names`` (``vllm:...``), summed over the workers."""
    totals = dict.fromkeys(names, 0.0)
    for url in worker_urls:
        text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=5.0).text
        for family in text_string_to_metric_families(text):
            if family.name in totals:
                totals[family.name] += sum(
                    s.value for s in family.samples if s.name.endswith("_total")
                )
    return totals


def read_prefix_cache(worker_urls: Iterable[str]) -> PrefixCacheStats:
    """Sum vLLM's own prefix-cache counters (in tokens) over the workers."""
    totals = read_vllm_totals(
        worker_urls,
        (
            "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits",
            "vllm:prompt_tokens",
            "vllm:request_success",
        ),
    )
    return PrefixCacheStats(
        totals["vllm:prefix_cache_queries"],
        totals["vllm:prefix_cache_hits"],
        totals["vllm:prompt_tokens"],
        totals["vllm:request_success"],
    )


def read_dead_letters(
    bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Read the dead-letter topic from the start until ``expected`` records or the timeout."""
    return read_json_topic(bootstrap, topic, expected, timeout_s)


def read_json_topic(
    bootstrap: str, topic: str, expected: int | None = None, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Read a topic of JSON records from the start until ``expected`` records (None: until
    the end of every partition) or the timeout."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"topic-reader-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        records: list[dict[str, Any]] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if expected is not None and len(records) >= expected:
                break
            if expected is None and at_end >= set(partitions):
                break
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            # Consumed records and end-of-partition events always name their partition.
            partition = cast(int, msg.partition())
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    at_end.add(partition)
                continue
            at_end.discard(partition)
            records.append(orjson.loads(cast(bytes, msg.value())))  # JSON topics: no tombstones
        return records
    finally:
        consumer.close()


def group_progress(bootstrap: str, group_id: str, topic: str) -> tuple[int, int]:
    """(records of ``topic`` that ``group_id`` has committed, records in ``topic``), over
    every partition; a partition it never committed counts as none. The job commits at each
    completed checkpoint or savepoint."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": group_id, "enable.auto.commit": False}
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        committed, total = 0, 0
        for position in consumer.committed(
            [TopicPartition(topic, p) for p in partitions], timeout=10
        ):
            low, end = partition_span(bootstrap, topic, position.partition)
            committed += max(position.offset, low) - low
            total += end - low
        return committed, total
    finally:
        consumer.close()


def partition_span(bootstrap: str, topic: str, partition: int) -> tuple[int, int]:
    """(first offset, offset after the last record) of one partition.

    The end is read from the records themselves: the last batch is fetched from the
    broker's high watermark back by one. A Kafka broker's high watermark is already the
    end; the embedded test broker (Tansu) reports the last batch's first offset plus one,
    so after a write of several records in one request, the high watermark alone would put
    the end before records a consumer has read (and committed), and a lag computed from it
    would never reach 0."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"span-reader-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        low, high = reader.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        if high <= low:
            return low, high
        reader.assign([TopicPartition(topic, partition, high - 1)])
        end = high
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            msg = reader.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    break
                continue
            end = max(end, cast(int, msg.offset()) + 1)  # a consumed record has its offset
        return low, end
    finally:
        reader.close()


def group_lag(bootstrap: str, group_id: str, topic: str) -> int:
    """Records of ``topic`` past what ``group_id`` has committed. 0 means a checkpoint
    covers every record: unlike ``events_in``, which a killed job under-counts by what it
    had not yet flushed, this survives a restart."""
    committed, total = group_progress(bootstrap, group_id, topic)
    return total - committed


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
