"""What the kv_prefix policy knows of the workers' KV caches, and how it learns it.

Modules, from the wire inward::

    subscriber     the ZMQ subscriber thread: each worker's event stream, replays of
                   missed batches (``EventSource``, ``KVEventSubscriber``)
    batches        a published batch decoded into plain values (``decode_batch``)
    index          which worker holds which block (``KVIndex``), pure and synchronous
    blocks         a prompt's block hashes computed as the worker computes them
                   (``BlockHashing``), and the worker's hashing read from its metrics
    prompt_tokens  a request's prompt token ids, rendered and tokenized as the worker
                   does (``PromptTokenizer``)
    feed           the router's side: the subscriber's batches applied to the index on
                   the event loop, the workers' hashing learned, a request's blocks
"""

from inference_sidecar.kv.batches import (
    Cleared,
    EventBatch,
    KVEventFormatError,
    Removed,
    Stored,
    decode_batch,
)
from inference_sidecar.kv.blocks import BlockHashing, external_hash, hashing_from_metrics
from inference_sidecar.kv.index import DEFAULT_STALE_AFTER_S, KVIndex
from inference_sidecar.kv.prompt_tokens import PromptTokenizer
from inference_sidecar.kv.subscriber import EventSource, KVEventSubscriber

__all__ = [
    "DEFAULT_STALE_AFTER_S",
    "BlockHashing",
    "Cleared",
    "EventBatch",
    "EventSource",
    "KVEventFormatError",
    "KVEventSubscriber",
    "KVIndex",
    "PromptTokenizer",
    "Removed",
    "Stored",
    "decode_batch",
    "external_hash",
    "hashing_from_metrics",
]
