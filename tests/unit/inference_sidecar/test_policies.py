"""Routing-policy invariants: stickiness, the load bound, and minimal, spread-out moves."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inference_sidecar.policies import (
    POLICY_NAMES,
    BoundedHashPolicy,
    RoundRobinPolicy,
    make_policy,
)
from inference_sidecar.policies.bounded_hash import load_bound, preference_order

WORKERS = [f"http://127.0.0.1:{8100 + i}" for i in range(4)]
KEYS = [f"shopper-{i}" for i in range(2000)]


def zipf_keys(n: int, n_keys: int, s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (rank**s) for rank in range(1, n_keys + 1)]
    return rng.choices([f"shopper-{i}" for i in range(n_keys)], weights=weights, k=n)


class TestFactory:
    def test_builds_each_named_policy(self) -> None:
        for name in POLICY_NAMES:
            assert make_policy(name).name == name

    def test_passes_load_factor_and_ignores_foreign_options(self) -> None:
        policy = make_policy("bounded_hash", load_factor=2.0)
        assert isinstance(policy, BoundedHashPolicy) and policy.load_factor == 2.0
        assert isinstance(make_policy("round_robin", load_factor=2.0), RoundRobinPolicy)

    def test_unknown_name(self) -> None:
        with pytest.raises(ValueError, match="unknown policy"):
            make_policy("random")

    def test_load_factor_below_one_is_refused(self) -> None:
        with pytest.raises(ValueError):
            BoundedHashPolicy(load_factor=0.9)


class TestLoadBound:
    def test_values(self) -> None:
        assert load_bound(0, 4, 1.25) == 1
        assert load_bound(7, 4, 1.25) == 3  # ceil(1.25 * 8 / 4) = ceil(2.5)
        assert load_bound(3, 2, 1.0) == 2

    def test_needs_workers(self) -> None:
        with pytest.raises(ValueError):
            load_bound(0, 0, 1.25)


class TestBoundedHashStickiness:
    def test_same_key_same_worker_when_idle(self) -> None:
        policy = BoundedHashPolicy()
        for key in KEYS[:200]:
            first = policy.pick(key, WORKERS, {})
            assert all(policy.pick(key, WORKERS, {}) == first for _ in range(3))
            assert policy.home(key, WORKERS) == first

    def test_choice_ignores_worker_list_order(self) -> None:
        policy = BoundedHashPolicy()
        shuffled = list(reversed(WORKERS))
        for key in KEYS[:200]:
            assert policy.pick(key, WORKERS, {}) == policy.pick(key, shuffled, {})

    def test_keys_spread_evenly(self) -> None:
        policy = BoundedHashPolicy()
        counts = Counter(policy.home(k, WORKERS) for k in KEYS)
        assert set(counts) == set(WORKERS)
        assert max(counts.values()) < 1.2 * len(KEYS) / len(WORKERS)

    def test_home_under_moderate_load_is_kept(self) -> None:
        policy = BoundedHashPolicy()
        loads = dict.fromkeys(WORKERS, 2)  # balanced: bound = ceil(1.25*9/4) = 3 > 2
        for key in KEYS[:100]:
            assert policy.pick(key, WORKERS, loads) == policy.home(key, WORKERS)

    def test_spills_to_next_preferred_when_home_is_full(self) -> None:
        policy = BoundedHashPolicy()
        key = "hot-shopper"
        order = preference_order(key, WORKERS)
        loads = dict.fromkeys(WORKERS, 0)
        loads[order[0]] = 5
        assert policy.pick(key, WORKERS, loads) == order[1]

    def test_single_worker_always_chosen(self) -> None:
        policy = BoundedHashPolicy()
        assert policy.pick("k", WORKERS[:1], {WORKERS[0]: 100}) == WORKERS[0]

    def test_empty_pool_is_an_error(self) -> None:
        with pytest.raises(ValueError):
            BoundedHashPolicy().pick("k", [], {})


class TestBoundedHashLoadBound:
    @pytest.mark.parametrize("load_factor", [1.0, 1.25, 1.5])
    def test_no_worker_above_the_bound_under_skewed_keys(self, load_factor: float) -> None:
        """Zipf-skewed keys, random completions: after every pick, the chosen worker is
        within max(min_bound, ceil(c * mean in-flight)), the new request included."""
        rng = random.Random(7)
        policy = BoundedHashPolicy(load_factor=load_factor)
        loads = dict.fromkeys(WORKERS, 0)
        in_flight: list[str] = []
        for key in zipf_keys(5000, 50, 1.2, seed=3):
            total = sum(loads.values())
            worker = policy.pick(key, WORKERS, loads)
            bound = load_bound(total, len(WORKERS), load_factor, policy.min_bound)
            assert loads[worker] + 1 <= bound
            loads[worker] += 1
            in_flight.append(worker)
            # complete a random number of requests, keeping 5-40 in flight
            while len(in_flight) > rng.randint(5, 40):
                done = in_flight.pop(rng.randrange(len(in_flight)))
                loads[done] -= 1

    def test_few_requests_in_flight_never_spill_a_key_off_its_worker(self) -> None:
        policy = BoundedHashPolicy(load_factor=1.25, min_bound=3)
        home = policy.home("shopper-012", WORKERS)
        loads = {w: (2 if w == home else 0) for w in WORKERS}

        assert policy.pick("shopper-012", WORKERS, loads) == home

    def test_the_floor_does_not_let_a_hot_key_pile_up(self) -> None:
        policy = BoundedHashPolicy(load_factor=1.25, min_bound=3)
        home = policy.home("shopper-012", WORKERS)
        loads = {w: (3 if w == home else 0) for w in WORKERS}

        assert policy.pick("shopper-012", WORKERS, loads) != home

    def test_hot_key_is_mostly_sticky_when_load_allows(self) -> None:
        policy = BoundedHashPolicy()
        loads = dict.fromkeys(WORKERS, 1)
        home = policy.home("hot", WORKERS)
        assert policy.pick("hot", WORKERS, loads) == home


class TestBoundedHashWorkerLoss:
    def test_only_the_lost_workers_keys_move(self) -> None:
        policy = BoundedHashPolicy()
        lost = WORKERS[1]
        survivors = [w for w in WORKERS if w != lost]
        moved = 0
        for key in KEYS:
            before = policy.pick(key, WORKERS, {})
            after = policy.pick(key, survivors, {})
            if before != lost:
                assert after == before, key
            else:
                moved += 1
        assert moved < 0.35 * len(KEYS)  # ~1/4 expected

    def test_lost_workers_keys_spread_over_all_survivors(self) -> None:
        policy = BoundedHashPolicy()
        lost = WORKERS[2]
        survivors = [w for w in WORKERS if w != lost]
        orphans = [k for k in KEYS if policy.home(k, WORKERS) == lost]
        landing = Counter(policy.pick(k, survivors, {}) for k in orphans)
        assert set(landing) == set(survivors)
        assert max(landing.values()) < 0.5 * len(orphans)  # not piled onto one (1/3 fair)

    def test_a_new_worker_takes_keys_only_for_itself(self) -> None:
        policy = BoundedHashPolicy()
        grown = [*WORKERS, "http://127.0.0.1:8200"]
        for key in KEYS:
            after = policy.pick(key, grown, {})
            assert after in (policy.pick(key, WORKERS, {}), grown[-1])


class TestRoundRobin:
    def test_cycles_through_workers(self) -> None:
        policy = RoundRobinPolicy()
        picks = [policy.pick("same-key", WORKERS, {}) for _ in range(8)]
        assert picks == WORKERS * 2

    def test_has_no_home(self) -> None:
        assert RoundRobinPolicy().home("k", WORKERS) is None

    def test_empty_pool_is_an_error(self) -> None:
        with pytest.raises(ValueError):
            RoundRobinPolicy().pick("k", [], {})
