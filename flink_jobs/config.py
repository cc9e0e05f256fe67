"""One typed configuration object for the job, loaded once and validated at start.

Sources, later ones winning:

1. the defaults below (an embedded stack on loopback);
2. a properties file in Amazon Managed Service for Apache Flink's format, a JSON list of
   ``{"PropertyGroupId": ..., "PropertyMap": {...}}``: ``/etc/flink/application_properties.json``
   when it exists (that is where Managed Flink puts it), else the file named by
   ``SI_PROPERTIES_FILE``;
3. environment variables ``SI_<GROUP>_<FIELD>``, e.g. ``SI_KAFKA_BOOTSTRAP_SERVERS``;
4. explicit overrides passed by the caller (the CLI, tests).

Each property group maps to one section dataclass; a key that no section knows, or a value
of the wrong shape, raises :class:`ConfigError` naming the group and key, so a typo fails the
deployment instead of silently falling back to a default. Every numeric field declares its
allowed range beside it (``bounded(default, gt=..., le=...)``); a value outside it, NaN or an
infinity is refused at start, naming the key, its ``SI_<GROUP>_<FIELD>`` variable and the
range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

# The one ConfigError of every package (docs/decisions.md#shared-config-errors), re-exported:
# the job's errors of its settings.
from intent_reader.config_errors import ConfigError as ConfigError
from intent_reader.config_errors import redact_url
from intent_reader.layout import DEFAULT_CLUSTER_SHARDS, HASH_SLOTS, KeyLayout

MANAGED_FLINK_PROPERTIES = Path("/etc/flink/application_properties.json")
ENV_PREFIX = "SI_"
#: The model ``scripts/setup.sh`` installs under ``<cache>/models/`` and the job asks for
#: by default (``llm.model``).
BUNDLED_MODEL = "SmolLM2-135M-Instruct"
#: ``prompt.tokenizer_path``'s default: the bundled model's tokenizer, shipped with the
#: templates.
AUTO_TOKENIZER = "auto"


#: The metadata key of a field's :class:`Bounds`.
BOUNDS = "bounds"


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting may take: finite, and within ``low``/``high`` (each
    inclusive unless ``low_open``/``high_open``; None: unbounded on that side)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range in words: ``> 0``, ``>= 0 and <= 10``."""
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        return " and ".join(parts) or "a finite number"


