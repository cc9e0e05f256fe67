"""The benchmarks' figures as text, built from the results files alone (no benchmark runs).

Three outputs come from ``bench/results/*.json``:

* the figures table: one row per judged target of every results file (benchmark, target,
  value, limit with its comparison, met or not, the commit and time of the run), and one
  row saying so for a file that judges none. It is written into ``bench/results/REPORT.md``
  and into ``FIGURES_DOC`` between ``BEGIN`` and ``END``, so no measured figure in the
  docs is typed by hand;
* ``REPORT.md``: that table, then per result document its run, machine, targets, key
  figures, peak memory, plots and notes;
* the sizing example: ``shopper-intents plan`` at ``SIZING_EVENTS_PER_S`` with its
  defaults (``flink_jobs/tools/sizing/``), written into ``SIZING_DOC`` between
  ``SIZING_BEGIN`` and ``SIZING_END``.

Everything here is a pure function of the files' contents (and of which plots exist), so a
unit test can regenerate each and compare it with what is committed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from bench._common import REPO, RESULTS_DIR, machine_text, targets_table
from flink_jobs.tools.sizing import render as sizing_render
from flink_jobs.tools.sizing.costs import ConfigDefaults, read_unit_costs
from flink_jobs.tools.sizing.model import PlanInputs, plan

FIGURES_DOC = REPO / "docs" / "development.md"
BEGIN = "<!-- figures:begin -->"
END = "<!-- figures:end -->"
REGENERATE = "make figures"

SIZING_DOC = REPO / "deploy" / "README.md"
SIZING_BEGIN = "<!-- sizing:begin -->"
SIZING_END = "<!-- sizing:end -->"
#: The worked example's rate, planned with every other input at its default.
SIZING_EVENTS_PER_S = 200_000

#: The plots ``bench.run_all`` draws per benchmark; the report shows those present.
PLOTS = {
    "redis_upsert": ("redis_upsert_throughput.png",),
    "pipeline_capacity": ("pipeline_capacity_throughput.png", "pipeline_capacity_latency.png"),
    "freshness": ("freshness_latency.png", "freshness_progress.png"),
}

#: Markdown written beside a results file by the benchmark that wrote it.
#: ``bench.routing`` writes one per run, under the run's ``--name``.
DETAILS = {
    name: f"{name}.md"
    for name in ("routing", "routing_scale", "routing_default", "routing_replicas",
                 "routing_replicas_hash")
}  # fmt: skip

NO_TARGET = "no target judged"
NOT_RECORDED = "not recorded"


def load_results(out: Path = RESULTS_DIR) -> dict[str, Any]:
    """Every ``*.json`` in ``out`` by file stem, in name order."""
    return {path.stem: orjson.loads(path.read_bytes()) for path in sorted(out.glob("*.json"))}


def is_result_doc(doc: Any) -> bool:
    """A benchmark's result document (``bench._common.result_doc``), as against the files
    the eval and distillation tools write, which carry no targets of their own."""
    return isinstance(doc, dict) and "benchmark" in doc and isinstance(doc.get("targets"), list)


# --- the figures table -----------------------------------------------------------------------


def figures_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """The figures table's cells: benchmark, target, value, limit, met, commit, run at."""
    rows = []
    for stem, doc in results.items():
        for label, part in _parts(stem, doc):
            run = [_commit(part), _when(part)]
            targets = (part.get("targets") or []) if isinstance(part, dict) else []
            if not targets:
                rows.append([label, NO_TARGET, "", "", "", *run])
            for t in targets:
                rows.append(
                    [
                        label,
                        str(t["name"]),
                        _value(t.get("value")),
                        f"{t['op']} {t['limit']}",
                        _verdict(t.get("met")),
                        *run,
                    ]
                )
    return rows


def _value(value: Any) -> str:
    """A figure as the table shows it: floats to four significant digits (the results file
    keeps every digit), anything else as written."""
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def figures_table(results: Mapping[str, Any]) -> str:
    """The figures table in markdown (``|`` in a cell escaped)."""
    header = ["benchmark", "target", "value", "limit", "met", "commit", "run at"]
    lines = [_row(header), _row(["---"] * len(header))]
    lines += [_row(cells) for cells in figures_rows(results)]
    return "\n".join(lines)


def _parts(stem: str, doc: Any) -> list[tuple[str, Any]]:
    """A file's runs: itself, or one per dataset when it holds several."""
    datasets = doc.get("datasets") if isinstance(doc, dict) else None
    if isinstance(datasets, dict) and not is_result_doc(doc):
        return [(f"{stem} ({name})", part) for name, part in datasets.items()]
    return [(stem, doc)]


