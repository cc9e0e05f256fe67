"""Read the shopper intents the job writes to Redis: typed, with their age, missing and
stale made explicit.

The layout read here is documented in ``docs/redis_layout.md`` (one hash per shopper at
``{prefix}:intent:{shopper_id}``); this module needs only redis-py, not the job.

Behaviour:

- a shopper with no hash (never inferred, or expired after 24 h) is **missing**: ``get``
  returns None and ``get_many`` maps the shopper to None;
- an intent whose newest event is older than ``max_age_s`` is **stale**: with
  ``stale="flag"`` (the default) it is returned with ``stale=True``, with ``stale="drop"``
  it is treated as missing;
- a hash that exists but cannot be read as an intent (a foreign writer, a missing field,
  a key of another type, bytes that are not UTF-8, a field over ``MAX_FIELD_BYTES``, JSON
  nested too deep, a confidence that is not a number within [0, 1]) is treated as missing,
  logged and counted (``malformed``), and named with its reason in the batch's ``errors``;
  a ``strict`` reader raises :class:`MalformedIntentError` instead. One bad hash never
  costs the other shoppers of a batch their intents;
- labels the reader does not know (``INTENT_LABELS``: a later schema may add some) are left
  out of ``labels``.

A reader made by ``from_url`` owns its Redis client and closes it: ``close()`` or ``with``
(``aclose()`` or ``async with`` for :class:`AsyncIntentReader`); a reader given a client
leaves it open, as redis-py and httpx do.

Beside the model's answer a record carries what the job knows exactly (``facts``: the
session's categories, brands, price band, cart, last purchase and searches, decoded JSON)
and what made it (``source``: ``"model"``, or ``"rules"`` for the rules-only record the job
writes the moment a prompt fires, which the model's answer then replaces). Records written
before those fields existed read with ``facts=None`` and ``source="model"``.

``age_ms`` is the reader's clock minus ``version_ts``: how long ago the newest event the
intent reflects happened (clamped at 0 for clocks that disagree). ``written_age_ms`` is the
same for the time the intent landed in Redis (``written_at_ms``, Redis server time).

A batch is one pipelined round trip of ``HMGET`` calls (not a transaction).
:class:`IntentReader` reads over ``redis.Redis``, :class:`AsyncIntentReader` (the same API,
coroutines) over ``redis.asyncio.Redis``.

Redis Cluster: ``from_url(url, cluster=True)`` (or a reader given a
``redis.cluster.RedisCluster`` / ``redis.asyncio.cluster.RedisCluster``) reads the cluster
layout the job writes with ``redis.cluster`` (``docs/redis_layout.md``, "Redis Cluster"):
``shards`` must be the job's ``redis.cluster_shards`` (the default is the same). A batch is
then one pipelined round trip per node, the client following ``MOVED`` and ``ASK`` while
slots move. A shopper whose reply is an error of a cluster in motion (its node lost
mid-batch, ``CLUSTERDOWN``, a redirection that did not settle) maps to None and is named in
``errors`` (:class:`ReaderUnavailableError`), the others are read; a batch that cannot be
sent, or whose every reply is such an error, raises it, as on a single node. An
:class:`AsyncIntentReader` over a cluster client sends one batch at a time
(``intent_reader.clients.pipeline_lock``).

Errors::

    IntentReaderError             base
    ├── ReaderUnavailableError    Redis could not be reached or timed out
    └── MalformedIntentError      a hash is not a readable intent (strict readers only)
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import redis
import redis.asyncio

from intent_reader.clients import (
    UNAVAILABLE_ERRORS,
    async_client,
    is_unavailable,
    layout_for,
    pipeline_lock,
    sync_client,
)
from intent_reader.layout import (
    DEFAULT_PREFIX,
    DEFAULT_SOURCE,
    HASH_FIELDS,
    INTENT_LABELS,
    MAX_FIELD_BYTES,
    OPTIONAL_FIELDS,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE_S = 15 * 60.0

#: The hash fields read, in HMGET order (see docs/redis_layout.md).
FIELDS = HASH_FIELDS

StalePolicy = Literal["flag", "drop"]


# --- errors ------------------------------------------------------------------------------


class IntentReaderError(Exception):
    """Base error of the intent reader."""


class ReaderUnavailableError(IntentReaderError):
    """Redis could not be reached or did not answer in time."""


class MalformedIntentError(IntentReaderError):
    """A shopper's hash exists but is not a readable intent."""

    def __init__(self, shopper_id: str, reason: str) -> None:
        self.shopper_id = shopper_id
        self.reason = reason
        super().__init__(f"malformed intent hash for shopper {shopper_id!r}: {reason}")


# --- values ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntentLabel:
    """One of the (at most three) intents the model gave, most confident first."""

    label: str
    confidence: float
    category: str | None = None


