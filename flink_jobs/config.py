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
deployment instead of silently falling back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANAGED_FLINK_PROPERTIES = Path("/etc/flink/application_properties.json")
ENV_PREFIX = "SI_"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or malformed; the message says which."""


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap_servers: str = "127.0.0.1:9092"
    events_topic: str = "shopper-events"
    dead_letter_topic: str = "shopper-events-dlq"
    # Optional copies, off when empty: every event that arrived behind the watermark, with
    # what became of it; every prompt rendered (for audits, evaluation sets and replay checks).
    late_events_topic: str = ""
    prompts_topic: str = ""
    group_id: str = "shopper-intents"
    # "committed" resumes from the group's offsets (earliest when it has none); "earliest"
    # and "latest" ignore them.
    starting_offsets: str = "committed"
    # A bounded replay (backfills, replay checks): read up to the offsets that are latest at
    # start, then fire every pending trigger (end of input passes every event time) and
    # finish. Unbounded (false) is the live service.
    bounded: bool = False
    # Passed to both the source and the sink as Kafka client properties (security settings,
    # e.g. security.protocol, sasl.mechanism, sasl.jaas.config). JSON object.
    client_properties: Mapping[str, str] = field(default_factory=dict, repr=False)

    def validate(self) -> None:
        _require(self.bootstrap_servers, "kafka", "bootstrap_servers")
        _one_of(
            self.starting_offsets, ("committed", "earliest", "latest"), "kafka", "starting_offsets"
        )


@dataclass(frozen=True)
class RedisConfig:
    # May carry a password (redis://:secret@host): kept out of reprs and logs.
    url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    key_prefix: str = "si"
    intent_ttl_s: int = 24 * 3600
    write_timeout_s: float = 2.0
    # How long writes are retried (with backoff) before the job fails and restarts from
    # its last checkpoint: back-pressure and a loud failure, never a silent loss.
    write_retry_budget_s: float = 30.0
    # Stream key that each landed intent write is also appended to, in the same script
    # (docs/redis_layout.md, "Update notifications"); empty: off. Needs a non-cluster Redis.
    notify_stream: str = ""
    # Approximate length the stream is trimmed to (XADD MAXLEN ~).
    notify_stream_maxlen: int = 100_000
    # For a backfill that re-evaluates recorded events with a new prompt template or model:
    # at an equal version, replace an intent made by another template or model (normally
    # an equal version is a no-op). Off for the live job (docs/redis_layout.md).
    reevaluate: bool = False

    def validate(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                "redis.url must start with redis://, rediss:// or unix:// "
                f"(got {redact_url(self.url)!r})"
            )
        _positive(self.intent_ttl_s, "redis", "intent_ttl_s")
        _positive(self.notify_stream_maxlen, "redis", "notify_stream_maxlen")
        if self.notify_stream.startswith(f"{self.key_prefix}:intent:"):
            raise ConfigError(
                f"redis.notify_stream {self.notify_stream!r} would be a shopper's intent key; "
                f"use e.g. {self.key_prefix}:intent-updates"
            )


@dataclass(frozen=True)
class LlmConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "SmolLM2-135M-Instruct"
    api_key: str = field(default="", repr=False)
    max_tokens: int = 192
    temperature: float = 0.0
    request_timeout_s: float = 60.0
    # With full-jitter backoff (0.5 s doubling to 8 s) six attempts ride out about 8 s of
    # outage on average, enough for a router or worker restart.
    max_attempts: int = 6
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    # Prompts queued or in flight per operator instance (outbox.Outbox): the bound on
    # waiting work; beyond it the job back-pressures into Kafka. A queued prompt that a
    # newer one of the same shopper supersedes is dropped, not sent, and takes no place.
    capacity: int = 128
    # Requests in flight to the LLM endpoint per operator instance.
    max_concurrency: int = 8
    # How often the operator collects the outcomes of a shopper's prompts (dead letters,
    # counts). Intents reach Redis as soon as they are answered, whatever this is.
    poll_interval_s: float = 0.5
    # An answer that is not a valid intent is asked for again this many times before it
    # is dead-lettered.
    invalid_answer_retries: int = 1
    # Send the JSON Schema as response_format so the server constrains decoding to it.
    guided_json: bool = True
    # Make the calls (HTTP, answer check, Redis upsert) in a helper process with its own
    # interpreter (call_process.py) instead of the job's, which they would share with
    # every event in thread mode.
    call_process: bool = True
    # Latest context wins (outbox.py): a shopper's queued prompt is replaced by its newer one
    # and a call still waiting for the LLM is stopped for it. false: every prompt is
    # answered, in order (evaluation runs that need a model answer at every trigger point;
    # slower to catch up, each queued prompt takes a place of llm.capacity).
    latest_wins: bool = True
    # Two speeds: write each prompt's rules-only intent the moment it fires, before the
    # model answers. false: only model answers are written (an evaluation run, where the
    # next prompt's rules-only record would otherwise outrank the model's earlier answers
    # and leave them unwritten).
    rules_first: bool = True
    # The HTTP proxy the calls go through; empty: the one the environment names, as
    # other HTTP clients read it (llm_client.proxy_for). May carry credentials.
    proxy_url: str = field(default="", repr=False)
    # Ask for the answer's token log-probabilities and make each label's confidence the
    # model's probability of it (core.intents.with_label_scores): a ranking score from the
    # model, not the digits it wrote. top_logprobs: alternatives read per token (vLLM's
    # default allows up to 20).
    label_scores: bool = True
    top_logprobs: int = 20

    def validate(self) -> None:
        _http_url(self.base_url, "llm", "base_url")
        if self.proxy_url:
            _http_url(self.proxy_url, "llm", "proxy_url")
        _require(self.model, "llm", "model")
        for name in (
            "max_tokens",
            "request_timeout_s",
            "max_attempts",
            "capacity",
            "max_concurrency",
            "poll_interval_s",
        ):
            _positive(getattr(self, name), "llm", name)
        if self.label_scores and not 1 <= self.top_logprobs <= 20:
            raise ConfigError(
                f"llm.top_logprobs: {self.top_logprobs} is outside 1-20 (what vLLM serves by"
                " default); lower it or set llm.label_scores=false"
            )


@dataclass(frozen=True)
class SessionConfig:
    max_events: int = 40
    gap_s: float = 30 * 60
    # Keyed state of a shopper idle for this long is dropped by Flink's state TTL.
    state_ttl_s: int = 24 * 3600
    # Events older than this behind the shopper's newest one are too late to matter.
    max_lateness_s: float = 10 * 60
    # Events of one shopper held until the watermark passes them (up to 5 min ahead of the
    # clock are accepted); beyond this the next one is dead-lettered (timeline.hold_event).
    # A person's events while the watermark waits are a few; 500 is a clock 5 min ahead at
    # more than one event a second.
    max_held_events: int = 500

    def validate(self) -> None:
        for name in ("max_events", "gap_s", "state_ttl_s", "max_lateness_s", "max_held_events"):
            _positive(getattr(self, name), "session", name)


@dataclass(frozen=True)
class TriggerConfig:
    high_signal_types: tuple[str, ...] = ("add_to_cart", "purchase", "remove_from_cart")
    # Short waits: a shopper's material changes rarely come in bursts, so a long quiet
    # period buys few calls and costs freshness. Replayed over the samples (seven of 30
    # shoppers for 4 min, one of 300 for an hour), 3 s / 5 s / 2 s sent 2-4% fewer prompts
    # than these and left a qualifying event up to 5.0 s without a prompt; these, at most
    # 1.0 s (bench/README.md, "Trigger policy").
    quiet_s: float = 0.5
    max_wait_s: float = 2.0
    min_interval_s: float = 1.0

    def validate(self) -> None:
        for name in ("quiet_s", "max_wait_s"):
            _positive(getattr(self, name), "trigger", name)
        if self.min_interval_s < 0:
            raise ConfigError("trigger.min_interval_s must be >= 0")
        if self.max_wait_s < self.quiet_s:
            raise ConfigError("trigger.max_wait_s must be >= trigger.quiet_s")


@dataclass(frozen=True)
class PromptConfig:
    template: str = "shopper_intent_v3.j2"
    templates_dir: str = ""  # empty: the prompts/ folder shipped with the job
    max_prompt_tokens: int = 3500
    max_text_chars: int = 120
    # Template A/B (core/arms.py): "template[@model]:weight,..." splits shoppers between
    # templates (and optionally models) by a stable hash of the shopper id, e.g.
    # "shopper_intent_v1.j2:50,shopper_intent_v2.j2:50". Empty: template for everyone.
    arms: str = ""

    def validate(self) -> None:
        _positive(self.max_prompt_tokens, "prompt", "max_prompt_tokens")
        _positive(self.max_text_chars, "prompt", "max_text_chars")
        from flink_jobs.core.arms import ArmsError, parse_arms

        try:
            parse_arms(self.arms, self.template)
        except ArmsError as exc:
            raise ConfigError(f"prompt.arms: {exc} (got {self.arms!r})") from None


@dataclass(frozen=True)
class JobConfig:
    name: str = "shopper-intents"
    # 0 leaves it to whoever runs the job: ``flink run -p``, or Managed Flink's
    # ParallelismConfiguration (which autoscaling changes; a parallelism set in the code
    # would pin it). A mini-cluster would take one per core, so local runs default to 1.
    parallelism: int = 1
    # The number of key groups the shoppers' state is split into, fixed for the job's life:
    # a snapshot restores at any parallelism up to it, and only at the same value (a new
    # one cannot restore the keyed state). 128 is what Flink derives for any parallelism
    # up to 85 when none is set, so snapshots taken before this setting existed restore.
    max_parallelism: int = 128
    checkpoint_interval_s: float = 10.0
    max_event_bytes: int = 16 * 1024
    # Watermark = newest record timestamp - out_of_orderness_s. Events are held until the
    # watermark passes them (timeline.py), so this is also the delay it adds to every prompt.
    out_of_orderness_s: float = 0.5
    # After this long without a record, a partition's watermark follows the wall clock (so
    # the last prompts fire when traffic stops); 0 turns that off. A prompt due while its
    # partition is quiet waits about this long plus out_of_orderness_s: bench/freshness.py
    # measured freshness p99 2.4 s above the LLM's at 2 s, 0.7-1.0 s at 0.5 s, 0.5 s at 0.25 s.
    # A paused task no longer makes records late through it (EventTimeWatermarks.java).
    watermark_idle_advance_s: float = 0.25
    # A partition that never had a record stops holding the watermark back after this long
    # from the job's start. Long enough for every partition's first fetch, even of a backlog
    # after a restore; at 30 s, a job started on a quiet topic held its first prompts for
    # up to 30 s (bench/freshness.py's first prompt: 8.8 s outside its LLM call).
    source_idleness_s: float = 5.0
    # Local runs only (Managed Flink manages both): where checkpoints are kept (empty: a
    # scratch folder, lost with the job), and a checkpoint or savepoint to start from
    # ("latest": the newest completed checkpoint under checkpoint_dir).
    checkpoint_dir: str = ""
    restore_from: str = ""
    # "thread" runs the Python operators inside the TaskManager's JVM (PyFlink's embedded
    # mode: about an eighth of the cost per keyed state access measured here); "process"
    # runs them in a separate Python worker over gRPC (Beam).
    python_execution_mode: str = "thread"
    # Session states each operator instance keeps as objects (operators._RecentSessions).
    session_cache_size: int = 20_000
    # Process mode only: PyFlink keeps this many keys' state in the Python worker; too
    # small and every state access becomes a round trip to the JVM.
    python_state_cache_size: int = 50_000
    python_bundle_size: int = 1000
    python_bundle_time_ms: int = 50
    # How often the source emits its watermark, and how long a network buffer may wait to
    # fill before it is sent: both add to every prompt's wait while traffic flows. Flink's
    # defaults (200 and 100 ms), with the Kafka client's 500 ms fetch wait, cost
    # bench/pipeline_capacity.py's paced run 0.25 s of event-to-Redis p50 at 300 events/s;
    # these cost no measurable throughput in its drains (bench/README.md).
    watermark_interval_ms: int = 50
    buffer_timeout_ms: int = 10
    stats_flush_s: float = 1.0
    # Extra jars (Kafka connector, our deserializer); empty: found under the cache folder.
    jars: tuple[str, ...] = ()
    # Flink's restart strategy for this job, as Flink's ``restart-strategy.*`` settings
    # without that prefix (JSON object), e.g. {"type": "fixed-delay",
    # "fixed-delay.attempts": "10", "fixed-delay.delay": "10 s"}. Empty: the cluster's.
    # A strategy the job sets overrides the cluster's, so it stays empty unless wanted:
    # Managed Flink's own restarts without limit, and Flink's default with checkpointing
    # (exponential-delay) does too.
    restart_strategy: Mapping[str, str] = field(default_factory=dict)
    # The metric group of the operators' metrics. Empty: the deployment's. The Managed Flink
    # zip's main file names KinesisAnalytics (the group CloudWatch receives); every other
    # run, shopper_intents (the Prometheus names the dashboards read). metrics.py.
    metric_group: str = ""

    def validate(self) -> None:
        for name in (
            "max_parallelism",
            "checkpoint_interval_s",
            "max_event_bytes",
            "session_cache_size",
            "watermark_interval_ms",
        ):
            _positive(getattr(self, name), "job", name)
        for name in (
            "out_of_orderness_s",
            "watermark_idle_advance_s",
            "source_idleness_s",
            "buffer_timeout_ms",
            "parallelism",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"job.{name} must be >= 0")
        _one_of(self.python_execution_mode, ("thread", "process"), "job", "python_execution_mode")
        if self.parallelism > self.max_parallelism:
            raise ConfigError(
                f"job.parallelism ({self.parallelism}) must be <= job.max_parallelism"
                f" ({self.max_parallelism})"
            )
        if self.restore_from == "latest" and not self.checkpoint_dir:
            raise ConfigError('job.restore_from "latest" needs job.checkpoint_dir')
        if self.restart_strategy and "type" not in self.restart_strategy:
            raise ConfigError(
                'job.restart_strategy needs a "type" (e.g. {"type": "fixed-delay", '
                f'"fixed-delay.attempts": "10"}}); got keys {sorted(self.restart_strategy)}'
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
        return self

    def with_overrides(self, groups: Mapping[str, Mapping[str, Any]]) -> AppConfig:
        """A copy with ``{group: {field: value}}`` applied; values may be strings."""
        sections = {}
        for group, values in groups.items():
            if group not in _SECTIONS:
                raise ConfigError(
                    f"unknown property group {group!r}; known: {', '.join(_SECTIONS)}"
                )
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
        raise ConfigError(f"cannot read properties file {path}: {exc}") from exc
    if not isinstance(raw, list):
        raise ConfigError(
            f"{path}: expected a JSON list of {{PropertyGroupId, PropertyMap}} objects"
        )
    groups: dict[str, dict[str, Any]] = {}
    for position, entry in enumerate(raw, start=1):
        # Named by position and keys only: the values may be passwords.
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{path}: entry {position} is a {type(entry).__name__}, not an object"
                " with a PropertyGroupId"
            )
        if "PropertyGroupId" not in entry:
            raise ConfigError(
                f"{path}: entry {position} has no PropertyGroupId (its keys: {sorted(entry)})"
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
            raise ConfigError(f"SI_PROPERTIES_FILE names {path}, which does not exist")
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
    if name not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"unknown key {group}.{name}; known keys of {group!r}: {known}")
    target = hints[name]
    try:
        return _convert(target, value)
    except (TypeError, ValueError) as exc:
        if _is_secret(cls, name):  # the value (and the parser's view of it) may hold a password
            raise ConfigError(
                f"{group}.{name}: cannot use the value given as {_type_name(target)} "
                f"({type(exc).__name__}; value not shown, it may hold a secret)"
            ) from None
        raise ConfigError(
            f"{group}.{name}: cannot use {value!r} as {_type_name(target)} ({exc})"
        ) from exc


def _is_secret(cls: type, name: str) -> bool:
    """Fields declared with ``repr=False`` may hold secrets: never echoed in errors."""
    return any(f.name == name and not f.repr for f in dataclasses.fields(cls))


def redact_url(url: str) -> str:
    """``url`` for messages and logs: the secret part of its userinfo (the password of
    ``user:password@``, or all of a lone ``secret@``) and any ``password=`` query parameter
    replaced by ``***``. Unencoded passwords holding ``/`` or ``@`` are masked whole."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    head, query, tail = rest.partition("?")
    tail = _PASSWORD_PARAM.sub(r"\1***", tail)  # redis-py also takes ?password=
    userinfo, at, hostpart = head.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        head = f"{user}:***@{hostpart}" if colon else f"***@{hostpart}"
    return f"{scheme}://{head}{query}{tail}"


_PASSWORD_PARAM = re.compile(r"((?:^|&)password=)[^&]*", re.IGNORECASE)


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
        raise ConfigError(
            f"{group}.{name} must be set (env {ENV_PREFIX}{group.upper()}_{name.upper()})"
        )


def _http_url(url: str, group: str, name: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{group}.{name} must be an http(s) URL (got {redact_url(url)!r})")


def _positive(value: float, group: str, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{group}.{name} must be > 0 (got {value})")


def _one_of(value: str, allowed: tuple[str, ...], group: str, name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{group}.{name} must be one of {', '.join(allowed)} (got {value!r})")
