"""The unit costs a plan multiplies, read from the benchmarks' results documents.

Every figure carries where it came from: the results file and the key within it
(``measured``), the arithmetic over such keys (``derived``), a default of the job's or
the router's configuration (``config``), a benchmark's target (``target``), the GPU table
(``assumed``, ``gpus.py``) or the command line (``input``: a flag's value, or the trigger
rate of an events file it names, ``trigger_rate.py``). A figure that is not there is
recorded with the reason (the file or key missing, and the command that writes it); a
plan asks for it with :meth:`UnitCosts.get`, which raises :class:`MissingFigure` with
that reason, so one absent measurement leaves only the resources that need it unsized.

Pure: the documents come in parsed (``{file stem: document}``), nothing is read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flink_jobs.config import AppConfig

MEASURED = "measured"
DERIVED = "derived"
CONFIG = "config"
TARGET = "target"
ASSUMED = "assumed"
INPUT = "input"

#: The processes of a capacity run that a Managed Flink KPU hosts: the TaskManager's JVM
#: (with the embedded interpreter in thread mode; a mini-cluster's JVM holds the
#: JobManager too), PyFlink's worker process in process mode. The LLM call process is
#: counted apart, per call (``call_process_cpu_ms_per_call``).
JVM_KINDS = ("flink_jvm", "flink_taskmanager", "python_udf_worker")
CALL_PROCESS_KIND = "llm_call_process"

#: The results files' writers, named in a missing figure's reason.
WRITERS = {
    "pipeline_capacity": "python -m bench.pipeline_capacity",
    "intent_quality": "shopper-intents eval",
    "routing": "python -m bench.routing",
    "redis_upsert": "python -m bench.redis_upsert",
    "router_load": "python -m bench.router_load",
    "freshness": "python -m bench.freshness",
    "trigger_policy": "python -m bench.freshness --policy-only",
}

#: The unit costs that make the trigger rate: a property of the traffic, not of the machine.
TRIGGER_RATE = ("llm_calls_per_event", "prompts_per_event")


class MissingFigure(LookupError):
    """A unit cost the plan needs is not in the results: the message names the file and
    key, and how to measure it or give it."""


@dataclass(frozen=True)
class Figure:
    value: float
    #: The results file (``bench/results/<name>.json``), the module or ``command line``.
    source: str
    #: Where in the source: a dotted key, an expression over keys, a setting or a flag.
    key: str
    #: ``measured``, ``derived``, ``config``, ``target``, ``assumed`` or ``input``.
    kind: str

    def cite(self) -> str:
        return f"{self.source}: {self.key}"


@dataclass(frozen=True)
class Spread:
    """The lowest and highest value of a figure the results hold across workloads."""

    low: float
    high: float
    #: The results file, and where in it.
    source: str
    key: str

    def cite(self) -> str:
        return f"{self.source}: {self.key}"


@dataclass(frozen=True)
class UnitCosts:
    """What one event, call or write costs, each figure with its source; None where the
    results do not hold it (``absent`` says why)."""

    #: CPU of the TaskManager's processes per event, in ms of the measuring host's cores.
    jvm_cpu_ms_per_event: Figure | None = None
    #: CPU of the LLM call process per LLM call (HTTP, answer check, Redis upserts).
    call_process_cpu_ms_per_call: Figure | None = None
    #: LLM calls per accepted event under the default trigger policy (the trigger rate).
    llm_calls_per_event: Figure | None = None
    #: Prompts the trigger policy fires per accepted event.
    prompts_per_event: Figure | None = None
    #: Redis upserts of a prompt's rules-only record (``llm.rules_first``): 1 or 0.
    rules_writes_per_prompt: Figure | None = None
    #: The job's own p99 from the trigger's firing time to the prompt sent, paced, at the
    #: default out-of-orderness.
    job_to_prompt_p99_s: Figure | None = None
    measuring_host_cores: Figure | None = None
    #: Prompt tokens per call of the shipped template, cached or not.
    prompt_tokens_per_call: Figure | None = None
    #: Output tokens the plan budgets per call: the configured cap, ``llm.max_tokens``.
    output_tokens_per_call: Figure | None = None
    #: Output tokens per call the shipped template's answers measured (mean).
    measured_output_tokens_per_call: Figure | None = None
    #: Share of prompt tokens the workers' prefix caches served, under the default router.
    prefix_cache_hit_ratio: Figure | None = None
    #: Versioned upserts per second one Redis node served in the job's write pattern.
    redis_writes_per_node_per_s: Figure | None = None
    #: The router's CPU per proxied request, in ms of the measuring host's cores.
    router_cpu_ms_per_request: Figure | None = None
    #: The trigger policy's longest wait before a prompt covers an event.
    trigger_max_wait_s: Figure | None = None
    #: The default target: from a qualifying event to the intent covering it in Redis.
    freshness_target_s: Figure | None = None
    max_parallelism: Figure | None = None
    #: One GPU's prefill throughput: no results file holds it (``gpus.py``, or an input).
    prefill_tokens_per_s: Figure | None = None
    #: One GPU's decode throughput: no results file holds it (``gpus.py``, or an input).
    decode_tokens_per_s: Figure | None = None
    #: The prompts per event the trigger policy's offline replays gave across samples of
    #: the generator, under the default trigger settings (``trigger_policy.json``): how far
    #: the trigger rate moves with the traffic.
    prompts_per_event_spread: Spread | None = None
    #: The machine the capacity figures were measured on.
    host: str = "unknown"
    #: Why a figure is None: the file or key missing and the command that writes it.
    absent: Mapping[str, str] = field(default_factory=dict)
    #: What the results say about their own figures that a reader of the plan should know.
    caveats: tuple[str, ...] = ()

    def get(self, name: str) -> Figure:
        """The figure ``name``; MissingFigure naming its file and key when it is absent."""
        figure: Figure | None = getattr(self, name)
        if figure is None:
            raise MissingFigure(self.absent.get(name, f"no figure {name}"))
        return figure

    def with_figure(self, name: str, figure: Figure) -> UnitCosts:
        """A copy with ``name`` replaced (an input given on the command line)."""
        if name not in FIGURE_NAMES:
            raise ValueError(f"unknown unit cost {name!r}")
        absent = {k: v for k, v in self.absent.items() if k != name}
        changes: dict[str, Any] = {name: figure, "absent": absent}
        return dataclasses.replace(self, **changes)


#: The figures of ``UnitCosts`` (its fields of type ``Figure | None``, as annotated).
FIGURE_NAMES = tuple(f.name for f in dataclasses.fields(UnitCosts) if f.type == "Figure | None")


@dataclass(frozen=True)
class ConfigDefaults:
    """The defaults of the job's and the router's configuration that a plan reads."""

    template: str
    max_tokens: int
    rules_first: bool
    trigger_max_wait_s: float
    out_of_orderness_s: float
    max_parallelism: int
    router_policy: str
    trigger_quiet_s: float
    trigger_min_interval_s: float

    @classmethod
    def from_code(cls) -> ConfigDefaults:
        from inference_sidecar.config import RouterConfig

        app = AppConfig()
        policy = {f.name: f.default for f in dataclasses.fields(RouterConfig)}["policy"]
        return cls(
            template=app.prompt.template,
            max_tokens=app.llm.max_tokens,
            rules_first=app.llm.rules_first,
            trigger_max_wait_s=app.trigger.max_wait_s,
            out_of_orderness_s=app.job.out_of_orderness_s,
            max_parallelism=app.job.max_parallelism,
            router_policy=str(policy),
            trigger_quiet_s=app.trigger.quiet_s,
            trigger_min_interval_s=app.trigger.min_interval_s,
        )


def read_unit_costs(
    results: Mapping[str, Any], config: ConfigDefaults, where: str = "bench/results"
) -> UnitCosts:
    """The unit costs in ``results`` (``{file stem: parsed document}``, as read from the
    folder ``where``) and ``config``; each figure absent from them is None, with its reason
    in ``absent``."""
    reader = _Reader(results, where)
    figures: dict[str, Figure | None] = {}
    absent: dict[str, str] = {}
    for name in FIGURE_NAMES:
        read = _READERS.get(name)
        if read is None:
            figures[name] = None
            absent[name] = f"no {name}: not a measurement; give it, or take the GPU table's"
            continue
        try:
            figures[name] = read(reader, config)
        except MissingFigure as exc:
            figures[name] = None
            absent[name] = str(exc)
    return UnitCosts(
        **figures,
        prompts_per_event_spread=_prompts_spread(reader, config),
        host=reader.host(),
        absent=absent,
        caveats=_caveats(reader, config),
    )


def _prompts_spread(reader: _Reader, config: ConfigDefaults) -> Spread | None:
    """The lowest and highest prompts per event of ``trigger_policy.json``'s row for the
    default trigger settings: over its samples and its long sample. None when the file
    or the row is not there."""
    timings = reader.results.get("trigger_policy", {})
    rows = timings.get("timings") if isinstance(timings, Mapping) else None
    defaults = {
        "quiet_s": config.trigger_quiet_s,
        "max_wait_s": config.trigger_max_wait_s,
        "min_interval_s": config.trigger_min_interval_s,
    }
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        trigger = row.get("trigger") if isinstance(row, Mapping) else None
        if not isinstance(trigger, Mapping) or any(
            trigger.get(k) != v for k, v in defaults.items()
        ):
            continue
        samples = [*(row.get("samples") or []), row.get("long_sample") or {}]
        values = [
            float(v)
            for sample in samples
            if isinstance(sample, Mapping)
            and isinstance(v := sample.get("prompts_per_event"), int | float)
            and not isinstance(v, bool)
        ]
        if values:
            settings = ", ".join(f"{k} {v:g}" for k, v in defaults.items())
            return Spread(
                min(values),
                max(values),
                reader.source("trigger_policy"),
                f"timings[{i}] ({settings}): samples[].prompts_per_event and"
                " long_sample.prompts_per_event",
            )
    return None


def _caveats(reader: _Reader, config: ConfigDefaults) -> tuple[str, ...]:
    """The capacity drain ran without rules-only writes when its stats count none: its call
    process's CPU then leaves out the upsert per prompt the default configuration makes."""
    try:
        stats = _mapping(reader, "pipeline_capacity", "phases.drain.stats")
    except MissingFigure:
        return ()
    if config.rules_first and "intents_written_rules" not in stats:
        return (
            f"{reader.source('pipeline_capacity')}: the drain's stats count no"
            " intents_written_rules, so it ran without the rules-only write per prompt that"
            " llm.rules_first makes by default: the call process's CPU per call leaves that"
            " upsert out (rerun `python -m bench.pipeline_capacity`)",
        )
    return ()


