"""Replay event files into a Kafka topic, and record a topic to a file.

Replay, in order:

1. read the input: JSON Lines (one record per line, bytes kept exactly), CSV with the event
   fields as columns (``product_id`` or ``product.product_id`` and so on; empty cells are
   left out), or a recording made by ``record`` (key, value bytes and timestamp kept);
2. plan it with :func:`plan_replay`, a pure function: the key is the event's ``shopper_id``
   (no key when the record can't be parsed: bad records are sent unchanged, for the
   pipeline to dead-letter), the Kafka timestamp is the event time (a record without one
   takes its predecessor's), and each record gets the offset in seconds at which it is due:
   as fast as possible, ``speed`` (event-time gaps divided by the factor) or ``rate``
   (a fixed number of records per second). Rebasing moves the times: by one delta so the
   first event (or the last) is "now", or onto the send times of a paced replay; it
   rewrites ``event_time`` inside schema-valid records only, nothing else in any record;
3. send the plan in file order with an idempotent producer (one partition's order is the
   file's order), reporting progress; delivery errors are counted, never raised.

Record: assign every partition of the topic from the beginning, read until no record has
come for ``idle_s`` seconds, and write the records merged across partitions by timestamp
(each partition's own order kept) as a recording.

The recording format (JSON Lines): a header line
``{"format": "shopper-intents-recording/1", "topic": ..., "records": N}`` then one line per
record ``{"partition", "offset", "timestamp_ms", "key", "value"}`` with key and value in
base64 (key null when the record had none).

CLI::

    python -m flink_jobs.tools.replay replay data/sample_sessions.jsonl \\
        --bootstrap 127.0.0.1:9092 --topic shopper-events [--speed 10 | --rate 200] \\
        [--rebase-time [first|last|send]]
    python -m flink_jobs.tools.replay record --bootstrap 127.0.0.1:9092 --topic shopper-events \\
        --out recording.jsonl [--idle-timeout 5]

``--metrics-port N`` serves the replay's Prometheus metrics (:class:`ReplayMetrics`: records
planned, produced, sent, failed by error, bytes sent) on ``http://<--metrics-host>:N/metrics``
while it runs, and ``--metrics-linger S`` seconds after, for a last scrape.

``-X KEY=VALUE`` (repeatable, both commands) passes a librdkafka client property, for a
broker with TLS or SASL: ``-X security.protocol=SASL_SSL -X sasl.mechanism=SCRAM-SHA-512
-X sasl.username=U -X sasl.password=P`` (librdkafka's names, not the Java client's
``sasl.jaas.config``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import functools
import heapq
import io
import logging
import os
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import orjson

from flink_jobs.core.events import parse_event_time
from flink_jobs.paths import resource_dir

__all__ = [
    "RECORDING_FORMAT",
    "InputFormatError",
    "PlannedSend",
    "RecordSummary",
    "ReplayCounts",
    "ReplayError",
    "ReplayMetrics",
    "ReplayProgress",
    "ReplaySummary",
    "SourceRecord",
    "event_time_ms",
    "main",
    "parse_csv",
    "parse_jsonl",
    "parse_recording",
    "plan_replay",
    "read_records",
    "record_topic",
    "replay_records",
    "shopper_key",
    "write_recording",
]

log = logging.getLogger(__name__)

RECORDING_FORMAT = "shopper-intents-recording/1"
SCHEMA_PATH = resource_dir("schemas") / "shopper_event.schema.json"
#: Records bigger than this are never rewritten by rebasing (the pipeline refuses them anyway).
DEFAULT_MAX_RECORD_BYTES = 64 * 1024
MAX_EPOCH_MS = 32_503_680_000_000  #: year 3000, the schema's bound

RebaseAnchor = Literal["first", "last", "send"]


class ReplayError(Exception):
    """Base error of the replay tool."""


class InputFormatError(ReplayError):
    """An input file can't be read as the format it claims; says which file and line."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


