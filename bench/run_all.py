"""Run the benchmark suite, print one table, write ``bench/results/REPORT.md`` with plots.

``python -m bench.run_all [--only redis_upsert,pipeline_capacity] [--render]``

Each benchmark runs as its own process (``python -m bench.<name>``), under the machine's
heavy-run lock (``flock /tmp/si-heavy.lock``; ``--no-lock`` when the caller holds it), and
writes ``bench/results/<name>.json``. Then the report is built from the JSON files present
(``--render`` only rebuilds it): a table of every target, the key figures of each
benchmark, PNG plots (matplotlib, when installed) and the machine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench._common import RESULTS_DIR, machine_text, targets_table

#: Suite order: quick and independent first, the long routing comparison last.
BENCHMARKS = ("redis_upsert", "pipeline_capacity", "freshness", "routing")
LOCK = "/tmp/si-heavy.lock"


def selected(only: str | None) -> list[str]:
    """The benchmarks named in ``only`` (comma-separated), in suite order; all if None."""
    if not only:
        return list(BENCHMARKS)
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = names - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"unknown benchmark(s): {', '.join(sorted(unknown))}; known: {BENCHMARKS}")
    return [n for n in BENCHMARKS if n in names]


def run_one(name: str, lock: bool, extra: Sequence[str]) -> tuple[int, float]:
    argv = [sys.executable, "-m", f"bench.{name}", *extra]
    if lock and shutil.which("flock"):
        argv = ["flock", LOCK, *argv]
    print(f"=== {name}: {' '.join(argv)}", flush=True)
    started = time.monotonic()
    code = subprocess.call(argv)
    return code, time.monotonic() - started


def load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return orjson.loads(path.read_bytes()) if path.exists() else None


# --- the table and the report ------------------------------------------------------------------


def key_figures(name: str, doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The few figures of a benchmark that the summary table shows."""
    if name == "redis_upsert":
        rows = [
            (
                f"{shape}: upsert / HSET ops/s",
                f"{s['upsert_ops_per_s']:,} / {s['hset_ops_per_s']:,}",
            )
            for shape, s in doc["shapes"].items()
        ]
        ref = doc.get("redis_benchmark")
        if ref:
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
    return []


def summary_table(docs: dict[str, dict[str, Any]]) -> str:
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


