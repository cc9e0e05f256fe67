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
from inference_sidecar.policies.bounded_hash import LATENCY_MEMORY_S, load_bound, preference_order
from tests.support.clock import FakeClock

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

    def test_kv_prefix_takes_the_hashing_policys_tuning(self) -> None:
        policy = make_policy(
            "kv_prefix", load_factor=2.0, recompute_weight=3.0, request_cost=100, port=9
        )
        assert (policy.load_factor, policy.recompute_weight, policy.request_cost) == (2, 3, 100)

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


def served(policy: BoundedHashPolicy, key: str, worker: str, size: int) -> None:
    """``worker`` served ``key``'s prompt of ``size`` tokens to the end."""
    policy.on_finish(worker, policy.on_start(worker, key, size), ok=True)


class TestTokenAwareSpilling:
    """With a prompt size the policy weighs recompute against queued prefill work."""

    A, B, C = WORKERS[:3]

    def test_key_stays_with_the_worker_holding_its_prefix_despite_a_short_queue(self) -> None:
        policy = BoundedHashPolicy()
        key = "shopper-1"
        served(policy, key, self.A, 2000)
        policy.on_start(self.A, "other", 1500)  # 1,500 tokens queued on A, B and C idle
        assert policy.pick(key, WORKERS[:3], {self.A: 1}, size=2050) == self.A

    def test_key_spills_when_its_workers_queue_costs_more_than_recomputing(self) -> None:
        policy = BoundedHashPolicy()  # recompute counts twice: 2 * 500 < queue on A
        key = "shopper-1"
        served(policy, key, self.A, 500)
        policy.on_start(self.A, "big", 3000)
        picked = policy.pick(key, WORKERS[:3], {self.A: 1}, size=520)
        assert picked != self.A

    def test_spill_prefers_the_worker_that_served_the_key_recently(self) -> None:
        policy = BoundedHashPolicy()
        key = "hot"
        served(policy, key, self.B, 2000)  # spilled there once
        served(policy, key, self.A, 2040)  # back home
        policy.on_start(self.A, "big-1", 4000)
        policy.on_start(self.B, "small", 300)  # B is busier than idle C...
        # ...but B holds the key's prefix: C would recompute all 2,060 tokens.
        assert policy.pick(key, WORKERS[:3], {self.A: 1, self.B: 1}, size=2060) == self.B

    def test_new_key_goes_to_the_least_queued_worker(self) -> None:
        policy = BoundedHashPolicy()
        home = policy.home("new-shopper", WORKERS[:3])
        assert home is not None
        policy.on_start(home, "someone", 2500)
        loads = {home: 1}
        picked = policy.pick("new-shopper", WORKERS[:3], loads, size=1800)
        assert picked != home and policy.queued_tokens(picked) == 0

    def test_a_new_key_goes_to_the_fewest_requests_in_flight_before_the_cheapest(self) -> None:
        """A decodes a hot shopper's three requests (nothing left to prefill), B prefills
        one cold prompt. By fewest requests (the default, with or without residency
        first) the new shopper goes to B; by cost alone, to A."""
        placements = (("fewest_first", self.B), ("least_loaded", self.B), ("cost", self.A))
        for placement, expected in placements:
            policy = BoundedHashPolicy(new_key_placement=placement)
            for _ in range(3):
                policy.on_prefilled(self.A, policy.on_start(self.A, "hot", 1500))
            policy.on_start(self.B, "cold", 1500)
            loads = {self.A: 3, self.B: 1}
            assert policy.pick("new", WORKERS[:2], loads, size=1500) == expected

    def test_fewest_first_places_a_new_key_on_an_idle_worker_whatever_it_held(self) -> None:
        """A remembers a long-gone shopper's 3,000 tokens and is idle; B serves a hot
        shopper's two requests. Residency first keeps the new shopper off A; fewest
        requests first sends it there."""
        for placement, expected in (("least_loaded", self.B), ("fewest_first", self.A)):
            policy = BoundedHashPolicy(new_key_placement=placement)
            served(policy, "gone", self.A, 3000)
            for _ in range(2):
                policy.on_start(self.B, "hot", 500)
            loads = {self.A: 0, self.B: 2}
            assert policy.pick("new", WORKERS[:2], loads, size=1500) == expected

    def test_hash_placement_sends_a_new_key_home_whatever_the_other_queues(self) -> None:
        """The home serves two requests, another worker none: fewest requests first would
        move the new shopper; by hash it goes home, where another router replica that
        sees it first would send it too."""
        policy = BoundedHashPolicy(new_key_placement="hash")
        home = preference_order("new", WORKERS[:2])[0]
        for _ in range(2):
            policy.on_start(home, "hot", 1500)
        loads = {home: 2}
        assert policy.pick("new", WORKERS[:2], loads, size=1500) == home

    def test_hash_placement_passes_a_home_at_the_load_bound(self) -> None:
        policy = BoundedHashPolicy(new_key_placement="hash")
        home, second = preference_order("new", WORKERS[:2])
        loads = {home: 3}
        assert policy.pick("new", WORKERS[:2], loads, size=1500) == second

    def test_new_key_on_idle_workers_goes_to_its_rendezvous_home(self) -> None:
        policy = BoundedHashPolicy()
        for key in KEYS[:50]:
            assert policy.pick(key, WORKERS, {}, size=1000) == preference_order(key, WORKERS)[0]

    def test_queued_tokens_leave_at_first_byte_and_never_go_negative(self) -> None:
        policy = BoundedHashPolicy()
        ticket = policy.on_start(self.A, "k", 1200)
        assert policy.queued_tokens(self.A) == 1200
        policy.on_prefilled(self.A, ticket)
        assert policy.queued_tokens(self.A) == 0
        policy.on_finish(self.A, ticket, ok=True)
        assert policy.queued_tokens(self.A) == 0

    def test_only_the_uncached_tail_is_queued_on_the_keys_worker(self) -> None:
        policy = BoundedHashPolicy()
        served(policy, "k", self.A, 1200)
        policy.on_start(self.A, "k", 1260)
        assert policy.queued_tokens(self.A) == 60

    def test_a_worker_that_failed_the_key_is_forgotten(self) -> None:
        policy = BoundedHashPolicy()
        served(policy, "k", self.A, 1000)
        policy.on_finish(self.B, policy.on_start(self.B, "k", 1010), ok=False)
        assert [w for w, _ in policy.visits("k")] == [self.A]
        assert policy.uncached("k", self.B, 1020) == 1020

    def test_history_is_bounded_and_forgets_the_least_recent_key(self) -> None:
        policy = BoundedHashPolicy(history_size=2)
        for key in ("a", "b", "c"):
            served(policy, key, self.A, 100)
        assert policy.is_new("a") and not policy.is_new("b") and not policy.is_new("c")

    def test_at_most_workers_per_key_are_remembered(self) -> None:
        policy = BoundedHashPolicy(workers_per_key=2)
        for worker in (self.A, self.B, self.C):
            served(policy, "k", worker, 100)
        assert [w for w, _ in policy.visits("k")] == [self.C, self.B]

    def test_the_bound_still_holds_for_a_hot_key_with_its_prefix_cached(self) -> None:
        policy = BoundedHashPolicy(load_factor=1.25, min_bound=3)
        served(policy, "hot", self.A, 2000)
        loads = {self.A: 3, self.B: 0, self.C: 0}  # bound: max(3, ceil(1.25 * 4 / 3)) = 3
        assert policy.pick("hot", WORKERS[:3], loads, size=2010) != self.A

    def test_a_keys_own_requests_in_flight_do_not_spill_it_off_its_prefix(self) -> None:
        """The end of a skewed-phase repeat: a hot shopper's two other requests and one
        of another shopper in flight on its worker, the rest idle, so the bound is at its
        floor of 3. Its own two count as one there, and it stays."""
        policy = BoundedHashPolicy(load_factor=1.25, min_bound=3)
        for _ in range(2):
            policy.on_start(self.A, "hot", 1500)
        loads = {self.A: 3, self.B: 0, self.C: 0}
        assert policy.pick("hot", WORKERS[:3], loads, size=1550) == self.A

    def test_a_burst_of_one_keys_requests_beyond_the_floor_still_spreads(self) -> None:
        policy = BoundedHashPolicy(load_factor=1.25, min_bound=3)
        for _ in range(5):
            policy.on_start(self.A, "hot", 1500)
        loads = {self.A: 5, self.B: 0, self.C: 0}
        assert policy.pick("hot", WORKERS[:3], loads, size=1550) != self.A

    def test_other_keys_see_the_worker_at_its_full_load(self) -> None:
        policy = BoundedHashPolicy()
        policy.on_start(self.A, "hot", 1500)
        policy.on_start(self.A, "hot", 1500)
        loads = {self.A: 2, self.B: 0}
        assert policy.loads_for("other", loads) == loads
        assert policy.loads_for("hot", loads) == {self.A: 1, self.B: 0}

    def test_a_finished_request_stops_counting_as_the_keys_own_even_if_finished_twice(
        self,
    ) -> None:
        policy = BoundedHashPolicy()
        first = policy.on_start(self.A, "hot", 1500)
        policy.on_start(self.A, "hot", 1500)
        policy.on_start(self.A, "hot", 1500)
        policy.on_finish(self.A, first, ok=True)
        policy.on_finish(self.A, first, ok=True)
        assert policy.loads_for("hot", {self.A: 3}) == {self.A: 2}  # two of its own left

    @pytest.mark.parametrize("weight", [0.0, 2.0, 10.0])
    def test_no_worker_above_the_bound_with_sizes(self, weight: float) -> None:
        rng = random.Random(11)
        policy = BoundedHashPolicy(recompute_weight=weight)
        loads = dict.fromkeys(WORKERS, 0)
        in_flight: list[tuple[str, object]] = []
        sizes: dict[str, int] = {}
        for key in zipf_keys(3000, 40, 1.2, seed=5):
            sizes[key] = sizes.get(key, rng.randint(800, 3000)) + rng.randint(20, 80)
            total = sum(loads.values())
            worker = policy.pick(key, WORKERS, loads, size=sizes[key])
            bound = load_bound(total, len(WORKERS), 1.25, policy.min_bound)
            # at the floor, the key's own requests on a worker count there as one
            seen = policy.loads_for(key, loads) if bound <= policy.min_bound else loads
            assert seen[worker] + 1 <= bound
            loads[worker] += 1
            in_flight.append((worker, policy.on_start(worker, key, sizes[key])))
            while len(in_flight) > rng.randint(4, 30):
                done, ticket = in_flight.pop(rng.randrange(len(in_flight)))
                loads[done] -= 1
                policy.on_finish(done, ticket, ok=True)
        for done, ticket in in_flight:
            policy.on_finish(done, ticket, ok=True)
        assert all(policy.queued_tokens(w) == 0 for w in WORKERS)

    def test_lost_workers_keys_spread_over_the_survivors(self) -> None:
        policy = BoundedHashPolicy()
        lost = self.A
        orphans = [k for k in KEYS[:600] if policy.home(k, WORKERS[:3]) == lost]
        for key in orphans:
            served(policy, key, lost, 1500)
        landing = Counter(policy.pick(k, [self.B, self.C], {}, size=1550) for k in orphans)
        assert set(landing) == {self.B, self.C}
        assert max(landing.values()) < 0.65 * len(orphans)

    def test_skewed_burst_keeps_hot_keys_home_and_sends_new_keys_elsewhere(self) -> None:
        """Three hot shoppers with three requests each in flight, then new shoppers
        arrive: the hot ones stay put (their prefixes are cached) and the new ones go
        to the workers with the least queued work."""
        policy = BoundedHashPolicy()
        workers = WORKERS[:3]
        loads = dict.fromkeys(workers, 0)
        homes: dict[str, set[str]] = {}
        for step in range(3):
            for hot in ("hot-1", "hot-2", "hot-3"):
                size = 2000 + 50 * step
                worker = policy.pick(hot, workers, loads, size=size)
                policy.on_start(worker, hot, size)
                loads[worker] += 1
                homes.setdefault(hot, set()).add(worker)
        assert all(len(ws) == 1 for ws in homes.values())
        assert len({next(iter(ws)) for ws in homes.values()}) == 3  # one hot key each
        for i in range(3):
            worker = policy.pick(f"cold-{i}", workers, loads, size=2000 + 100 * i)
            policy.on_start(worker, f"cold-{i}", 2000 + 100 * i)
            loads[worker] += 1
        assert sorted(loads.values()) == [4, 4, 4]