# --- records and plans -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """One record to replay. From event files only ``value`` is set and key and timestamp
    are derived from it; from a recording (``recorded=True``) key and timestamp are kept."""

    value: bytes
    key: bytes | None = None
    timestamp_ms: int | None = None
    recorded: bool = False
    partition: int | None = None
    offset: int | None = None


class PlannedSend(NamedTuple):
    send_at_s: float  #: seconds after the replay starts
    key: bytes | None
    value: bytes
    timestamp_ms: int | None  #: Kafka record timestamp; None: the producer's clock


def shopper_key(value: bytes) -> bytes | None:
    """The Kafka key of an event: its ``shopper_id`` as UTF-8, or None when unparseable."""
    return _key_of(_parse_object(value))


def event_time_ms(value: Any) -> int | None:
    """Epoch ms from an ``event_time`` value: RFC 3339 with an offset, or epoch ms."""
    if isinstance(value, str) and (len(value) > 40 or "T" not in value.upper()):
        return None
    ms = parse_event_time(value)
    return ms if ms is not None and 0 <= ms <= MAX_EPOCH_MS else None


def format_rfc3339_ms(epoch_ms: int) -> str:
    """``2026-06-01T09:00:00.123Z``."""
    seconds, millis = divmod(epoch_ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def plan_replay(
    records: Sequence[SourceRecord | bytes],
    *,
    speed: float | None = None,
    rate: float | None = None,
    rebase_to_ms: int | None = None,
    rebase_anchor: RebaseAnchor = "first",
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    is_valid: Callable[[dict[str, Any]], bool] | None = None,
) -> list[PlannedSend]:
    """Decide key, value, timestamp and due time of every record, in input order.

    ``speed`` and ``rate`` exclude each other; with neither, every record is due at 0.
    With ``speed``, a record is due at (its time - the first time) / speed, never before
    its predecessor (out-of-order events go right after it).

    ``rebase_to_ms`` moves the times. Anchors "first" and "last" shift all of them by one
    delta so that the first event in the file, or the latest one, lands on it. Anchor
    "send" (needs ``speed`` or ``rate``) maps each record's time to ``rebase_to_ms`` plus
    its due offset, so event time follows the wall clock of a sped-up replay: with
    ``speed``, gaps shrink by the factor (and out-of-order events stay out of order); with
    ``rate``, each record's time is its send time. ``event_time`` is rewritten only in
    records that ``is_valid`` (default: the event schema) accepts and that are within
    ``max_record_bytes``; the Kafka timestamp is moved for every record.
    """
    if speed is not None and rate is not None:
        raise ValueError("give speed or rate, not both")
    if speed is not None and not speed > 0:
        raise ValueError(f"speed must be > 0 (got {speed})")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 (got {rate})")
    if rebase_anchor not in ("first", "last", "send"):
        raise ValueError(f"rebase_anchor must be first, last or send (got {rebase_anchor!r})")
    if rebase_anchor == "send" and rebase_to_ms is not None and speed is None and rate is None:
        raise ValueError("rebasing to the send time needs speed or rate")
    is_valid = is_valid or _schema_valid

    sources = [r if isinstance(r, SourceRecord) else SourceRecord(r) for r in records]
    docs = [_parse_object(s.value) for s in sources]
    keys = [s.key if s.recorded else _key_of(doc) for s, doc in zip(sources, docs, strict=True)]
    own_times = [
        s.timestamp_ms if s.recorded else (event_time_ms(doc.get("event_time")) if doc else None)
        for s, doc in zip(sources, docs, strict=True)
    ]
    times = _fill_gaps(own_times)

    first_time = next((t for t in times if t is not None), None)
    shift = _time_shift(own_times, rebase_to_ms, rebase_anchor, speed, rate)

    plan: list[PlannedSend] = []
    due = 0.0
    for i, source in enumerate(sources):
        timestamp = times[i]
        if rate is not None:
            due = i / rate
        elif speed is not None and timestamp is not None and first_time is not None:
            due = max(due, (timestamp - first_time) / 1000.0 / speed)
        value = source.value
        if shift is not None:
            shift_this = functools.partial(shift, i)
            value = _rebased_value(source.value, docs[i], shift_this, max_record_bytes, is_valid)
            timestamp = shift_this(timestamp) if timestamp is not None else None
        if timestamp is not None and timestamp < 0:
            timestamp = None
        plan.append(PlannedSend(due, keys[i], value, timestamp))
    return plan


def _time_shift(
    own_times: list[int | None],
    rebase_to_ms: int | None,
    anchor: RebaseAnchor,
    speed: float | None,
    rate: float | None,
) -> Callable[[int, int], int] | None:
    """(record index, its time in ms) -> its rebased time, or None when nothing moves."""
    known = [t for t in own_times if t is not None]
    if rebase_to_ms is None or not known:
        return None
    if anchor == "send":
        if rate is not None:
            return lambda i, t: rebase_to_ms + round(i * 1000 / rate)
        assert speed is not None
        return lambda i, t: rebase_to_ms + round((t - known[0]) / speed)
    delta = rebase_to_ms - (known[0] if anchor == "first" else max(known))
    return lambda i, t: t + delta


def _parse_object(value: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _key_of(doc: dict[str, Any] | None) -> bytes | None:
    shopper_id = doc.get("shopper_id") if doc is not None else None
    return shopper_id.encode() if isinstance(shopper_id, str) and shopper_id else None


def _fill_gaps(times: list[int | None]) -> list[int | None]:
    """A record without a time takes its predecessor's (the first known one at the start),
    so unparseable records never jump the Kafka timestamps, and so the watermark, around."""
    filled: list[int | None] = []
    previous = next((t for t in times if t is not None), None)
    for t in times:
        previous = t if t is not None else previous
        filled.append(previous)
    return filled


@functools.cache
def _schema_validator() -> Callable[[Any], Any]:
    import fastjsonschema

    return fastjsonschema.compile(orjson.loads(SCHEMA_PATH.read_bytes()))


def _schema_valid(doc: dict[str, Any]) -> bool:
    import fastjsonschema

    try:
        _schema_validator()(doc)
    except fastjsonschema.JsonSchemaValueException:
        return False
    return True


_EVENT_TIME_TOKEN = re.compile(rb'"event_time"\s*:\s*("(?:[^"\\]|\\.)*"|-?[0-9]+)')


def _rebased_value(
    value: bytes,
    doc: dict[str, Any] | None,
    shift: Callable[[int], int],
    max_record_bytes: int,
    is_valid: Callable[[dict[str, Any]], bool],
) -> bytes:
    """The record with ``event_time`` moved by ``shift``, everything else byte for byte;
    the record unchanged when it is not a valid event."""
    if doc is None or len(value) > max_record_bytes or not is_valid(doc):
        return value
    old = doc["event_time"]
    old_ms = event_time_ms(old)
    new_ms = shift(old_ms) if old_ms is not None else -1
    if new_ms < 0 or new_ms == old_ms:
        return value
    new: str | int = new_ms if isinstance(old, int) else format_rfc3339_ms(new_ms)
    wanted = {**doc, "event_time": new}
    matches = [m for m in _EVENT_TIME_TOKEN.finditer(value) if orjson.loads(m.group(1)) == old]
    if len(matches) == 1:
        start, end = matches[0].span(1)
        candidate = value[:start] + orjson.dumps(new) + value[end:]
        if orjson.loads(candidate) == wanted:
            return candidate
    log.debug("event_time not found as one token; re-serializing the record")
    return orjson.dumps(wanted)


# --- reading and writing files -----------------------------------------------------------------

InputFormat = Literal["auto", "jsonl", "csv", "recording"]

#: CSV columns that belong inside "product" and the types of non-string fields.
_PRODUCT_COLUMNS = ("product_id", "title", "category", "brand", "price")


def read_records(path: Path | str, fmt: InputFormat = "auto") -> list[SourceRecord]:
    """Records of a JSONL, CSV or recording file, in file order."""
    path = Path(path)
    data = path.read_bytes()
    if fmt == "auto":
        fmt = _detect_format(path, data)
    log.debug("reading %s as %s", path, fmt)
    if fmt == "jsonl":
        return parse_jsonl(data)
    if fmt == "csv":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputFormatError(
                str(path), 0, f"CSV must be UTF-8 ({exc.reason} at byte {exc.start})"
            ) from exc
        return parse_csv(text, source=str(path))
    if fmt == "recording":
        return parse_recording(data, source=str(path))
    raise ValueError(f"unknown input format {fmt!r}")


def _detect_format(path: Path, data: bytes) -> InputFormat:
    if path.suffix.lower() == ".csv":
        return "csv"
    first_line = data.split(b"\n", 1)[0]
    header = _parse_object(first_line)
    if header is not None and str(header.get("format", "")).startswith(
        "shopper-intents-recording/"
    ):
        return "recording"
    return "jsonl"


def parse_jsonl(data: bytes) -> list[SourceRecord]:
    """One record per line, bytes unchanged (a CRLF line ending is dropped; blank lines are
    skipped)."""
    records = []
    for line in data.split(b"\n"):
        line = line.removesuffix(b"\r")
        if line.strip():
            records.append(SourceRecord(line))
    return records


def parse_csv(text: str, source: str = "<csv>") -> list[SourceRecord]:
    """Rows to JSON events: product columns nest under ``product``, ``price`` becomes a
    number, ``quantity`` and an all-digit ``event_time`` integers; a value that does not
    convert is kept as text (so a bad row stays bad); empty cells are left out; unknown
    columns are kept as top-level fields."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if not reader.fieldnames or "event_id" not in [n.strip() for n in reader.fieldnames]:
        raise InputFormatError(source, 1, "CSV needs a header row with at least event_id")
    records = []
    for row in reader:
        if None in row:
            raise InputFormatError(source, reader.line_num, "row has more cells than the header")
        doc: dict[str, Any] = {}
        product: dict[str, Any] = {}
        for raw_name, cell in row.items():
            name = raw_name.strip()
            if cell is None or cell == "":
                continue
            short = name.removeprefix("product.")
            if name.startswith("product.") or name in _PRODUCT_COLUMNS:
                product[short] = _number(cell, float) if short == "price" else cell
            elif name == "quantity":
                doc[name] = _number(cell, int)
            elif name == "event_time":
                doc[name] = int(cell) if cell.isdigit() else cell
            else:
                doc[name] = cell
        if product:
            doc["product"] = product
        records.append(SourceRecord(orjson.dumps(doc)))
    return records


