"""KV cache event batches as vLLM publishes them, decoded into plain values.

What vLLM publishes (``vllm/distributed/kv_events.py``): per engine step a batch
``[timestamp, [event, ...], data_parallel_rank]`` with a sequence number counting up from
0 when the worker starts. Events are ``BlockStored`` (new blocks, and blocks a request
reused from the prefix cache), ``BlockRemoved`` (evicted) and ``AllBlocksCleared``; each
is a tagged msgspec struct, encoded as a map or, ``array_like``, as an array.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inference_sidecar.kv.blocks import external_hash

#: Blocks one ``BlockStored`` or ``BlockRemoved`` may name: a 262,144-token context at 16
#: tokens a block. vLLM publishes a request's new (or reused) full blocks per engine step.
MAX_EVENT_BLOCKS = 1 << 14
#: Token ids one ``BlockStored`` may carry (its blocks' tokens).
MAX_EVENT_TOKENS = 1 << 18
#: Events one batch may carry (one engine step's requests).
MAX_BATCH_EVENTS = 1 << 14


class KVEventFormatError(ValueError):
    """A payload that is not a KV event batch as vLLM publishes it."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    #: Per block, the untagged extra keys its hash includes (``kv.blocks``), or None.
    extra_keys: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    events: tuple[Event, ...]
    ts: float = 0.0
    #: Events of kinds this index does not use (another medium, an unknown tag).
    ignored: int = 0


def _field(raw: Any, name: str, position: int) -> Any:
    """A struct field, encoded as a map (msgspec's default) or an array (array_like)."""
    if isinstance(raw, Mapping):
        return raw.get(name)
    if isinstance(raw, list | tuple) and len(raw) > position:
        return raw[position]
    return None


def _decode_event(raw: Any) -> Event | None:
    """One event: a tagged struct, ``{"type": "BlockStored", ...}`` or ``["BlockStored",
    ...]``; None for kinds not used here (a medium other than the worker's own memory)."""
    tag = raw.get("type") if isinstance(raw, Mapping) else (raw[0] if raw else None)
    offset = 0 if isinstance(raw, Mapping) else 1
    if tag == "BlockStored":
        medium = _field(raw, "medium", 5 + offset)
        if medium not in (None, "GPU"):
            return None
        hashes = _field(raw, "block_hashes", 0 + offset)
        parent = _field(raw, "parent_block_hash", 1 + offset)
        tokens = _field(raw, "token_ids", 2 + offset)
        size = _field(raw, "block_size", 3 + offset)
        if not isinstance(hashes, list) or not isinstance(tokens, list | None):
            raise KVEventFormatError(f"BlockStored without block hashes: {raw!r:.200}")
        _bounded("BlockStored block hashes", len(hashes), MAX_EVENT_BLOCKS)
        _bounded("BlockStored token ids", len(tokens or ()), MAX_EVENT_TOKENS)
        lora_name = _field(raw, "lora_name", 6 + offset)
        extra_keys = _field(raw, "extra_keys", 7 + offset)
        return Stored(
            tuple(external_hash(h) for h in hashes),
            None if parent is None else external_hash(parent),
            tuple(tokens or ()),
            int(size or 0),
            lora_name if isinstance(lora_name, str) else None,
            tuple(extra_keys) if isinstance(extra_keys, list | tuple) else None,
        )
    if tag == "BlockRemoved":
        medium = _field(raw, "medium", 1 + offset)
        if medium not in (None, "GPU"):
            return None
        hashes = _field(raw, "block_hashes", 0 + offset)
        if not isinstance(hashes, list):
            raise KVEventFormatError(f"BlockRemoved without block hashes: {raw!r:.200}")
        _bounded("BlockRemoved block hashes", len(hashes), MAX_EVENT_BLOCKS)
        return Removed(tuple(external_hash(h) for h in hashes))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(seq: int, payload: Any) -> EventBatch:
    """A batch from its sequence number and its msgpack-decoded payload
    ``[ts, [event, ...], dp_rank?]``; raises ``KVEventFormatError`` naming what is wrong."""
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise KVEventFormatError(f"a KV event batch is [ts, events, ...], got {payload!r:.200}")
    ts, raw_events = payload[0], payload[1]
    if not isinstance(raw_events, list):
        raise KVEventFormatError(f"a batch's events must be a list, got {raw_events!r:.200}")
    _bounded("events of a batch", len(raw_events), MAX_BATCH_EVENTS)
    events: list[Event] = []
    ignored = 0
    try:
        for raw in raw_events:
            event = _decode_event(raw)
            if event is None:
                ignored += 1
            else:
                events.append(event)
    except (TypeError, ValueError) as exc:
        raise KVEventFormatError(str(exc)) from exc
    return EventBatch(seq, tuple(events), float(ts or 0.0), ignored)


def _bounded(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise KVEventFormatError(f"{n} {what}, more than the {limit} a worker publishes at once")
