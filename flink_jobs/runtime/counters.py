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

A flush is applied exactly once. Redis may apply a batch and then go away before its
reply arrives (a restart, a dropped connection); a client that sent the batch again would
count it twice, and the accounting above would no longer balance. So each reporter numbers
its batches, and a Lua script adds a batch only if its number is above the last one this
reporter applied (kept in ``{prefix}:stats:flushes``); a batch that failed is sent again
unchanged, under the same number, until Redis answers.

On Redis Cluster (``redis.cluster``) the keys follow the cluster layout
(``intent_reader.layout.KeyLayout``): each reporter writes the stats hash, ledger and
samples lists of one slot group, picked by its id (``{prefix}:stats:{s<n>}``,
``{prefix}:stats:flushes:{s<n>}``, ``{prefix}:samples:<name>:{s<n>}``), so the hash and its
ledger share the slot the script needs, and the operators' instances spread their flushes
over the primaries instead of all writing one hot key. Readers sum the hashes and
concatenate the lists (``flink_jobs.tools.run_summary``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter

import redis

from intent_reader.clients import sync_client
from intent_reader.layout import DEFAULT_CLUSTER_SHARDS, KeyLayout

log = logging.getLogger(__name__)


#: The newest samples each list keeps (each of a cluster's, one per slot group).
MAX_SAMPLES = 10_000


def stats_key(prefix: str) -> str:
    """The stats hash of the single-node layout."""
    return KeyLayout(prefix).stats_key()


def samples_key(prefix: str, name: str) -> str:
    """A samples list of the single-node layout."""
    return KeyLayout(prefix).samples_key(name)


def flushes_key(prefix: str) -> str:
    """The ledger of the single-node layout."""
    return KeyLayout(prefix).flushes_key()


#: KEYS: the stats hash, the flushes hash. ARGV: reporter id, batch number, then name and
#: amount pairs. Adds the batch unless this reporter's batch of that number was applied.
APPLY_BATCH = """
local applied = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local seq = tonumber(ARGV[2])
if seq <= applied then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[2], ARGV[1], seq)
return 1
"""


class StatsReporter:
    """One operator instance's counters, flushed to Redis by a daemon thread; ``cluster``
    makes its client a cluster client and its keys those of one of ``shards`` slot groups."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        flush_interval_s: float,
        *,
        cluster: bool = False,
        shards: int = DEFAULT_CLUSTER_SHARDS,
    ) -> None:
        self._id = uuid.uuid4().hex
        self._layout = KeyLayout(prefix, shards if cluster else 0)
        self._group = self._layout.shard_of(self._id)
        self._keys = [self._layout.stats_key(self._group), self._layout.flushes_key(self._group)]
        self._samples: dict[str, list[int]] = {}
        self._client = sync_client(redis_url, cluster=cluster, socket_timeout=5)
        # redis-py types register_script for its single-node clients only; a cluster
        # client has it too (a script object that runs by EVALSHA on the key's node).
        self._apply = self._client.register_script(APPLY_BATCH)  # type: ignore[misc]
        self._interval = flush_interval_s
        self._pending: Counter[str] = Counter()
        self._unacked: tuple[int, Counter[str]] | None = None
        """The batch sent and not yet acknowledged, with its number: sent again as it is."""
        self._seq = 0
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # the flusher thread and close()
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
        with self._flushing:
            # Twice at most: a batch an outage held back, then what was counted meanwhile
            # (close() flushes once, and must publish both).
            for _ in range(2):
                if not self._send_batch():
                    return

    def _send_batch(self) -> bool:
        """Send the unacknowledged batch, or make one of what is pending, with the samples;
        True when it was acknowledged and more is pending."""
        with self._lock:
            if self._unacked is None and self._pending:
                self._seq += 1
                self._unacked, self._pending = (self._seq, self._pending), Counter()
            samples, self._samples = self._samples, {}
        if self._unacked is None and not samples:
            return False
        try:
            pipe = self._client.pipeline(transaction=False)
            batch_args: list[object] = []
            if self._unacked is not None:
                seq, batch = self._unacked
                args = [self._id, seq, *(x for item in batch.items() for x in item)]
                # The raw command: a cluster pipeline has no evalsha method.
                batch_args = [self._apply.sha, len(self._keys), *self._keys, *args]
                pipe.execute_command("EVALSHA", *batch_args)
            for name, values in samples.items():
                key = self._layout.samples_key(name, self._group)
                pipe.rpush(key, *values)
                pipe.ltrim(key, -MAX_SAMPLES, -1)
            replies = pipe.execute(raise_on_error=False)
            if batch_args and isinstance(replies[0], redis.exceptions.NoScriptError):
                # The server lost the script (a restart, a promoted replica): load it and
                # send the batch again, which its number keeps from being counted twice.
                self._client.script_load(APPLY_BATCH)
                replies[0] = self._client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", *batch_args
                )  # the cluster client's execute_command is untyped in redis-py
            failed = next((r for r in replies if isinstance(r, Exception)), None)
            if failed is not None:
                raise failed
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            # The batch stays unacknowledged and is sent again, under its number, on the
            # next flush: counts are never lost nor added twice while Redis is away.
            # (Timing samples are best effort and dropped.)
            log.warning("could not publish stats to Redis (%s); will retry", exc)
            return False
        self._unacked = None
        with self._lock:
            return bool(self._pending)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval * 2 + 1)
        self.flush()
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()
