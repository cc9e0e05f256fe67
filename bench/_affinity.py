"""Where a phase's computed prompt tokens came from, by what each shopper's request did
relative to the shopper's previous one. Pure.

A router's total alone cannot tell a spill's cold prefill from an eviction's: both show as
prompt tokens the prefix cache did not serve. Each reply says how many of its prompt
tokens the cache served (``Outcome.cached_tokens``), and our router names the worker that
served it (``Outcome.worker``), so every request falls in one class:

* ``first``: the shopper's first request in the phase (its prompt is new to every cache
  but for the shared instruction prefix);
* ``stayed``: served by the same worker as the shopper's previous request;
* ``moved``: served by another worker (a spill or a failover: its prefix was elsewhere);
* ``returned``: a later request whose worker, or its previous one's, the router does not
  name (vllm-router's): stayed or moved cannot be told apart.

Per class: the requests, their computed tokens (prompt minus cached), and how many
recomputed more than half their prompt (``recomputed_over_half``): for ``stayed`` that is
a prefix its own worker had evicted, for ``moved`` a prefix the new worker never held.
Requests without usage figures are counted apart (``without_usage``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench._client import Outcome

CLASSES = ("first", "stayed", "moved", "returned")


def request_class(outcome: Outcome, previous: Outcome | None) -> str:
    """The class (module doc) of ``outcome``, given its shopper's previous request."""
    if previous is None:
        return "first"
    if not outcome.worker or not previous.worker:
        return "returned"
    return "stayed" if outcome.worker == previous.worker else "moved"


def computed_by_affinity(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The successful ``outcomes`` by class (module doc), each shopper's requests taken in
    ``seq`` order: the order the schedule sends them in."""
    classes: dict[str, dict[str, int]] = {
        name: {"requests": 0, "computed_tokens": 0, "recomputed_over_half": 0} for name in CLASSES
    }
    without_usage = 0
    last: dict[str, Outcome] = {}
    for o in sorted((o for o in outcomes if o.ok), key=lambda o: o.seq):
        name = request_class(o, last.get(o.shopper))
        last[o.shopper] = o
        if o.prompt_tokens is None or o.cached_tokens is None:
            without_usage += 1
            continue
        computed = o.prompt_tokens - o.cached_tokens
        into = classes[name]
        into["requests"] += 1
        into["computed_tokens"] += computed
        into["recomputed_over_half"] += int(2 * computed > o.prompt_tokens)
    return {**{k: v for k, v in classes.items() if v["requests"]}, "without_usage": without_usage}
