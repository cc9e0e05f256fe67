"""The test suite's own layout rule: what tests share lives in ``tests/support``.

A test module (``test_*.py``) imports no other test module, whatever the tier: a helper two
modules need moves to ``tests/support`` (or stays a non-test helper module beside them,
such as ``tests/model/clusters.py``). No module of a tier (``tests/unit``, ``tests/service``,
``tests/model``, ``tests/compose``) imports another tier's, and ``tests/support`` imports
none: the model tier runs without the service tier's modules, and the unit tier's purity
guard sees only what the unit tier imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "service", "model", "compose")


def _is_test_module(module: str) -> bool:
    return module.rsplit(".", 1)[-1].startswith("test_")


def _imported(tree: ast.Module, package: str) -> list[tuple[int, list[str]]]:
    """Each import statement of a file: its line and the modules it may import (``from a
    import b`` may import ``a`` and ``a.b``); relative imports are resolved against
    ``package``."""
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found.append((node.lineno, [base, *(f"{base}.{a.name}" for a in node.names)]))
    return found


def _against_the_rule(module: str, tier: str | None, beside: Path) -> str | None:
    names = module.split(".")
    if names[0] != "tests":
        # A bare name is a module beside the file (its folder is on sys.path) or a library.
        sibling = len(names) == 1 and (beside / f"{module}.py").exists()
        return "a test module" if sibling and _is_test_module(module) else None
    if _is_test_module(module):
        return "a test module"
    if len(names) > 1 and names[1] in TIERS and names[1] != tier:
        return "another tier's module"
    return None


def violations(path: Path, source: str, tests_dir: Path = TESTS) -> list[str]:
    """What ``source`` (the file at ``path`` under ``tests_dir``) imports against the rule."""
    relative = path.relative_to(tests_dir)
    parts = relative.parts
    tier = parts[0] if len(parts) > 1 else None
    package = ".".join(["tests", *parts[:-1]])
    found = []
    for line, modules in _imported(ast.parse(source, str(path)), package):
        for module in modules:
            if why := _against_the_rule(module, tier, path.parent):
                found.append(f"{relative}:{line} imports {module}: {why}")
                break
    return found


def test_no_test_module_imports_another_and_no_tier_another_tiers_modules() -> None:
    found = [
        v
        for path in sorted(TESTS.rglob("*.py"))
        for v in violations(path, path.read_text(encoding="utf-8"))
    ]

    assert not found, "shared test helpers belong in tests/support:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("service/test_outbox.py", "import tests.service.test_inference"),
        ("unit/test_arms.py", "from .test_outcome_recorder import FakeGroup"),
        ("unit/distill/test_splits.py", "from ..test_outcome_recorder import FakeGroup"),
        ("service/test_stats.py", "from tests import support, unit"),
        ("model/test_e2e.py", "import tests.service.job_process"),
        ("model/test_e2e.py", "from tests import service"),
        ("compose/test_compose_stack.py", "from tests.model.clusters import Stack"),
        ("support/builders.py", "import tests.unit.conftest"),
    ],
)
def test_an_import_of_a_test_module_or_of_another_tier_is_found(where: str, source: str) -> None:
    assert violations(TESTS / where, source)


def test_a_sibling_test_module_imported_by_its_bare_name_is_found(tmp_path: Path) -> None:
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_other.py").write_text("")

    assert violations(tmp_path / "unit" / "test_this.py", "import test_other", tmp_path)


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("model/test_e2e.py", "from tests.support.job_process import job_groups"),
        ("model/test_router.py", "from tests.model.clusters import Stack"),
        ("unit/test_purity_guard.py", "import tests.unit.conftest"),
        ("unit/inference_sidecar/test_kv_wiring.py", "from kv_harness import FakePublisher"),
        ("unit/test_service_backend.py", "from tests.conftest import choose_backend"),
        ("service/test_stats.py", "from tests.support import builders"),
    ],
)
def test_shared_helpers_and_a_tiers_own_modules_are_allowed(where: str, source: str) -> None:
    assert violations(TESTS / where, source) == []