@dataclass(frozen=True, slots=True)
class ShopperIntent:
    """A shopper's stored intent as a ranking service sees it."""

    shopper_id: str
    labels: tuple[IntentLabel, ...]
    summary: str
    top_label: str
    top_confidence: float
    version_ts: int
    version_seq: int
    event_time_ms: int
    written_at_ms: int
    template: str
    template_hash: str
    model: str
    age_ms: int
    written_age_ms: int
    stale: bool
    intent_json: str
    #: What made the intent: "model", or "rules" (see the module docstring).
    source: str = DEFAULT_SOURCE
    #: The session's grounded facts (decoded JSON, docs/redis_layout.md); None when absent.
    facts: Any = None
    #: The model's own answer (JSON) before the job held it to the cart's facts; "" on a
    #: rules-only record. A record written before the field existed stored the answer as is.
    answer_json: str = ""

    @property
    def is_rules_only(self) -> bool:
        """Whether the model has not answered for this version yet (or failed to)."""
        return self.source == "rules"

    @property
    def age_s(self) -> float:
        return self.age_ms / 1000.0

    @property
    def intent(self) -> Any:
        """The intent document (``{"intents": [...], "summary": ...}``), decoded."""
        return json.loads(self.intent_json)

    @property
    def answer(self) -> Any:
        """The model's own answer, decoded: ``answer_json``, or the intent itself on a model
        record written before the field existed; None on a rules-only record."""
        if self.answer_json:
            return json.loads(self.answer_json)
        return None if self.is_rules_only else self.intent

    @property
    def categories(self) -> tuple[str, ...]:
        """Categories named by the intents, most confident first, each once."""
        seen: dict[str, None] = {}
        for label in self.labels:
            if label.category:
                seen.setdefault(label.category, None)
        return tuple(seen)

    def confidence_of(self, label: str) -> float:
        """The confidence the model gave ``label`` (0 when it did not name it)."""
        return max((x.confidence for x in self.labels if x.label == label), default=0.0)


class IntentBatch(dict[str, ShopperIntent | None]):
    """What ``get_many`` returns: each requested shopper mapped to its intent or None, in
    request order, and ``errors``, the shoppers whose hash could not be read (mapped to None
    above) with the reason."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[str, IntentReaderError] = {}


# --- the pure part -----------------------------------------------------------------------

_KNOWN_LABELS = frozenset(INTENT_LABELS)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def confidence(value: Any) -> float:
    """``value`` as a confidence: a finite number within [0, 1], else ValueError (NaN and
    1e308 would order a re-ranking arbitrarily or swamp every other score)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"confidence {value!r:.40} is not a number")
    number = float(value)
    if not (math.isfinite(number) and 0.0 <= number <= 1.0):
        raise ValueError(f"confidence {value!r:.40} is not a finite number within [0, 1]")
    return number


def _labels(intent_json: str) -> tuple[IntentLabel, ...]:
    doc = json.loads(intent_json)
    if not isinstance(doc, dict) or not isinstance(doc.get("intents") or [], list):
        raise ValueError("the intent is not an object with a list of intents")
    out = []
    for item in doc.get("intents") or ():
        if not isinstance(item, dict):
            raise ValueError(f"an intent entry is not an object: {item!r:.80}")
        label, category = item.get("label"), item.get("category") or None
        if category is not None and not isinstance(category, str):
            raise ValueError(f"category {category!r:.80} is not text")
        level = confidence(item.get("confidence"))
        if label in _KNOWN_LABELS:  # a label of a later schema is left out, as documented
            out.append(IntentLabel(label, level, category))
    return tuple(out)


