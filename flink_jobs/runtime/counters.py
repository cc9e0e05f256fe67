"""Per-operator outcome counters, published to one Redis hash for the operator's console.

Flink metrics (which the operators also report) reach Managed Flink's CloudWatch, but a
local run and its tests need the same numbers without a metrics backend. Each operator
counts in memory and a daemon thread adds the deltas to ``{prefix}:stats`` with HINCRBY
about once a second, and once more when the operator closes. The hash is what the demo's
progress line and the integration test's accounting read:

    events_in = events_accepted + events_late_folded + events_duplicate
              + events_late_dropped + events_held_overflow + dead_letter_decode

Timings (LLM latency, event-to-intent latency) are kept as samples: the newest
``MAX_SAMPLES`` values of each in a list at ``{prefix}:samples:<name>``, for percentiles.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import redis

log = logging.getLogger(__name__)


MAX_SAMPLES = 10_000


def stats_key(prefix: str) -> str:
    return f"{prefix}:stats"


def samples_key(prefix: str, name: str) -> str:
    return f"{prefix}:samples:{name}"


class StatsReporter:
    def __init__(self, redis_url: str, prefix: str, flush_interval_s: float) -> None:
        self._key = stats_key(prefix)
        self._prefix = prefix
        self._samples: dict[str, list[int]] = {}
        self._client = redis.Redis.from_url(redis_url, socket_timeout=5)
        self._interval = flush_interval_s
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-flusher", daemon=True)
        self._thread.start()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._pending[name] += amount

    def sample(self, name: str, value: int) -> None:
        with self._lock:
            values = self._samples.setdefault(name, [])
            if len(values) < MAX_SAMPLES:
                values.append(value)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, Counter()
            samples, self._samples = self._samples, {}
        if not pending and not samples:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, amount in pending.items():
                pipe.hincrby(self._key, name, amount)
            for name, values in samples.items():
                key = samples_key(self._prefix, name)
                pipe.rpush(key, *values)
                pipe.ltrim(key, -MAX_SAMPLES, -1)
            pipe.execute()
        except redis.RedisError as exc:
            # Put the deltas back: counts are retried, never lost, while Redis is away.
            # (Timing samples are best effort and dropped.)
            log.warning("could not publish stats to Redis (%s); will retry", exc)
            with self._lock:
                self._pending.update(pending)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval * 2 + 1)
        self.flush()
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()
