"""What every benchmark of the suite shares: the machine, targets, results files, memory.

Pure functions except where a name says it reads (``/proc``) or writes (``write_result``).
A result document has the keys every benchmark shares (``RESULT_KEYS``) plus its own;
``docs/lab_notebook.md`` lists them.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

# The commit a run measured, as the eval records it too.
from flink_jobs.tools.provenance import git_state as git_state

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
SCHEMA_VERSION = 1

#: Keys of every result document, in this order, whatever the benchmark.
RESULT_KEYS = (
    "benchmark",
    "schema_version",
    "timestamp",
    "command",
    "git",
    "runtime_s",
    "machine",
    "targets",
    "all_targets_met",
    "notes",
)

_OPS = {
    ">=": lambda v, limit: v >= limit,
    "<=": lambda v, limit: v <= limit,
    "<": lambda v, limit: v < limit,
    ">": lambda v, limit: v > limit,
}


def ratio(numerator: float | None, denominator: float | None) -> float:
    """``numerator / denominator``; NaN when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return math.nan
    return numerator / denominator


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (the definition ``run_summary.percentile`` uses); NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return float(ordered[rank - 1])


def target(name: str, value: float | None, op: str, limit: float | None, note: str = "") -> dict:
    """One target's verdict, ``met`` always a bool: a missing or NaN value or limit (a
    limit taken from a peer that did not run) never meets it."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {', '.join(_OPS)} (got {op!r})")
    met = bool(_known(value) and _known(limit) and _OPS[op](value, limit))
    return {
        "name": name,
        "value": rounded(value),
        "op": op,
        "limit": limit,
        "met": met,
        "note": note,
    }


def _known(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def rounded(value: Any, digits: int = 3) -> Any:
    """Floats rounded for the JSON (NaN becomes None: JSON has no NaN); others unchanged."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, digits)
    return value


#: CPU features that change what a CPU vLLM worker computes in and how fast: two hosts
#: both named "AMD EPYC" differed by 2x in the routing benchmark (bf16 vs float32).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict[str, Any]:
    """Cores, CPU model and features, memory and Python of this machine (read from /proc)."""
    first: dict[str, str] = {}  # /proc/cpuinfo repeats every field per core
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            first.setdefault(name.strip(), value.strip())
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "cores": os.cpu_count(),
        "cpu_model": first.get("model name") or platform.processor() or "unknown",
        "cpu_features": [f for f in CPU_FEATURES if f in first.get("flags", "").split()],
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def machine_text(m: Mapping[str, Any]) -> str:
    """One line describing a results file's ``machine``."""
    features = m.get("cpu_features")
    return (
        f"{m.get('cores')} cores, {m.get('cpu_model')}"
        + (f" ({', '.join(features) or 'no AVX2'})" if features is not None else "")
        + f", {m.get('memory_gib')} GiB RAM, Python {m.get('python')}"
        + (f", Linux {m['kernel']}" if m.get("kernel") else "")
    )


def result_doc(
    benchmark: str,
    started: float,
    targets: Sequence[Mapping[str, Any]],
    notes: Sequence[str] = (),
    **figures: Any,
) -> dict[str, Any]:
    """A result document: the shared keys (``RESULT_KEYS``) first, then ``figures``."""
    clash = set(figures) & set(RESULT_KEYS)
    if clash:
        raise ValueError(f"figures may not use the shared keys {sorted(clash)}")
    doc: dict[str, Any] = {
        "benchmark": benchmark,
        "schema_version": SCHEMA_VERSION,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(),
        "git": git_state(),
        "runtime_s": round(time.monotonic() - started, 1),
        "machine": machine(),
        "targets": list(targets),
        "all_targets_met": bool(targets) and all(t["met"] for t in targets),
        "notes": list(notes),
    }
    doc.update(figures)
    return doc


