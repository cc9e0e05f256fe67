"""The Redis contract between the job that writes intents and the services that read them.

One module, imported by both sides (``flink_jobs.runtime.intent_store`` writes with it,
``intent_reader`` reads with it), so the key layout and field names cannot drift apart.
Plain constants and pure functions: it needs nothing but the standard library.
``docs/redis_layout.md`` documents the same layout for readers in other languages.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# --- Redis Cluster -----------------------------------------------------------------------
#
# On Redis Cluster a Lua script may only touch keys of one hash slot, and the upsert writes
# the shopper's hash and, with notifications on, a stream entry in one script. So in the
# cluster layout every key carries a hash tag naming one of ``shards`` slot groups: a
# shopper's intent key and the notification stream its writes append to share the tag of
# the shopper's group (the same slot), and the stats hash and its ledger, which one script
# updates together, share a reporter's group. The single-node layout (``shards`` 0) has no
# tags: its keys are the ones above, unchanged.

#: How many hash slots Redis Cluster has; a key's slot is the CRC16 of its hash tag (or of
#: the whole key) modulo this.
HASH_SLOTS = 16384

#: Slot groups of the cluster layout by default (``redis.cluster_shards``): enough that the
#: groups spread evenly over a few primaries (64 tags over three equal slot ranges fall
#: 21/20/23), few enough that a follower polls every notification shard in one pipeline.
DEFAULT_CLUSTER_SHARDS = 64


def _crc16_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return tuple(table)


_CRC16 = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM (polynomial 0x1021, initial 0), the hash Redis Cluster slots keys by."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc


def key_slot(key: str | bytes) -> int:
    """The Redis Cluster hash slot of ``key`` (``CLUSTER KEYSLOT``): of the text between
    the first ``{`` and the next ``}`` when that is not empty, else of the whole key."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc16(data) % HASH_SLOTS


def shard_tag(shard: int) -> str:
    """The hash tag of slot group ``shard``: ``{s<shard>}`` (``{s7}``)."""
    return f"{{s{shard}}}"


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Every key the job writes under ``prefix``: the single-node layout when ``shards`` is
    0, else the cluster layout over ``shards`` slot groups (docs/redis_layout.md, "Redis
    Cluster"). Writer and readers build their keys here and nowhere else."""

    prefix: str = DEFAULT_PREFIX
    shards: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.shards, bool) or not 0 <= self.shards <= HASH_SLOTS:
            raise ValueError(f"shards must be within [0, {HASH_SLOTS}], got {self.shards!r}")
        if self.shards and ("{" in self.prefix or "}" in self.prefix):
            raise ValueError(
                f"the key prefix {self.prefix!r} holds a brace: in the cluster layout its hash "
                "tag would pin every key to one slot"
            )

    @property
    def cluster(self) -> bool:
        return self.shards > 0

    def shard_of(self, name: str) -> int:
        """The slot group of a shopper id (or a stats reporter's id): its hash slot, as a
        key of its own, modulo ``shards`` (0 in the single-node layout)."""
        return key_slot(name) % self.shards if self.shards else 0

    def _tag(self, shard: int) -> str:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard must be within [0, {self.shards}), got {shard}")
        return shard_tag(shard)

    # intents

    def intent_key(self, shopper_id: str) -> str:
        """``{prefix}:intent:{shopper_id}``; in the cluster layout
        ``{prefix}:intent:{s<n>}:{shopper_id}``, ``n`` the shopper's group."""
        if not self.shards:
            return intent_key(shopper_id, self.prefix)
        return f"{self.prefix}:intent:{self._tag(self.shard_of(shopper_id))}:{shopper_id}"

    def intent_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern of every intent key."""
        return f"{self.prefix}:intent:*"

    def shopper_id(self, key: str | bytes) -> str | None:
        """The shopper whose intent ``key`` is; None for a key that is not one."""
        text = key.decode() if isinstance(key, bytes) else key
        head = f"{self.prefix}:intent:"
        if not text.startswith(head):
            return None
        rest = text[len(head) :]
        if not self.shards:
            return rest or None
        _tag, colon, shopper_id = rest.partition(":")
        if not colon or not shopper_id or self.intent_key(shopper_id) != text:
            return None
        return shopper_id

    # notifications

    def notify_keys(self, stream: str) -> tuple[str, ...]:
        """Every key of the notification stream ``stream`` (``redis.notify_stream``): itself,
        or in the cluster layout one shard per group, ``{stream}:{s<n>}``."""
        if not self.shards:
            return (stream,)
        return tuple(f"{stream}:{shard_tag(n)}" for n in range(self.shards))

    def notify_key(self, stream: str, shopper_id: str) -> str:
        """The stream key a write of ``shopper_id`` appends to: in the shopper's slot."""
        if not self.shards:
            return stream
        return f"{stream}:{self._tag(self.shard_of(shopper_id))}"

    def notify_maxlen(self, maxlen: int) -> int:
        """The length each stream key is trimmed to so that all of them hold about
        ``maxlen`` entries together."""
        return max(1, -(-maxlen // self.shards)) if self.shards else maxlen

    # counters

    def stats_keys(self) -> tuple[str, ...]:
        """Every stats hash: ``{prefix}:stats``, or one per group, ``{prefix}:stats:{s<n>}``;
        a reader sums them field by field."""
        return tuple(self.stats_key(n) for n in range(max(1, self.shards)))

    def stats_key(self, shard: int = 0) -> str:
        if not self.shards:
            return f"{self.prefix}:stats"
        return f"{self.prefix}:stats:{self._tag(shard)}"

    def flushes_key(self, shard: int = 0) -> str:
        """The ledger of applied stats batches, in the slot of ``stats_key(shard)``."""
        if not self.shards:
            return f"{self.prefix}:stats:flushes"
        return f"{self.prefix}:stats:flushes:{self._tag(shard)}"

    def samples_key(self, name: str, shard: int = 0) -> str:
        if not self.shards:
            return f"{self.prefix}:samples:{name}"
        return f"{self.prefix}:samples:{name}:{self._tag(shard)}"

    def samples_keys(self, name: str) -> tuple[str, ...]:
        """Every list of timing samples ``name``; a reader concatenates them."""
        return tuple(self.samples_key(name, n) for n in range(max(1, self.shards)))
