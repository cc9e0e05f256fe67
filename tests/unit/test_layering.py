"""The package layers, read from the imports themselves (every ``import``, at any depth).

- ``flink_jobs.core`` is pure: nothing from ``flink_jobs.runtime`` or ``flink_jobs.tools``,
  and no I/O library (PyFlink, Kafka, Redis, HTTP clients).
- Only the Flink shell (the modules at the root of ``flink_jobs``) imports PyFlink.
- Nothing outside ``flink_jobs.tools`` imports ``flink_jobs.tools``.
- ``intent_reader`` imports nothing from ``flink_jobs``: ranking services install it alone.
- ``inference_sidecar`` imports nothing from ``flink_jobs``: the router runs without the job.
- What the Managed Flink zip ships (``flink_jobs`` but its tools) imports nothing from
  ``inference_sidecar``, which the zip leaves out. What both sides share lives in
  ``intent_reader`` (``layout``, ``config_errors``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flink_jobs", "inference_sidecar", "intent_reader")
IO_LIBRARIES = ("pyflink", "confluent_kafka", "redis", "httpx", "httpx_aiohttp", "aiohttp")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {
    _module_name(path): _imports(path)
    for package in PACKAGES
    for path in sorted((REPO / package).rglob("*.py"))
    if "java" not in path.parts
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(modules: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {
        module: sorted(i for i in MODULES[module] if any(_within(i, f) for f in forbidden))
        for module in modules
    }
    return {module: names for module, names in found.items() if names}


def test_every_package_was_read():
    for package in ("flink_jobs.core", "flink_jobs.runtime", "flink_jobs.tools"):
        assert any(_within(m, package) for m in MODULES), package


def test_core_imports_no_runtime_tools_or_io():
    core = [m for m in MODULES if _within(m, "flink_jobs.core")]
    forbidden = ("flink_jobs.runtime", "flink_jobs.tools", *IO_LIBRARIES)
    assert _violations(core, forbidden) == {}


def test_only_the_flink_shell_imports_pyflink():
    shell = {m for m in MODULES if m.count(".") == 1 and _within(m, "flink_jobs")}
    assert {"flink_jobs.job", "flink_jobs.operators"} <= shell
    others = [m for m in MODULES if m not in shell]
    assert _violations(others, ("pyflink",)) == {}


def test_nothing_outside_tools_imports_tools():
    outside = [m for m in MODULES if not _within(m, "flink_jobs.tools")]
    assert _violations(outside, ("flink_jobs.tools",)) == {}


def test_the_reader_imports_nothing_from_the_job():
    reader = [m for m in MODULES if _within(m, "intent_reader")]
    assert _violations(reader, ("flink_jobs", "inference_sidecar")) == {}


def test_the_router_imports_nothing_from_the_job():
    router = [m for m in MODULES if _within(m, "inference_sidecar")]
    assert _violations(router, ("flink_jobs",)) == {}


def test_what_the_job_zip_ships_imports_nothing_from_the_router():
    shipped = [
        m for m in MODULES if _within(m, "flink_jobs") and not _within(m, "flink_jobs.tools")
    ]
    assert _violations(shipped, ("inference_sidecar",)) == {}


@pytest.mark.parametrize(
    ("module", "imports", "forbidden", "expected"),
    [
        ("flink_jobs.core.x", {"flink_jobs.runtime.inference"}, ("flink_jobs.runtime",), 1),
        ("flink_jobs.core.x", {"redis.asyncio"}, ("redis",), 1),
        ("flink_jobs.core.x", {"redisx"}, ("redis",), 0),
    ],
)
def test_a_violation_is_seen(module, imports, forbidden, expected, monkeypatch):
    """The checks above can fail: a forbidden import, direct or of a submodule, is found."""
    monkeypatch.setitem(MODULES, module, imports)
    assert len(_violations([module], forbidden)) == expected