# --- reading the documents -------------------------------------------------------------------


class _Reader:
    def __init__(self, results: Mapping[str, Any], where: str) -> None:
        self.results = results
        self.where = where.rstrip("/")

    def source(self, stem: str) -> str:
        return f"{self.where}/{stem}.json"

    def value(self, stem: str, key: str) -> float:
        """The number at dotted ``key`` of results file ``stem``."""
        node = self.document(stem)
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise self.missing(stem, f"no {key}")
            node = node[part]
        if isinstance(node, bool) or not isinstance(node, int | float):
            raise self.missing(stem, f"{key} is not a number ({node!r})")
        return float(node)

    def document(self, stem: str) -> Any:
        if stem not in self.results:
            raise self.missing(stem, "the file is missing")
        return self.results[stem]

    def missing(self, stem: str, what: str) -> MissingFigure:
        writer = WRITERS.get(stem)
        return MissingFigure(
            f"{self.source(stem)}: {what}" + (f" (written by `{writer}`)" if writer else "")
        )

    def host(self) -> str:
        doc = self.results.get("pipeline_capacity")
        machine = doc.get("machine") if isinstance(doc, Mapping) else None
        if not isinstance(machine, Mapping):
            return "unknown"
        return f"{machine.get('cores')} cores, {machine.get('cpu_model')}"


