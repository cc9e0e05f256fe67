"""Outcome counters published to one Redis hash: counted in memory, added with HINCRBY on
flush (by a background thread and on close), and never lost while Redis is away. Here the
key; the behaviour against a real Redis is in ``tests/service/test_stats.py``."""

from __future__ import annotations

from flink_jobs.runtime.counters import stats_key


class TestKey:
    def test_stats_live_in_one_hash_under_the_prefix(self) -> None:
        assert stats_key("si") == "si:stats"
