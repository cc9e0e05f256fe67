"""Run the benchmark suite, print one table, write ``bench/results/REPORT.md`` with plots.

``python -m bench.run_all [--only redis_upsert,pipeline_capacity] [--report-only]``

Each benchmark runs as its own process (``python -m bench.<name>``), under the machine's
heavy-run lock (``flock /tmp/si-heavy.lock``; ``--no-lock`` when the caller holds it), and
writes ``bench/results/<name>.json``. Then the suite's PNG plots are drawn (matplotlib,
when installed) and ``bench.report`` builds ``REPORT.md``, the figures table of
``docs/development.md`` and the sizing example of ``deploy/README.md`` from every JSON
file present.
``--report-only`` (alias ``--render``; ``make figures``) runs no benchmark and draws no
plot: it only rebuilds the three texts, so results written by a benchmark run on its own
reach the docs.
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

from bench import report
from bench._common import RESULTS_DIR

#: Suite order: quick and independent first, the long routing comparison last.
BENCHMARKS = ("redis_upsert", "pipeline_capacity", "freshness", "plan_check", "routing")
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


# --- plots and the report ----------------------------------------------------------------


def plots(docs: dict[str, dict[str, Any]], out: Path) -> None:
    """The PNG files of ``report.PLOTS`` for the benchmarks in ``docs`` (none when
    matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return

    def save(fig, image: str) -> None:
        fig.tight_layout()
        fig.savefig(out / image, dpi=90)
        plt.close(fig)

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
        (image,) = report.PLOTS["redis_upsert"]
        save(fig, image)

    doc = docs.get("pipeline_capacity")
    if doc:
        throughput, latency = report.PLOTS["pipeline_capacity"]
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
        save(fig, throughput)
        paced = doc["phases"].get("paced")
        if paced and paced.get("event_to_redis_ms"):
            fig, ax = plt.subplots(figsize=(6, 3.2))
            _cdf(ax, [v / 1000 for v in paced["event_to_redis_ms"]], "event to Redis")
            ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel("seconds")
            ax.set_ylabel("share of intents")
            ax.legend()
            save(fig, latency)

    doc = docs.get("freshness")
    if doc:
        latency, progress = report.PLOTS["freshness"]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        _cdf(ax, [v / 1000 for v in doc.get("freshness_ms", [])], "event to intent in Redis")
        _cdf(ax, [v / 1000 for v in doc.get("llm_latency_ms", [])], "LLM call")
        ax.set_xlabel("seconds")
        ax.set_ylabel("share")
        ax.legend()
        save(fig, latency)
        series = doc.get("series") or []
        if series:
            fig, ax = plt.subplots(figsize=(7, 3.2))
            xs = [row["t_s"] for row in series]
            for key in ("events_in", "prompts_sent", "intents_written"):
                ax.plot(xs, [row.get(key, 0) for row in series], label=key)
            ax.set_xlabel("s since the replay started")
            ax.set_ylabel("count")
            ax.legend()
            save(fig, progress)


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def render(out: Path, doc: Path | None, draw: bool, sizing_doc: Path | None = None) -> str:
    """``REPORT.md``, the figures table in ``doc`` and the sizing example in ``sizing_doc``
    (none: not that one) from the results files in ``out``, after the plots when ``draw``
    (and matplotlib is installed); returns the console summary."""
    if draw:
        plots({n: d for n in BENCHMARKS if (d := load(out, n)) is not None}, out)
    results = report.write(out, doc, sizing_doc)
    return report.summary_table({n: d for n, d in results.items() if report.is_result_doc(d)})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--only", help=f"comma-separated, from {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--report-only",
        "--render",
        action="store_true",
        help="run nothing: rebuild REPORT.md and the figures table from the JSON files",
    )
    p.add_argument("--no-lock", action="store_true", help="the caller holds the heavy-run lock")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--doc",
        type=Path,
        help="the document whose figures table to rewrite (default: "
        f"{report.FIGURES_DOC.relative_to(report.REPO)} when --out is the default)",
    )
    args = p.parse_args(argv)
    names = selected(args.only)
    default_out = args.out.resolve() == RESULTS_DIR
    doc = args.doc or (report.FIGURES_DOC if default_out else None)
    sizing_doc = report.SIZING_DOC if default_out else None
    failed = []
    if not args.report_only:
        for name in names:
            extra = [] if name == "routing" else ["--out", str(args.out)]
            code, seconds = run_one(name, not args.no_lock, extra)
            print(f"=== {name}: exit {code} after {seconds:.0f} s", flush=True)
            if code not in (0, 1):  # 1: ran, some target not met
                failed.append(name)
    print(render(args.out, doc, draw=not args.report_only, sizing_doc=sizing_doc))
    print(
        f"report: {args.out / 'REPORT.md'}"
        + (f"; figures table: {doc}" if doc else "")
        + (f"; sizing example: {sizing_doc}" if sizing_doc else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
