"""The unit tier stays pure: a test here that reaches for a service fails, naming where it belongs.

While a unit test runs (its setup, call and teardown, so session fixtures it pulls in are
caught too), connecting a socket to an IPv4 or IPv6 address, loopback included, and
starting one of the service programs (redis-server, tansu, java, vllm) are refused. Unix
sockets stay allowed: asyncio's self-pipe is a Unix socketpair. The refusal raises
``ImpureUnitTest`` where the attempt is made and is also recorded on the test, so a test
whose code catches the error (a client that retries, a check that expects "connection
refused") still fails.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

UNIT_DIR = Path(__file__).parent
SERVICE_PROGRAMS = frozenset({"redis-server", "tansu", "java", "vllm"})
NETWORK_FAMILIES = (socket.AF_INET, socket.AF_INET6)
MOVE_HINT = (
    "unit tests are pure (no Redis, broker, JVM, model server or network): "
    "move this test to tests/service"
)
_VIOLATIONS = pytest.StashKey[list[str]]()
_REPORTED = pytest.StashKey[int]()


class ImpureUnitTest(Exception):
    """A unit test tried to use the network or start a service program.

    Not an ``OSError``, so a client does not mistake it for a refused connection.
    """


def _program(args: Any, executable: Any, shell: bool) -> str:
    if executable is not None and not shell:
        return os.path.basename(os.fsdecode(executable))
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        first = shlex.split(text)[0] if shell and text.strip() else text
    else:
        first = os.fsdecode(next(iter(args), ""))
    return os.path.basename(first)


class _Guard:
    """Refuses network connects and service programs, and remembers each attempt."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations

    def refuse(self, what: str) -> ImpureUnitTest:
        self.violations.append(what)
        return ImpureUnitTest(f"{what}: {MOVE_HINT}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        guard = self
        connect = socket.socket.connect
        connect_ex = socket.socket.connect_ex
        execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

        def guarded_connect(sock: socket.socket, address: Any) -> None:
            if sock.family in NETWORK_FAMILIES:
                raise guard.refuse(f"connects a socket to {address!r}")
            return connect(sock, address)

        def guarded_connect_ex(sock: socket.socket, address: Any) -> int:
            if sock.family in NETWORK_FAMILIES:
                raise guard.refuse(f"connects a socket to {address!r}")
            return connect_ex(sock, address)

        def guarded_execute_child(popen: subprocess.Popen, args: Any, executable: Any, *rest):
            shell = rest[8]  # preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, ..., shell
            program = _program(args, executable, shell)
            if program in SERVICE_PROGRAMS:
                raise guard.refuse(f"starts the service program {program!r}")
            return execute_child(popen, args, executable, *rest)

        monkeypatch.setattr(socket.socket, "connect", guarded_connect)
        monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
        monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded_execute_child)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # A hook, not an autouse fixture: wider-scoped fixtures (a session Redis) are set up
    # before any function-scoped autouse fixture, and they must be guarded too. pytest
    # calls this hook of every conftest for every test, so it picks this tier's own.
    if not item.path.is_relative_to(UNIT_DIR):
        return (yield)
    violations: list[str] = []
    item.stash[_VIOLATIONS] = violations
    with pytest.MonkeyPatch.context() as monkeypatch:
        _Guard(violations).install(monkeypatch)
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    report = yield
    violations = item.stash.get(_VIOLATIONS, [])
    reported = item.stash.get(_REPORTED, 0)
    if len(violations) > reported:
        item.stash[_REPORTED] = len(violations)
        if not report.failed:  # the code under test caught the refusal
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid} {violations[reported]}: {MOVE_HINT}"
    return report