def plots(docs: dict[str, dict[str, Any]], out: Path) -> dict[str, list[str]]:
    """PNG files per benchmark (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    made: dict[str, list[str]] = {}

    def save(fig, name: str, bench: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.setdefault(bench, []).append(name)

    doc = docs.get("redis_upsert")
    if doc:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        labels, ups, hs = [], [], []
        for shape, s in doc["shapes"].items():
            labels.append(shape)
            ups.append(s["upsert_ops_per_s"])
            hs.append(s["hset_ops_per_s"])
        ref = doc.get("redis_benchmark")
        if ref and ref.get("hset"):
            labels.append("redis-benchmark")
            ups.append(ref["upsert_evalsha"])
            hs.append(ref["hset"])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], ups, 0.4, label="versioned upsert (Lua)")
        ax.bar([x + 0.2 for x in xs], hs, 0.4, label="plain HSET")
        ax.set_xticks(list(xs), labels)
        ax.set_yscale("log")
        ax.set_ylabel("writes/s (log)")
        ax.legend()
        save(fig, "redis_upsert_throughput.png", "redis_upsert")

    doc = docs.get("pipeline_capacity")
    if doc:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        curves = {
            **{phase: p for phase, p in doc["phases"].items() if isinstance(p, dict)},
            **{
                f"floor {shape}": p
                for shape, p in doc["phases"].get("floor", {}).items()
                if isinstance(p, dict)
            },
        }
        for label, p in curves.items():
            if p.get("throughput_series"):
                xs, ys = zip(*p["throughput_series"], strict=True)
                ax.plot(xs, ys, label=label)
        ax.set_xlabel("s since the job was submitted (drain, floor) / the pace started (paced)")
        ax.set_ylabel("events/s (2 s window)")
        if "floor" in doc["phases"]:
            ax.set_yscale("log")  # the floor drains several times faster than the job
        ax.legend()
        save(fig, "pipeline_capacity_throughput.png", "pipeline_capacity")
        paced = doc["phases"].get("paced")
        if paced and paced.get("event_to_redis_ms"):
            fig, ax = plt.subplots(figsize=(6, 3.2))
            _cdf(ax, [v / 1000 for v in paced["event_to_redis_ms"]], "event to Redis")
            ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel("seconds")
            ax.set_ylabel("share of intents")
            ax.legend()
            save(fig, "pipeline_capacity_latency.png", "pipeline_capacity")

    doc = docs.get("freshness")
    if doc:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        _cdf(ax, [v / 1000 for v in doc.get("freshness_ms", [])], "event to intent in Redis")
        _cdf(ax, [v / 1000 for v in doc.get("llm_latency_ms", [])], "LLM call")
        ax.set_xlabel("seconds")
        ax.set_ylabel("share")
        ax.legend()
        save(fig, "freshness_latency.png", "freshness")
        series = doc.get("series") or []
        if series:
            fig, ax = plt.subplots(figsize=(7, 3.2))
            xs = [row["t_s"] for row in series]
            for key in ("events_in", "prompts_sent", "intents_written"):
                ax.plot(xs, [row.get(key, 0) for row in series], label=key)
            ax.set_xlabel("s since the replay started")
            ax.set_ylabel("count")
            ax.legend()
            save(fig, "freshness_progress.png", "freshness")
    return made


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def report(docs: dict[str, dict[str, Any]], images: dict[str, list[str]], table: str) -> str:
    hosts = {machine_text(doc.get("machine") or {}) for doc in docs.values()}
    where = (
        f"Machine: {hosts.pop()}."
        if len(hosts) == 1
        else "Measured on more than one machine: each section names its own."
    )
    lines = [
        "# Benchmark report",
        "",
        f"{where} Shared with other work: absolute times are noisy, so comparisons are "
        "ratios measured side by side in one run.",
        "",
        "```",
        table,
        "```",
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
            targets_table(doc.get("targets", [])),
            "",
        ]
        for label, value in key_figures(name, doc):
            lines.append(f"- {label}: {value}")
        if key_figures(name, doc):
            lines.append("")
        memory = doc.get("memory_peak")
        if memory:
            lines += [
                "Peak resident memory (VmHWM):",
                "",
                "| process | n | largest MiB | sum MiB |",
            ]
            lines.append("| --- | --- | --- | --- |")
            for kind, v in memory.items():
                lines.append(f"| {kind} | {v['processes']} | {v['max_mib']} | {v['sum_mib']} |")
            lines.append("")
        for image in images.get(name, []):
            lines += [f"![{image}]({image})", ""]
        for note in doc.get("notes", []):
            lines.append(f"> {note}")
        if name == "routing":
            lines.append("\nDetails: [routing.md](routing.md).")
        lines.append("")
    return "\n".join(lines)


def render(out: Path, names: Sequence[str] = BENCHMARKS) -> str:
    docs = {n: d for n in names if (d := load(out, n)) is not None}
    table = summary_table(docs)
    images = plots(docs, out)
    (out / "REPORT.md").write_text(report(docs, images, table))
    return table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--only", help=f"comma-separated, from {', '.join(BENCHMARKS)}")
    p.add_argument("--render", action="store_true", help="only rebuild the report from the JSON")
    p.add_argument("--no-lock", action="store_true", help="the caller holds the heavy-run lock")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    names = selected(args.only)
    failed = []
    if not args.render:
        for name in names:
            extra = [] if name == "routing" else ["--out", str(args.out)]
            code, seconds = run_one(name, not args.no_lock, extra)
            print(f"=== {name}: exit {code} after {seconds:.0f} s", flush=True)
            if code not in (0, 1):  # 1: ran, some target not met
                failed.append(name)
    table = render(args.out)
    print(table)
    print(f"report: {args.out / 'REPORT.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
