"""The Redis write protocol for inferred shopper intents: atomic, versioned, expiring.

Key layout
----------
One hash per shopper::

    {prefix}:intent:{shopper_id}        e.g. si:intent:shopper-42   (default prefix "si")

=================  =====================================================================
field              value (all stored as strings)
=================  =====================================================================
version_ts         epoch ms of the newest event the intent is based on
version_seq        the shopper's prompt sequence number (breaks ties on version_ts)
intent             the intent as JSON (the bounded intent schema)
top_label          label of the most confident intent
top_confidence     its confidence, 0..1
summary            the short summary of the shopper's session
event_time_ms      epoch ms (event time) the prompt was triggered at
template           name of the prompt template
template_hash      hash of that template
model              the model that produced the intent ("" for a rules-only record)
facts              the session's grounded facts as JSON (``grounding.GroundedFacts``)
source             ``model`` (the model's answer) or ``rules`` (derived by rules alone)
answer             the model's own answer as JSON, before ``grounding.reconcile`` held it
                   to the cart's facts ("" for a rules-only record)
written_at_ms      Redis server time (epoch ms) of the write
=================  =====================================================================

The key expires ``ttl_ms`` after the last write sent to it, landed or refused (default
24 h): a refused write extends the expiry (never shortens it), so the newer intent that
refused it outlives it, and an older result retried later is refused again instead of
landing on an expired key. Readers that need a few fields use ``HMGET``;
``IntentStore.read`` returns them all.

Write rule
----------
A write carries a version, the triple ``(version_ts, version_seq, rank)`` where ``rank`` is
its source's (``rules`` 0, ``model`` 1; a stored record without ``source``, written before
the field existed, ranks as model). It is applied only when that triple is strictly
greater, compared lexicographically, than the stored one (or when the key does not exist):
a newer event time wins; for equal event times the higher prompt sequence wins; for the
same prompt the model's answer wins over the rules-only record written when the prompt
fired (two speeds: the rules record lands at once, the model's replaces it), never the
reverse; an equal version is a no-op. A write replaces every field above and resets the
expiry. An older result never overwrites a newer one, whatever the order in which
concurrent writers arrive.

Re-evaluation (``reevaluate``, ``redis.reevaluate``): a backfill that replays recorded
events with a new prompt template or model computes the same versions as the live job did,
so its writes would all be no-ops. A re-evaluating store also lands a write at an equal
version when the stored intent was made by another ``template_hash`` or ``model``; an older
version is still refused, and the same template and model at an equal version is still a
no-op (a replayed backfill changes nothing). A live store never replaces an equal version,
so the live job replaying a checkpoint does not undo a re-evaluation; it logs a warning the
first time an equal version of another template or model refuses its write.

The check and the write run in one Lua script (``EVALSHA``), so they are atomic. A batch
is sent as one pipeline (one round trip per node, not a transaction: each upsert is atomic on
its own).

Redis Cluster
-------------
Over a cluster client the keys follow the cluster layout (``intent_reader.layout.KeyLayout``
with ``shards`` slot groups): ``{prefix}:intent:{s<n>}:{shopper_id}``, ``n`` the shopper's
group, and the notification stream's shard ``{stream}:{s<n>}``. Both keys of one write share
the hash tag, hence the slot, so the script stays one atomic call on the primary that owns
it. The client follows ``MOVED`` and ``ASK`` while slots move; a write that still meets a
cluster in motion (``CLUSTERDOWN`` while a failed primary's replica is promoted,
``TRYAGAIN`` while its slot migrates, a redirection that did not settle, a node that cannot
be reached) is retried like an unavailable Redis, and the store reads the topology again
before the next attempt. The asyncio store sends one pipeline at a time on a cluster client
(``intent_reader.clients.pipeline_lock`` says why). Replication is asynchronous: a write
the old primary acknowledged and had not sent to its replica before it died is lost
(docs/redis_layout.md, "Redis Cluster").

Update notifications (optional)
-------------------------------
With ``notify_stream`` set (``redis.notify_stream``), a write that lands also appends one
entry to that stream in the same script (``XADD key MAXLEN ~ maxlen *``)::

    shopper_id  version_ts  version_seq  top_label  written_at_ms  source  template  model
    intent

A refused (stale or equal) write appends nothing. On a cluster the entry goes to the
stream's shard in the shopper's slot (above); ``intent_reader.IntentUpdates`` reads the
stream, or all its shards. The script checks both keys' types before it writes anything:
were the stream key something else (say, the stats hash), the intent would otherwise land
and the ``XADD`` after it fail, a stored intent reported as failed. The job also refuses such a key
at start (:func:`check_notify_stream`; ``RedisConfig.validate`` for a name of the layout).
Approximate trimming keeps about ``maxlen`` entries: a consumer that falls further behind
misses notifications, never intents (the hash stays the truth).

Everything that decides what is sent (key names, script arguments, parsing a stored hash)
is a pure function here; ``IntentStore`` and ``AsyncIntentStore`` only do the I/O.

Errors::

    IntentStoreError           base; any other refusal (a bug or a misconfiguration: fail loudly)
    ├── NotifyStreamError      the notification stream key holds another type (a
    │                          misconfiguration: every write would fail; nothing written)
    ├── StoreUnavailableError  Redis could not be reached or timed out, or the cluster client
    │   │                      found no node for the slot (retry later)
    │   └── StoreBusyError     Redis answered but cannot take writes for now: READONLY (a
    │                          replica, e.g. after a failover), LOADING, BUSY (a long script),
    │                          OOM (``maxmemory`` reached under ``noeviction``), MASTERDOWN,
    │                          NOREPLICAS, TRYAGAIN, CLUSTERDOWN, MOVED or ASK left over
    │                          (retry later)
    └── KeyRejectedError       this shopper's key cannot take the write (WRONGTYPE: the key
                               holds another type); retrying cannot help, other keys can
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis
import redis.asyncio
import redis.exceptions

from intent_reader.clients import (
    UNAVAILABLE_ERRORS,
    AsyncClient,
    SyncClient,
    arediscover,
    is_cluster,
    layout_for,
    pipeline_lock,
    rediscover,
)
from intent_reader.layout import (
    DEFAULT_PREFIX,
    DEFAULT_SOURCE,
    DEFAULT_TTL_MS,
    RECORD_FIELDS,
    SOURCE_RANKS,
    KeyLayout,
)
from intent_reader.layout import intent_key as intent_key  # the single-node key, re-exported

log = logging.getLogger(__name__)

DEFAULT_NOTIFY_MAXLEN = 100_000

#: Both keys' types are checked before anything is written: a shopper's key of another type
#: refuses that shopper's write (WRONGTYPE), a notification stream key of another type refuses
#: every write (NOTIFYWRONGTYPE, a misconfiguration), and neither leaves a write half done.
#: KEYS[1] = the shopper's hash; ARGV[1] = version_ts; ARGV[2] = version_seq; ARGV[3] = TTL ms;
#: ARGV[4..] = field, value, field, value, ... (RECORD_FIELDS). The version is the triple
#: (version_ts, version_seq, rank of source: rules 0, model or absent 1). Returns 1 if written;
#: else 0, or -1 when the version is equal and the stored intent was made by another template
#: or model (what a re-evaluation replaces). A refused write extends the key's expiry to TTL ms
#: if it would end sooner. With KEYS[2] (the notification stream) the last three ARGV are the
#: stream's approximate MAXLEN, the shopper id and the top label, and a landed write also
#: appends NOTIFY_FIELDS.
_SCRIPT_TEMPLATE = """
local intent_type = redis.call('TYPE', KEYS[1])['ok']
if intent_type ~= 'hash' and intent_type ~= 'none' then
  return redis.error_reply('WRONGTYPE the intent key holds a ' .. intent_type .. ', not a hash')
