"""Routing-key extraction: which "session" a request belongs to.

Pure functions only, so the precedence is easy to read and to test:

1. the ``X-Session-ID`` header (the pipeline sends the shopper id there);
2. the body's ``user`` field (the OpenAI field meant to identify an end user);
3. a stable hash of the prompt (``messages`` for chat, ``prompt`` for completions).

Requests of one shopper share almost their whole prompt, so keeping them on one worker
keeps that prefix in its KV cache. The prompt hash is the fallback for clients that say
nothing about who they are: identical prompts still land together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

KeySource = Literal["header", "user", "prompt", "none"]

#: Header names checked in order (lower case; HTTP header names are case-insensitive).
DEFAULT_KEY_HEADERS: tuple[str, ...] = ("x-session-id",)

#: Longer identifiers are hashed so a hostile client cannot blow up memory or labels.
MAX_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """A routing key and where it came from (the source is a metrics label)."""

    value: str
    source: KeySource


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _normalise(value: str) -> str:
    """Strip blanks and bound the length; long ids keep their identity through a hash."""
    value = value.strip()
    if len(value) > MAX_KEY_CHARS:
        return "h:" + _digest(value.encode())
    return value


def header_key(
    headers: Mapping[str, str], names: Iterable[str] = DEFAULT_KEY_HEADERS
) -> str | None:
    """The first non-blank value among ``names`` in ``headers``, matched case-insensitively."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in names:
        value = lowered.get(name.lower())
        if isinstance(value, str) and value.strip():
            return _normalise(value)
    return None


def user_key(body: Mapping[str, Any]) -> str | None:
    """The body's ``user`` field when it is a non-blank string or an integer."""
    user = body.get("user")
    if isinstance(user, bool):  # bool is an int subclass; true/false identify nobody
        return None
    if isinstance(user, int):
        return str(user)
    if isinstance(user, str) and user.strip():
        return _normalise(user)
    return None


def prompt_key(body: Mapping[str, Any]) -> str | None:
    """A stable hash of ``messages`` (chat) or ``prompt`` (completions), if present.

    The value is serialised canonically (sorted keys), so key order in the client's JSON
    does not change the key.
    """
    for field in ("messages", "prompt"):
        value = body.get(field)
        if value is None or value in ("", []):
            continue
        try:
            data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            data = repr(value).encode()
        return "p:" + _digest(field.encode() + b"\0" + data)
    return None


def extract_routing_key(
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
    header_names: Iterable[str] = DEFAULT_KEY_HEADERS,
) -> RoutingKey:
    """Apply the precedence header > ``user`` > prompt hash; ``source="none"`` if all miss."""
    key = header_key(headers, header_names)
    if key is not None:
        return RoutingKey(key, "header")
    if body:
        key = user_key(body)
        if key is not None:
            return RoutingKey(key, "user")
        key = prompt_key(body)
        if key is not None:
            return RoutingKey(key, "prompt")
    return RoutingKey("", "none")
