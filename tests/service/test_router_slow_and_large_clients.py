"""The router as it runs (a real process, the kv_prefix policy, the model folder's
tokenizer in a process of its own) in front of LLM stand-ins (``bench/standin_llm.py``:
the model is not the subject), under slow uploads as many as its admission slots, 4 MiB
and tokenizer-heavy bodies, and legitimate clients, all at once (``bench.router_load``'s
scenario, for a shorter time).

What must hold: no legitimate request is refused while the slow uploads hold their
connections, ``/health`` answers every probe, and the large bodies are served. How fast
``/health`` answers is the benchmark's figure (``bench/results/router_load.json``), not
this test's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.router_load import SLOTS, LoadFigures, LoadStack, run_load

pytestmark = [pytest.mark.timeout(240)]

LOAD_SECONDS = 8.0


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadFigures]:
    stack = LoadStack(tmp_path_factory.mktemp("router-load"), tokenizer_workers=1)
    try:
        yield asyncio.run(run_load(stack.router_url, LOAD_SECONDS))
    finally:
        stack.close()


def test_no_legitimate_request_is_refused_while_slow_uploads_hold_connections(
    load: LoadFigures,
) -> None:
    assert sum(load.legit.values()) > 0
    assert dict(load.legit) == {200: sum(load.legit.values())}


def test_the_slow_uploads_held_their_connections_throughout(load: LoadFigures) -> None:
    assert load.slow_opened == SLOTS
    assert load.slow_answered_early == 0


def test_health_answers_every_probe_meanwhile(load: LoadFigures) -> None:
    assert load.health_ms and load.health_failures == 0


def test_the_large_bodies_are_served(load: LoadFigures) -> None:
    assert sum(load.large.values()) > 0
    assert dict(load.large) == {200: sum(load.large.values())}
