"""Read shopper intents from Redis for ranking services, and an example re-ranker.

    from intent_reader import IntentReader, Candidate, rerank

    reader = IntentReader.from_url("redis://cache:6379/0", max_age_s=900)
    intent = reader.get("shopper-42")                    # ShopperIntent | None
    intent.facts, intent.source                          # grounded facts; "model" | "rules"
    intents = reader.get_many(["shopper-42", "s-7"])     # one round trip
    intents.errors                                       # unreadable hashes, and why
    reader.close()                                       # or: with IntentReader.from_url(...)
    ranked = rerank([Candidate("p1", 0.8, "Running Shoes"), ...], intent)

    reader = AsyncIntentReader.from_url("redis://cache:6379/0")   # asyncio services
    intent = await reader.get("shopper-42")

    updates = IntentUpdates.from_url("redis://cache:6379/0", "si:intent-updates")
    for update in updates.follow():                      # when redis.notify_stream is set
        ...

    reader = IntentReader.from_url("rediss://clustercfg...:6379", cluster=True)  # redis.cluster

The Redis layout is documented in ``docs/redis_layout.md``.
"""

from intent_reader.client import (
    AsyncIntentReader,
    IntentBatch,
    IntentLabel,
    IntentReader,
    IntentReaderError,
    MalformedIntentError,
    ReaderUnavailableError,
    ShopperIntent,
    parse_intent,
)
from intent_reader.layout import KeyLayout, intent_key
from intent_reader.rerank import Candidate, Ranked, RerankWeights, rerank
from intent_reader.updates import IntentUpdate, IntentUpdates, MalformedUpdateError

__all__ = [
    "AsyncIntentReader",
    "Candidate",
    "IntentBatch",
    "IntentLabel",
    "IntentReader",
    "IntentReaderError",
    "IntentUpdate",
    "IntentUpdates",
    "KeyLayout",
    "MalformedIntentError",
    "MalformedUpdateError",
    "Ranked",
    "ReaderUnavailableError",
    "RerankWeights",
    "ShopperIntent",
    "intent_key",
    "parse_intent",
    "rerank",
]
