"""The Managed Flink application zip as the service tests run it: built for this
interpreter, fed a few shoppers' events, configured by a properties file in Managed Flink's
format (``deploy/build_managed_flink_zip.py`` builds the zip, ``deploy/local_run.py`` runs
it)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from deploy import build_managed_flink_zip as builder
from deploy.vendor import TargetPlatform

#: Each shopper's events, in order: browsing that ends with an item in the cart.
SHOPPER_EVENT_TYPES = ("view", "click", "view", "add_to_cart")


def build_local_zip(out: Path) -> builder.BuildResult:
    """The zip, built into ``out`` for this interpreter (``TargetPlatform.local()``: the
    cp312 build's layout, importable here). Without the connector jars (scripts/setup.sh
    builds them) there is nothing to build from, and the test is skipped."""
    missing = [n for n in builder.JARS if not (builder.default_jars_dir() / n).is_file()]
    if missing:
        pytest.skip(f"connector jars not built ({', '.join(missing)}): run scripts/setup.sh")
    return builder.build(out, TargetPlatform.local())


def shopper_events(name: str, shoppers: int) -> list[bytes]:
    """The events of ``shoppers`` shoppers (``<name>-shopper-<n>``), each of
    :data:`SHOPPER_EVENT_TYPES` on one running shoe or another, 50 ms apart from now."""
    base_ms = int(time.time() * 1000)
    per_shopper = len(SHOPPER_EVENT_TYPES)
    records = []
    for s in range(shoppers):
        for i, kind in enumerate(SHOPPER_EVENT_TYPES):
            event = {
                "event_id": f"{name}-{s}-{i}",
                "shopper_id": f"{name}-shopper-{s}",
                "event_type": kind,
                "event_time": base_ms + (s * per_shopper + i) * 50,
                "product": {
                    "product_id": f"p-{s}-{i % 2}",
                    "title": "Trail running shoe",
                    "category": "Running Shoes",
                    "price": 89.5,
                },
            }
            records.append(orjson.dumps(event))
    return records


def write_properties(path: Path, groups: Mapping[str, Mapping[str, Any]]) -> Path:
    """``groups`` as Managed Flink's runtime properties file at ``path``, after the zip's
    run options (the group Managed Flink reads the entry point from)."""
    doc = [{"PropertyGroupId": builder.RUN_OPTIONS_GROUP, "PropertyMap": builder.run_options()}]
    doc += [{"PropertyGroupId": g, "PropertyMap": dict(m)} for g, m in groups.items()]
    path.write_text(json.dumps(doc))
    return path