def command_line() -> str:
    """How this process was started, as ``python -m bench.<name> args`` when it was."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return " ".join([*head, *sys.argv[1:]])


def write_result(doc: Mapping[str, Any], out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{doc['benchmark']}.json"
    path.write_bytes(
        orjson.dumps(
            doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        )
        + b"\n"
    )
    return path


def targets_table(targets: Iterable[Mapping[str, Any]]) -> str:
    """The targets as a markdown table."""
    lines = ["| target | value | limit | met |", "| --- | --- | --- | --- |"]
    for t in targets:
        mark = "yes" if t["met"] else "**no**"
        lines.append(f"| {t['name']} | {t['value']} | {t['op']} {t['limit']} | {mark} |")
    return "\n".join(lines)


# --- memory --------------------------------------------------------------------------------


def read_hwm_kib(pid: int) -> int | None:
    """Peak resident memory (``VmHWM``) of one process, in KiB; None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def classify_process(cmdline: str) -> str | None:
    """Which part of the stack a command line is (None: not ours to report)."""
    if "org.apache.flink.runtime.taskexecutor.TaskManagerRunner" in cmdline:
        return "flink_taskmanager"  # a standalone cluster's (flink_cluster.py)
    if "org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint" in cmdline:
        return "flink_jobmanager"
    if "org.apache.flink" in cmdline or ("java" in cmdline.split(" ", 1)[0] and "flink" in cmdline):
        return "flink_jvm"
    if "pyflink.fn_execution" in cmdline or "beam_boot" in cmdline or "pyflink/bin" in cmdline:
        return "python_udf_worker"
    if "redis-server" in cmdline:
        return "redis"
    if "tansu" in cmdline:
        return "tansu"
    if "VLLM::" in cmdline or "vllm-venv" in cmdline or "vllm.entrypoints" in cmdline:
        return "vllm_worker"  # the API server, its engine core and their helpers
    if "inference_sidecar" in cmdline and "router" in cmdline:
        return "router"
    if "standin_llm" in cmdline:
        return "standin_llm"
    if "flink_jobs.runtime.call_process" in cmdline:
        return "llm_call_process"
    return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def our_processes(root: int) -> list[tuple[int, str]]:
    """``root`` (as ``bench_driver``) and its descendants that are part of the stack."""
    found = [(root, "bench_driver")]
    for pid in _descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        kind = classify_process(cmd)
        if kind is not None:
            found.append((pid, kind))
    return found


def read_cpu_s(pid: int) -> float | None:
    """User plus system CPU time one process has used, in seconds; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CpuClock:
    """CPU seconds per part of the stack between two points of a run.

    On a shared host, events per second move with the neighbours' load; the CPU time the
    stack spends per event moves much less, so an A/B run on a noisy machine reads it
    beside the rate. ``sample()`` keeps each live process's latest reading (a process that
    exits between samples keeps its last one); ``since(mark)`` gives, per kind, the CPU
    seconds used after ``mark`` (a ``mark()`` taken earlier), counting a process that
    started after it from zero.
    """

    def __init__(self, root: int | None = None) -> None:
        self.root = root or os.getpid()
        self.latest: dict[int, tuple[str, float]] = {}

    def sample(self) -> None:
        for pid, kind in our_processes(self.root):
            cpu = read_cpu_s(pid)
            if cpu is not None:
                self.latest[pid] = (kind, cpu)

    def mark(self) -> dict[int, tuple[str, float]]:
        self.sample()
        return dict(self.latest)

    def since(self, mark: Mapping[int, tuple[str, float]]) -> dict[str, float]:
        self.sample()
        out: dict[str, float] = {}
        for pid, (kind, cpu) in self.latest.items():
            before = mark.get(pid, (kind, 0.0))[1]
            out[kind] = out.get(kind, 0.0) + cpu - before
        return dict(sorted(out.items()))


class PeakMemory:
    """Peak RSS per part of the stack, from ``VmHWM`` of every descendant of ``root``.

    ``sample()`` records each live process's high-water mark (call it now and then and at
    the end: a process that exits between samples keeps its last reading). ``summary()``
    gives, per kind, the largest single process and the sum over that kind's processes,
    in MiB. The bench process itself is reported as ``bench_driver`` (it hosts the Flink
    client and, in process mode, nothing of the job's Python work).
    """

    def __init__(self, root: int | None = None) -> None:
        self.root = root or os.getpid()
        self.peaks: dict[int, tuple[str, int]] = {}

    def sample(self) -> None:
        for pid, kind in our_processes(self.root):
            hwm = read_hwm_kib(pid)
            if hwm is None:
                continue
            previous = self.peaks.get(pid, (kind, 0))[1]
            self.peaks[pid] = (kind, max(previous, hwm))

    def summary(self) -> dict[str, dict[str, float]]:
        return summarise_peaks(self.peaks.values())


def summarise_peaks(peaks: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
    """Per kind: ``processes``, ``max_mib`` (largest process) and ``sum_mib`` (all of them)."""
    out: dict[str, dict[str, float]] = {}
    for kind, kib in peaks:
        entry = out.setdefault(kind, {"processes": 0, "max_mib": 0.0, "sum_mib": 0.0})
        entry["processes"] += 1
        entry["max_mib"] = round(max(entry["max_mib"], kib / 1024), 1)
        entry["sum_mib"] = round(entry["sum_mib"] + kib / 1024, 1)
    return dict(sorted(out.items()))
