"""Routing policies behind one small interface, built by name with ``make_policy``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
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

_FACTORIES: dict[str, Callable[..., Policy]] = {
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
    accepted = inspect.signature(factory).parameters
    return factory(**{k: v for k, v in kwargs.items() if k in accepted})
