"""Reading a service of docker-compose.yml as Compose does: its command as an argument
list, its bind mounts as (host path, container path) pairs."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath
from typing import Any


def command_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, PurePosixPath]]:
    """(host path, container path) of each bind mount; named volumes are left out."""
    out = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                out.append((volume["source"], PurePosixPath(volume["target"])))
            continue
        source, _, rest = volume.partition(":")
        if source.startswith((".", "/", "~")):
            out.append((source, PurePosixPath(rest.split(":")[0])))
    return out
