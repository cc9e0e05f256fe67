"""Where a worker publishes its KV cache events, checked when it is given.

An endpoint libzmq cannot connect to (``tcp://host`` without a port, a bind address such
as ``tcp://*:5557``, another protocol, an ``ipc://`` path longer than a Unix socket's) is
refused here, with a ``ConfigError`` naming the key, rather than found by the subscriber
thread at connect time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inference_sidecar.exceptions import ConfigError

_TCP = re.compile(
    r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?)"
    r":(?P<port>\d{1,5})"
)
#: A Unix socket's path must fit ``sun_path`` (108 bytes with its terminating NUL).
MAX_IPC_PATH_BYTES = 107


def check_endpoint(value: object, key: str) -> str:
    """``value`` if it is an endpoint a subscriber can connect to (``tcp://host:port``
    with a host name or address, not ``*``, or ``ipc://path``); raises ``ConfigError``
    naming ``key``."""
    if isinstance(value, str):
        tcp = _TCP.fullmatch(value)
        if tcp is not None and 1 <= int(tcp.group("port")) <= 65535:
            return value
        path = value.removeprefix("ipc://")
        if value.startswith("ipc://") and path and path.isprintable():
            if len(path.encode()) <= MAX_IPC_PATH_BYTES:
                return value
            raise ConfigError(key, f"an ipc:// path fits {MAX_IPC_PATH_BYTES} bytes at most")
    raise ConfigError(key, f"expected tcp://host:port or ipc://path, got {value!r:.200}")


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker publishes: its PUB endpoint, and its replay endpoint if any."""

    endpoint: str
    replay: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        check_endpoint(self.endpoint, "kv_events.endpoint")
        if self.replay is not None:
            check_endpoint(self.replay, "kv_events.replay")
        if not isinstance(self.topic, str):
            raise ConfigError("kv_events.topic", f"expected a string, got {self.topic!r:.200}")