def _number(cell: str, kind: type[int] | type[float]) -> Any:
    try:
        number = kind(cell)
    except ValueError:
        return cell
    if (
        isinstance(number, float)
        and number.is_integer()
        and "." not in cell
        and "e" not in cell.lower()
    ):
        return int(number)
    return number


def parse_recording(data: bytes, source: str = "<recording>") -> list[SourceRecord]:
    lines = [line for line in data.split(b"\n") if line.strip()]
    if not lines:
        raise InputFormatError(source, 1, "empty recording (no header line)")
    header = _parse_object(lines[0])
    if header is None or header.get("format") != RECORDING_FORMAT:
        raise InputFormatError(
            source, 1, f"not a recording: the first line must have format {RECORDING_FORMAT!r}"
        )
    records = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            doc = orjson.loads(line)
            key = (
                base64.b64decode(doc["key"], validate=True) if doc.get("key") is not None else None
            )
            records.append(
                SourceRecord(
                    value=base64.b64decode(doc["value"], validate=True),
                    key=key,
                    timestamp_ms=doc.get("timestamp_ms"),
                    recorded=True,
                    partition=doc.get("partition"),
                    offset=doc.get("offset"),
                )
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InputFormatError(source, number, f"bad recording line: {exc}") from exc
    if isinstance(header.get("records"), int) and header["records"] != len(records):
        raise InputFormatError(
            source,
            1,
            f"header says {header['records']} records, the file has {len(records)} (truncated?)",
        )
    return records


def write_recording(path: Path | str, topic: str, records: Sequence[SourceRecord]) -> None:
    def b64(data: bytes | None) -> str | None:
        return None if data is None else base64.b64encode(data).decode("ascii")

    lines = [orjson.dumps({"format": RECORDING_FORMAT, "topic": topic, "records": len(records)})]
    lines.extend(
        orjson.dumps(
            {
                "partition": r.partition,
                "offset": r.offset,
                "timestamp_ms": r.timestamp_ms,
                "key": b64(r.key),
                "value": b64(r.value),
            }
        )
        for r in records
    )
    Path(path).write_bytes(b"\n".join(lines) + b"\n")


# --- talking to Kafka ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    total: int
    produced: int  #: handed to the producer
    sent: int  #: acknowledged by the broker
    failed: int
    bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class ReplaySummary:
    records: int
    sent: int
    failed: int
    bytes: int  #: value bytes of the acknowledged records
    elapsed_s: float
    errors: Mapping[str, int] = field(default_factory=dict)  #: Kafka error name -> count
    first_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.sent == self.records

    def describe(self, topic: str) -> str:
        rate = self.sent / self.elapsed_s if self.elapsed_s > 0 else float("inf")
        text = (
            f"replayed {self.records} records to {topic}: sent {self.sent}, failed {self.failed}, "
            f"{self.bytes:,} bytes in {self.elapsed_s:.1f} s ({rate:,.0f} records/s)"
        )
        if self.errors:
            text += "; errors: " + ", ".join(
                f"{name} x{n}" for name, n in sorted(self.errors.items())
            )
            text += f"; first: {self.first_error}"
        return text


class ReplayMetrics:
    """Prometheus metrics of a replay, in a registry of their own (names start with
    ``shopper_intents_replay_``). Counters only grow, so several replays served by one
    process add up; ``records_planned`` is the last replay's plan."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.planned = Gauge(
            "shopper_intents_replay_records_planned", "Records in the replay plan.", registry=r
        )
        self.produced = Counter(
            "shopper_intents_replay_records_produced",
            "Records handed to the Kafka producer.",
            registry=r,
        )
        self.sent = Counter(
            "shopper_intents_replay_records_sent",
            "Records acknowledged by the broker.",
            registry=r,
        )
        self.failed = Counter(
            "shopper_intents_replay_records_failed",
            "Records not delivered, by Kafka error name (or LOCAL_QUEUE_FULL, "
            "NOT_DELIVERED_BEFORE_FLUSH_TIMEOUT).",
            ["error"],
            registry=r,
        )
        self.bytes_sent = Counter(
            "shopper_intents_replay_bytes_sent",
            "Value bytes of the acknowledged records.",
            registry=r,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve ``/metrics`` from a daemon thread; returns the server (``shutdown()`` it)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


def producer_config(bootstrap: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        # Idempotence keeps each partition in file order across retries.
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        # The Java client's partitioner, so keys land where a JVM producer would put them.
        "partitioner": "murmur2_random",
        "message.timeout.ms": 30_000,
        **(extra or {}),
    }


@dataclass
class ReplayCounts:
    """What a replay has done so far, counted in one place by the send loop and by the
    producer's delivery callbacks (both on the replay's thread: the callbacks run inside
    ``poll`` and ``flush``), and mirrored into ``metrics`` when given."""

    metrics: ReplayMetrics | None = None
    produced: int = 0  #: handed to the producer, failed or not
    sent: int = 0  #: acknowledged by the broker
    failed: int = 0
    sent_bytes: int = 0
    errors: Counter[str] = field(default_factory=Counter)  #: Kafka error name -> count
    first_error: str | None = None

    def count_produced(self) -> None:
        self.produced += 1
        if self.metrics is not None:
            self.metrics.produced.inc()

    def count_failure(self, name: str, detail: str, amount: int = 1) -> None:
        self.failed += amount
        self.errors[name] += amount
        self.first_error = self.first_error or detail
        if self.metrics is not None:
            self.metrics.failed.labels(name).inc(amount)

    def on_delivery(self, err: Any, msg: Any) -> None:
        """The producer's delivery callback."""
        if err is not None:
            self.count_failure(err.name(), str(err))
            return
        size = len(msg.value() or b"")
        self.sent += 1
        self.sent_bytes += size
        if self.metrics is not None:
            self.metrics.sent.inc()
            self.metrics.bytes_sent.inc(size)

    def progress(self, total: int, elapsed_s: float) -> ReplayProgress:
        return ReplayProgress(
            total, self.produced, self.sent, self.failed, self.sent_bytes, elapsed_s
        )

    def summary(self, total: int, elapsed_s: float) -> ReplaySummary:
        return ReplaySummary(
            records=total,
            sent=self.sent,
            failed=self.failed,
            bytes=self.sent_bytes,
            elapsed_s=elapsed_s,
            errors=dict(self.errors),
            first_error=self.first_error,
        )