def bounded(
    default: float,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A numeric field whose allowed range is declared beside it (``Bounds`` in its
    metadata): every section's ``validate`` refuses a value outside it, NaN and infinity."""
    if (gt is not None and ge is not None) or (le is not None and lt is not None):
        raise TypeError("give at most one lower and one upper bound")
    bounds = Bounds(
        low=gt if gt is not None else ge,
        high=lt if lt is not None else le,
        low_open=gt is not None,
        high_open=lt is not None,
    )
    return field(default=default, metadata={BOUNDS: bounds})


def env_name(group: str, name: str) -> str:
    """The environment variable that sets ``group.name``: ``SI_<GROUP>_<FIELD>``."""
    return f"{ENV_PREFIX}{group.upper()}_{name.upper()}"


def check_bounds(section: Any, group: str) -> None:
    """Refuse any field of ``section`` outside its declared :class:`Bounds`, naming the key,
    its environment variable and the allowed range."""
    for f in dataclasses.fields(section):
        bounds = f.metadata.get(BOUNDS)
        if bounds is None:
            continue
        value = getattr(section, f.name)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or not bounds.admits(value):
            raise ConfigError(
                f"{group}.{f.name}",
                f"must be {bounds.describe()} ({env_name(group, f.name)}; got {value!r})",
            )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class _Section:
    """A property group: ``validate`` checks every field's declared bounds, then the
    group's own rules (``_check``)."""

    #: The property group's name (``PropertyGroupId``, the ``<GROUP>`` of ``SI_<GROUP>_*``).
    group: ClassVar[str]

    def validate(self) -> None:
        check_bounds(self, self.group)
        self._check()

    def _check(self) -> None:
        """Rules across fields, or beyond a range (URLs, choices); none by default."""


@dataclass(frozen=True)
class KafkaConfig(_Section):
    group: ClassVar[str] = "kafka"

    bootstrap_servers: str = "127.0.0.1:9092"
    events_topic: str = "shopper-events"
    dead_letter_topic: str = "shopper-events-dlq"
    #: Optional copies, off when empty: every event that arrived behind the watermark, with
    #: what became of it; every prompt rendered (for audits, evaluation sets and replay checks).
    late_events_topic: str = ""
    prompts_topic: str = ""
    group_id: str = "shopper-intents"
    #: "committed" resumes from the group's offsets (earliest when it has none); "earliest"
    #: and "latest" ignore them.
    starting_offsets: str = "committed"
    #: A bounded replay (backfills, replay checks): read up to the offsets that are latest at
    #: start, then fire every pending trigger (end of input passes every event time) and
    #: finish. Unbounded (false) is the live service.
    bounded: bool = False
    #: Passed to both the source and the sink as Kafka client properties (security settings,
    #: e.g. security.protocol, sasl.mechanism, sasl.jaas.config). JSON object.
    client_properties: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Passed to the source only, after client_properties: consumer tuning for a broker
    #: (e.g. {"fetch.max.wait.ms": "50"}, which the embedded stack sets for its broker,
    #: Tansu, which holds a fetch even with records waiting). JSON object.
    source_properties: Mapping[str, str] = field(default_factory=dict)

    def _check(self) -> None:
        _require(self.bootstrap_servers, "kafka", "bootstrap_servers")
        _one_of(
            self.starting_offsets, ("committed", "earliest", "latest"), "kafka", "starting_offsets"
        )


@dataclass(frozen=True)
class RedisConfig(_Section):
    group: ClassVar[str] = "redis"

    #: May carry a password (redis://:secret@host): kept out of reprs and logs.
    url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    key_prefix: str = "si"
    intent_ttl_s: int = bounded(24 * 3600, gt=0)
    #: Per command: 0 would time out every write.
    write_timeout_s: float = bounded(2.0, gt=0)
    #: How long writes are retried (with backoff) before the job fails and restarts from
    #: its last checkpoint: back-pressure and a loud failure, never a silent loss.
    write_retry_budget_s: float = bounded(30.0, gt=0)
    #: Stream key that each landed intent write is also appended to, in the same script
    #: (docs/redis_layout.md, "Update notifications"); empty: off. On a cluster, one shard of
    #: it per slot group.
    notify_stream: str = ""
    #: Approximate length the stream is trimmed to (XADD MAXLEN ~), all shards together.
    notify_stream_maxlen: int = bounded(100_000, gt=0)
    #: Redis Cluster (ElastiCache with cluster mode enabled, MemoryDB): the job's clients are
    #: cluster clients and its keys carry hash tags, so that every key one write touches
    #: shares a slot (docs/redis_layout.md, "Redis Cluster"). Off: one primary, keys untagged.
    cluster: bool = False
    #: Slot groups of the cluster layout: part of the key layout, so readers must use the
    #: same number, and changing it moves every key.
    cluster_shards: int = bounded(DEFAULT_CLUSTER_SHARDS, ge=1, le=HASH_SLOTS)
    #: For a backfill that re-evaluates recorded events with a new prompt template or model:
    #: at an equal version, replace an intent made by another template or model (normally
    #: an equal version is a no-op). Off for the live job (docs/redis_layout.md).
    reevaluate: bool = False

    def _check(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                "redis.url",
                f"must start with redis://, rediss:// or unix:// (got {redact_url(self.url)!r})",
            )
        if self.notify_stream:
            taken = layout_key_named(self.notify_stream, self.key_prefix)
            if taken:
                raise ConfigError(
                    "redis.notify_stream",
                    f"{self.notify_stream!r} would be {taken}; "
                    f"use e.g. {self.key_prefix}:intent-updates",
                )
        if self.cluster:
            self._check_cluster()

    def _check_cluster(self) -> None:
        if not self.url.startswith(("redis://", "rediss://")):
            raise ConfigError(
                "redis.cluster",
                "needs a redis:// or rediss:// URL naming one of the cluster's nodes or its "
                f"configuration endpoint (got {redact_url(self.url)!r})",
            )
        database = urlsplit(self.url).path.strip("/")
        if database not in ("", "0"):
            raise ConfigError(
                "redis.cluster",
                f"Redis Cluster has database 0 only; redis.url names database {database!r} "
                f"({redact_url(self.url)!r})",
            )
        for name in ("key_prefix", "notify_stream"):
            value = getattr(self, name)
            if "{" in value or "}" in value:
                raise ConfigError(
                    f"redis.{name}",
                    f"{value!r} holds a brace: with redis.cluster the job gives its keys their "
                    "hash tags, and one of its own would put every key in one slot",
                )

    def layout(self) -> KeyLayout:
        """The job's key layout: tagged over ``cluster_shards`` groups with ``cluster``."""
        return KeyLayout(self.key_prefix, self.cluster_shards if self.cluster else 0)


def layout_key_named(key: str, prefix: str) -> str:
    """What ``key`` already is in the job's Redis layout under ``prefix``
    (``docs/redis_layout.md``), or "" when it is none of its keys."""
    if key.startswith(f"{prefix}:intent:"):
        return "a shopper's intent key"
    if key.startswith(f"{prefix}:samples:"):
        return "a timing samples list"
    return {f"{prefix}:stats": "the stats hash", f"{prefix}:stats:flushes": "the stats ledger"}.get(
        key, ""
    )


@dataclass(frozen=True)
class LlmConfig(_Section):
    group: ClassVar[str] = "llm"

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = BUNDLED_MODEL
    api_key: str = field(default="", repr=False)
    max_tokens: int = bounded(192, gt=0)
    #: The context of the model the workers serve (vLLM's --max-model-len): a prompt's
    #: tokens and max_tokens must fit in it together, or the server refuses the request.
    max_model_len: int = bounded(4096, gt=0)
    temperature: float = bounded(0.0, ge=0, le=2)
    request_timeout_s: float = bounded(60.0, gt=0)
    #: With full-jitter backoff (0.5 s doubling to 8 s) six attempts ride out about 8 s of
    #: outage on average, enough for a router or worker restart.
    max_attempts: int = bounded(6, ge=1, le=100)
    backoff_initial_s: float = bounded(0.5, gt=0)
    backoff_max_s: float = bounded(8.0, gt=0)
    #: Prompts queued or in flight per operator instance (outbox.Outbox): the bound on
    #: waiting work; beyond it the job back-pressures into Kafka. A queued prompt that a
    #: newer one of the same shopper supersedes is dropped, not sent, and takes no place.
    capacity: int = bounded(128, ge=1)
    #: Requests in flight to the LLM endpoint per operator instance.
    max_concurrency: int = bounded(8, ge=1)
    #: How often the operator collects the outcomes of a shopper's prompts (dead letters,
    #: counts). Intents reach Redis as soon as they are answered, whatever this is.
    poll_interval_s: float = bounded(0.5, gt=0)
    #: An answer that is not a valid intent is asked for again this many times before it
    #: is dead-lettered.
    invalid_answer_retries: int = bounded(1, ge=0, le=10)
    #: Send the JSON Schema as response_format so the server constrains decoding to it.
    guided_json: bool = True
    #: Make the calls (HTTP, answer check, Redis upsert) in a helper process with its own
    #: interpreter (call_process.py) instead of the job's, which they would share with
    #: every event in thread mode.
    call_process: bool = True
    #: Latest context wins (outbox.py): a shopper's queued prompt is replaced by its newer one
    #: and a call still waiting for the LLM is stopped for it. false: every prompt is
    #: answered, in order (evaluation runs that need a model answer at every trigger point;
    #: slower to catch up, each queued prompt takes a place of llm.capacity).
    latest_wins: bool = True
    #: Two speeds: write each prompt's rules-only intent the moment it fires, before the
    #: model answers. false: only model answers are written (an evaluation run, where the
    #: next prompt's rules-only record would otherwise outrank the model's earlier answers
    #: and leave them unwritten).
    rules_first: bool = True
    #: The HTTP proxy the calls go through; empty: the one the environment names, as
    #: other HTTP clients read it (llm_client.proxy_for). May carry credentials.
    proxy_url: str = field(default="", repr=False)
    #: Ask for the answer's token log-probabilities and make each label's confidence the
    #: model's probability of it (core.intents.with_label_scores): a ranking score from the
    #: model, not the digits it wrote. top_logprobs: alternatives read per token (vLLM's
    #: default allows up to 20).
    label_scores: bool = True
    top_logprobs: int = bounded(20, ge=1, le=20)

    def _check(self) -> None:
        _http_url(self.base_url, "llm", "base_url")
        if self.proxy_url:
            _http_url(self.proxy_url, "llm", "proxy_url")
        _require(self.model, "llm", "model")


@dataclass(frozen=True)
class SessionConfig(_Section):
    group: ClassVar[str] = "session"

    max_events: int = bounded(40, ge=1)
    gap_s: float = bounded(30 * 60, gt=0)
    #: Keyed state of a shopper idle for this long is dropped by Flink's state TTL.
    state_ttl_s: int = bounded(24 * 3600, gt=0)
    #: Events older than this behind the shopper's newest one are too late to matter.
    max_lateness_s: float = bounded(10 * 60, gt=0)
    #: Events of one shopper held until the watermark passes them (up to 5 min ahead of the
    #: clock are accepted); beyond this the next one is dead-lettered (timeline.hold_event).
    #: A person's events while the watermark waits are a few; 500 is a clock 5 min ahead at
    #: more than one event a second.
    max_held_events: int = bounded(500, ge=1)


@dataclass(frozen=True)
class TriggerConfig(_Section):
    group: ClassVar[str] = "trigger"

    high_signal_types: tuple[str, ...] = ("add_to_cart", "purchase", "remove_from_cart")
    #: Short waits: a shopper's material changes rarely come in bursts, so a long quiet
    #: period buys few calls and costs freshness (docs/decisions.md#trigger-timings).
    quiet_s: float = bounded(0.5, gt=0)
    max_wait_s: float = bounded(2.0, gt=0)
    min_interval_s: float = bounded(1.0, ge=0)

    def _check(self) -> None:
        if self.max_wait_s < self.quiet_s:
            raise ConfigError("trigger.max_wait_s", "must be >= trigger.quiet_s")


@dataclass(frozen=True)
class PromptConfig(_Section):
    group: ClassVar[str] = "prompt"

    template: str = "shopper_intent_v3.j2"
    templates_dir: str = ""  #: empty: the prompts/ folder shipped with the job
    #: The budget a rendered prompt is kept within (oldest events dropped first); with
    #: llm.max_tokens it must fit in llm.max_model_len.
    max_prompt_tokens: int = bounded(3500, gt=0)
    max_text_chars: int = bounded(120, gt=0)
    #: What counts the budget's tokens (core/token_budget.py): a model folder (its
    #: tokenizer.json and chat template) or a tokenizer.json, counted exactly; "auto" (the
    #: default): the bundled model's (SmolLM2-135M-Instruct) tokenizer, shipped with the
    #: templates (prompts/tokenizer/), so the count is exact on Managed Flink too; empty:
    #: the bound, UTF-8 bytes, which never undercounts but counts English about four times
    #: over. Serving another model, name its folder (or leave it empty).
    tokenizer_path: str = AUTO_TOKENIZER
    #: Template A/B (core/arms.py): "template[@model]:weight,..." splits shoppers between
    #: templates (and optionally models) by a stable hash of the shopper id, e.g.
    #: "shopper_intent_v1.j2:50,shopper_intent_v2.j2:50". Empty: template for everyone.
    arms: str = ""

    def _check(self) -> None:
        if (
            self.tokenizer_path not in ("", AUTO_TOKENIZER)
            and not Path(self.tokenizer_path).exists()
        ):
            raise ConfigError(
                "prompt.tokenizer_path",
                f"{self.tokenizer_path!r} does not exist: name the model folder (with "
                "tokenizer.json) or a tokenizer.json, or leave it empty "
                f"({env_name('prompt', 'tokenizer_path')})",
            )
        from flink_jobs.core.arms import ArmsError, parse_arms

        try:
            parse_arms(self.arms, self.template)
        except ArmsError as exc:
            raise ConfigError("prompt.arms", f"{exc} (got {self.arms!r})") from None


@dataclass(frozen=True)
class JobConfig(_Section):
    group: ClassVar[str] = "job"

    name: str = "shopper-intents"
    #: 0 leaves it to whoever runs the job: ``flink run -p``, or Managed Flink's
    #: ParallelismConfiguration (which autoscaling changes; a parallelism set in the code
    #: would pin it). A mini-cluster would take one per core, so local runs default to 1.
    parallelism: int = bounded(1, ge=0)
    #: The number of key groups the shoppers' state is split into, fixed for the job's life:
    #: a snapshot restores at any parallelism up to it, and only at the same value (a new
    #: one cannot restore the keyed state). 128 is what Flink derives for any parallelism
    #: up to 85 when none is set, so snapshots taken before this setting existed restore.
    #: Flink's own limit on key groups is 32768.
    max_parallelism: int = bounded(128, ge=1, le=32768)
    checkpoint_interval_s: float = bounded(10.0, gt=0)
    max_event_bytes: int = bounded(16 * 1024, gt=0)
    #: Watermark = newest record timestamp - out_of_orderness_s. Events are held until the
    #: watermark passes them (timeline.py), so this is also the delay it adds to every prompt.
    out_of_orderness_s: float = bounded(0.5, ge=0)
    #: After this long without a record, a partition's watermark follows the wall clock (so
    #: the last prompts fire when traffic stops); 0 turns that off. A prompt due while its
    #: partition is quiet waits about this long plus out_of_orderness_s, so it is short. A
    #: paused task cannot make records late through it (EventTimeWatermarks.java), which is
    #: what makes a short one safe (docs/decisions.md#watermark-idle-advance).
    watermark_idle_advance_s: float = bounded(0.25, ge=0)
    #: A partition that never had a record stops holding the watermark back after this long
    #: from the job's start. Long enough for every partition's first fetch, even of a backlog
    #: after a restore; short, because until then a job started on a quiet topic holds its
    #: first prompts (docs/decisions.md#source-idleness).
    source_idleness_s: float = bounded(5.0, ge=0)
    #: Local runs only (Managed Flink manages both): where checkpoints are kept (empty: a
    #: scratch folder, lost with the job), and a checkpoint or savepoint to start from
    #: ("latest": the newest completed checkpoint under checkpoint_dir).
    checkpoint_dir: str = ""
    restore_from: str = ""
    #: "thread" runs the Python operators inside the TaskManager's JVM (PyFlink's embedded
    #: mode: a keyed state access is a call, not a round trip); "process" runs them in a
    #: separate Python worker over gRPC (Beam) (docs/decisions.md#python-thread-mode).
    python_execution_mode: str = "thread"
    #: Session states each operator instance keeps as objects (operators._RecentSessions).
    session_cache_size: int = bounded(20_000, ge=1)
    #: Process mode only: PyFlink keeps this many keys' state in the Python worker; too
    #: small and every state access becomes a round trip to the JVM.
    python_state_cache_size: int = bounded(50_000, ge=1)
    python_bundle_size: int = bounded(1000, ge=1)
    python_bundle_time_ms: int = bounded(50, ge=1)
    #: How often the source emits its watermark, and how long a network buffer may wait to
    #: fill before it is sent: both add to every prompt's wait while traffic flows, so they
    #: are far below Flink's defaults (200 and 100 ms); the extra watermarks and buffers cost
    #: no measurable throughput (docs/decisions.md#short-flush-periods).
    watermark_interval_ms: int = bounded(50, ge=1)
    #: -1 would be Flink's "send a buffer only when full": fine for a batch, not here.
    buffer_timeout_ms: int = bounded(10, ge=0)
    stats_flush_s: float = bounded(1.0, gt=0)
    #: Extra jars (Kafka connector, our deserializer); empty: found under the cache folder.
    jars: tuple[str, ...] = ()
    #: Flink's restart strategy for this job, as Flink's ``restart-strategy.*`` settings
    #: without that prefix (JSON object), e.g. {"type": "fixed-delay",
    #: "fixed-delay.attempts": "10", "fixed-delay.delay": "10 s"}. Empty: the cluster's.
    #: A strategy the job sets overrides the cluster's, so it stays empty unless wanted:
    #: Managed Flink's own restarts without limit, and Flink's default with checkpointing
    #: (exponential-delay) does too.
    restart_strategy: Mapping[str, str] = field(default_factory=dict)
    #: The metric group of the operators' metrics. Empty: the deployment's. The Managed Flink
    #: zip's main file names KinesisAnalytics (the group CloudWatch receives); every other
    #: run, shopper_intents (the Prometheus names the dashboards read). metrics.py.
    metric_group: str = ""

    def _check(self) -> None:
        _one_of(self.python_execution_mode, ("thread", "process"), "job", "python_execution_mode")
        if self.parallelism > self.max_parallelism:
            raise ConfigError(
                "job.parallelism",
                f"{self.parallelism} must be <= job.max_parallelism ({self.max_parallelism})",
            )
        if self.restore_from == "latest" and not self.checkpoint_dir:
            raise ConfigError("job.restore_from", '"latest" needs job.checkpoint_dir')
        if self.restart_strategy and "type" not in self.restart_strategy:
            raise ConfigError(
                "job.restart_strategy",
                'needs a "type" (e.g. {"type": "fixed-delay", "fixed-delay.attempts": "10"}); '
                f"got keys {sorted(self.restart_strategy)}",
            )


@dataclass(frozen=True)
class AppConfig:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    llm: LlmConfig = field(default_factory=LlmConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    job: JobConfig = field(default_factory=JobConfig)

    def validate(self) -> AppConfig:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        context = self.prompt.max_prompt_tokens + self.llm.max_tokens
        if context > self.llm.max_model_len:
            raise ConfigError(
                "prompt.max_prompt_tokens",
                f"{self.prompt.max_prompt_tokens} plus llm.max_tokens ({self.llm.max_tokens}) "
                f"is {context}, over llm.max_model_len ({self.llm.max_model_len}), so the "
                "model would refuse every full prompt: lower "
                f"one of the first two, or raise {env_name('llm', 'max_model_len')} to the "
                "context the workers serve",
            )
        return self

    def with_overrides(self, groups: Mapping[str, Mapping[str, Any]]) -> AppConfig:
        """A copy with ``{group: {field: value}}`` applied; values may be strings."""
        sections = {}
        for group, values in groups.items():
            if group not in _SECTIONS:
                raise ConfigError(group, f"no such property group; known: {', '.join(_SECTIONS)}")
            current = getattr(self, group)
            sections[group] = dataclasses.replace(
                current, **{k: _coerce(type(current), group, k, v) for k, v in values.items()}
            )
        return dataclasses.replace(self, **sections)


_SECTIONS = {f.name: f for f in dataclasses.fields(AppConfig)}


def load_config(
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
    properties_file: Path | None = None,
) -> AppConfig:
    """Build and validate the configuration from every source (see the module docstring)."""
    environ = os.environ if environ is None else environ
    config = AppConfig()
    path = properties_file or _properties_path(environ)
    if path is not None:
        config = config.with_overrides(read_property_groups(path))
    config = config.with_overrides(_env_groups(environ))
    if overrides:
        config = config.with_overrides(overrides)
    return config.validate()


def read_property_groups(path: Path) -> dict[str, dict[str, Any]]:
    """Read a Managed Flink properties file, keeping only this job's groups."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(str(path), f"cannot read the properties file: {exc}") from exc
    if not isinstance(raw, list):
        raise ConfigError(
            str(path), "expected a JSON list of {PropertyGroupId, PropertyMap} objects"
        )
    groups: dict[str, dict[str, Any]] = {}
    for position, entry in enumerate(raw, start=1):
        # Named by position and keys only: the values may be passwords.
        if not isinstance(entry, dict):
            raise ConfigError(
                str(path),
                f"entry {position} is a {type(entry).__name__}, not an object"
                " with a PropertyGroupId",
            )
        if "PropertyGroupId" not in entry:
            raise ConfigError(
                str(path), f"entry {position} has no PropertyGroupId (its keys: {sorted(entry)})"
            )
        group = entry["PropertyGroupId"]
        if group in _SECTIONS:
            groups.setdefault(group, {}).update(entry.get("PropertyMap") or {})
    return groups


def config_as_property_groups(config: AppConfig) -> list[dict[str, Any]]:
    """The inverse of :func:`read_property_groups`, for writing example files."""
    out = []
    for name in _SECTIONS:
        section = getattr(config, name)
        values = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, tuple):
                value = ",".join(value)
            elif isinstance(value, Mapping):
                value = json.dumps(dict(value))
            values[f.name] = str(value)
        out.append({"PropertyGroupId": name, "PropertyMap": values})
    return out


def _properties_path(environ: Mapping[str, str]) -> Path | None:
    if MANAGED_FLINK_PROPERTIES.exists():
        return MANAGED_FLINK_PROPERTIES
    named = environ.get("SI_PROPERTIES_FILE")
    if named:
        path = Path(named)
        if not path.exists():
            raise ConfigError("SI_PROPERTIES_FILE", f"names {path}, which does not exist")
        return path
    return None


def _env_groups(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == "SI_PROPERTIES_FILE" or key == "SI_CACHE_DIR":
            continue
        group, _, name = key[len(ENV_PREFIX) :].lower().partition("_")
        if group in _SECTIONS and name:
            groups.setdefault(group, {})[name] = value
    return groups


def _coerce(cls: type, group: str, name: str, value: Any) -> Any:
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in dataclasses.fields(cls)}:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{group}.{name}", f"unknown key; known keys of {group!r}: {known}")
    target = hints[name]
    try:
        return _convert(target, value)
    except (TypeError, ValueError) as exc:
        if _is_secret(cls, name):  # the value (and the parser's view of it) may hold a password
            raise ConfigError(
                f"{group}.{name}",
                f"cannot use the value given as {_type_name(target)} "
                f"({type(exc).__name__}; value not shown, it may hold a secret)",
            ) from None
        raise ConfigError(
            f"{group}.{name}", f"cannot use {value!r} as {_type_name(target)} ({exc})"
        ) from exc


def _is_secret(cls: type, name: str) -> bool:
    """Fields declared with ``repr=False`` may hold secrets: never echoed in errors."""
    return any(f.name == name and not f.repr for f in dataclasses.fields(cls))


def _convert(target: Any, value: Any) -> Any:
    origin = typing.get_origin(target)
    if target is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if target in (int, float, str):
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError("expected a whole number")
        return target(value)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(str(i).strip() for i in items if str(i).strip())
    if origin in (Mapping, dict) or target is Mapping:
        parsed = json.loads(value) if isinstance(value, str) else value
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object")
        return {str(k): str(v) for k, v in parsed.items()}
    raise TypeError(f"unsupported config type {target}")


def _type_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


def _require(value: str, group: str, name: str) -> None:
    if not value:
        raise ConfigError(f"{group}.{name}", f"must be set (env {env_name(group, name)})")


def _http_url(url: str, group: str, name: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{group}.{name}", f"must be an http(s) URL (got {redact_url(url)!r})")


def _one_of(value: str, allowed: tuple[str, ...], group: str, name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{group}.{name}", f"must be one of {', '.join(allowed)} (got {value!r})")
