"""Routing policies behind one small interface, built by name with ``make_policy``."""

from __future__ import annotations

import inspect
from typing import Any

from inference_sidecar.policies.base import Policy
from inference_sidecar.policies.bounded_hash import BoundedHashPolicy
from inference_sidecar.policies.kv_prefix import KVPrefixPolicy
from inference_sidecar.policies.round_robin import RoundRobinPolicy

__all__ = [
    "POLICY_NAMES",
    "BoundedHashPolicy",
    "KVPrefixPolicy",
    "Policy",
    "RoundRobinPolicy",
    "make_policy",
]

_FACTORIES: dict[str, type[Policy]] = {
    BoundedHashPolicy.name: BoundedHashPolicy,
    KVPrefixPolicy.name: KVPrefixPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build the policy called ``name``; options it does not take are ignored.

    Ignoring unknown options lets one router config carry e.g. ``load_factor`` whatever
    the policy chosen.
    """
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        ) from None
    accepted = options(factory)
    return factory(**{k: v for k, v in kwargs.items() if k in accepted})


def options(factory: type[Policy]) -> set[str]:
    """The keyword options ``factory`` takes, its bases' included where it passes
    ``**kwargs`` on to them (``kv_prefix`` takes ``bounded_hash``'s tuning that way; read
    from its own signature alone, it silently dropped ``load_factor`` and the rest)."""
    names: set[str] = set()
    for cls in factory.__mro__:
        if "__init__" not in vars(cls):
            continue
        params = list(inspect.signature(vars(cls)["__init__"]).parameters.values())[1:]
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names
