"""Follow intent updates pushed on a Redis Stream, instead of polling the hashes.

The job appends one entry per landed intent write to the stream named by
``redis.notify_stream`` (off by default; ``docs/redis_layout.md``, "Update notifications"):

    shopper_id  version_ts  version_seq  top_label  written_at_ms  source  template  model
    intent

(entries appended by a job older than ``source``, ``template``, ``model`` and ``intent``
lack those four: they parse with ``source="model"`` and the others empty)::

    updates = IntentUpdates.from_url("redis://cache:6379/0", "si:intent-updates")
    for update in updates.follow(idle_timeout_s=30):   # IntentUpdate, oldest first
        intent = reader.get(update.shopper_id)            # the hash is the truth

Semantics a consumer should know:

- **From now, gap-free.** ``start="latest"`` (the default) pins the cursor to the stream's
  newest entry when the follower is created, so nothing appended after that is skipped
  between two reads; ``start="earliest"`` replays what the stream still holds. Each
  :class:`IntentUpdates` keeps its own cursor (``last_id``): save it to resume later with
  ``start=<that id>``.
- **At most a hint.** A notification says that the hash changed, not what it holds now: by
  the time it is read a newer write may have landed. Read the hash (``IntentReader``).
- **Trimmed when far behind.** The writer trims the stream to about ``maxlen`` entries; a
  consumer further behind than that misses notifications, never intents:
  :meth:`IntentUpdates.missed` says how many (Redis 7+).
- **A foreign entry is passed, not fatal.** An entry that is not an update (missing
  fields, bytes that are not UTF-8, a field over ``MAX_FIELD_BYTES``) is skipped by
  :meth:`IntentUpdates.follow`, logged and counted (``malformed``); the good entries read
  with it are yielded. :meth:`IntentUpdates.read` raises it, with those good entries on the
  error (``MalformedUpdateError.updates``).
- **Sharded on Redis Cluster.** With ``redis.cluster`` the job appends to one stream per
  slot group, ``{stream}:{s<n>}``; a follower over a cluster client (``cluster=True``)
  follows every shard, polling them (a blocking read cannot span slots), with a cursor per
  shard (``last_ids``). A shopper's updates stay in order; across shards they are ordered
  by entry ID only.

A follower made by ``from_url`` owns its client and closes it (``close()`` or ``with``).

For several consumers sharing the work, use a consumer group (``XREADGROUP``) on the same
stream; this helper is the single-reader case.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis

from intent_reader.client import IntentReaderError, ReaderUnavailableError
from intent_reader.clients import (
    UNAVAILABLE_ERRORS,
    SyncClient,
    is_unavailable,
    layout_for,
    sync_client,
)
from intent_reader.layout import (
    DEFAULT_PREFIX,
    DEFAULT_SOURCE,
    MAX_FIELD_BYTES,
    NOTIFY_FIELDS,
    NOTIFY_REQUIRED_FIELDS,
)

log = logging.getLogger(__name__)

#: The fields of each stream entry.
UPDATE_FIELDS = NOTIFY_FIELDS


class MalformedUpdateError(IntentReaderError):
    """A stream entry is not an intent update (a foreign writer on the stream). Raised by
    :meth:`IntentUpdates.read` after the cursor moved past it; ``updates`` holds the good
    entries read in the same batch."""

    def __init__(self, message: str, updates: list[IntentUpdate] | None = None) -> None:
        super().__init__(message)
        self.updates: list[IntentUpdate] = updates or []


@dataclass(frozen=True, slots=True)
class IntentUpdate:
    """One landed intent write, as announced on the stream."""

    entry_id: str  #: the stream entry ID, "<ms>-<seq>"
    shopper_id: str
    version_ts: int
    version_seq: int
    top_label: str
    written_at_ms: int
    source: str = DEFAULT_SOURCE  #: "model" or "rules"
    template: str = ""
    model: str = ""
    intent_json: str = ""  #: the intent written (JSON), "" in entries that predate it
    answer_json: str = ""  #: the model's own answer (JSON); "" on rules-only writes

    @property
    def version(self) -> tuple[int, int]:
        return (self.version_ts, self.version_seq)

    @property
    def intent(self) -> Any:
        """The intent written, decoded (None when the entry does not carry it)."""
        return json.loads(self.intent_json) if self.intent_json else None


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def parse_update(entry_id: bytes | str, fields: Mapping[Any, Any]) -> IntentUpdate:
    """An :class:`IntentUpdate` from one ``XREAD`` entry; raises :class:`MalformedUpdateError`
    (missing fields, bytes that are not UTF-8, a field over ``MAX_FIELD_BYTES``, a number
    that is not one)."""
    try:
        entry_id = _text(entry_id)
        big = next((k for k, v in fields.items() if len(v) > MAX_FIELD_BYTES), None)
        if big is not None:
            raise MalformedUpdateError(
                f"entry {entry_id}: field {_text(big)[:40]} holds {len(fields[big])} bytes; "
                f"at most {MAX_FIELD_BYTES}"
            )
        data = {_text(k): _text(v) for k, v in fields.items()}
    except UnicodeDecodeError as e:
        raise MalformedUpdateError(f"entry {entry_id!r}: not UTF-8 ({e.reason})") from e
    missing = [name for name in NOTIFY_REQUIRED_FIELDS if name not in data]
    if missing:
        raise MalformedUpdateError(f"entry {_text(entry_id)}: missing {', '.join(missing)}")
    try:
        return IntentUpdate(
            entry_id=_text(entry_id),
            shopper_id=data["shopper_id"],
            version_ts=int(data["version_ts"]),
            version_seq=int(data["version_seq"]),
            top_label=data["top_label"],
            written_at_ms=int(data["written_at_ms"]),
            source=data.get("source") or DEFAULT_SOURCE,
            template=data.get("template", ""),
            model=data.get("model", ""),
            intent_json=data.get("intent", ""),
            answer_json=data.get("answer", ""),
        )
    except ValueError as e:
        raise MalformedUpdateError(f"entry {entry_id}: {str(e)[:200]}") from e


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return (int(ms), int(seq or 0))


@dataclass(slots=True)
class _Cursor:
    """Where a follower is in one stream key: the last ID read, and how many entries the
    stream had been given up to it (XINFO's "entries-added" numbering; None when unknown:
    a resumed cursor, Redis < 7)."""

    last_id: str
    position: int | None = None


def _cursor(start: str, info: Mapping[str, Any] | None) -> _Cursor:
    if start == "earliest":
        if info is None:
            return _Cursor("0-0", 0)
        if "entries-added" in info:
            return _Cursor("0-0", int(info["entries-added"]) - int(info["length"]))
        return _Cursor("0-0")
    if start == "latest":
        if info is None:
            return _Cursor("0-0", 0)
        position = int(info["entries-added"]) if "entries-added" in info else None
        return _Cursor(_text(info["last-generated-id"]), position)
    _id_tuple(start)  # raises ValueError for a malformed ID
    return _Cursor(start)


class IntentUpdates:
    """A cursor over the notification stream (``XREAD``, blocking).

    ``start``: ``"latest"`` (only what is appended from now on), ``"earliest"`` (everything
    the stream still holds) or an entry ID to resume after (in the cluster layout, a mapping
    of shard keys to IDs, ``last_ids``; a shard it does not name is read from its start).

    Over a cluster client (or with ``shards``) it follows every shard of the stream
    (``{stream}:{s<n>}``, docs/redis_layout.md, "Redis Cluster"): a shopper's updates are in
    one shard, in order; across shards each batch is ordered by entry ID, which follows the
    shards' clocks. A blocking read cannot span slots, so :meth:`read` polls the shards
    (``XRANGE`` after each cursor, one pipelined round trip per node) every ``poll_s``
    seconds until one has an entry or ``block_s`` has passed.
    """

    def __init__(
        self,
        client: SyncClient,
        stream: str,
        start: str | Mapping[str, str] = "latest",
        batch: int = 100,
        owns_client: bool = False,
        shards: int | None = None,
        poll_s: float = 0.05,
    ) -> None:
        if not stream:
            raise ValueError("stream must not be empty")
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {poll_s}")
        self.client = client
        self.stream = stream
        self.batch = batch
        self.poll_s = poll_s
        #: Every key followed: the stream, or its shards in the cluster layout.
        self.streams = layout_for(client, DEFAULT_PREFIX, shards).notify_keys(stream)
        #: Whether ``close`` closes the client (a follower made by ``from_url``).
        self.owns_client = owns_client
        #: Entries that were not updates, since the follower was made (each also logged).
        self.malformed = 0
        if isinstance(start, Mapping):
            starts = {key: start.get(key, "0-0") for key in self.streams}
        else:
            starts = dict.fromkeys(self.streams, start)
        needs_info = any(s in ("latest", "earliest") for s in starts.values())
        infos = self._infos() if needs_info else dict.fromkeys(self.streams)
        self._cursors = {key: _cursor(starts[key], infos[key]) for key in self.streams}

    @classmethod
    def from_url(
        cls,
        url: str,
        stream: str,
        block_timeout_s: float = 60.0,
        *,
        cluster: bool = False,
        **kwargs: Any,
    ) -> IntentUpdates:
        """A follower with its own client, which :meth:`close` closes; the socket timeout
        outlasts any blocking read. ``cluster``: a Redis Cluster client, following every
        shard."""
        client = sync_client(
            url, cluster=cluster, socket_timeout=block_timeout_s + 5.0, socket_connect_timeout=2.0
        )
        try:
            return cls(client, stream, owns_client=True, **kwargs)
        except BaseException:
            client.close()
            raise

    @property
    def sharded(self) -> bool:
        return len(self.streams) > 1 or self.streams[0] != self.stream

    @property
    def last_id(self) -> str:
        """The cursor of a follower of one stream key: save it to resume with
        ``start=<it>``. A sharded follower has one per shard (:attr:`last_ids`)."""
        if self.sharded:
            raise ValueError("a sharded follower has a cursor per shard: use last_ids")
        return self._cursors[self.stream].last_id

    @property
    def last_ids(self) -> dict[str, str]:
        """Each followed key's cursor: save it to resume with ``start=<it>``."""
        return {key: cursor.last_id for key, cursor in self._cursors.items()}

    def close(self) -> None:
        """Close the client if this follower made it (``from_url``)."""
        if self.owns_client:
            self.client.close()

    def __enter__(self) -> IntentUpdates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _infos(self) -> dict[str, dict[str, Any] | None]:
        """``XINFO STREAM`` of each key (one atomic view of each stream), or None for a key
        that does not exist."""
        try:
            if not self.sharded:
                replies: list[Any] = [self._xinfo(self.stream)]
            else:
                with self.client.pipeline(transaction=False) as pipe:
                    for key in self.streams:
                        pipe.xinfo_stream(key)
                    replies = pipe.execute(raise_on_error=False)
        except UNAVAILABLE_ERRORS as e:
            raise ReaderUnavailableError(f"Redis unavailable: {e}") from e
        infos: dict[str, dict[str, Any] | None] = {}
        for key, reply in zip(self.streams, replies, strict=True):
            if is_unavailable(reply):
                raise ReaderUnavailableError(f"Redis unavailable: {reply}")
            infos[key] = None if isinstance(reply, Exception) else _decoded(reply)
        return infos

    def _xinfo(self, key: str) -> Any:
        try:
            return self.client.xinfo_stream(key)
        except redis.ResponseError as e:  # no such key
            return e

    def read(self, block_s: float | None = 0.0) -> list[IntentUpdate]:
        """The next updates after the cursor (at most ``batch`` per key), oldest first.

        Waits up to ``block_s`` seconds for the first one (``None``: no wait). Advances the
        cursor past what it returns, malformed entries included: the first raises
        :class:`MalformedUpdateError` after the cursor moved (so a retry does not meet it
        again), carrying the batch's good updates.
        """
        batches = self._poll_shards(block_s) if self.sharded else self._xread(block_s)
        updates: list[IntentUpdate] = []
        bad: MalformedUpdateError | None = None
        for key, entries in batches:
            cursor = self._cursors[key]
            if cursor.position is not None:
                cursor.position += len(entries)
            for entry_id, fields in entries:
                cursor.last_id = _text(entry_id)  # XADD IDs are ASCII, whatever the fields hold
                try:
                    updates.append(parse_update(entry_id, fields))
                except MalformedUpdateError as e:
                    self.malformed += 1
                    log.warning("%s; skipped", e)
                    bad = bad or e
        if len(batches) > 1:
            updates.sort(key=lambda u: _id_tuple(u.entry_id))  # stable: each shard in order
        if bad is not None:
            raise MalformedUpdateError(str(bad), updates) from bad
        return updates

    def _xread(self, block_s: float | None) -> list[tuple[str, list[Any]]]:
        block = None if block_s is None else max(1, int(block_s * 1000))
        try:
            reply = cast(
                "list[Any] | dict[Any, Any]",
                self.client.xread(
                    {self.stream: self._cursors[self.stream].last_id}, count=self.batch, block=block
                ),
            )
        except UNAVAILABLE_ERRORS as e:
            raise ReaderUnavailableError(f"Redis unavailable: {e}") from e
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [(self.stream, entries)]

    def _poll_shards(self, block_s: float | None) -> list[tuple[str, list[Any]]]:
        """Every shard's entries after its cursor, polled until there are some or
        ``block_s`` has passed."""
        deadline = time.monotonic() + (block_s or 0.0)
        while True:
            try:
                with self.client.pipeline(transaction=False) as pipe:
                    for key, cursor in self._cursors.items():
                        pipe.xrange(key, min=f"({cursor.last_id}", max="+", count=self.batch)
                    replies = pipe.execute(raise_on_error=False)
            except UNAVAILABLE_ERRORS as e:
                raise ReaderUnavailableError(f"Redis unavailable: {e}") from e
            failed = next((r for r in replies if isinstance(r, Exception)), None)
            if failed is not None:
                if is_unavailable(failed):
                    raise ReaderUnavailableError(f"Redis unavailable: {failed}")
                raise IntentReaderError(f"reading the notification shards failed: {failed}")
            found = [(key, r) for key, r in zip(self.streams, replies, strict=True) if r]
            left = deadline - time.monotonic()
            if found or left <= 0:
                return found
            time.sleep(min(self.poll_s, left))

    def follow(
        self, idle_timeout_s: float | None = None, poll_s: float = 5.0
    ) -> Iterator[IntentUpdate]:
        """Yield updates as they come; stops after ``idle_timeout_s`` without one (None:
        never). Malformed entries are skipped (logged and counted in ``malformed``), the good
        ones read with them yielded."""
        last_seen = time.monotonic()
        while True:
            wait = poll_s
            if idle_timeout_s is not None:
                left = idle_timeout_s - (time.monotonic() - last_seen)
                if left <= 0:
                    return
                wait = min(wait, left)
            try:
                updates = self.read(block_s=wait)
            except MalformedUpdateError as e:
                updates = e.updates
            if updates:
                last_seen = time.monotonic()
            yield from updates

    def missed(self) -> int | None:
        """How many entries after the cursor were trimmed away unread since the last call,
        over every followed key.

        Call it now and then (say, after a long pause), not per entry: it is one
        ``XINFO STREAM`` per key. The count is exact for a follower started "latest" or
        "earliest" on Redis 7+; for one resumed from a saved ID it is None (unknown) until
        the first call, which only syncs the count. Missed entries are counted once.
        """
        infos = self._infos()
        total: int | None = 0
        for key, info in infos.items():
            lost = self._missed(key, info)
            total = None if lost is None or total is None else total + lost
        return total

    def _missed(self, key: str, info: Mapping[str, Any] | None) -> int | None:
        if info is None:
            return 0
        if "entries-added" not in info:
            return None  # Redis < 7 does not number entries
        cursor = self._cursors[key]
        trimmed = int(info["entries-added"]) - int(info["length"])  # gone from the front
        if cursor.position is None:
            ahead = len(cast(list[Any], self.client.xrange(key, min=f"({cursor.last_id}", max="+")))
            cursor.position = int(info["entries-added"]) - ahead
            return None
        lost = max(0, trimmed - cursor.position)
        cursor.position += lost
        return lost


def _decoded(info: Mapping[Any, Any]) -> dict[str, Any]:
    return {_text(k): v for k, v in info.items()}
