"""Outlier ejection: who is taken out, when they come back, and who never is."""

from __future__ import annotations

import pytest

from inference_sidecar.health import (
    HealthConfig,
    PoolHealth,
    available,
    expire,
    new_pool_health,
    outlier_reason,
    probe,
    record,
)

W = ["a", "b", "c"]
CFG = HealthConfig(window=10, min_requests=4, base_ejection_s=5.0, max_ejection_s=20.0)


def feed(
    state: PoolHealth, worker: str, n: int, ok: bool, latency: float, now: float = 0.0
) -> tuple[PoolHealth, list[str]]:
    kinds: list[str] = []
    for _ in range(n):
        state, events = record(state, worker, ok, latency, now, CFG)
        kinds += [e.kind for e in events]
    return state, kinds


def warmed(latency: float = 0.2) -> PoolHealth:
    state = new_pool_health(W)
    for w in W:
        state, _ = feed(state, w, 5, True, latency)
    return state


class TestErrorRate:
    def test_erroring_worker_is_ejected(self) -> None:
        state = warmed()
        for _ in range(4):  # two failures per success: never 3 in a row
            state, _ = record(state, "a", False, 0.2, 0.0, CFG)
            state, _ = record(state, "a", False, 0.2, 0.0, CFG)
            state, _ = record(state, "a", True, 0.2, 0.0, CFG)
        assert "a" not in available(state)
        assert state.get("a").ejections == 1

    def test_everybody_erroring_ejects_nobody_on_rate(self) -> None:
        """A shared cause (bad requests, model overload) is not one worker's fault."""
        state = warmed()
        for _ in range(3):
            for w in W:
                state, _ = record(state, w, False, 0.2, 0.0, CFG)
                state, _ = record(state, w, True, 0.2, 0.0, CFG)
        assert available(state) == W

    def test_consecutive_failures_eject_quickly(self) -> None:
        state = new_pool_health(W)
        state, kinds = feed(state, "b", 3, False, 0.01)
        assert kinds == ["ejected"]
        assert outlier_reason(state, "a", CFG) is None

    def test_few_requests_are_not_judged(self) -> None:
        state = new_pool_health(W)
        state, _ = feed(state, "a", 2, False, 0.1)
        assert available(state) == W


class TestLatency:
    def test_slow_worker_is_ejected(self) -> None:
        state = warmed(0.2)
        state, kinds = feed(state, "c", 10, True, 3.0)
        assert kinds == ["ejected"]
        assert available(state) == ["a", "b"]

    def test_small_absolute_difference_is_tolerated(self) -> None:
        state = warmed(0.01)
        state, kinds = feed(state, "c", 10, True, 0.2)  # 20x slower but only 0.19 s
        assert kinds == []

    def test_a_worker_with_more_work_in_hand_is_judged_per_unit_of_it(self) -> None:
        """Sticky routing gave it a hot shopper's three concurrent requests."""
        state = warmed(1.0)
        for _ in range(10):
            state, events = record(state, "c", True, 4.5, 0.0, CFG, work=3)
            assert events == []
        assert available(state) == W

    def test_a_slow_worker_under_the_same_load_is_ejected(self) -> None:
        state = warmed(1.0)
        kinds = []
        for _ in range(10):
            state, events = record(state, "c", True, 15.0, 0.0, CFG, work=3)
            kinds += [e.kind for e in events]
        assert kinds == ["ejected"]

    def test_uniformly_slow_pool_ejects_nobody(self) -> None:
        state = warmed(5.0)
        state, kinds = feed(state, "a", 10, True, 6.0)
        assert kinds == []


class TestMinimumHealthy:
    def test_never_below_min_healthy(self) -> None:
        cfg = HealthConfig(window=10, min_requests=4, min_healthy=2)
        state = new_pool_health(W)
        for w in ("a", "b"):
            for _ in range(3):
                state, _ = record(state, w, False, 0.1, 0.0, cfg)
        assert available(state) == ["b", "c"]  # a ejected, b kept: 2 must stay

    def test_last_worker_is_never_ejected(self) -> None:
        cfg = HealthConfig(min_healthy=0)
        state = new_pool_health(["only"])
        for _ in range(10):
            state, events = record(state, "only", False, 0.1, 0.0, cfg)
            assert events == []
        assert available(state) == ["only"]


class TestReadmission:
    def eject_a(self) -> PoolHealth:
        state, kinds = feed(new_pool_health(W), "a", 3, False, 0.1, now=100.0)
        assert kinds == ["ejected"]
        return state

    def test_probe_before_backoff_does_not_readmit(self) -> None:
        state, events = probe(self.eject_a(), "a", True, 101.0, CFG)
        assert events == [] and "a" not in available(state)

    def test_probe_after_backoff_readmits_with_clean_window(self) -> None:
        state, events = probe(self.eject_a(), "a", True, 105.0, CFG)
        assert [e.kind for e in events] == ["readmitted"]
        assert "a" in available(state)
        assert state.get("a").outcomes == () and state.get("a").consecutive_failures == 0

    def test_failed_probe_keeps_it_out(self) -> None:
        state, _ = probe(self.eject_a(), "a", False, 200.0, CFG)
        assert "a" not in available(state)

    def test_backoff_doubles_and_is_capped(self) -> None:
        state = new_pool_health(W)
        now = 0.0
        periods = []
        for _ in range(4):
            state, _ = feed(state, "a", 3, False, 0.1, now=now)
            until = state.get("a").ejected_until
            assert until is not None
            periods.append(until - now)
            now = until
            state, _ = probe(state, "a", True, now, CFG)
        assert periods == [5.0, 10.0, 20.0, 20.0]

    def test_expire_readmits_without_probe(self) -> None:
        state, events = expire(self.eject_a(), 200.0)
        assert [e.kind for e in events] == ["readmitted"] and "a" in available(state)

    def test_outcomes_while_ejected_are_ignored(self) -> None:
        state = self.eject_a()
        state2, events = record(state, "a", False, 0.1, 101.0, CFG)
        assert state2 == state and events == []


class TestActiveChecks:
    def test_down_after_consecutive_failed_probes_and_up_again(self) -> None:
        state = new_pool_health(W)
        state, e1 = probe(state, "b", False, 0.0, CFG)
        assert e1 == [] and "b" in available(state)
        state, e2 = probe(state, "b", False, 1.0, CFG)
        assert [e.kind for e in e2] == ["down"] and "b" not in available(state)
        state, e3 = probe(state, "b", True, 2.0, CFG)
        assert [e.kind for e in e3] == ["up"] and "b" in available(state)

    def test_all_down_falls_back_to_everyone(self) -> None:
        state = new_pool_health(W)
        for w in W:
            for t in (0.0, 1.0):
                state, _ = probe(state, w, False, t, CFG)
        assert available(state) == W  # panic mode: try rather than refuse

    def test_unknown_worker_is_ignored(self) -> None:
        state = new_pool_health(W)
        assert probe(state, "zz", False, 0.0, CFG) == (state, [])
        assert record(state, "zz", False, 0.1, 0.0, CFG) == (state, [])


class TestConfig:
    def test_invalid_values(self) -> None:
        with pytest.raises(ValueError):
            HealthConfig(window=2, min_requests=5)
        with pytest.raises(ValueError):
            HealthConfig(min_healthy=-1)

    def test_state_is_immutable(self) -> None:
        state = new_pool_health(W)
        with pytest.raises(TypeError):
            state.workers["a"] = state.workers["b"]  # type: ignore[index]
