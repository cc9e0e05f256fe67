"""Rendezvous hashing with a bound on each worker's load, and token-aware spilling.

The policy keeps each key (shopper) on the worker that holds its prompt prefix in its KV
cache, unless that costs more than recomputing the prefix elsewhere. Five rules, from
hard to soft (the fifth is hard again, for new keys only):

1. **The load bound** (Mirrokni, Thorup and Zadimoghaddam, 2016): a worker may take a
   request only while its in-flight load is below ``ceil(c * (total in flight + 1) / n)``,
   and never below ``min_bound`` (default 3, so a handful of requests do not spill a
   shopper off its prefix). Some worker always qualifies: the mean is below the bound.
   While the bound is at that floor (a nearly idle cluster), the key's own requests in
   flight on a worker count there as one, up to ``min_bound`` of them: they share its
   prefix and the worker batches their decoding, so moving one away recomputes the whole
   prefix to relieve a queue the key made itself, as a hot shopper does once the other
   shoppers are done. Above the floor, and beyond ``min_bound`` of them, they count as
   anyone's, so a burst from one key still spreads
   (``docs/decisions.md#bounded-hash-min-bound``).
2. **Affinity**: per key, a bounded LRU remembers the last workers that served it and
   its prompt size there; on those only the prompt's new tail is uncached. Keys never seen
   are ordered by rendezvous hashing: a stable preference order without virtual nodes, so
   a lost worker's keys spread over the survivors and separate routers agree on an idle
   cluster.
3. **Cost** (Dynamo's KV-aware routing, reduced to what a router knows alone): among the
   workers under the bound, take the one minimising
   ``recompute_weight * uncached(key, worker) + queued(worker)``, ``queued`` being the
   uncached tokens sent there still without a first byte plus ``request_cost`` per request
   in flight; ties go to the key's most recent worker, then to rendezvous order. A
   recompute counts twice by default: in this request's wait, and in the capacity it
   takes from everyone else on the worker it lands on.
4. **Speed**, for new keys only: their cost is scaled by the worker's recent latency over
   its peers' median (clamped to ``SLOWNESS_RANGE``; 1 within ``SLOWNESS_DEAD_BAND`` and
   until two workers answered within ``LATENCY_MEMORY_S``), so they go where they will be
   served soonest. A key with history keeps the token cost alone: it must not leave its
   cached prefix for a faster worker.
5. **Residency**, for new keys only: a new key goes only to a worker whose resident
   prompt tokens (the last prompt of every key homed there) are at most
   ``residency_factor`` times the mean, rule 1 applied to what the KV caches must hold.
   It comes before speed, which alone herds new keys onto one worker until its cache
   overflows (``docs/decisions.md#bounded-hash-speed-and-residency``).

**Placing a new key** (``new_key_placement``): by default (``"fewest_first"``) it goes to
the workers with the fewest requests in flight, then to the roomy ones among them (rule
5), and rules 3 and 4 break the remaining ties. Residency cannot see evictions: it counts
every remembered shopper's last prompt, one-shot shoppers long evicted included, so ahead
of the load (residency first: ``"least_loaded"``) it can keep a new hot shopper off the
least loaded worker, beside another hot one, until both spill; it evens the load at the
cost of that risk. By cost alone (``"cost"``), a worker decoding a hot shopper's requests
costs a new shopper ``request_cost`` a request, one prefilling a cold prompt all of that
prompt, so cold shoppers join the hot ones and push them to the bound, where they spill
(``docs/decisions.md#bounded-hash-new-key-placement``). By hash (``"hash"``), it goes to
the first worker of its rendezvous order under the load bound, as plain consistent
hashing would: the one placement router replicas that do not share their histories agree
on, whichever of them sees the key first (``docs/decisions.md#router-load-view``).

Without a size (``size=0``: the caller could not estimate the prompt) this is plain
bounded-load hashing: the first worker under the bound in the key's order.

Limits: the history does not see a worker evict a key's blocks (the estimate then errs
towards staying). Router replicas agree on a key's rendezvous order, and on the loads with
the ``workers`` load view (``inference_sidecar.load_view``), but keep their own histories.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from inference_sidecar.policies.base import Policy

#: ``c`` of rule 1. It must bind on two workers, where any ``c`` of 2 or more lets one
#: worker take every request (``docs/decisions.md#bounded-hash-load-factor``).
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_RESIDENCY_FACTOR = 1.25
DEFAULT_MIN_BOUND = 3
DEFAULT_RECOMPUTE_WEIGHT = 2.0
#: Tokens of queue cost per request in flight: a tie-breaker towards fewer requests
#: (decoding slots), small next to a prompt of 1-4k tokens. A cost near ``routing_state``'s
#: unit of work makes the cost rule move hot shoppers off their cached prefix
#: (``docs/decisions.md#bounded-hash-request-cost``).
DEFAULT_REQUEST_COST = 64
#: Share of a new key's prompt one worker must hold beyond another for the key to follow it
#: there rather than to fewer requests in flight or a roomier cache (``kv_prefix``: a
#: repeated prompt under a new key; a shared instruction prefix alone does not qualify).
SAME_PROMPT_SHARE = 0.5
NEW_KEY_PLACEMENTS = ("least_loaded", "fewest_first", "cost", "hash")
DEFAULT_NEW_KEY_PLACEMENT = "fewest_first"
DEFAULT_HISTORY_SIZE = 50_000
#: Workers remembered per key: its home and the one it last spilled to.
DEFAULT_WORKERS_PER_KEY = 2
#: Weight of the newest latency in a worker's moving average.
LATENCY_SMOOTHING = 0.3
SLOWNESS_RANGE = (0.5, 4.0)
#: Latencies this close to the median (as a ratio, or within 0.1 s) count as equal: noise
#: must not herd new keys.
SLOWNESS_DEAD_BAND = (0.8, 1.25, 0.1)
#: How long a worker's latency average is trusted after its last answer. Older, it counts as
#: unknown: a worker that new keys avoided gets no answers to refresh its figure, so without
#: this it would be starved on one old measurement
#: (``docs/decisions.md#bounded-hash-speed-and-residency``).
LATENCY_MEMORY_S = 60.0


def rendezvous_score(key: str, worker: str) -> int:
    """A pseudo-random weight of the (key, worker) pair, stable across processes."""
    digest = hashlib.blake2b(f"{worker}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preference_order(key: str, workers: Sequence[str]) -> list[str]:
    """``workers`` sorted from most to least preferred for ``key`` (ties by name)."""
    return sorted(workers, key=lambda w: (-rendezvous_score(key, w), w))


def load_bound(total_in_flight: int, n_workers: int, load_factor: float, min_bound: int = 1) -> int:
    """Largest load a worker may reach after taking one more request, at least ``min_bound``."""
    if n_workers <= 0:
        raise ValueError("load_bound() needs at least one worker")
    return max(min_bound, 1, math.ceil(load_factor * (total_in_flight + 1) / n_workers))


@dataclass(slots=True)
class Ticket:
    """One request in flight, as the policy accounts for it."""

    worker: str
    key: str
    #: Uncached tokens still counted in the worker's queue (0 once the prefill is done).
    pending: int
    started: float = field(default=0.0)
    #: ``on_finish`` has run: the key's count of requests in flight is released once.
    finished: bool = False


class BoundedHashPolicy(Policy):
    """Sticky per key, spilling under overload to where the prefix is cheapest to get."""

    name = "bounded_hash"

    def __init__(
        self,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        min_bound: int = DEFAULT_MIN_BOUND,
        residency_factor: float = DEFAULT_RESIDENCY_FACTOR,
        recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
        request_cost: int = DEFAULT_REQUEST_COST,
        history_size: int = DEFAULT_HISTORY_SIZE,
        workers_per_key: int = DEFAULT_WORKERS_PER_KEY,
        new_key_placement: str = DEFAULT_NEW_KEY_PLACEMENT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor!r}")
        if not residency_factor >= 1.0:
            raise ValueError(f"residency_factor must be >= 1.0, got {residency_factor!r}")
        if min_bound < 1:
            raise ValueError(f"min_bound must be >= 1, got {min_bound!r}")
        if not recompute_weight >= 0:
            raise ValueError(f"recompute_weight must be >= 0, got {recompute_weight!r}")
        if new_key_placement not in NEW_KEY_PLACEMENTS:
            raise ValueError(
                f"new_key_placement must be one of {NEW_KEY_PLACEMENTS}, got {new_key_placement!r}"
            )
        if request_cost < 0 or history_size < 0 or workers_per_key < 1:
            raise ValueError("request_cost and history_size must be >= 0, workers_per_key >= 1")
        self.load_factor = load_factor
        self.residency_factor = residency_factor
        self.min_bound = min_bound
        self.recompute_weight = recompute_weight
        self.request_cost = request_cost
        self.history_size = history_size
        self.workers_per_key = workers_per_key
        self.new_key_placement = new_key_placement
        # key -> ((worker, prompt tokens it last served for the key), ...), most recent first
        self._history: OrderedDict[str, tuple[tuple[str, int], ...]] = OrderedDict()
        self._queued: dict[str, int] = {}
        self._resident: dict[str, int] = {}  # worker -> last prompt sizes of keys homed there
        self._latency: dict[str, tuple[float, float]] = {}  # worker -> (average, as of)
        self._own: dict[str, Counter[str]] = {}  # key -> its requests in flight per worker
        self._clock = clock

    # ----- what the policy knows ----------------------------------------------------------

    def visits(self, key: str) -> tuple[tuple[str, int], ...]:
        """The workers that served ``key`` recently and its prompt size there."""
        return self._history.get(key, ())

    def queued_tokens(self, worker: str) -> int:
        """Uncached prompt tokens sent to ``worker`` whose prefill is not done yet."""
        return self._queued.get(worker, 0)

    def uncached(self, key: str, worker: str, size: int, blocks: Sequence[int] = ()) -> int:
        """Estimated prompt tokens ``worker`` must compute for ``key``'s prompt of ``size``
        (from the key's history; ``blocks`` are for policies that know the caches)."""
        for visited, tokens in self.visits(key):
            if visited == worker:
                return max(0, size - tokens)
        return size

    def resident_tokens(self, worker: str) -> int:
        """Prompt tokens of the remembered keys whose latest request went to ``worker``."""
        return self._resident.get(worker, 0)

    def roomy(self, workers: Sequence[str]) -> list[str]:
        """``workers`` whose resident tokens are within the residency factor of their mean
        (module doc, 5); never empty for a non-empty ``workers``."""
        if not workers:
            return []
        mean = sum(self.resident_tokens(w) for w in workers) / len(workers)
        return [w for w in workers if self.resident_tokens(w) <= self.residency_factor * mean]

    def new_key_candidates(
        self, allowed: Sequence[str], size: int = 0, blocks: Sequence[int] = ()
    ) -> list[str]:
        """Where a key seen for the first time may go among ``allowed``: the roomy ones
        (module doc, 5), or all of them if none is."""
        return self.roomy(allowed) or list(allowed)

    def slowness(self, worker: str, workers: Sequence[str]) -> float:
        """``worker``'s recent latency over the median of ``workers``' (module doc, 4)."""
        known = {w: self._latency[w][0] for w in workers if self._is_recent(w)}
        if worker not in known or len(known) < 2:
            return 1.0
        median = statistics.median(known.values())
        ratio = known[worker] / median
        low_ratio, high_ratio, seconds = SLOWNESS_DEAD_BAND
        if low_ratio <= ratio <= high_ratio or abs(known[worker] - median) < seconds:
            return 1.0
        low, high = SLOWNESS_RANGE
        return min(high, max(low, ratio))

    def cost(
        self,
        key: str,
        worker: str,
        size: int,
        load: int,
        workers: Sequence[str] = (),
        blocks: Sequence[int] = (),
    ) -> float:
        """What sending the request to ``worker`` costs, in prompt tokens at the median
        worker's speed (see module doc)."""
        queue = self.queued_tokens(worker) + self.request_cost * load
        tokens = self.recompute_weight * self.uncached(key, worker, size, blocks) + queue
        return tokens * self.slowness(worker, workers) if self.is_new(key) else tokens

    def loads_for(self, key: str, loads: Mapping[str, int]) -> Mapping[str, int]:
        """``loads`` as rule 1 weighs them for ``key`` while the bound is at its floor:
        its own requests in flight on a worker count as one there, up to ``min_bound``."""
        own = self._own.get(key)
        if not own:
            return loads
        seen = dict(loads)
        for worker, n in own.items():
            if worker in seen:
                seen[worker] = max(0, seen[worker] - (min(n, self.min_bound) - 1))
        return seen

    def least_loaded(
        self,
        key: str,
        workers: Sequence[str],
        loads: Mapping[str, int],
        size: int,
        blocks: Sequence[int] = (),
    ) -> list[str]:
        """Of ``workers``, those with the fewest requests in flight among the ones that
        would compute nearly the least of the prompt (within ``SAME_PROMPT_SHARE`` of it).
        Here every worker computes a new key's whole prompt; a policy that knows the
        caches (``kv_prefix``) keeps a new shopper with the worker that holds most of it."""
        uncached = {w: self.uncached(key, w, size, blocks) for w in workers}
        least = min(uncached.values())
        close = [w for w in workers if uncached[w] - least < SAME_PROMPT_SHARE * size]
        fewest = min(loads.get(w, 0) for w in close)
        return [w for w in close if loads.get(w, 0) == fewest]

    def order(self, key: str, workers: Sequence[str]) -> list[str]:
        """``workers`` by affinity: the key's recent workers first, then rendezvous order."""
        recent = [w for w, _ in self.visits(key) if w in workers]
        return recent + [w for w in preference_order(key, workers) if w not in recent]

    # ----- the policy ----------------------------------------------------------------------

    def pick(
        self,
        key: str,
        workers: Sequence[str],
        loads: Mapping[str, int],
        size: int = 0,
        blocks: Sequence[int] = (),
    ) -> str:
        if not workers:
            raise ValueError("pick() needs at least one worker")
        total = sum(loads.get(w, 0) for w in workers)
        bound = load_bound(total, len(workers), self.load_factor, self.min_bound)
        if bound <= self.min_bound:
            loads = self.loads_for(key, loads)
        order = self.order(key, workers)
        allowed = [w for w in order if loads.get(w, 0) < bound]
        if not allowed:
            # Unreachable for load_factor >= 1 (the least loaded is below the mean), kept
            # so that inconsistent loads still yield the least-loaded worker, never an error.
            return min(order, key=lambda w: loads.get(w, 0))
        if size <= 0:
            return allowed[0]
        if self.is_new(key):
            if self.new_key_placement == "hash":
                return allowed[0]
            if self.new_key_placement == "fewest_first":
                allowed = self.least_loaded(key, allowed, loads, size, blocks)
            allowed = self.new_key_candidates(allowed, size, blocks)
            if self.new_key_placement == "least_loaded":
                allowed = self.least_loaded(key, allowed, loads, size, blocks)
        # min() keeps the first of equal costs, i.e. the most affine worker.
        return min(allowed, key=lambda w: self.cost(key, w, size, loads.get(w, 0), workers, blocks))

    def home(self, key: str, workers: Sequence[str]) -> str | None:
        if not workers:
            return None
        return self.order(key, workers)[0]

    def is_new(self, key: str) -> bool:
        return key not in self._history

    def on_start(
        self, worker: str, key: str = "", size: int = 0, blocks: Sequence[int] = ()
    ) -> Ticket:
        pending = self.uncached(key, worker, size, blocks) if size > 0 else 0
        self._queued[worker] = self._queued.get(worker, 0) + pending
        if key:
            self._remember(key, worker, size)
            self._own.setdefault(key, Counter())[worker] += 1
        return Ticket(worker, key, pending, self._clock())

    def on_prefilled(self, worker: str, ticket: object = None) -> None:
        if isinstance(ticket, Ticket) and ticket.pending:
            self._queued[ticket.worker] = max(
                0, self._queued.get(ticket.worker, 0) - ticket.pending
            )
            ticket.pending = 0

    def on_finish(self, worker: str, ticket: object = None, ok: bool | None = None) -> None:
        self.on_prefilled(worker, ticket)
        if isinstance(ticket, Ticket) and ticket.key:
            self._release(ticket)
        if ok is True and isinstance(ticket, Ticket):
            now = self._clock()
            latency = now - ticket.started
            previous = (
                self._latency[ticket.worker][0] if self._is_recent(ticket.worker) else latency
            )
            average = previous + LATENCY_SMOOTHING * (latency - previous)
            self._latency[ticket.worker] = (average, now)
        if ok is False and isinstance(ticket, Ticket) and ticket.key:
            self._forget(ticket.key, ticket.worker)  # the worker failed: nothing cached there

    def _release(self, ticket: Ticket) -> None:
        own = self._own.get(ticket.key)
        if ticket.finished or own is None:
            return
        ticket.finished = True
        own[ticket.worker] -= 1
        if own[ticket.worker] == 0:
            del own[ticket.worker]
            if not own:
                del self._own[ticket.key]

    def _is_recent(self, worker: str) -> bool:
        entry = self._latency.get(worker)
        return entry is not None and self._clock() - entry[1] <= LATENCY_MEMORY_S

    # ----- history -------------------------------------------------------------------------

    def _remember(self, key: str, worker: str, size: int) -> None:
        """Record that ``worker`` now holds ``key``'s prompt of ``size`` tokens.

        Recorded when the request starts, not when it ends, so a key's concurrent
        requests see their worker at once instead of fanning out as "new".
        """
        others = tuple(v for v in self.visits(key) if v[0] != worker)
        self._set_visits(key, ((worker, size), *others)[: self.workers_per_key])
        self._history.move_to_end(key)
        while len(self._history) > self.history_size:
            self._set_visits(next(iter(self._history)), ())

    def _forget(self, key: str, worker: str) -> None:
        self._set_visits(key, tuple(v for v in self.visits(key) if v[0] != worker))

    def _set_visits(self, key: str, visits: tuple[tuple[str, int], ...]) -> None:
        """Replace ``key``'s history (none: forget the key), keeping residency in step."""
        before = self.visits(key)
        if before:
            home, tokens = before[0]
            self._resident[home] -= tokens
        if visits:
            self._history[key] = visits
            home, tokens = visits[0]
            self._resident[home] = self._resident.get(home, 0) + tokens
        else:
            self._history.pop(key, None)
