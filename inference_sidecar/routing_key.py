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
    #: Estimated prompt tokens of the request carrying the key (0: unknown); the router sets
    #: it from the body (``estimate_prompt_tokens``) for the routing policy.
    size: int = 0
    #: The prompt's KV block hashes (``kv.blocks``) when the policy asks for them and the
    #: router could tokenize the prompt; ``size`` is then the exact token count.
    blocks: tuple[int, ...] = ()


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


#: Characters per token assumed by ``estimate_prompt_tokens`` (English-ish text, JSON
#: event payloads; SmolLM2's tokenizer gives 3.5-4.5 on the shopper prompts).
CHARS_PER_TOKEN = 4


def _text_chars(value: Any) -> int:
    """Characters of text in a prompt or a message's content (string or parts list)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                total += len(text) if isinstance(text, str) else 0
        return total
    return 0


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """A rough prompt size in tokens from the request body, without a tokenizer.

    The routing policy compares such estimates with each other (a prompt's uncached part
    against a worker's queued prefill work), so a consistent scale matters more than
    accuracy. Chat messages count their text plus a few tokens of template each;
    ``prompt`` may be a string or a list of strings (token-id prompts count one per id).
    0 when there is nothing to measure.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(_text_chars(m.get("content")) for m in messages if isinstance(m, Mapping))
        return chars // CHARS_PER_TOKEN + 4 * len(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return _text_chars(prompt) // CHARS_PER_TOKEN