end
if KEYS[2] then
  local stream_type = redis.call('TYPE', KEYS[2])['ok']
  if stream_type ~= 'stream' and stream_type ~= 'none' then
    return redis.error_reply('NOTIFYWRONGTYPE the notification stream key holds a ' ..
                             stream_type .. ', not a stream')
  end
end
local ts = tonumber(ARGV[1])
local seq = tonumber(ARGV[2])
local rank = 1
if ARGV[@SOURCE@] == 'rules' then
  rank = 0
end
local last = #ARGV
if KEYS[2] then
  last = last - 3
end
local stored = redis.call('HMGET', KEYS[1], 'version_ts', 'version_seq', 'template_hash', 'model',
                          'source')
local stored_ts = tonumber(stored[1])
if stored_ts then
  local stored_seq = tonumber(stored[2]) or -1
  local stored_rank = 1
  if stored[5] == 'rules' then
    stored_rank = 0
  end
  local refused = 0
  if ts < stored_ts or (ts == stored_ts and (seq < stored_seq
      or (seq == stored_seq and rank < stored_rank))) then
    refused = 0
  elseif ts == stored_ts and seq == stored_seq and rank == stored_rank then
    if stored[3] == ARGV[@TEMPLATE_HASH@] and stored[4] == ARGV[@MODEL@] then
      refused = 0
    elseif @REEVALUATE@ then
      refused = nil
    else
      refused = -1
    end
  else
    refused = nil
  end
  if refused then
    local pttl = redis.call('PTTL', KEYS[1])
    if pttl >= 0 and pttl < tonumber(ARGV[3]) then
      redis.call('PEXPIRE', KEYS[1], ARGV[3])
    end
    return refused
  end
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local written_at_ms = string.format('%.0f', now_ms)
redis.call('HSET', KEYS[1], 'version_ts', ARGV[1], 'version_seq', ARGV[2],
           'written_at_ms', written_at_ms, unpack(ARGV, 4, last))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if KEYS[2] then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[last + 1], '*',
             'shopper_id', ARGV[last + 2], 'version_ts', ARGV[1], 'version_seq', ARGV[2],
             'top_label', ARGV[last + 3], 'written_at_ms', written_at_ms,
             'source', ARGV[@SOURCE@], 'template', ARGV[@TEMPLATE@], 'model', ARGV[@MODEL@],
             'intent', ARGV[@INTENT@], 'answer', ARGV[@ANSWER@])