def _drain_kinds(reader: _Reader) -> dict[str, float]:
    key = "phases.drain.cpu_ms_per_event"
    kinds = {
        kind: reader.value("pipeline_capacity", f"{key}.{kind}")
        for kind in (*JVM_KINDS, CALL_PROCESS_KIND)
        if kind in _mapping(reader, "pipeline_capacity", key)
    }
    if not any(kind in kinds for kind in JVM_KINDS):
        raise reader.missing("pipeline_capacity", f"no {key}.flink_jvm")
    return kinds


def _mapping(reader: _Reader, stem: str, key: str) -> Mapping[str, Any]:
    node = reader.document(stem)
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping):
        raise reader.missing(stem, f"no {key}")
    return node


def _jvm_cpu(reader: _Reader, _config: ConfigDefaults) -> Figure:
    kinds = {k: v for k, v in _drain_kinds(reader).items() if k in JVM_KINDS}
    key = " + ".join(f"phases.drain.cpu_ms_per_event.{k}" for k in kinds)
    return Figure(sum(kinds.values()), reader.source("pipeline_capacity"), key, MEASURED)


def _per_accepted_event(reader: _Reader, stat: str) -> Figure:
    """The drain phase's count ``stat`` per event the job accepted."""
    count = reader.value("pipeline_capacity", f"phases.drain.stats.{stat}")
    events = reader.value("pipeline_capacity", "phases.drain.stats.events_accepted")
    if events <= 0:
        raise reader.missing("pipeline_capacity", "phases.drain.stats.events_accepted is 0")
    return Figure(
        count / events,
        reader.source("pipeline_capacity"),
        f"phases.drain.stats.{stat} / events_accepted",
        DERIVED,
    )


