"""A TCP forwarder in the test process: what a Redis endpoint (a DNS name, a load balancer)
is to its clients, and a network link that can be cut.

Each connection accepted on ``port`` is joined to a new connection to ``target``; changing
``target`` sends the connections made after it elsewhere (a failover's new primary behind
the same endpoint), the ones already open keep their server. :meth:`hold` stops passing
bytes either way (a partition: nothing is lost or refused, nothing arrives) until
:meth:`release`.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from flink_jobs.tools.local_services import free_port


class TcpForwarder:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def hold(self) -> None:
        """Pass no byte, either way, until :meth:`release`."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> TcpForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                self._flowing.wait()
                if not data or self._closed.is_set():
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
