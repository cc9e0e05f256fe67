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
from intent_reader.layout import (
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


class IntentUpdates:
    """A cursor over the notification stream (``XREAD``, blocking).

    ``start``: ``"latest"`` (only what is appended from now on), ``"earliest"`` (everything
    the stream still holds) or an entry ID to resume after.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        start: str = "latest",
        batch: int = 100,
        owns_client: bool = False,
    ) -> None:
        if not stream:
            raise ValueError("stream must not be empty")
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        self.client = client
        self.stream = stream
        self.batch = batch
        #: Whether ``close`` closes the client (a follower made by ``from_url``).
        self.owns_client = owns_client
        #: Entries that were not updates, since the follower was made (each also logged).
        self.malformed = 0
        # How many entries the stream had been given up to the cursor (XINFO's
        # "entries-added" numbering); None when unknown (a resumed cursor, Redis < 7).
        self._position: int | None = None
        info = self._info()
        if start == "earliest":
            self.last_id = "0-0"
            if info is not None and "entries-added" in info:
                self._position = int(info["entries-added"]) - int(info["length"])
            elif info is None:
                self._position = 0
        elif start == "latest":
            self.last_id = _text(info["last-generated-id"]) if info else "0-0"
            if info is None:
                self._position = 0
            elif "entries-added" in info:
                self._position = int(info["entries-added"])
        else:
            _id_tuple(start)  # raises ValueError for a malformed ID
            self.last_id = start

    @classmethod
    def from_url(
        cls, url: str, stream: str, block_timeout_s: float = 60.0, **kwargs: Any
    ) -> IntentUpdates:
        """A follower with its own client, which :meth:`close` closes; the socket timeout
        outlasts any blocking read."""
        client = redis.Redis.from_url(
            url, socket_timeout=block_timeout_s + 5.0, socket_connect_timeout=2.0
        )
        try:
            return cls(client, stream, owns_client=True, **kwargs)
        except BaseException:
            client.close()
            raise

    def close(self) -> None:
        """Close the client if this follower made it (``from_url``)."""
        if self.owns_client:
            self.client.close()

    def __enter__(self) -> IntentUpdates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _info(self) -> dict[str, Any] | None:
        """``XINFO STREAM`` (one atomic view of the stream), or None when it does not exist."""
        try:
            info = cast(dict[bytes | str, Any], self.client.xinfo_stream(self.stream))
            return {_text(k): v for k, v in info.items()}
        except redis.ResponseError:
            return None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise ReaderUnavailableError(f"Redis unavailable: {e}") from e

    def read(self, block_s: float | None = 0.0) -> list[IntentUpdate]:
        """The next updates after the cursor (at most ``batch``), oldest first.

        Waits up to ``block_s`` seconds for the first one (``None``: no wait). Advances the
        cursor past what it returns, malformed entries included: the first raises
        :class:`MalformedUpdateError` after the cursor moved (so a retry does not meet it
        again), carrying the batch's good updates.
        """
        block = None if block_s is None else max(1, int(block_s * 1000))
        try:
            reply = cast(
                "list[Any] | dict[Any, Any]",
                self.client.xread({self.stream: self.last_id}, count=self.batch, block=block),
            )
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise ReaderUnavailableError(f"Redis unavailable: {e}") from e
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        updates: list[IntentUpdate] = []
        bad: MalformedUpdateError | None = None
        if self._position is not None:
            self._position += len(entries)
        for entry_id, fields in entries:
            self.last_id = _text(entry_id)  # XADD IDs are ASCII, whatever the fields hold
            try:
                updates.append(parse_update(entry_id, fields))
            except MalformedUpdateError as e:
                self.malformed += 1
                log.warning("%s; skipped", e)
                bad = bad or e
        if bad is not None:
            raise MalformedUpdateError(str(bad), updates) from bad
        return updates

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
        """How many entries after the cursor were trimmed away unread since the last call.

        Call it now and then (say, after a long pause), not per entry: it is one
        ``XINFO STREAM``. The count is exact for a follower started "latest" or "earliest"
        on Redis 7+; for one resumed from a saved ID it is None (unknown) until the first
        call, which only syncs the count. Missed entries are counted once.
        """
        info = self._info()
        if info is None:
            return 0
        if "entries-added" not in info:
            return None  # Redis < 7 does not number entries
        trimmed = int(info["entries-added"]) - int(info["length"])  # gone from the front
        if self._position is None:
            after = self.client.xrange(self.stream, min=f"({self.last_id}", max="+")
            ahead = len(cast(list[Any], after))
            self._position = int(info["entries-added"]) - ahead
            return None
        lost = max(0, trimmed - self._position)
        self._position += lost
        return lost