def parse_intent(
    shopper_id: str,
    values: Sequence[bytes | str | None],
    now_ms: int,
    max_age_ms: int,
) -> ShopperIntent | None:
    """A ``ShopperIntent`` from the HMGET reply for ``FIELDS``; None when the hash is absent.

    Raises :class:`MalformedIntentError` when some fields are there but not all, a value is
    over ``MAX_FIELD_BYTES`` or not UTF-8, or does not parse (JSON nested too deep, a
    confidence that is not a finite number within [0, 1], a number that is not one).
    """
    if len(values) != len(FIELDS):
        raise ValueError(f"expected {len(FIELDS)} values, got {len(values)}")
    if all(v is None for v in values):
        return None
    data = dict(zip(FIELDS, values, strict=True))
    absent = [name for name, value in data.items() if value is None and name not in OPTIONAL_FIELDS]
    if absent:
        raise MalformedIntentError(shopper_id, f"missing fields {', '.join(absent)}")
    for name, value in data.items():
        if value is not None and len(value) > MAX_FIELD_BYTES:
            raise MalformedIntentError(
                shopper_id, f"field {name} holds {len(value)} bytes; at most {MAX_FIELD_BYTES}"
            )
    try:
        text = {name: _text(value) for name, value in data.items() if value is not None}
        version_ts = int(text["version_ts"])
        written_at_ms = int(text["written_at_ms"])
        labels = _labels(text["intent"])
        age_ms = max(0, now_ms - version_ts)
        return ShopperIntent(
            shopper_id=shopper_id,
            labels=labels,
            summary=text["summary"],
            top_label=text["top_label"],
            top_confidence=confidence(float(text["top_confidence"])),
            version_ts=version_ts,
            version_seq=int(text["version_seq"]),
            event_time_ms=int(text["event_time_ms"]),
            written_at_ms=written_at_ms,
            template=text["template"],
            template_hash=text["template_hash"],
            model=text["model"],
            age_ms=age_ms,
            written_age_ms=max(0, now_ms - written_at_ms),
            stale=age_ms > max_age_ms,
            intent_json=text["intent"],
            source=text.get("source") or DEFAULT_SOURCE,
            facts=json.loads(text["facts"]) if text.get("facts") else None,
            answer_json=text.get("answer", ""),
        )
    except RecursionError as e:
        raise MalformedIntentError(shopper_id, "JSON nested too deep") from e
    except UnicodeDecodeError as e:
        raise MalformedIntentError(shopper_id, f"a field is not UTF-8 ({e.reason})") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MalformedIntentError(shopper_id, str(e)[:200]) from e


# --- the client --------------------------------------------------------------------------


class _ReaderSettings:
    """What both readers share: the staleness rule and turning replies into intents."""

    def __init__(
        self,
        client: Any,
        prefix: str = DEFAULT_PREFIX,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        stale: StalePolicy = "flag",
        strict: bool = False,
        clock: Callable[[], float] = time.time,
        owns_client: bool = False,
        shards: int | None = None,
    ) -> None:
        if not (max_age_s > 0 and math.isfinite(max_age_s)):
            raise ValueError(f"max_age_s must be a positive number, got {max_age_s}")
        _check_policy(stale)
        self.client = client
        self.prefix = prefix
        #: The key layout read: ``shards`` slot groups (None: the cluster layout's default
        #: over a cluster client, the single-node layout otherwise).
        self.layout = layout_for(client, prefix, shards)
        self.max_age_s = max_age_s
        self.stale = stale
        self.strict = strict
        self._clock = clock
        #: Whether ``close``/``aclose`` closes the client (a reader made by ``from_url``).
        self.owns_client = owns_client
        #: Hashes found malformed since the reader was made (each also logged).
        self.malformed = 0

    def _queue(self, pipe: Any, ids: Sequence[str]) -> None:
        for shopper_id in ids:
            pipe.hmget(self.layout.intent_key(shopper_id), FIELDS)

    def _results(
        self,
        ids: Sequence[str],
        replies: Sequence[Any],
        max_age_s: float | None,
        stale: StalePolicy | None,
    ) -> IntentBatch:
        """Each shopper's reply (its HMGET values, or the error Redis answered for its key
        alone) as its intent, None, or an entry of ``errors``."""
        policy = self.stale if stale is None else _check_policy(stale)
        max_age_ms = int((self.max_age_s if max_age_s is None else max_age_s) * 1000)
        now_ms = int(self._clock() * 1000)
        out = IntentBatch()
        unavailable = [r for r in replies if is_unavailable(r)]
        if unavailable and len(unavailable) == len(replies):
            raise ReaderUnavailableError(f"Redis unavailable: {unavailable[0]}")
        for shopper_id, reply in zip(ids, replies, strict=True):
            if is_unavailable(reply):  # its node alone is down, or its slot moving
                out.errors[shopper_id] = ReaderUnavailableError(f"Redis unavailable: {reply}")
                out[shopper_id] = None
                continue
            try:
                if isinstance(reply, redis.ResponseError):  # WRONGTYPE: another type at the key
                    raise MalformedIntentError(shopper_id, f"Redis refused the read: {reply}")
                result = parse_intent(shopper_id, reply, now_ms, max_age_ms)
            except MalformedIntentError as e:
                self.malformed += 1
                if self.strict:
                    raise
                log.warning("%s; treated as missing", e)
                out.errors[shopper_id] = e
                result = None
            if result is not None and result.stale and policy == "drop":
                log.debug("intent of %s is stale (%d ms); dropped", shopper_id, result.age_ms)
                result = None
            out[shopper_id] = result
        return out


class _Timeouts(TypedDict):
    socket_timeout: float
    socket_connect_timeout: float


def _client_timeouts(timeout_s: float) -> _Timeouts:
    """Timeouts that suit a ranking request's budget."""
    return {"socket_timeout": timeout_s, "socket_connect_timeout": max(timeout_s, 0.5)}