def _calls_per_event(reader: _Reader, _config: ConfigDefaults) -> Figure:
    return _per_accepted_event(reader, "llm_calls")


def _prompts_per_event(reader: _Reader, _config: ConfigDefaults) -> Figure:
    return _per_accepted_event(reader, "prompts_sent")


def _call_process_cpu(reader: _Reader, config: ConfigDefaults) -> Figure:
    kinds = _drain_kinds(reader)
    if CALL_PROCESS_KIND not in kinds:
        raise reader.missing(
            "pipeline_capacity", f"no phases.drain.cpu_ms_per_event.{CALL_PROCESS_KIND}"
        )
    calls = _calls_per_event(reader, config).value
    if calls <= 0:
        raise reader.missing("pipeline_capacity", "phases.drain.stats.llm_calls is 0")
    return Figure(
        kinds[CALL_PROCESS_KIND] / calls,
        reader.source("pipeline_capacity"),
        f"phases.drain.cpu_ms_per_event.{CALL_PROCESS_KIND} / (llm_calls / events_accepted)",
        DERIVED,
    )


def _rules_writes(_reader: _Reader, config: ConfigDefaults) -> Figure:
    return Figure(
        1.0 if config.rules_first else 0.0,
        "flink_jobs/config.py",
        f"llm.rules_first = {str(config.rules_first).lower()}",
        CONFIG,
    )


def _job_to_prompt(reader: _Reader, config: ConfigDefaults) -> Figure:
    """The paced run's p99, moved by the difference between the default out-of-orderness
    and the run's: the watermark holds every event that long before its timer fires."""
    key = "phases.paced.event_to_prompt_s.p99"
    p99 = reader.value("pipeline_capacity", key)
    setting = "phases.paced.settings.job.out_of_orderness_s"
    try:
        run_bound = float(_text(reader, "pipeline_capacity", setting))
    except (MissingFigure, ValueError):
        return Figure(p99, reader.source("pipeline_capacity"), key, MEASURED)
    return Figure(
        p99 + config.out_of_orderness_s - run_bound,
        reader.source("pipeline_capacity"),
        f"{key} + job.out_of_orderness_s ({config.out_of_orderness_s:g}) - {setting}"
        f" ({run_bound:g})",
        DERIVED,
    )


def _text(reader: _Reader, stem: str, key: str) -> str:
    parent, _, last = key.rpartition(".")
    node = _mapping(reader, stem, parent)
    if last not in node:
        raise reader.missing(stem, f"no {key}")
    return str(node[last])


def _host_cores(reader: _Reader, _config: ConfigDefaults) -> Figure:
    key = "machine.cores"
    return Figure(
        reader.value("pipeline_capacity", key), reader.source("pipeline_capacity"), key, MEASURED
    )


def _template_arm(reader: _Reader, config: ConfigDefaults) -> tuple[str, int, Mapping[str, Any]]:
    """The dataset and arm index of the shipped template's arm (served by the base model)
    with the most calls in ``intent_quality.json``, and its ``cost``."""
    datasets = _mapping(reader, "intent_quality", "datasets")
    best: tuple[str, int, Mapping[str, Any]] | None = None
    for name, dataset in datasets.items():
        arms = dataset.get("arms") if isinstance(dataset, Mapping) else None
        for i, arm in enumerate(arms if isinstance(arms, list) else []):
            cost = arm.get("cost") if isinstance(arm, Mapping) else None
            if arm.get("template") != config.template or not isinstance(cost, Mapping):
                continue
            if best is None or cost.get("llm_calls", 0) > best[2].get("llm_calls", 0):
                best = (name, i, cost)
    if best is None:
        raise reader.missing("intent_quality", f"no arm of the template {config.template}")
    return best


