"""The Redis contract between the job that writes intents and the services that read them.

One module, imported by both sides (``flink_jobs.runtime.intent_store`` writes with it,
``intent_reader`` reads with it), so the key layout and field names cannot drift apart.
Plain constants and pure functions: it needs nothing but the standard library.
``docs/redis_layout.md`` documents the same layout for readers in other languages.
"""

from __future__ import annotations

#: The key prefix of every key the job writes (``redis.key_prefix``).
DEFAULT_PREFIX = "si"

#: How long a shopper's intent hash lives after its last write.
DEFAULT_TTL_MS = 24 * 60 * 60 * 1000

#: The two fields that order writes, with the rank of ``source`` (below) as the third term.
VERSION_FIELDS = ("version_ts", "version_seq")

#: What made a record: the model's answer, or the rules alone (``flink_jobs.core.grounding``)
#: written the moment its prompt fired. At an equal ``(version_ts, version_seq)`` the higher
#: rank wins; a record without ``source`` (written before the field existed) ranks as model.
SOURCE_RANKS = {"rules": 0, "model": 1}
DEFAULT_SOURCE = "model"

#: Fields written by every successful upsert, in this order (after the two version fields).
RECORD_FIELDS = (
    "intent",
    "top_label",
    "top_confidence",
    "summary",
    "event_time_ms",
    "template",
    "template_hash",
    "model",
    "facts",
    "source",
    "answer",
)

#: Fields of :data:`RECORD_FIELDS` that records written before them lack: readers take a
#: missing ``source`` as :data:`DEFAULT_SOURCE`, a missing ``facts`` as unknown and a missing
#: ``answer`` as the ``intent`` itself (the model's answer was stored unchanged then).
OPTIONAL_FIELDS = ("facts", "source", "answer")

#: The intent labels of the intent schema (``schemas/shopper_intent.schema.json``; a unit
#: test keeps the two equal). A reader ignores a label it does not know: a later schema may
#: add some.
INTENT_LABELS = (
    "browsing",
    "comparing_options",
    "researching_product",
    "ready_to_buy",
    "gift_shopping",
    "replenishing",
    "deal_seeking",
    "abandoning_cart",
    "post_purchase",
)

#: The most bytes any field of an intent hash or notification may hold for a reader to
#: parse it. The job writes a few KiB at most (the intent schema is bounded; the facts list
#: at most 8 categories and brands); a larger value is not the job's, and is refused unread.
MAX_FIELD_BYTES = 256 * 1024

#: Set by the script itself when a write lands (Redis's clock, not the writer's).
WRITTEN_AT_FIELD = "written_at_ms"

#: Every field of an intent hash, in the order readers fetch them (HMGET).
HASH_FIELDS = (*VERSION_FIELDS, *RECORD_FIELDS, WRITTEN_AT_FIELD)

#: Fields every update notification (an entry of ``redis.notify_stream``) carries.
NOTIFY_REQUIRED_FIELDS = ("shopper_id", "version_ts", "version_seq", "top_label", WRITTEN_AT_FIELD)

#: Fields of each update notification, in this order: the required ones, then what the write
#: was (entries appended before these existed lack them).
NOTIFY_FIELDS = (*NOTIFY_REQUIRED_FIELDS, "source", "template", "model", "intent", "answer")


def intent_key(shopper_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The key of a shopper's intent hash: ``{prefix}:intent:{shopper_id}``."""
    return f"{prefix}:intent:{shopper_id}"