class IntentReader(_ReaderSettings):
    """Get and batch-get intents over a ``redis.Redis`` client (thread-safe like the client).

    ``max_age_s`` and ``stale`` set the default staleness rule; each call may override them.
    """

    client: redis.Redis

    @classmethod
    def from_url(
        cls, url: str, timeout_s: float = 0.05, *, cluster: bool = False, **kwargs: Any
    ) -> IntentReader:
        """A reader with its own client, which :meth:`close` closes; the timeouts suit a
        ranking request's budget. ``cluster``: a Redis Cluster client, from any node's
        address or the configuration endpoint."""
        client = sync_client(url, cluster=cluster, **_client_timeouts(timeout_s))
        return cls(client, owns_client=True, **kwargs)

    def close(self) -> None:
        """Close the client if this reader made it (``from_url``); a given one stays open."""
        if self.owns_client:
            self.client.close()

    def __enter__(self) -> IntentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(
        self,
        shopper_id: str,
        max_age_s: float | None = None,
        stale: StalePolicy | None = None,
    ) -> ShopperIntent | None:
        """The intent of ``shopper_id``; None when missing (or stale, with ``stale="drop"``)."""
        return self.get_many([shopper_id], max_age_s, stale)[shopper_id]

    def get_many(
        self,
        shopper_ids: Iterable[str],
        max_age_s: float | None = None,
        stale: StalePolicy | None = None,
    ) -> IntentBatch:
        """Each requested shopper mapped to its intent or None, in order (one round trip);
        the batch's ``errors`` name the shoppers whose hash could not be read, and why."""
        ids = _requested(shopper_ids, stale)
        if not ids:
            return IntentBatch()
        return self._results(ids, self._hmget_all(ids), max_age_s, stale)

    def _hmget_all(self, ids: Sequence[str]) -> list[Any]:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                self._queue(pipe, ids)
                return list(pipe.execute(raise_on_error=False))
        except UNAVAILABLE_ERRORS as e:
            raise ReaderUnavailableError(f"Redis unavailable: {e}") from e


def _requested(shopper_ids: Iterable[str], stale: StalePolicy | None) -> list[str]:
    """The shoppers to read, each once in order; a wrong ``stale`` raises before any I/O."""
    ids = list(dict.fromkeys(shopper_ids))
    if ids and stale is not None:
        _check_policy(stale)
    return ids


def _check_policy(stale: str) -> StalePolicy:
    if stale == "flag":
        return "flag"
    if stale == "drop":
        return "drop"
    raise ValueError(f"stale must be 'flag' or 'drop', got {stale!r}")


class AsyncIntentReader(_ReaderSettings):
    """:class:`IntentReader` for asyncio services, over a ``redis.asyncio.Redis`` client:
    the same settings and results, ``get`` and ``get_many`` awaited."""

    client: redis.asyncio.Redis

    @classmethod
    def from_url(
        cls, url: str, timeout_s: float = 0.05, *, cluster: bool = False, **kwargs: Any
    ) -> AsyncIntentReader:
        """A reader with its own client, which :meth:`aclose` closes; the timeouts suit a
        ranking request's budget. ``cluster``: a Redis Cluster client (it reads the
        topology on first use)."""
        client = async_client(url, cluster=cluster, **_client_timeouts(timeout_s))
        return cls(client, owns_client=True, **kwargs)

    async def __aenter__(self) -> AsyncIntentReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def get(
        self,
        shopper_id: str,
        max_age_s: float | None = None,
        stale: StalePolicy | None = None,
    ) -> ShopperIntent | None:
        """The intent of ``shopper_id``; None when missing (or stale, with ``stale="drop"``)."""
        return (await self.get_many([shopper_id], max_age_s, stale))[shopper_id]

    async def get_many(
        self,
        shopper_ids: Iterable[str],
        max_age_s: float | None = None,
        stale: StalePolicy | None = None,
    ) -> IntentBatch:
        """Each requested shopper mapped to its intent or None, in order (one round trip);
        the batch's ``errors`` name the shoppers whose hash could not be read, and why."""
        ids = _requested(shopper_ids, stale)
        if not ids:
            return IntentBatch()
        return self._results(ids, await self._hmget_all(ids), max_age_s, stale)

    async def _hmget_all(self, ids: Sequence[str]) -> list[Any]:
        try:
            async with pipeline_lock(self.client), self.client.pipeline(transaction=False) as pipe:
                self._queue(pipe, ids)
                return list(await pipe.execute(raise_on_error=False))
        except UNAVAILABLE_ERRORS as e:
            raise ReaderUnavailableError(f"Redis unavailable: {e}") from e

    async def aclose(self) -> None:
        """Close the client if this reader made it (``from_url``); a given one stays open."""
        if self.owns_client:
            await self.client.aclose()
