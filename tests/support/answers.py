"""Whether every shopper's newest prompt was answered, and if not, why: the oracle the
restart and rescale tests share.

A prompt is *answered* when Redis holds the model's intent at the prompt's version
(``version_ts``, ``seq``), or the prompt was dead-lettered. The prompts come from the job's
audit topic (``kafka.prompts_topic``), which every attempt of the job writes at least once:
an attempt killed after its last checkpoint may have written prompts that the attempt
restored from that checkpoint renders again, or not at all. :class:`Unanswered` carries what
a failed wait needs to tell those cases apart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from intent_reader.layout import intent_key

Version = tuple[int, int]  # (version_ts, seq)


@dataclass(frozen=True)
class Stored:
    """What Redis holds for a shopper: its intent's version and source."""

    version: Version
    source: str


@dataclass(frozen=True)
class Unanswered:
    """A shopper whose newest prompt has neither the model's intent nor a dead letter."""

    shopper_id: str
    newest: Version
    stored: Stored | None
    #: Every prompt of the shopper on the audit topic: (version_ts, seq, sha256 prefix),
    #: in topic order. Two digests for one seq: attempts rendered that prompt differently.
    prompts: tuple[tuple[int, int, str], ...]

    def __str__(self) -> str:
        stored = f"{self.stored.version} from {self.stored.source}" if self.stored else "nothing"
        return (
            f"{self.shopper_id}: newest prompt {self.newest}, Redis holds {stored}; "
            f"prompts on the topic {list(self.prompts)}"
        )


def stored_versions(client: redis.Redis, prefix: str, shoppers: Iterable[str]) -> dict:
    """``shopper -> Stored`` for the shoppers with an intent under ``prefix``."""
    shoppers = list(shoppers)
    pipe = client.pipeline(transaction=False)
    for shopper in shoppers:
        pipe.hmget(intent_key(shopper, prefix), "version_ts", "version_seq", "source")
    stored = {}
    for shopper, (ts, seq, source) in zip(shoppers, pipe.execute(), strict=True):
        if ts is not None:
            stored[shopper] = Stored((int(ts), int(seq)), (source or b"model").decode())
    return stored


def unanswered(
    prompts: list[dict], dead_letters: list[dict], stored: dict[str, Stored]
) -> list[Unanswered]:
    """Shoppers whose newest prompt (by version) is neither answered by the model in
    ``stored`` nor dead-lettered, each with what the topic and Redis say of it."""
    by_shopper: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for p in prompts:
        by_shopper[p["shopper_id"]].append((p["version_ts"], p["seq"], p["sha256"][:12]))
    dead = {
        (d["shopper_id"], d["context"]["prompt_seq"])
        for d in dead_letters
        if d.get("context") and "prompt_seq" in d["context"]
    }
    missing = []
    for shopper, seen in by_shopper.items():
        newest = max((ts, seq) for ts, seq, _ in seen)
        held = stored.get(shopper)
        answered = held is not None and held.version == newest and held.source == "model"
        if not answered and (shopper, newest[1]) not in dead:
            missing.append(Unanswered(shopper, newest, held, tuple(seen)))
    return missing


def unanswered_in(
    client: redis.Redis, prefix: str, prompts: list[dict], dead_letters: list[dict]
) -> list[Unanswered]:
    """:func:`unanswered` against what Redis holds under ``prefix`` now."""
    shoppers = {p["shopper_id"] for p in prompts}
    return unanswered(prompts, dead_letters, stored_versions(client, prefix, shoppers))
