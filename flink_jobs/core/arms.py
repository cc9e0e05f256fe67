"""Template A/B arms: which prompt template (and, optionally, which model) a shopper gets.

``prompt.arms`` names the arms and their weights::

    shopper_intent_v1.j2:50,shopper_intent_v2.j2:50
    shopper_intent_v1.j2:90,shopper_intent_v2.j2@SmolLM2-360M-Instruct:10

Each arm is ``template[@model]:weight``; the weight is a whole number (0 keeps the arm
declared but gives it nobody). Empty: one arm, ``prompt.template`` for everyone.

A shopper's arm is a pure function of its id (:func:`assign_arm`): a salted 64-bit hash of
the id, read as a point of [0, 1), falls into one arm's share (its weight over the total,
in declared order). So a shopper keeps its arm across prompts, sessions, restarts and
operator instances (its prompt prefix stays one template's, and its intents are comparable
over time), and the shares follow the weights over many shoppers. Changing the setting
moves shoppers between arms: compare arms within one setting.

An arm's name (:attr:`Arm.name`, the template, with ``@model`` when it names one) labels
its records (``template``, ``model``) and its metrics: a small, fixed set.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

#: Mixed into the hash, so a shopper's arm is independent of other hashes of its id (the
#: router's worker choice among them).
_SALT = b"shopper-intents:arm:"
_ARM = re.compile(r"^(?P<template>[^@:\s]+)(?:@(?P<model>[^:\s]+))?:(?P<weight>\d+)$")


class ArmsError(ValueError):
    """``prompt.arms`` does not parse or cannot split anyone; the message says why."""


@dataclass(frozen=True, slots=True)
class Arm:
    template: str
    weight: int
    model: str = ""  #: empty: llm.model

    @property
    def name(self) -> str:
        return f"{self.template}@{self.model}" if self.model else self.template


def parse_arms(text: str, default_template: str) -> tuple[Arm, ...]:
    """The arms ``text`` declares (module docstring); empty text: ``default_template`` for
    everyone. Raises :class:`ArmsError` for a malformed entry, a repeated arm or weights
    that sum to 0."""
    if not text.strip():
        return (Arm(default_template, 1),)
    arms = []
    for entry in text.split(","):
        match = _ARM.match(entry.strip())
        if match is None:
            raise ArmsError(
                f"{entry.strip()!r} is not template[@model]:weight "
                "(e.g. shopper_intent_v2.j2:50, weight a whole number >= 0)"
            )
        arms.append(Arm(match["template"], int(match["weight"]), match["model"] or ""))
    names = [a.name for a in arms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ArmsError(f"arm {', '.join(repeated)} is named more than once")
    if sum(a.weight for a in arms) == 0:
        raise ArmsError("the weights sum to 0: nobody would get a prompt")
    return tuple(arms)


def arm_point(shopper_id: str) -> int:
    """A stable 64-bit number for ``shopper_id`` (the same on every machine and run)."""
    digest = hashlib.blake2b(_SALT + shopper_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign_arm(shopper_id: str, arms: Sequence[Arm]) -> Arm:
    """The arm of ``shopper_id``: the share its point falls in (an arm of weight 0 has
    none)."""
    total = sum(a.weight for a in arms)
    if total <= 0:
        raise ArmsError("the weights sum to 0: nobody would get a prompt")
    at = arm_point(shopper_id) * total  # compared with shares scaled by 2**64: exact
    bound = 0
    for arm in arms:
        bound += arm.weight << 64
        if at < bound:
            return arm
    raise AssertionError("unreachable: the shares cover [0, 1)")
