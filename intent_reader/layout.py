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

#: The two fields that order writes: a write lands only if its pair is newer.
VERSION_FIELDS = ("version_ts", "version_seq")

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
)

#: Set by the script itself when a write lands (Redis's clock, not the writer's).
WRITTEN_AT_FIELD = "written_at_ms"

#: Every field of an intent hash, in the order readers fetch them (HMGET).
HASH_FIELDS = (*VERSION_FIELDS, *RECORD_FIELDS, WRITTEN_AT_FIELD)

#: Fields of each update notification (an entry of ``redis.notify_stream``), in this order.
NOTIFY_FIELDS = ("shopper_id", "version_ts", "version_seq", "top_label", WRITTEN_AT_FIELD)


def intent_key(shopper_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The key of a shopper's intent hash: ``{prefix}:intent:{shopper_id}``."""
    return f"{prefix}:intent:{shopper_id}"