end
return 1
"""


def _value_index(field: str) -> str:
    """The ARGV index (1-based, as Lua counts) of ``field``'s value in ``upsert_args``."""
    return str(4 + 2 * RECORD_FIELDS.index(field) + 1)


def _script(reevaluate: bool) -> str:
    return (
        _SCRIPT_TEMPLATE.replace("@TEMPLATE_HASH@", _value_index("template_hash"))
        .replace("@TEMPLATE@", _value_index("template"))
        .replace("@MODEL@", _value_index("model"))
        .replace("@SOURCE@", _value_index("source"))
        .replace("@INTENT@", _value_index("intent"))
        .replace("@ANSWER@", _value_index("answer"))
        .replace("@REEVALUATE@", "true" if reevaluate else "false")
    )


#: The live job's upsert: strictly newer versions land.
UPSERT_SCRIPT = _script(reevaluate=False)
#: A re-evaluation's upsert: also an equal version made by another template or model.
REEVALUATE_SCRIPT = _script(reevaluate=True)


# --- errors ------------------------------------------------------------------------------


class IntentStoreError(Exception):
    """Base error of the intent store."""


class StoreUnavailableError(IntentStoreError):
    """Redis could not be reached or did not answer in time; the write may be retried."""


class StoreBusyError(StoreUnavailableError):
    """Redis answered that it cannot take writes now (``code``: READONLY, BUSY, OOM, ...);
    the state passes (a promotion, the script's end, freed memory), so retry later."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(code, detail)
        self.code, self.detail = code, detail

    def __str__(self) -> str:
        return f"Redis cannot take writes now ({self.code}): {self.detail}"


class NotifyStreamError(IntentStoreError):
    """The notification stream key (``redis.notify_stream``) holds another type: every write
    would fail the same way, so the job must stop until the setting or the key is fixed.
    Nothing was written."""


class KeyRejectedError(IntentStoreError):
    """Redis refused the write for one shopper's key alone (``reason``, e.g.
    ``key_wrong_type``): the same write would fail again, so it is not retried, and the
    other shoppers' writes are not held up by it."""

    def __init__(self, shopper_id: str, reason: str, detail: str) -> None:
        super().__init__(shopper_id, reason, detail)
        self.shopper_id, self.reason, self.detail = shopper_id, reason, detail

    def __str__(self) -> str:
        return f"upsert of shopper {self.shopper_id!r} refused ({self.reason}): {self.detail}"