def _arm_figure(reader: _Reader, config: ConfigDefaults, what: str) -> Figure:
    dataset, index, cost = _template_arm(reader, config)
    key = f"datasets.{dataset}.arms[{index}].cost.{what}"
    value = cost.get(what)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise reader.missing("intent_quality", f"no {key}")
    return Figure(
        float(value), reader.source("intent_quality"), f"{key} ({config.template})", MEASURED
    )


def _prompt_tokens(reader: _Reader, config: ConfigDefaults) -> Figure:
    return _arm_figure(reader, config, "prompt_tokens_per_call")


def _measured_output_tokens(reader: _Reader, config: ConfigDefaults) -> Figure:
    return _arm_figure(reader, config, "output_tokens_per_call")


def _output_tokens(_reader: _Reader, config: ConfigDefaults) -> Figure:
    return Figure(float(config.max_tokens), "flink_jobs/config.py", "llm.max_tokens", CONFIG)


def _hit_ratio(reader: _Reader, config: ConfigDefaults) -> Figure:
    key = f"phases.steady.sidecar_{config.router_policy}.prefix_cache_hit_ratio"
    return Figure(
        reader.value("routing", key),
        reader.source("routing"),
        f"{key} (the router's default policy)",
        MEASURED,
    )


def _redis_node(reader: _Reader, _config: ConfigDefaults) -> Figure:
    key = "shapes.job.upsert_ops_per_s"
    return Figure(reader.value("redis_upsert", key), reader.source("redis_upsert"), key, MEASURED)


def _router_cpu(reader: _Reader, _config: ConfigDefaults) -> Figure:
    key = "throughput.cpu_ms_per_request"
    value = reader.value("router_load", key)
    if value <= 0:
        raise reader.missing("router_load", f"{key} is not positive ({value})")
    return Figure(value, reader.source("router_load"), key, MEASURED)


def _max_wait(_reader: _Reader, config: ConfigDefaults) -> Figure:
    return Figure(config.trigger_max_wait_s, "flink_jobs/config.py", "trigger.max_wait_s", CONFIG)


def _freshness(reader: _Reader, _config: ConfigDefaults) -> Figure:
    """The freshness benchmark's staleness target: the job's configuration has none."""
    targets = reader.document("freshness").get("targets") or []
    for i, t in enumerate(targets):
        if str(t.get("name", "")).startswith("staleness") and isinstance(
            t.get("limit"), int | float
        ):
            return Figure(
                float(t["limit"]),
                reader.source("freshness"),
                f"targets[{i}].limit ({t['name']})",
                TARGET,
            )
    raise reader.missing("freshness", "no staleness target")


def _max_parallelism(_reader: _Reader, config: ConfigDefaults) -> Figure:
    return Figure(
        float(config.max_parallelism), "flink_jobs/config.py", "job.max_parallelism", CONFIG
    )


_READERS: dict[str, Callable[[_Reader, ConfigDefaults], Figure]] = {
    "jvm_cpu_ms_per_event": _jvm_cpu,
    "call_process_cpu_ms_per_call": _call_process_cpu,
    "llm_calls_per_event": _calls_per_event,
    "prompts_per_event": _prompts_per_event,
    "rules_writes_per_prompt": _rules_writes,
    "job_to_prompt_p99_s": _job_to_prompt,
    "measuring_host_cores": _host_cores,
    "prompt_tokens_per_call": _prompt_tokens,
    "output_tokens_per_call": _output_tokens,
    "measured_output_tokens_per_call": _measured_output_tokens,
    "prefix_cache_hit_ratio": _hit_ratio,
    "redis_writes_per_node_per_s": _redis_node,
    "router_cpu_ms_per_request": _router_cpu,
    "trigger_max_wait_s": _max_wait,
    "freshness_target_s": _freshness,
    "max_parallelism": _max_parallelism,
}
