"""Where the project's installed components live on this machine.

One place for it, because the job (its connector jars), the tools (binaries, the model)
and the benchmarks all look there.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

CACHE_DIR_ENV = "SI_CACHE_DIR"


def cache_dir() -> Path:
    """The folder ``scripts/setup.sh`` installs into: ``$SI_CACHE_DIR``, else ``.cache`` in
    the source checkout, else ``~/.cache/shopper-intents`` for an installed wheel."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache"
    return Path.home() / ".cache" / "shopper-intents"


def resource_dir(name: str) -> Path:
    """A folder of data shipped inside the package: ``schemas``, ``prompts`` or ``sample``.

    In the source tree they are links to the top-level ``schemas/``, ``prompts/`` and
    ``data/``; a wheel carries copies as package data. Either way
    ``importlib.resources`` finds them beside the code, with no guess about the checkout.
    """
    return Path(str(resources.files("flink_jobs") / name))
