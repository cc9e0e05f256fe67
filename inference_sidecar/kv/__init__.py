"""What the kv_prefix policy knows of the workers' KV caches, and how it learns it.

Modules, from the wire inward::

    sources        where a worker publishes, checked when given (``EventSource``)
    subscriber     the ZMQ subscriber thread: each worker's event stream, bounded
                   replays of missed batches (``KVEventSubscriber``)
    batches        a published batch decoded into plain values (``decode_batch``)
    index          which worker holds which block (``KVIndex``), pure and synchronous
    blocks         a prompt's block hashes computed as the worker computes them, extra
                   keys included (``BlockHashing``), and the worker's hashing read from
                   its metrics
    prompt_tokens  a request's prompt token ids, rendered and tokenized as the worker
                   does, never past the context (``PromptTokenizer``)
    prompt_blocks  that work in tokenizer processes, off the event loop
    models         what the workers serve: the context, LoRA adapters' paths
    feed           the router's side: the subscriber's batches applied to the index on
                   the event loop, the workers' hashing and models learned, a
                   request's blocks
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
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.kv.subscriber import KVEventSubscriber

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
