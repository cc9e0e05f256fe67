"""Merge several jars into one, the single ``jarfile`` Managed Flink puts on the classpath.

Rules, applied to entries in the order the jars are given:

- ``META-INF/services/*`` files (Java ``ServiceLoader`` registrations) are concatenated,
  each line kept once, so every jar's factories stay discoverable;
- signature files (``META-INF/*.SF``, ``*.DSA``, ``*.RSA``, ``*.EC``) and the jars' own
  manifests are dropped: a merged jar is unsigned and gets one fresh manifest;
- any other duplicate entry keeps the first jar's copy (``LICENSE``/``NOTICE`` files,
  identical package directories).

The output is deterministic: entries sorted, timestamps fixed, so the same inputs give
the same bytes.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FIXED_DATE = (1980, 1, 1, 0, 0, 0)
MANIFEST = "META-INF/MANIFEST.MF"
_SIGNATURE_SUFFIXES = (".SF", ".DSA", ".RSA", ".EC")


@dataclass(frozen=True)
class MergeReport:
    jars: tuple[str, ...]
    entries: int
    duplicates_skipped: int
    services_merged: tuple[str, ...]
    signatures_dropped: int


def is_signature_file(name: str) -> bool:
    """True for a jar signature entry directly under META-INF/."""
    if not name.startswith("META-INF/") or name.count("/") != 1:
        return False
    return name.upper().endswith(_SIGNATURE_SUFFIXES)


def merge_service_files(chunks: Sequence[bytes]) -> bytes:
    """Concatenate ServiceLoader files, keeping each provider line once, in first-seen order."""
    seen: dict[str, None] = {}
    for chunk in chunks:
        for raw in chunk.decode("utf-8").splitlines():
            line = raw.strip()
            if line and not line.startswith("#"):
                seen.setdefault(line, None)
    return ("\n".join(seen) + "\n").encode("utf-8")


def merge_jars(jars: Sequence[Path], out: Path, created_by: str = "shopper-intents") -> MergeReport:
    """Write one jar at ``out`` holding every entry of ``jars`` (see the module docstring)."""
    if not jars:
        raise ValueError("merge_jars needs at least one jar")
    entries: dict[str, bytes] = {}
    services: dict[str, list[bytes]] = {}
    duplicates = signatures = 0
    for jar in jars:
        with zipfile.ZipFile(jar) as zf:
            for info in zf.infolist():
                name = info.filename
                if info.is_dir() or name == MANIFEST:
                    continue
                if is_signature_file(name):
                    signatures += 1
                    continue
                if name.startswith("META-INF/services/"):
                    services.setdefault(name, []).append(zf.read(info))
                    continue
                if name in entries:
                    duplicates += 1
                    log.debug("%s: %s already taken from an earlier jar", jar.name, name)
                    continue
                entries[name] = zf.read(info)
    for name, chunks in services.items():
        entries[name] = merge_service_files(chunks)
    manifest = f"Manifest-Version: 1.0\r\nCreated-By: {created_by}\r\n\r\n".encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        _write(zf, MANIFEST, manifest)
        for directory in sorted(_directories(entries)):
            info = zipfile.ZipInfo(directory, FIXED_DATE)
            info.external_attr = (0o40755 << 16) | 0x10
            zf.writestr(info, b"")
        for name in sorted(entries):
            _write(zf, name, entries[name])
    return MergeReport(
        jars=tuple(j.name for j in jars),
        entries=len(entries) + 1,
        duplicates_skipped=duplicates,
        services_merged=tuple(sorted(services)),
        signatures_dropped=signatures,
    )


def _write(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, FIXED_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    zf.writestr(info, data)


def _directories(names: dict[str, bytes]) -> set[str]:
    dirs: set[str] = {"META-INF/"}
    for name in names:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]) + "/")
    return dirs
