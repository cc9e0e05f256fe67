"""The unit tier's guard (tests/unit/conftest.py) refuses the network and the service
programs, names where such a test belongs, and leaves asyncio's self-pipe alone."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from tests.unit.conftest import _VIOLATIONS, ImpureUnitTest


@pytest.fixture
def violations(request: pytest.FixtureRequest) -> list[str]:
    """What the guard recorded for this test (a test here forgets it once checked, or the
    guard would fail the test)."""
    return request.node.stash[_VIOLATIONS]


def test_a_connect_to_a_loopback_port_fails_saying_where_the_test_belongs(violations) -> None:
    with pytest.raises(ImpureUnitTest, match="move this test to tests/service"):
        socket.create_connection(("127.0.0.1", 6379), timeout=1)

    assert violations == ["connects a socket to ('127.0.0.1', 6379)"]
    violations.clear()


def test_starting_redis_server_fails_before_it_runs(violations) -> None:
    with pytest.raises(ImpureUnitTest, match="'redis-server'"):
        subprocess.Popen(["redis-server", "--port", "0"])

    assert violations == ["starts the service program 'redis-server'"]
    violations.clear()


def test_a_plain_subprocess_and_asyncio_still_work(violations) -> None:
    done = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True)

    assert done.stdout == "ok\n"
    assert asyncio.run(asyncio.sleep(0, result="loop ran")) == "loop ran"  # its socketpair
    assert violations == []
