"""The plan: the resources a rate of events needs, from unit costs (pure arithmetic).

Each tier's work is the rate times a unit cost, in the unit the tier is bought in, and its
count is that work divided by the planned utilisation, rounded up:

- **Managed Flink**: vCPU = events/s x (TaskManager CPU per event + call-process CPU per
  LLM call x LLM calls per event) / the KPU's CPU speed relative to the measuring host;
  one KPU is one vCPU and 4 GiB, and runs ``parallelism_per_kpu`` subtasks;
- **vLLM workers**: GPU-seconds per second = prefill tokens/s / the GPU's prefill
  throughput + decode tokens/s / its decode throughput, where prefill tokens are the
  prompt tokens the prefix cache did not serve (prompt tokens x (1 - hit ratio)) and
  decode tokens the output tokens, per call, times LLM calls/s: one GPU does either in a
  given second, so the two add;
- **router**: cores = LLM calls/s x the router's CPU per request, at least
  ``MIN_ROUTER_REPLICAS`` replicas of one core;
- **Redis**: nodes = upserts/s / the upserts one node served, where each LLM call writes
  the model's record and each prompt its rules-only record (``llm.rules_first``).

Freshness is a budget, not a count: the GPU figures are throughputs, and a call's latency
under continuous batching does not follow from them. The plan says what the target
leaves the LLM call once the trigger's longest wait and the job's own share are taken,
and warns when nothing is left. docs/decisions.md#sizing-model gives the model's
assumptions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from flink_jobs.tools.sizing import gpus
from flink_jobs.tools.sizing.costs import (
    ASSUMED,
    INPUT,
    TRIGGER_RATE,
    Figure,
    MissingFigure,
    Spread,
    UnitCosts,
)

#: Every resource is planned at this share of its capacity: room for peaks, a lost node,
#: and the rebalancing after one, without a queue that grows.
DEFAULT_UTILISATION = 0.7
#: Router replicas, whatever the load: one may restart while the other serves.
MIN_ROUTER_REPLICAS = 2
KPU_VCPU = 1
KPU_MEMORY_GIB = 4

#: Inputs that replace the unit cost of the same name when given.
COST_INPUTS = (
    "prompt_tokens_per_call",
    "output_tokens_per_call",
    "prefix_cache_hit_ratio",
    "llm_calls_per_event",
    "prompts_per_event",
    "router_cpu_ms_per_request",
    "redis_writes_per_node_per_s",
)


@dataclass(frozen=True)
class PlanInputs:
    events_per_s: float
    #: Default: the unit costs' ``freshness_target_s``.
    freshness_s: float | None = None
    gpu: str = gpus.DEFAULT_GPU
    #: Per GPU; default: the GPU table's (assumed).
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    prompt_tokens_per_call: float | None = None
    output_tokens_per_call: float | None = None
    prefix_cache_hit_ratio: float | None = None
    #: The trigger rate; given alone, each sets the other too (one LLM call per prompt).
    llm_calls_per_event: float | None = None
    prompts_per_event: float | None = None
    router_cpu_ms_per_request: float | None = None
    redis_writes_per_node_per_s: float | None = None
    utilisation: float = DEFAULT_UTILISATION
    parallelism_per_kpu: int = 1
    #: A KPU's (and a router host's) vCPU speed relative to a core of the measuring host.
    cpu_speed: float = 1.0

    def validated(self) -> PlanInputs:
        """Itself, or ValueError naming the first input out of its range."""
        positive = (
            "events_per_s",
            "freshness_s",
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "prompt_tokens_per_call",
            "output_tokens_per_call",
            "router_cpu_ms_per_request",
            "redis_writes_per_node_per_s",
            "cpu_speed",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{_flag(name)} must be > 0 (got {value})")
        for name in TRIGGER_RATE:
            check_trigger_rate(_flag(name), getattr(self, name))
        calls, prompts = self.llm_calls_per_event, self.prompts_per_event
        if calls is not None and prompts is not None and calls > prompts:
            raise ValueError(
                f"{_flag('llm_calls_per_event')} ({calls}) cannot exceed"
                f" {_flag('prompts_per_event')} ({prompts}): each LLM call answers a prompt"
            )
        hit = self.prefix_cache_hit_ratio
        if hit is not None and not 0 <= hit < 1:
            raise ValueError(f"{_flag('prefix_cache_hit_ratio')} must be in [0, 1) (got {hit})")
        if not 0 < self.utilisation <= 1:
            raise ValueError(f"{_flag('utilisation')} must be in (0, 1] (got {self.utilisation})")
        if self.parallelism_per_kpu < 1:
            raise ValueError(f"{_flag('parallelism_per_kpu')} must be >= 1")
        if self.prefill_tokens_per_s is None or self.decode_tokens_per_s is None:
            gpus.gpu(self.gpu)  # an unknown GPU is refused even when one figure is given
        return self


def check_trigger_rate(name: str, value: float | None) -> None:
    """ValueError unless ``value`` (None: not given) is a trigger rate: above 0 (a plan
    for a job that never prompts sizes nothing) and at most 1 (a prompt covers at least
    one accepted event, and a call answers a prompt)."""
    if value is not None and not 0 < value <= 1:
        raise ValueError(
            f"{name} must be in (0, 1] (got {value}): a prompt covers at least one accepted event"
        )


@dataclass(frozen=True)
class Resource:
    tier: str
    unit: str
    #: None: not sized (``missing`` says which figure is absent).
    count: int | None
    #: The units' worth of work at full use, before the utilisation.
    work: float | None = None
    rule: str = ""
    missing: str = ""


@dataclass(frozen=True)
class Freshness:
    target_s: float
    trigger_max_wait_s: float
    job_p99_s: float

    @property
    def llm_budget_s(self) -> float:
        """What is left for the LLM call (its queue and its compute) at p99."""
        return self.target_s - self.trigger_max_wait_s - self.job_p99_s


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    resources: tuple[Resource, ...]
    #: Per second: events, LLM calls, prefill and decode tokens, Redis upserts.
    rates: dict[str, float]
    #: Per sized tier, largest count first: what its work is made of.
    drivers: tuple[str, ...]
    freshness: Freshness | None
    warnings: tuple[str, ...]
    #: Every unit cost the plan used, by name.
    figures: dict[str, Figure]
    host: str
    #: The unit costs' own caveats (``UnitCosts.caveats``).
    caveats: tuple[str, ...] = ()
    #: The trigger rate in effect (``costs.TRIGGER_RATE``, those present), used or not.
    trigger_rate: dict[str, Figure] = field(default_factory=dict)
    #: How far the results' trigger rate moves across samples (``UnitCosts``).
    trigger_rate_spread: Spread | None = None
    #: Figures a tier needed and did not find, with the reason.
    absent: dict[str, str] = field(default_factory=dict)

    def resource(self, tier: str) -> Resource:
        return next(r for r in self.resources if r.tier == tier)


FLINK = "Managed Flink"
LLM = "vLLM workers"
ROUTER = "router"
REDIS = "Redis"


def plan(inputs: PlanInputs, costs: UnitCosts) -> Plan:
    """The resources ``inputs.events_per_s`` needs at the unit costs ``costs``, where the
    inputs given replace the costs of the same name. A tier whose figures are absent is
    not sized (its ``missing`` names them); the others are."""
    inputs = inputs.validated()
    costs = with_inputs(costs, inputs)
    used: dict[str, Figure] = {}

    def fig(name: str) -> float:
        figure = costs.get(name)
        used[name] = figure
        return figure.value

    e, u = inputs.events_per_s, inputs.utilisation
    rates: dict[str, float] = {"events": e}
    warnings: list[str] = []
    drivers: dict[str, str] = {}

    def flink() -> Resource:
        calls, jvm = fig("llm_calls_per_event"), fig("jvm_cpu_ms_per_event")
        per_call = fig("call_process_cpu_ms_per_call")
        ms_per_event = jvm + per_call * calls
        vcpu = e * ms_per_event / 1000 / inputs.cpu_speed
        kpus = _units(vcpu / KPU_VCPU / u)
        parallelism = kpus * inputs.parallelism_per_kpu
        max_parallelism = int(fig("max_parallelism"))
        if parallelism > max_parallelism:
            warnings.append(
                f"parallelism {parallelism:,} is above job.max_parallelism ({max_parallelism}):"
                " a snapshot cannot restore past it, so such a job starts without its state at"
                " a higher max parallelism; the events topic needs at least as many partitions"
            )
        drivers[FLINK] = (
            f"{_share(jvm, ms_per_event)} the TaskManager ({num(jvm)} ms of CPU per event),"
            f" {_share(per_call * calls, ms_per_event)} the LLM call process ({num(per_call)}"
            f" ms per call x {num(calls)} calls per event)"
        )
        speed = f" / {num(inputs.cpu_speed)} CPU speed" if inputs.cpu_speed != 1 else ""
        return Resource(
            FLINK,
            f"KPU ({KPU_VCPU} vCPU, {KPU_MEMORY_GIB} GiB)",
            kpus,
            vcpu,
            f"{num(e)} events/s x {num(ms_per_event)} ms CPU per event{speed} ="
            f" {num(vcpu)} vCPU; / {num(u)} utilisation; parallelism {parallelism:,}"
            f" ({inputs.parallelism_per_kpu} per KPU)",
        )

    def llm() -> Resource:
        calls = e * fig("llm_calls_per_event")
        prompt, hit = fig("prompt_tokens_per_call"), fig("prefix_cache_hit_ratio")
        output = fig("output_tokens_per_call")
        computed = prompt * (1 - hit)
        prefill, decode = calls * computed, calls * output
        prefill_rate, decode_rate = fig("prefill_tokens_per_s"), fig("decode_tokens_per_s")
        work_prefill, work_decode = prefill / prefill_rate, decode / decode_rate
        work = work_prefill + work_decode
        rates.update(prefill_tokens=prefill, decode_tokens=decode)
        per_event = used["llm_calls_per_event"].value
        drivers[LLM] = (
            f"decode {_share(work_decode, work)} of GPU time: LLM calls per event x output"
            f" tokens per call = {num(per_event)} x {num(output)} = {num(per_event * output)}"
            f" tokens per event; prefill {_share(work_prefill, work)}: LLM calls per event x"
            f" prompt tokens x (1 - prefix-cache hit ratio) = {num(per_event)} x {num(prompt)} x"
            f" {num(1 - hit)} = {num(per_event * computed)} computed tokens per event"
        )
        return Resource(
            LLM,
            f"GPU ({inputs.gpu})" if _gpu_from_table(inputs) else "GPU",
            _units(work / u),
            work,
            f"{num(prefill)} prefill tokens/s / {num(prefill_rate)} + {num(decode)} decode"
            f" tokens/s / {num(decode_rate)} = {num(work)} GPUs busy; / {num(u)} utilisation",
        )

    def router() -> Resource:
        requests = e * fig("llm_calls_per_event")
        per_request = fig("router_cpu_ms_per_request")
        cores = requests * per_request / 1000 / inputs.cpu_speed
        drivers[ROUTER] = (
            f"LLM calls/s x the router's CPU per request = {num(requests)} x {num(per_request)} ms"
        )
        return Resource(
            ROUTER,
            "replica (1 core)",
            max(MIN_ROUTER_REPLICAS, _units(cores / u)),
            cores,
            f"{num(requests)} requests/s x {num(per_request)} ms CPU = {num(cores)} cores;"
            f" / {num(u)} utilisation, at least {MIN_ROUTER_REPLICAS}",
        )

    def redis() -> Resource:
        calls, prompts = fig("llm_calls_per_event"), fig("prompts_per_event")
        rules = fig("rules_writes_per_prompt")
        per_event = calls + prompts * rules
        writes = e * per_event
        per_node = fig("redis_writes_per_node_per_s")
        nodes = writes / per_node
        shards = _units(nodes / u)
        rates["redis_upserts"] = writes
        if shards > 1:
            warnings.append(
                f"{shards} Redis shards need cluster mode; redis.notify_stream needs it"
                " disabled (one shard): leave the stream off or plan one larger node"
            )
        drivers[REDIS] = (
            f"{num(per_event)} upserts per event: the model's record per LLM call ({num(calls)})"
            f" + the rules-only record per prompt ({num(prompts)} x {num(rules)})"
        )
        return Resource(
            REDIS,
            "shard (node)",
            shards,
            nodes,
            f"{num(writes)} upserts/s / {num(per_node)} per node = {num(nodes)} nodes busy;"
            f" / {num(u)} utilisation",
        )

    absent: dict[str, str] = {}
    resources = tuple(
        _sized(tier, unit, build, absent)
        for tier, unit, build in (
            (FLINK, "KPU", flink),
            (LLM, "GPU", llm),
            (ROUTER, "replica", router),
            (REDIS, "shard", redis),
        )
    )
    if "llm_calls_per_event" in used:
        rates["llm_calls"] = e * used["llm_calls_per_event"].value
    if LLM not in absent and costs.measured_output_tokens_per_call is not None:
        used["measured_output_tokens_per_call"] = costs.measured_output_tokens_per_call
    freshness = _freshness(fig, absent, warnings)
    sized = sorted((r for r in resources if r.count is not None), key=lambda r: -(r.count or 0))
    return Plan(
        inputs=inputs,
        resources=resources,
        rates=rates,
        drivers=tuple(f"{r.tier}, {r.count:,} x {r.unit}: {drivers[r.tier]}" for r in sized),
        freshness=freshness,
        warnings=tuple(warnings),
        figures=used,
        host=costs.host,
        caveats=tuple(costs.caveats),
        trigger_rate={n: f for n in TRIGGER_RATE if (f := getattr(costs, n)) is not None},
        trigger_rate_spread=costs.prompts_per_event_spread,
        absent=absent,
    )


def with_inputs(costs: UnitCosts, inputs: PlanInputs) -> UnitCosts:
    """``costs`` with the figures ``inputs`` give (kind ``input``) and the GPU's (the
    table's, ``assumed``, where the inputs give none). One of the trigger rate's two
    figures given alone sets the other: the same traffic makes both, and each prompt makes
    one LLM call at most."""
    for name in COST_INPUTS:
        value = getattr(inputs, name)
        if value is not None:
            costs = costs.with_figure(name, _input(name, value))
    calls, prompts = TRIGGER_RATE
    for given, other in ((calls, prompts), (prompts, calls)):
        value = getattr(inputs, given)
        if value is not None and getattr(inputs, other) is None:
            key = f"{_flag(given)} (one LLM call per prompt)"
            costs = costs.with_figure(other, Figure(float(value), "command line", key, INPUT))
    if inputs.freshness_s is not None:
        costs = costs.with_figure("freshness_target_s", _input("freshness_s", inputs.freshness_s))
    table = gpus.gpu(inputs.gpu) if _gpu_from_table(inputs) else None
    for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        value = getattr(inputs, name)
        if value is not None:
            costs = costs.with_figure(name, _input(name, value))
        elif table is not None:
            source = f"GPUS[{table.name!r}].{name}"
            costs = costs.with_figure(
                name, Figure(getattr(table, name), gpus.SOURCE, source, ASSUMED)
            )
    return costs


def _gpu_from_table(inputs: PlanInputs) -> bool:
    return inputs.prefill_tokens_per_s is None or inputs.decode_tokens_per_s is None


def _input(name: str, value: float) -> Figure:
    return Figure(float(value), "command line", _flag(name), INPUT)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _sized(tier: str, unit: str, build: Callable[[], Resource], absent: dict[str, str]) -> Resource:
    try:
        return build()
    except MissingFigure as exc:
        absent[tier] = str(exc)
        return Resource(tier, unit, None, missing=str(exc))


def _freshness(
    fig: Callable[[str], float], absent: dict[str, str], warnings: list[str]
) -> Freshness | None:
    try:
        budget = Freshness(
            fig("freshness_target_s"), fig("trigger_max_wait_s"), fig("job_to_prompt_p99_s")
        )
    except MissingFigure as exc:
        absent["freshness"] = str(exc)
        return None
    if budget.llm_budget_s <= 0:
        warnings.append(
            f"a freshness target of {num(budget.target_s)} s cannot be met: the trigger's"
            f" longest wait ({num(budget.trigger_max_wait_s)} s) and the job's own p99"
            f" ({num(budget.job_p99_s)} s) leave nothing for the LLM call"
        )
    return budget


def _units(work: float) -> int:
    """Whole units for ``work``: rounded up, ignoring float noise below a millionth."""
    return max(1, math.ceil(work - 1e-6)) if work > 0 else 0


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "n/a"


def num(x: float) -> str:
    """A figure for the rules: four significant digits, thousands separated."""
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}"