def _commit(doc: Any) -> str:
    git = doc.get("git") if isinstance(doc, dict) else None
    if not isinstance(git, dict) or not git.get("commit"):
        return NOT_RECORDED
    return git["commit"][:10] + (" (uncommitted changes)" if git.get("dirty") else "")


def _when(doc: Any) -> str:
    if not isinstance(doc, dict):
        return NOT_RECORDED
    return str(doc.get("timestamp") or doc.get("when") or NOT_RECORDED)


def _verdict(met: Any) -> str:
    return {True: "yes", False: "**no**"}.get(met, "n/a")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


# --- the table in a document -----------------------------------------------------------------


def table_in(text: str, begin: str = BEGIN, end: str = END) -> str:
    """What stands between the markers of ``text`` (ValueError unless there is one pair)."""
    start, stop = _span(text, begin, end)
    return text[start:stop].strip("\n")


def with_table(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with what stands between its markers replaced by ``table``."""
    start, stop = _span(text, begin, end)
    return f"{text[:start]}\n{table}\n{text[stop:]}"


def _span(text: str, begin: str, end: str) -> tuple[int, int]:
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {begin} and one {end}")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise ValueError(f"{end} comes before {begin}")
    return start, stop


# --- the sizing example ----------------------------------------------------------------------


def sizing_example(results: Mapping[str, Any]) -> str:
    """``shopper-intents plan`` at ``SIZING_EVENTS_PER_S`` with every other input at its
    default, from the unit costs in ``results``, in markdown."""
    costs = read_unit_costs(results, ConfigDefaults.from_code())
    worked = plan(PlanInputs(SIZING_EVENTS_PER_S), costs)
    return "\n".join(
        [
            f"Generated by `{REGENERATE}` from `bench/results/*.json`: the output of"
            f" `shopper-intents plan --events-per-s {SIZING_EVENTS_PER_S}` with every other"
            " input at its default. Do not edit by hand.",
            "",
            sizing_render.markdown(worked),
        ]
    )


# --- the console summary and REPORT.md -------------------------------------------------------


def key_figures(name: str, doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The few figures of a benchmark, beside its targets, that the summaries show."""
    if name == "redis_upsert":
        rows = [
            (
                f"{shape}: upsert / HSET ops/s",
                f"{s['upsert_ops_per_s']:,} / {s['hset_ops_per_s']:,}",
            )
            for shape, s in doc["shapes"].items()
        ]
        ref = doc.get("redis_benchmark")
        if ref and ref.get("upsert_evalsha") and ref.get("hset"):
            rows.append(
                (
                    "redis-benchmark: EVALSHA / HSET rps",
                    f"{ref['upsert_evalsha']:,.0f} / {ref['hset']:,.0f}"
                    f" ({ref['upsert_over_hset']})",
                )
            )
        return rows
    if name == "pipeline_capacity":
        drain = doc["phases"].get("drain", {})
        paced = doc["phases"].get("paced", {})
        rows = [("drain events/s", drain.get("events_per_s"))]
        cpu = drain.get("cpu_ms_per_event")
        if cpu:
            rows.append(
                (
                    "drain CPU ms/event: total (Flink JVM, call process)",
                    f"{cpu['total']} ({cpu.get('flink_jvm')}, {cpu.get('llm_call_process')})",
                )
            )
        floor = doc["phases"].get("floor")
        if floor:
            shapes = {shape: p for shape, p in floor.items() if isinstance(p, dict)}
            rows.append(
                (
                    f"PyFlink floor events/s: {' / '.join(shapes)} (job over state_timer)",
                    " / ".join(str(shapes[s]["events_per_s"]) for s in shapes)
                    + f" ({floor['job_over_floor']})",
                )
            )
        if paced:
            lat = paced["event_to_redis_s"]
            rows.append(
                (
                    f"paced {paced['rate_offered']:,.0f}/s event-to-Redis p50/p99 s",
                    f"{lat['p50']} / {lat['p99']}",
                )
            )
        return rows
    if name == "freshness":
        c = doc["calls"]
        return [
            ("freshness p50/p99 s", f"{doc['freshness_s']['p50']} / {doc['freshness_s']['p99']}"),
            ("LLM p50/p99 s", f"{doc['llm_latency_s']['p50']} / {doc['llm_latency_s']['p99']}"),
            (
                "LLM calls per event (baseline)",
                f"{c['llm_calls_per_event']} ({c['baseline_calls_per_event']})",
            ),
            (
                "prompt tokens, run / baseline",
                f"{c['prompt_tokens']:,} / {c['baseline_prompt_tokens']:,}",
            ),
        ]
    if name == "plan_check":
        p, m = doc.get("predicted") or {}, doc.get("measured") or {}
        return [
            (
                f"at {doc.get('rate_offered')} events/s, {label}: predicted / measured",
                f"{p.get(key)} / {m.get(key)}",
            )
            for key, label in (
                ("job_cores", "job CPU cores"),
                ("redis_upserts_per_s", "Redis upserts/s"),
                ("llm_calls_per_s", "LLM calls/s"),
            )
        ]
    return []


def summary_table(docs: Mapping[str, dict[str, Any]]) -> str:
    """Fixed-width text of every target and key figure, for the console."""
    lines = [f"{'benchmark':<18} {'target':<58} {'value':>10} {'limit':>10}  met"]
    for name, doc in docs.items():
        for t in doc.get("targets", []):
            value = "n/a" if t["value"] is None else t["value"]
            lines.append(
                f"{name:<18} {t['name'][:58]:<58} {value!s:>10} {t['op']} {t['limit']!s:>7}"
                f"  {'yes' if t['met'] else 'NO'}"
            )
        for label, value in key_figures(name, doc):
            lines.append(f"{name:<18}   {label[:56]:<56} {value!s:>21}")
    return "\n".join(lines)


def report(results: Mapping[str, Any], plots: Mapping[str, list[str]]) -> str:
    """``REPORT.md``: the figures table, then a section per result document in ``results``.
    ``plots`` names the images to show per benchmark."""
    docs = {name: doc for name, doc in results.items() if is_result_doc(doc)}
    hosts = {machine_text(doc.get("machine") or {}) for doc in docs.values()}
    where = (
        f"Machine: {hosts.pop()}."
        if len(hosts) == 1
        else "Measured on more than one machine: each section names its own."
    )
    lines = [
        "# Benchmark report",
        "",
        f"Generated from `bench/results/*.json` by `{REGENERATE}` (`python -m bench.run_all"
        " --report-only`); `make bench` runs the benchmarks first. Do not edit by hand.",
        "",
        f"{where} Shared with other work: absolute times are noisy, so comparisons are "
        "ratios measured side by side in one run.",
        "",
        figures_table(results),
        "",
    ]
    for name, doc in docs.items():
        git = doc.get("git") or {}
        dirty = " + uncommitted changes" if git.get("dirty") else ""
        lines += [
            f"## {name}",
            "",
            f"Run {doc.get('timestamp')} ({doc.get('runtime_s')} s), commit "
            f"{(git.get('commit') or '?')[:10]}{dirty}; "
            f"`{doc.get('command')}`. Figures: `bench/results/{name}.json`.",
            f"Machine: {machine_text(doc.get('machine') or {})}.",
            "",
            targets_table(doc["targets"]) if doc["targets"] else "No target judged.",
            "",
        ]
        figures = key_figures(name, doc)
        lines += [f"- {label}: {value}" for label, value in figures]
        if figures:
            lines.append("")
        memory = doc.get("memory_peak")
        if memory:
            lines += [
                "Peak resident memory (VmHWM):",
                "",
                "| process | n | largest MiB | sum MiB |",
                "| --- | --- | --- | --- |",
            ]
            for kind, v in memory.items():
                lines.append(f"| {kind} | {v['processes']} | {v['max_mib']} | {v['sum_mib']} |")
            lines.append("")
        for image in plots.get(name, []):
            lines += [f"![{image}]({image})", ""]
        lines += [f"> {note}" for note in doc.get("notes", [])]
        if name in DETAILS:
            lines.append(f"\nDetails: [{DETAILS[name]}]({DETAILS[name]}).")
        lines.append("")
    return "\n".join(lines)


def plots_present(out: Path) -> dict[str, list[str]]:
    """Per benchmark, the plots of ``PLOTS`` that exist in ``out``."""
    return {
        name: [image for image in images if (out / image).exists()]
        for name, images in PLOTS.items()
    }


def write(
    out: Path = RESULTS_DIR,
    doc: Path | None = FIGURES_DOC,
    sizing_doc: Path | None = SIZING_DOC,
) -> dict[str, Any]:
    """Write ``out/REPORT.md``, the figures table into ``doc`` and the sizing example into
    ``sizing_doc`` (none: not that one) from the results files in ``out``; returns the
    results read."""
    results = load_results(out)
    (out / "REPORT.md").write_text(report(results, plots_present(out)))
    if doc is not None:
        doc.write_text(with_table(doc.read_text(), figures_table(results)))
    if sizing_doc is not None:
        text = with_table(sizing_doc.read_text(), sizing_example(results), SIZING_BEGIN, SIZING_END)
        sizing_doc.write_text(text)
    return results
