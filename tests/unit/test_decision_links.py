"""Every link into ``docs/decisions.md`` names an anchor the file defines.

The code links the evidence behind a default as ``docs/decisions.md#<anchor>``; an entry
renamed or dropped would leave those links pointing nowhere without a word."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions.md"
LINK = re.compile(r"decisions\.md#([A-Za-z0-9_-]+)")
ANCHOR = re.compile(r'<a id="([A-Za-z0-9_-]+)"></a>')
LINKING = ("flink_jobs", "inference_sidecar", "intent_reader", "bench", "deploy", "docs")


def linking_files() -> list[Path]:
    found = [ROOT / "pyproject.toml", ROOT / "README.md"]
    for folder in LINKING:
        found += [
            p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md"} and p.is_file()
        ]
    return found


def links() -> dict[str, list[str]]:
    """Each anchor linked, with the files that link it."""
    seen: dict[str, list[str]] = {}
    for path in linking_files():
        for anchor in LINK.findall(path.read_text(encoding="utf-8")):
            seen.setdefault(anchor, []).append(str(path.relative_to(ROOT)))
    return seen


def test_every_linked_anchor_is_defined() -> None:
    defined = set(ANCHOR.findall(DECISIONS.read_text(encoding="utf-8")))
    missing = {a: files for a, files in links().items() if a not in defined}
    assert not missing, f"links to anchors docs/decisions.md does not define: {missing}"


def test_anchors_are_unique() -> None:
    anchors = ANCHOR.findall(DECISIONS.read_text(encoding="utf-8"))
    assert len(anchors) == len(set(anchors))


def test_the_code_links_decisions_it_rests_on() -> None:
    assert links(), "no link into docs/decisions.md found: is the pattern still right?"