class _ProgressReports:
    """Hands ``callback`` the replay's progress at most every ``interval_s`` seconds (and
    whenever forced); ``start`` is the replay clock's zero (``time.monotonic``)."""

    def __init__(
        self,
        callback: Callable[[ReplayProgress], None] | None,
        interval_s: float,
        start: float,
        total: int,
        counts: ReplayCounts,
    ) -> None:
        self._callback = callback
        self._interval_s = interval_s
        self._start = start
        self._last = start
        self._total = total
        self._counts = counts

    def __call__(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._callback is not None and (force or now - self._last >= self._interval_s):
            self._last = now
            self._callback(self._counts.progress(self._total, now - self._start))


def replay_records(
    bootstrap: str,
    topic: str,
    records: Iterable[SourceRecord | bytes],
    speed: float | None = None,
    rate: float | None = None,
    rebase_time: bool | RebaseAnchor = False,
    progress: Callable[[ReplayProgress], None] | None = None,
    *,
    progress_interval_s: float = 0.5,
    flush_timeout_s: float = 30.0,
    extra_config: Mapping[str, Any] | None = None,
    metrics: ReplayMetrics | None = None,
    start_at_ms: int | None = None,
) -> ReplaySummary:
    """Send ``records`` to ``topic`` as planned by :func:`plan_replay`; never raises on
    delivery errors (they are counted in the summary, and in ``metrics`` when given).

    ``rebase_time``: True or "first" puts the first event at now, "last" the latest one,
    "send" makes each event's time its send time (with ``speed`` or ``rate``); see
    :func:`plan_replay`. With "first" and a speed above 1 (or rate, or no pacing), later
    events are stamped ahead of the wall clock.

    ``start_at_ms``: the wall-clock time at which the first record is due (default: when
    sending starts; with "send", the time the records were stamped with), for records
    already stamped with the times they should be sent at.
    """
    from confluent_kafka import Producer

    anchor: RebaseAnchor = rebase_time if isinstance(rebase_time, str) else "first"
    producer = Producer(producer_config(bootstrap, extra_config))
    if anchor == "send" or start_at_ms is not None:
        _learn_leaders(producer, topic)
    now_ms = int(time.time() * 1000) if rebase_time else None
    plan = plan_replay(
        list(records), speed=speed, rate=rate, rebase_to_ms=now_ms, rebase_anchor=anchor
    )
    if metrics is not None:
        metrics.planned.set(len(plan))
    counts = ReplayCounts(metrics)
    start = _replay_clock_start(now_ms if anchor == "send" else start_at_ms)
    report = _ProgressReports(progress, progress_interval_s, start, len(plan), counts)
    try:
        _send_plan(producer, topic, plan, start, counts, report, flush_timeout_s)
    finally:
        undelivered = producer.flush(flush_timeout_s)
    if undelivered:
        counts.count_failure(
            "NOT_DELIVERED_BEFORE_FLUSH_TIMEOUT",
            f"{undelivered} records not delivered within {flush_timeout_s} s",
            undelivered,
        )
    report(force=True)
    summary = counts.summary(len(plan), time.monotonic() - start)
    log.info(summary.describe(topic))
    return summary


def _learn_leaders(producer: Any, topic: str) -> None:
    """Connect and learn the topic's leaders before the first send, which would otherwise
    wait up to a second for them and be that much later than its stamp."""
    from confluent_kafka import KafkaException

    with contextlib.suppress(KafkaException):
        producer.list_topics(topic, timeout=10)


def _replay_clock_start(due_from_ms: int | None) -> float:
    """The replay clock's zero on ``time.monotonic``: now, or the instant the records were
    stamped for (``due_from_ms``, wall clock), so that records already due go out at once
    and the planning's own time is not added to every due time."""
    start = time.monotonic()
    if due_from_ms is not None:
        start -= time.time() - due_from_ms / 1000
    return start


def _send_plan(
    producer: Any,
    topic: str,
    plan: Sequence[PlannedSend],
    start: float,
    counts: ReplayCounts,
    report: _ProgressReports,
    flush_timeout_s: float,
) -> None:
    """Each planned record at its due time, in plan order; deliveries are served while
    waiting."""
    for item in plan:
        due = start + item.send_at_s
        while (wait := due - time.monotonic()) > 0:
            producer.poll(min(wait, 0.05))
            report()
        _produce(producer, topic, item, counts, flush_timeout_s)
        counts.count_produced()
        producer.poll(0)
        report()


def _produce(
    producer: Any, topic: str, item: PlannedSend, counts: ReplayCounts, timeout_s: float
) -> None:
    """Hand one record to the producer. While its local queue is full, deliveries drain it
    for up to ``timeout_s``; a record that still finds no room, or that the producer
    refuses, is counted as failed, not raised."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            producer.produce(
                topic,
                value=item.value,
                key=item.key,
                timestamp=item.timestamp_ms or 0,
                on_delivery=counts.on_delivery,
            )
            return
        except BufferError:
            if time.monotonic() > deadline:
                counts.count_failure("LOCAL_QUEUE_FULL", "local producer queue stayed full")
                return
            producer.poll(0.1)
        except KafkaException as exc:
            name = exc.args[0].name() if exc.args else "KafkaException"
            counts.count_failure(name, str(exc))
            return


@dataclass(frozen=True)
class RecordSummary:
    records: list[SourceRecord]
    partitions: int
    elapsed_s: float
    stopped_by: str  #: idle | max_records | timeout


def record_topic(
    bootstrap: str,
    topic: str,
    *,
    idle_s: float = 5.0,
    max_records: int | None = None,
    timeout_s: float = 600.0,
    extra_config: Mapping[str, Any] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> RecordSummary:
    """Every record of ``topic`` from the beginning until none came for ``idle_s`` seconds
    (or ``max_records``, or ``timeout_s``), merged across partitions by timestamp with each
    partition's order kept. Uses no consumer group offsets and commits nothing."""
    from confluent_kafka import (
        OFFSET_BEGINNING,
        TIMESTAMP_NOT_AVAILABLE,
        Consumer,
        KafkaError,
        KafkaException,
        TopicPartition,
    )

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"shopper-intents-recorder-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            **(extra_config or {}),
        }
    )
    start = time.monotonic()
    by_partition: dict[int, list[SourceRecord]] = {}
    count = 0
    stopped_by = "idle"
    try:
        try:
            metadata = consumer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            raise ReplayError(f"can't read metadata of {topic!r} from {bootstrap}: {exc}") from exc
        topic_meta = metadata.topics.get(topic)
        if topic_meta is None or topic_meta.error is not None or not topic_meta.partitions:
            reason = topic_meta.error if topic_meta is not None else "not in metadata"
            raise ReplayError(f"topic {topic!r} is not available on {bootstrap}: {reason}")
        partitions = sorted(topic_meta.partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        last_record = time.monotonic()
        last_report = last_record
        while True:
            now = time.monotonic()
            if now - last_record >= idle_s:
                break
            if now - start >= timeout_s:
                stopped_by = "timeout"
                break
            if max_records is not None and count >= max_records:
                stopped_by = "max_records"
                break
            batch_size = 500 if max_records is None else max(1, min(500, max_records - count))
            for msg in consumer.consume(num_messages=batch_size, timeout=min(0.5, idle_s)):
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise ReplayError(f"reading {topic!r} failed: {error}")
                ts_type, ts = msg.timestamp()
                partition = cast(int, msg.partition())  # a consumed record names its partition
                by_partition.setdefault(partition, []).append(
                    SourceRecord(
                        value=msg.value() or b"",
                        key=msg.key(),
                        timestamp_ms=None if ts_type == TIMESTAMP_NOT_AVAILABLE else ts,
                        recorded=True,
                        partition=partition,
                        offset=msg.offset(),
                    )
                )
                count += 1
                last_record = time.monotonic()
            if progress is not None and time.monotonic() - last_report >= 0.5:
                last_report = time.monotonic()
                progress(count, last_report - start)
    finally:
        consumer.close()
    streams = [
        sorted(records, key=lambda r: r.offset or 0) for _, records in sorted(by_partition.items())
    ]
    merged = list(heapq.merge(*streams, key=lambda r: (r.timestamp_ms or 0, r.partition or 0)))
    if max_records is not None:
        merged = merged[:max_records]
    return RecordSummary(merged, len(partitions), time.monotonic() - start, stopped_by)


# --- the command line --------------------------------------------------------------------------


def _progress_printer(stream: Any) -> Callable[[ReplayProgress], None]:
    interactive = stream.isatty()
    last_line = 0.0

    def show(p: ReplayProgress) -> None:
        nonlocal last_line
        done = p.sent + p.failed
        fraction = done / p.total if p.total else 1.0
        bar = "#" * int(fraction * 30)
        rate = p.sent / p.elapsed_s if p.elapsed_s > 0 else 0.0
        line = (
            f"[{bar:<30}] {fraction:4.0%} {done}/{p.total} sent {p.sent} failed {p.failed} "
            f"{p.bytes / 1e6:.2f} MB {p.elapsed_s:.1f} s {rate:,.0f}/s"
        )
        if interactive:
            stream.write("\r" + line)
            if done == p.total:
                stream.write("\n")
        elif p.elapsed_s - last_line >= 5.0 or done == p.total:
            last_line = p.elapsed_s
            stream.write(line + "\n")
        stream.flush()

    return show


def _client_property(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` for ``-X``; the error never repeats the text (it may be a password)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError("expected KEY=VALUE (a librdkafka property)")
    return key.strip(), value


_CLIENT_PROPERTY_HELP = (
    "librdkafka client property, repeatable; e.g. -X security.protocol=SASL_SSL "
    "-X sasl.mechanism=SCRAM-SHA-512 -X sasl.username=U -X sasl.password=P"
)


def _build_parser() -> argparse.ArgumentParser:
    default_bootstrap = os.environ.get("SI_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    default_topic = os.environ.get("SI_KAFKA_EVENTS_TOPIC", "shopper-events")
    parser = argparse.ArgumentParser(
        prog="python -m flink_jobs.tools.replay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser("replay", help="send an event file to a topic")
    replay.add_argument("file", type=Path)
    replay.add_argument(
        "--bootstrap", default=default_bootstrap, help=f"default: {default_bootstrap}"
    )
    replay.add_argument("--topic", default=default_topic, help=f"default: {default_topic}")
    replay.add_argument(
        "-X", "--client-property", type=_client_property, action="append", default=[],
        metavar="KEY=VALUE", help=_CLIENT_PROPERTY_HELP,
    )  # fmt: skip
    replay.add_argument("--format", default="auto", choices=("auto", "jsonl", "csv", "recording"))
    timing = replay.add_mutually_exclusive_group()
    timing.add_argument("--speed", type=float, help="keep event-time gaps, divided by this factor")
    timing.add_argument("--rate", type=float, help="send at a fixed number of records per second")
    replay.add_argument(
        "--rebase-time",
        nargs="?",
        const="first",
        choices=("first", "last", "send"),
        help="move event times: the first event (default) or the last one lands on now, or "
        "each event's time becomes its send time (send: needs --speed or --rate)",
    )
    replay.add_argument("--limit", type=int, help="send only the first N records")
    replay.add_argument("--quiet", action="store_true", help="no progress line")
    replay.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port while replaying"
    )
    replay.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (0.0.0.0 in a container); default: 127.0.0.1",
    )
    replay.add_argument(
        "--metrics-linger",
        type=float,
        default=0.0,
        metavar="S",
        help="keep serving metrics this many seconds after the replay, for a last scrape",
    )

    record = commands.add_parser("record", help="write a topic's records to a file")
    record.add_argument(
        "--bootstrap", default=default_bootstrap, help=f"default: {default_bootstrap}"
    )
    record.add_argument("--topic", default=default_topic, help=f"default: {default_topic}")
    record.add_argument(
        "-X", "--client-property", type=_client_property, action="append", default=[],
        metavar="KEY=VALUE", help=_CLIENT_PROPERTY_HELP,
    )  # fmt: skip
    record.add_argument("--out", type=Path, required=True)
    record.add_argument(
        "--idle-timeout", type=float, default=5.0, help="stop after this many idle seconds"
    )
    record.add_argument("--max-records", type=int)
    record.add_argument(
        "--timeout", type=float, default=600.0, help="stop after this many seconds in all"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    if args.command == "replay":
        for name in ("speed", "rate"):
            if getattr(args, name) is not None and not getattr(args, name) > 0:
                parser.error(f"--{name} must be > 0")
        if args.rebase_time == "send" and args.speed is None and args.rate is None:
            parser.error("--rebase-time send needs --speed or --rate")
        try:
            records = read_records(args.file, args.format)
        except (OSError, ReplayError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.limit is not None:
            records = records[: args.limit]
        metrics = server = None
        if args.metrics_port is not None:
            metrics = ReplayMetrics()
            try:
                server = metrics.serve(args.metrics_port, args.metrics_host)
            except OSError as exc:
                print(
                    f"error: cannot serve metrics on port {args.metrics_port}: {exc}",
                    file=sys.stderr,
                )
                return 2
            print(
                f"metrics on http://{args.metrics_host}:{args.metrics_port}/metrics",
                file=sys.stderr,
            )
        try:
            summary = replay_records(
                args.bootstrap,
                args.topic,
                records,
                speed=args.speed,
                rate=args.rate,
                rebase_time=args.rebase_time or False,
                progress=None if args.quiet else _progress_printer(sys.stderr),
                metrics=metrics,
                extra_config=dict(args.client_property),
            )
            print(summary.describe(args.topic), file=sys.stderr)
            if server is not None and args.metrics_linger > 0:
                time.sleep(args.metrics_linger)
        finally:
            if server is not None:
                server.shutdown()
        return 0 if summary.ok else 1

    shown = [-1, 0.0]

    def show(count: int, elapsed: float) -> None:
        if count != shown[0] and elapsed - shown[1] >= 2.0:
            shown[:] = [count, elapsed]
            print(f"recorded {count} records ({elapsed:.1f} s)", file=sys.stderr)

    try:
        result = record_topic(
            args.bootstrap,
            args.topic,
            idle_s=args.idle_timeout,
            max_records=args.max_records,
            timeout_s=args.timeout,
            progress=show,
            extra_config=dict(args.client_property),
        )
    except ReplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_recording(args.out, args.topic, result.records)
    print(
        f"recorded {len(result.records)} records from {args.topic} "
        f"({result.partitions} partitions) to {args.out} in {result.elapsed_s:.1f} s "
        f"(stopped by {result.stopped_by})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
