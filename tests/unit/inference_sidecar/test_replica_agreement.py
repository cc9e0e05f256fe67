"""Router replicas behind one load balancer agree where a key goes: the placement depends on
the worker set and the key alone (rendezvous hashing over a fixed digest: no virtual nodes,
no seed, no process's hash salt, no order in which the workers were listed, added or found
healthy), and with the ``workers`` load view and the same reported loads, on the same
bounded-load decisions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from inference_sidecar.load_view import WorkerLoads, sample_lifetime
from inference_sidecar.policies import make_policy
from inference_sidecar.policies.bounded_hash import preference_order
from inference_sidecar.routing_state import RoutingState
from tests.support.clock import FakeClock

WORKERS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"shopper-{i}" for i in range(1000)]
#: Reported requests in flight per worker: the bound (ceil(1.25 * 21 / 5) = 6) excludes
#: the first two, so the keys homed there spill.
REPORTED = dict(zip(WORKERS, (9, 6, 3, 2, 0), strict=True))


def replica(order: list[str], reported: dict[str, int] | None = None) -> RoutingState:
    """One replica's pool, its workers listed in ``order``, with the workers view fed
    ``reported`` when given."""
    loads = None
    if reported is not None:
        loads = WorkerLoads(sample_lifetime(0.5, 1.0), FakeClock())
        for worker in reversed(order):  # polls answer in any order
            loads.record(worker, reported[worker])
    return RoutingState("worker", order, make_policy("bounded_hash"), worker_loads=loads)


def placements(pool: RoutingState) -> list[tuple[str, str]]:
    """Where each of ``KEYS`` goes and how that is classified, without sending it."""
    out = []
    for key in KEYS:
        choice = pool.choose(key)
        assert choice is not None
        out.append((choice.worker, choice.decision))
    return out


def test_two_replicas_given_the_workers_in_different_orders_place_1000_keys_alike() -> None:
    first = replica(WORKERS)
    second = replica([*reversed(WORKERS[2:]), *WORKERS[:2]])
    assert placements(first) == placements(second)


def test_a_worker_added_at_runtime_draws_the_keys_it_would_have_had_from_the_start() -> None:
    configured = replica(WORKERS)
    grown = replica(WORKERS[1:])
    grown.add_worker(WORKERS[0])
    assert placements(grown) == placements(configured)


def test_the_health_checks_order_of_answers_changes_no_placement() -> None:
    first = replica(WORKERS)
    second = replica(WORKERS)
    for worker in reversed(WORKERS):  # down (two failed probes), then back in turn
        second.probed(worker, False, 0.0)
        second.probed(worker, False, 0.5)
    assert not any(second.is_in_service(w) for w in WORKERS)
    for worker in WORKERS[::2] + WORKERS[1::2]:
        second.probed(worker, True, 1.0)
    assert placements(first) == placements(second)


def test_with_the_same_reported_loads_two_replicas_make_the_same_bounded_load_decisions() -> None:
    first = replica(WORKERS, REPORTED)
    second = replica(list(reversed(WORKERS)), REPORTED)
    decided = placements(first)
    assert decided == placements(second)
    homes = [preference_order(k, WORKERS)[0] for k in KEYS]
    moved_from = {home for home, (worker, _) in zip(homes, decided, strict=True) if worker != home}
    assert moved_from == set(WORKERS[:2])  # the bound excluded exactly the two over it


def test_placements_do_not_depend_on_the_process() -> None:
    script = (
        "import json, sys\n"
        "from inference_sidecar.policies.bounded_hash import preference_order\n"
        "workers, keys = json.loads(sys.stdin.read())\n"
        "print(json.dumps([preference_order(k, workers) for k in keys]))\n"
    )
    here = [preference_order(k, WORKERS) for k in KEYS]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script],
            input=json.dumps([list(reversed(WORKERS)), KEYS]),
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert json.loads(out.stdout) == here