class TestPolicyOptions:
    def test_invalid_options_are_refused(self) -> None:
        for kwargs in (
            {"recompute_weight": -1},
            {"workers_per_key": 0},
            {"history_size": -1},
            {"residency_factor": 0.5},
        ):
            with pytest.raises(ValueError):
                BoundedHashPolicy(**kwargs)

    def test_factory_passes_recompute_weight(self) -> None:
        policy = make_policy("bounded_hash", recompute_weight=0.5)
        assert isinstance(policy, BoundedHashPolicy) and policy.recompute_weight == 0.5


def served_in(policy: BoundedHashPolicy, clock: FakeClock, worker: str, key: str, s: float):
    ticket = policy.on_start(worker, key, 1000)
    clock.now += s
    policy.on_finish(worker, ticket, ok=True)


class TestSpeedAwareness:
    A, B, C = WORKERS[:3]

    def c_answered_slower(self) -> tuple[BoundedHashPolicy, FakeClock, list[str]]:
        """A policy that saw worker C answer 3x slower than A and B, and 20 new keys whose
        rendezvous home is C."""
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for i in range(5):
            served_in(policy, clock, self.A, f"a{i}", 1.0)
            served_in(policy, clock, self.B, f"b{i}", 1.0)
            served_in(policy, clock, self.C, f"c{i}", 3.0)
        homed_on_c = [k for k in KEYS if policy.home(k, WORKERS[:3]) == self.C][:20]
        return policy, clock, homed_on_c

    def test_a_new_key_avoids_a_worker_that_has_been_answering_slower(self) -> None:
        policy, _clock, homed_on_c = self.c_answered_slower()

        picks = {policy.pick(k, WORKERS[:3], {}, size=1500) for k in homed_on_c}

        assert self.C not in picks

    def test_a_slow_figure_is_forgotten_when_the_worker_has_not_answered_for_a_while(
        self,
    ) -> None:
        policy, clock, homed_on_c = self.c_answered_slower()
        clock.now += LATENCY_MEMORY_S
        served_in(policy, clock, self.A, "a5", 1.0)
        served_in(policy, clock, self.B, "b5", 1.0)

        picks = {policy.pick(k, WORKERS[:3], {}, size=1500) for k in homed_on_c}

        assert picks == {self.C}

    def test_a_known_key_is_weighed_in_tokens_alone(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for i in range(5):
            served_in(policy, clock, self.A, f"a{i}", 1.0)
            served_in(policy, clock, self.B, f"b{i}", 3.0)
        served(policy, "hot", self.B, 2000)

        assert policy.cost("hot", self.B, 2040, 0, WORKERS[:2]) == policy.cost(
            "hot", self.B, 2040, 0
        )

    def test_a_key_stays_on_a_slower_worker_that_holds_its_prefix(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for i in range(5):
            served_in(policy, clock, self.A, f"a{i}", 1.0)
            served_in(policy, clock, self.B, f"b{i}", 2.0)
        served(policy, "hot", self.B, 2000)

        assert policy.pick("hot", WORKERS[:2], {}, size=2040) == self.B

    def test_equal_workers_weigh_the_same(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for w in WORKERS[:3]:
            served_in(policy, clock, w, "k", 1.0)

        assert {policy.slowness(w, WORKERS[:3]) for w in WORKERS[:3]} == {1.0}

    def test_failed_requests_say_nothing_about_speed(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        served_in(policy, clock, self.A, "k", 1.0)
        ticket = policy.on_start(self.B, "k", 1000)
        clock.now += 30
        policy.on_finish(self.B, ticket, ok=False)

        assert policy.slowness(self.B, WORKERS[:2]) == 1.0

    def test_slowness_is_clamped(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for worker, seconds in zip(WORKERS[:3], (0.1, 1.0, 10.0), strict=True):
            served_in(policy, clock, worker, "k", seconds)

        assert policy.slowness(self.C, WORKERS[:3]) == 4.0
        assert policy.slowness(self.A, WORKERS[:3]) == 0.5

    def test_small_differences_count_as_equal(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for worker, seconds in zip(WORKERS[:3], (1.0, 1.1, 1.2), strict=True):
            served_in(policy, clock, worker, "k", seconds)

        assert {policy.slowness(w, WORKERS[:3]) for w in WORKERS[:3]} == {1.0}


class TestResidency:
    """New keys spread the prompts the workers' KV caches must hold (module doc, 5)."""

    A, B, C = WORKERS[:3]

    def test_a_new_key_skips_the_fastest_worker_when_it_holds_more_than_its_share(
        self,
    ) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        for i in range(4):
            served_in(policy, clock, self.A, f"a{i}", 1.0)
        served_in(policy, clock, self.B, "b0", 3.0)
        served_in(policy, clock, self.C, "c0", 3.0)

        picks = {policy.pick(k, WORKERS[:3], {}, size=1500) for k in KEYS[:30]}

        assert self.A not in picks

    def test_new_keys_placed_one_after_another_fill_the_workers_evenly(self) -> None:
        clock = FakeClock()
        policy = BoundedHashPolicy(clock=clock)
        served_in(policy, clock, self.A, "warm-a", 1.0)
        served_in(policy, clock, self.B, "warm-b", 3.0)  # A answers 3x faster than B and C
        served_in(policy, clock, self.C, "warm-c", 3.0)
        for key in KEYS[:30]:
            served(policy, key, policy.pick(key, WORKERS[:3], {}, size=1000), 1000)

        resident = [policy.resident_tokens(w) for w in WORKERS[:3]]
        assert max(resident) <= 1.25 * sum(resident) / 3 + 1000, resident

    def test_its_bound_is_the_residency_factor_not_the_in_flight_load_factor(self) -> None:
        """A holds twice the mean's share of prompt tokens: a new key may not go there
        at the default residency factor, however loose the bound on requests in flight."""
        policy = BoundedHashPolicy(load_factor=3.0)
        for i in range(4):
            served(policy, f"a{i}", self.A, 1000)
        served(policy, "b0", self.B, 1000)
        served(policy, "c0", self.C, 1000)

        assert policy.roomy(WORKERS[:3]) == [self.B, self.C]
        looser = BoundedHashPolicy(load_factor=1.25, residency_factor=2.5)
        for key, worker in (*((f"a{i}", self.A) for i in range(4)), ("b0", self.B)):
            served(looser, key, worker, 1000)
        served(looser, "c0", self.C, 1000)
        assert looser.roomy(WORKERS[:3]) == [self.A, self.B, self.C]

    def test_a_known_key_stays_home_whatever_its_worker_holds(self) -> None:
        policy = BoundedHashPolicy()
        for i in range(5):
            served(policy, f"a{i}", self.A, 2000)
        assert policy.pick("a0", WORKERS[:3], {}, size=2050) == self.A

    def test_residency_follows_each_keys_latest_worker(self) -> None:
        policy = BoundedHashPolicy(history_size=2)
        served(policy, "k", self.A, 1000)
        served(policy, "k", self.B, 1100)  # spilled: its latest prompt is on B
        assert [policy.resident_tokens(w) for w in (self.A, self.B)] == [0, 1100]
        policy.on_finish(self.B, policy.on_start(self.B, "k", 1200), ok=False)
        assert [policy.resident_tokens(w) for w in (self.A, self.B)] == [1000, 0]
        served(policy, "x", self.C, 500)
        served(policy, "y", self.C, 700)  # a history of two keys forgets "k"
        assert [policy.resident_tokens(w) for w in (self.A, self.C)] == [0, 1200]