# --- values ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntentRecord:
    """One inferred intent to store for a shopper.

    ``intent_json`` is the intent as JSON text (already validated against the schema);
    ``facts_json`` the session's grounded facts as JSON; ``source`` what made the intent
    (``model`` or ``rules``). The version is ``(version_ts, version_seq)``, with the
    source's rank as the third term of the order (:attr:`ordered_version`): see the module
    docstring.
    """

    shopper_id: str
    version_ts: int
    version_seq: int
    intent_json: str
    top_label: str
    top_confidence: float
    summary: str
    event_time_ms: int
    template: str
    template_hash: str
    model: str
    facts_json: str = ""
    source: str = DEFAULT_SOURCE
    answer_json: str = ""

    def __post_init__(self) -> None:
        if not self.shopper_id:
            raise ValueError("shopper_id must not be empty")
        if self.source not in SOURCE_RANKS:
            raise ValueError(
                f"source must be one of {', '.join(SOURCE_RANKS)}, got {self.source!r}"
            )
        for name in ("version_ts", "version_seq", "event_time_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not 0.0 <= float(self.top_confidence) <= 1.0:
            raise ValueError(f"top_confidence must be within [0, 1], got {self.top_confidence!r}")

    @property
    def version(self) -> tuple[int, int]:
        return (self.version_ts, self.version_seq)

    @property
    def ordered_version(self) -> tuple[int, int, int]:
        """What the write rule compares: the version and the source's rank."""
        return (self.version_ts, self.version_seq, SOURCE_RANKS[self.source])


@dataclass(frozen=True, slots=True)
class StoredIntent:
    """The intent stored for a shopper, as read back from Redis."""

    shopper_id: str
    version_ts: int
    version_seq: int
    intent_json: str
    top_label: str
    top_confidence: float
    summary: str
    event_time_ms: int
    template: str
    template_hash: str
    model: str
    written_at_ms: int
    facts_json: str = ""  #: "" for a record written before the field existed
    source: str = DEFAULT_SOURCE
    answer_json: str = ""  #: "" for a rules-only record, or one written before the field

    @property
    def version(self) -> tuple[int, int]:
        return (self.version_ts, self.version_seq)

    @property
    def ordered_version(self) -> tuple[int, int, int]:
        return (self.version_ts, self.version_seq, SOURCE_RANKS.get(self.source, 1))

    @property
    def facts(self) -> Any:
        """The grounded facts, decoded (None when the record has none)."""
        return orjson.loads(self.facts_json) if self.facts_json else None

    @property
    def intent(self) -> Any:
        """The intent JSON, decoded."""
        return orjson.loads(self.intent_json)


# --- the pure protocol -------------------------------------------------------------------


def is_newer(candidate: tuple[int, ...], stored: tuple[int, ...] | None) -> bool:
    """The write rule in Python (the script applies the same rule): strictly newer wins.
    Versions are compared as tuples: ``ordered_version`` triples, or pairs of one source."""
    return stored is None or candidate > stored


def _format_confidence(value: float) -> str:
    return repr(float(value))


def upsert_args(record: IntentRecord, ttl_ms: int) -> list[str]:
    """ARGV for ``UPSERT_SCRIPT`` and ``REEVALUATE_SCRIPT``: the version, the TTL, then
    field/value pairs."""
    if ttl_ms <= 0:
        raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
    values = (
        record.intent_json,
        record.top_label,
        _format_confidence(record.top_confidence),
        record.summary,
        str(record.event_time_ms),
        record.template,
        record.template_hash,
        record.model,
        record.facts_json,
        record.source,
        record.answer_json,
    )
    args = [str(record.version_ts), str(record.version_seq), str(int(ttl_ms))]
    for field, value in zip(RECORD_FIELDS, values, strict=True):
        args += (field, value)
    return args


@dataclass(frozen=True, slots=True)
class Notify:
    """Where landed writes are announced: a stream key and its approximate maximum length."""

    stream: str
    maxlen: int = DEFAULT_NOTIFY_MAXLEN

    def __post_init__(self) -> None:
        if not self.stream:
            raise ValueError("the notification stream key must not be empty")
        if self.maxlen <= 0:
            raise ValueError(f"maxlen must be positive, got {self.maxlen}")


def evalsha_args(
    record: IntentRecord, layout: KeyLayout, ttl_ms: int, sha: str, notify: Notify | None = None
) -> list[str | int]:
    """The full ``EVALSHA`` argument list for upserting ``record`` (and notifying): the
    shopper's key and, with ``notify``, the stream key in the same slot."""
    key = layout.intent_key(record.shopper_id)
    args = upsert_args(record, ttl_ms)
    if notify is None:
        return [sha, 1, key, *args]
    return [
        sha,
        2,
        key,
        layout.notify_key(notify.stream, record.shopper_id),
        *args,
        str(layout.notify_maxlen(notify.maxlen)),
        record.shopper_id,
        record.top_label,
    ]


def _script_missing(replies: Sequence[object]) -> list[int]:
    """Indexes of pipeline replies that failed because the server lost the script."""
    return [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def parse_stored(shopper_id: str, fields: Mapping[bytes | str, bytes | str]) -> StoredIntent | None:
    """A ``StoredIntent`` from an ``HGETALL`` reply; None for an empty or foreign hash."""
    data = {_text(k): _text(v) for k, v in fields.items()}
    if "version_ts" not in data:
        return None
    try:
        return StoredIntent(
            shopper_id=shopper_id,
            version_ts=int(data["version_ts"]),
            version_seq=int(data["version_seq"]),
            intent_json=data["intent"],
            top_label=data["top_label"],
            top_confidence=float(data["top_confidence"]),
            summary=data["summary"],
            event_time_ms=int(data["event_time_ms"]),
            template=data["template"],
            template_hash=data["template_hash"],
            model=data["model"],
            written_at_ms=int(data["written_at_ms"]),
            facts_json=data.get("facts", ""),
            source=data.get("source") or DEFAULT_SOURCE,
            answer_json=data.get("answer", ""),
        )
    except (KeyError, ValueError) as e:
        raise IntentStoreError(f"malformed intent hash for shopper {shopper_id!r}: {e}") from e


#: Server states that pass: the write is retried (StoreBusyError). redis-py raises some as
#: their own classes (with the code cut from the message), the rest as ResponseError. A
#: subclass comes before its base (MASTERDOWN is a CLUSTERDOWN to redis-py, MOVED an ASK).
_BUSY_CLASSES = {
    redis.exceptions.ReadOnlyError: "READONLY",
    redis.exceptions.OutOfMemoryError: "OOM",
    redis.exceptions.BusyLoadingError: "LOADING",
    redis.exceptions.MasterDownError: "MASTERDOWN",
    redis.exceptions.TryAgainError: "TRYAGAIN",
    redis.exceptions.ClusterDownError: "CLUSTERDOWN",
    redis.exceptions.MovedError: "MOVED",
    redis.exceptions.AskError: "ASK",
}
_BUSY_CODES = frozenset(
    {
        "READONLY",
        "OOM",
        "LOADING",
        "BUSY",
        "MASTERDOWN",
        "NOREPLICAS",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "MOVED",
        "ASK",
    }
)
#: Errors of one key's content: the shopper's write is refused, with this reason.
_PER_KEY_CODES = {"WRONGTYPE": "key_wrong_type"}
#: The script's refusal of a notification stream key of another type.
NOTIFY_WRONGTYPE = "NOTIFYWRONGTYPE"


def error_code(error: Exception) -> str:
    """The Redis error code of a reply error (``READONLY``, ``WRONGTYPE``, ``ERR``, ...)."""
    for cls, code in _BUSY_CLASSES.items():
        if isinstance(error, cls):
            return code
    return str(error).split(" ", 1)[0]


def server_error(error: redis.ResponseError, shopper_id: str | None = None) -> IntentStoreError:
    """What an error reply means for the write (see the module docstring's tree)."""
    code = error_code(error)
    if code in _BUSY_CODES:
        return StoreBusyError(code, str(error))
    if code == NOTIFY_WRONGTYPE:
        return NotifyStreamError(
            f"{error}: redis.notify_stream must name a stream key (or none yet); nothing was "
            "written. Name another key or remove this one"
        )
    if code in _PER_KEY_CODES and shopper_id is not None:
        return KeyRejectedError(shopper_id, _PER_KEY_CODES[code], str(error))
    who = f"shopper {shopper_id!r}" if shopper_id is not None else "the batch"
    return IntentStoreError(f"upsert of {who} failed: {error}")


def check_notify_stream(client: SyncClient, stream: str, layout: KeyLayout | None = None) -> None:
    """Refuse a notification stream whose key (or, in the cluster layout, the key of any of
    its shards) exists and is not a stream (:class:`NotifyStreamError`); a missing key is
    fine (the first write makes it)."""
    keys = (layout or KeyLayout()).notify_keys(stream)
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        kinds = [_text(kind) for kind in pipe.execute()]
    for key, kind in zip(keys, kinds, strict=True):
        if kind not in ("stream", "none"):
            where = repr(stream) if key == stream else f"{stream!r}: its shard {key!r}"
            raise NotifyStreamError(
                f"{where} holds a {kind}, not a stream: name another key or remove this one"
            )


def _results_to_bools(records: Sequence[IntentRecord], replies: Sequence[object]) -> list[bool]:
    """Per record, whether it wrote; raises for a failed reply: a server that cannot take
    writes now before a refused key (the batch is retried whole, the upserts are idempotent),
    a refused key after the other records were applied."""
    written: list[bool] = []
    rejected: KeyRejectedError | None = None
    for record, reply in zip(records, replies, strict=True):
        if isinstance(reply, redis.ResponseError):
            error = server_error(reply, record.shopper_id)
            if not isinstance(error, KeyRejectedError):
                raise error from reply
            rejected = rejected or error
            written.append(False)
        elif isinstance(reply, UNAVAILABLE_ERRORS):
            # A node lost mid-pipeline, or no node for the slot: retried as a whole.
            raise StoreUnavailableError(f"Redis unavailable: {reply}") from reply
        elif isinstance(reply, Exception):
            raise IntentStoreError(
                f"upsert of shopper {record.shopper_id!r} failed: {reply}"
            ) from reply
        else:
            written.append(reply == 1)
    if rejected is not None:
        raise rejected
    return written


class _EqualVersionNote:
    """Says once per store that a write met an equal version of another template or model
    (the script's -1): kept, as the write rule says, but a backfill with a new template
    that meant to replace it needs ``redis.reevaluate``."""

    def __init__(self) -> None:
        self._said = False

    def check(self, records: Sequence[IntentRecord], replies: Sequence[object]) -> None:
        if self._said:
            return
        for record, reply in zip(records, replies, strict=True):
            if not isinstance(reply, Exception) and reply == -1:
                self._said = True
                log.warning(
                    "the intent of shopper %s at version %s was made by another template or "
                    "model and is kept (an equal version is a no-op); a backfill meant to "
                    "replace such intents needs redis.reevaluate (said once)",
                    record.shopper_id,
                    record.version,
                )
                return


_UNAVAILABLE = UNAVAILABLE_ERRORS


class _StoreCore:
    """What both stores share: settings, the script's arguments and reading its replies;
    the subclasses add only the I/O.

    ``shards``: the slot groups of the key layout (``intent_reader.layout.KeyLayout``); by
    default the cluster layout's over a cluster client, the single-node layout otherwise."""

    def __init__(
        self,
        client: SyncClient | AsyncClient,
        prefix: str = DEFAULT_PREFIX,
        ttl_ms: int = DEFAULT_TTL_MS,
        notify: Notify | None = None,
        reevaluate: bool = False,
        shards: int | None = None,
    ) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        self.client = client
        self.prefix = prefix
        self.layout = layout_for(client, prefix, shards)
        self.cluster = is_cluster(client)
        self.ttl_ms = ttl_ms
        self.notify = notify
        self._source = REEVALUATE_SCRIPT if reevaluate else UPSERT_SCRIPT
        # redis-py types register_script for its single-node clients only; a cluster
        # client has it too (a script object that runs by EVALSHA on the key's node).
        self._script = client.register_script(self._source)  # type: ignore[misc]
        self._equal_version = _EqualVersionNote()

    def key(self, shopper_id: str) -> str:
        return self.layout.intent_key(shopper_id)

    def _queue(self, pipe: Any, records: Sequence[IntentRecord]) -> None:
        # The raw command: a cluster pipeline has no evalsha method, and needs none (it
        # routes EVALSHA by its keys).
        for record in records:
            pipe.execute_command(
                "EVALSHA",
                *evalsha_args(record, self.layout, self.ttl_ms, self._script.sha, self.notify),
            )

    def _written(self, records: Sequence[IntentRecord], replies: Sequence[object]) -> list[bool]:
        """Per record, whether it wrote (raises as ``_results_to_bools``)."""
        self._equal_version.check(records, replies)
        return _results_to_bools(records, replies)


def _fill_resent(replies: list[object], missing: Sequence[int], again: Sequence[object]) -> None:
    for i, reply in zip(missing, again, strict=True):
        replies[i] = reply


def _is_failover(error: StoreUnavailableError, cluster: bool) -> bool:
    """Whether the refusal may come from a failover, after which the endpoint may name a new
    primary or a replica own the slots (the caller drops its idle connections or reads the
    cluster's topology again): a server that refused as a replica; on a cluster, any
    refusal that passes but a slot being migrated (TRYAGAIN: its owners are known)."""
    code = error.code if isinstance(error, StoreBusyError) else ""
    if cluster:
        return code != "TRYAGAIN"
    return code == "READONLY"


# --- synchronous store -------------------------------------------------------------------


class IntentStore(_StoreCore):
    """Versioned intent upserts and reads over a ``redis.Redis`` client (thread-safe).

    ``notify``: also append each landed write to a stream; ``reevaluate``: also replace an
    equal version made by another template or model (both in the module docstring).
    """

    client: SyncClient

    def upsert(self, record: IntentRecord) -> bool:
        """Write ``record`` if it is newer than what is stored; returns whether it wrote."""
        return self.upsert_many([record])[0]

    def upsert_many(self, records: Sequence[IntentRecord]) -> list[bool]:
        """Upsert each record (one pipeline round trip); returns, per record, whether it wrote."""
        if not records:
            return []
        try:
            replies = self._send(records)
            missing = _script_missing(replies)
            if missing:  # the server lost its script cache (restart, SCRIPT FLUSH): load, resend
                log.debug("upsert script not cached on the server; loading it")
                self.client.script_load(self._source)
                _fill_resent(replies, missing, self._send([records[i] for i in missing]))
        except _UNAVAILABLE as e:
            if self.cluster:
                rediscover(self.client)
            raise StoreUnavailableError(f"Redis unavailable: {e}") from e
        except redis.ResponseError as e:  # the script could not be loaded
            raise server_error(e) from e
        try:
            return self._written(records, replies)
        except StoreUnavailableError as e:
            if _is_failover(e, self.cluster):
                rediscover(self.client)
            raise

    def _send(self, records: Sequence[IntentRecord]) -> list[object]:
        with self.client.pipeline(transaction=False) as pipe:
            self._queue(pipe, records)
            return list(pipe.execute(raise_on_error=False))

    def read(self, shopper_id: str) -> StoredIntent | None:
        """The stored intent of ``shopper_id``, or None."""
        try:
            fields = cast(dict[bytes | str, bytes | str], self.client.hgetall(self.key(shopper_id)))
        except _UNAVAILABLE as e:
            raise StoreUnavailableError(f"Redis unavailable: {e}") from e
        return parse_stored(shopper_id, fields)


# --- asynchronous store ------------------------------------------------------------------


class AsyncIntentStore(_StoreCore):
    """``IntentStore`` over a ``redis.asyncio.Redis`` client."""

    client: AsyncClient

    async def upsert(self, record: IntentRecord) -> bool:
        return (await self.upsert_many([record]))[0]

    async def upsert_many(self, records: Sequence[IntentRecord]) -> list[bool]:
        if not records:
            return []
        async with pipeline_lock(self.client):
            return await self._upsert_many(records)

    async def _upsert_many(self, records: Sequence[IntentRecord]) -> list[bool]:
        try:
            replies = await self._send(records)
            missing = _script_missing(replies)
            if missing:
                log.debug("upsert script not cached on the server; loading it")
                await self.client.script_load(self._source)
                _fill_resent(replies, missing, await self._send([records[i] for i in missing]))
        except _UNAVAILABLE as e:
            if self.cluster:
                await arediscover(self.client)
            raise StoreUnavailableError(f"Redis unavailable: {e}") from e
        except redis.ResponseError as e:  # the script could not be loaded
            raise server_error(e) from e
        try:
            return self._written(records, replies)
        except StoreUnavailableError as e:
            if _is_failover(e, self.cluster):
                await arediscover(self.client)
            raise

    async def _send(self, records: Sequence[IntentRecord]) -> list[object]:
        async with self.client.pipeline(transaction=False) as pipe:
            self._queue(pipe, records)
            return list(await pipe.execute(raise_on_error=False))

    async def read(self, shopper_id: str) -> StoredIntent | None:
        try:
            async with pipeline_lock(self.client):
                fields = await cast(
                    Awaitable[dict[bytes | str, bytes | str]],
                    self.client.hgetall(self.key(shopper_id)),
                )
        except _UNAVAILABLE as e:
            raise StoreUnavailableError(f"Redis unavailable: {e}") from e
        return parse_stored(shopper_id, fields)
