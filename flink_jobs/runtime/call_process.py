"""The LLM calls in a helper process: their own interpreter, off the job's.

Why: in PyFlink's thread mode every Python operator of a TaskManager runs in one
interpreter embedded in the JVM. The calls' HTTP and Redis client work (httpx, redis-py)
holds that interpreter's lock, and every event waits behind it. In a child process that
work runs on another core; the operator's side costs a pickle and a socket write per
prompt (``docs/decisions.md#call-process``).

``CallProcess`` is an ``outbox.Runner``: ``await call_process.run(task)`` returns the
``TaskResult`` the child computed with ``inference.PromptRunner``, or raises
what the child's ``run_task`` raised (Redis unreachable for its whole budget), so the
outbox fails the job exactly as it does for a call made in-process. If the child exits,
every call in flight and every later one raises :class:`CallProcessExited`: the job
restarts from its last checkpoint, whose keyed state still holds the prompts, and the
restarted operator starts a new child.

The protocol, over a socket pair: frames of a 4-byte big-endian length and a pickle (both
ends are this module, started together). The parent sends the ``AppConfig`` once, then
``("call", call id, PromptTask)`` per prompt, ``("rules", call id, PromptTask)`` per
rules-only write (``PromptRunner.write_rules``: the outbox's rules lane) and
``("supersede", shopper id, seq)`` to stop a call still waiting for the LLM
(``PromptRunner.supersede``); the child answers
``("answer", call id, True, TaskResult)`` or ``("answer", call id, False, exception)``, and
sends its log records as ``("log", level, logger, text)``, which the parent logs again:
in thread mode the job's Python logging goes to the TaskManager's log (CloudWatch on
Managed Flink), where the child's stderr does not. The child stops when the parent closes
its end, or dies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from flink_jobs.config import AppConfig
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.runtime.inference import PromptRunner
from flink_jobs.runtime.llm_client import quiet_http_logs

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
STOP_TIMEOUT_S = 5.0


class CallProcessExited(RuntimeError):
    """The helper process is gone; its calls cannot be answered."""


def _frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


def python_executable() -> str:
    """The interpreter to start the child with: this environment's (a venv's own, when the
    job runs in one). Embedded in the JVM (thread mode) ``sys.executable`` names the base
    interpreter the venv was made from, or none."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for name in (version, "python3", "python"):
        candidate = Path(sys.prefix) / "bin" / name
        if candidate.exists():
            return str(candidate)
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    raise CallProcessExited(
        f"cannot find a Python interpreter under {sys.prefix}/bin to run the LLM calls "
        "in; set llm.call_process=false to make them in the job's own interpreter"
    )


class CallProcess:
    """Runs prompts in a child process (module docstring); used from one event loop."""

    def __init__(self, config: AppConfig) -> None:
        self._config = config
        self._process: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[TaskResult]] = {}
        self._ids = itertools.count()
        self._exited: CallProcessExited | None = None
        self._starting = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def run(self, task: PromptTask) -> TaskResult:
        """``PromptRunner.run`` in the child."""
        return await self._request("call", task)

    async def write_rules(self, task: PromptTask) -> TaskResult:
        """``PromptRunner.write_rules`` in the child."""
        return await self._request("rules", task)

    async def _request(self, kind: str, task: PromptTask) -> TaskResult:
        async with self._starting:  # the first calls arrive together
            writer = self._writer or await self._start()
        if self._exited is not None:
            raise self._exited
        call_id = next(self._ids)
        answer: asyncio.Future[TaskResult] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answer
        try:
            writer.write(_frame((kind, call_id, task)))
            await writer.drain()
            return await answer
        except (ConnectionError, OSError) as exc:
            raise self._exited or CallProcessExited(f"the LLM call process is gone: {exc}") from exc
        finally:
            self._pending.pop(call_id, None)

    def supersede(self, shopper_id: str, seq: int) -> None:
        """``PromptRunner.supersede`` in the child; the call then answers ``superseded``."""
        if self._writer is not None and self._exited is None:
            self._writer.write(_frame(("supersede", shopper_id, seq)))

    async def _start(self) -> asyncio.StreamWriter:
        """Start the child and send it the config; returns the writer to its socket."""
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self._process = process = subprocess.Popen(
                [python_executable(), "-m", "flink_jobs.runtime.call_process", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        reader, writer = await asyncio.open_connection(sock=parent)
        self._writer = writer
        writer.write(_frame(self._config))
        self._reader_task = asyncio.get_running_loop().create_task(
            self._read_answers(reader, process)
        )
        log.info("LLM calls run in process %d", process.pid)
        return writer

    async def _read_answers(
        self, reader: asyncio.StreamReader, process: subprocess.Popen[bytes]
    ) -> None:
        try:
            while True:
                kind, *message = await _read_frame(reader)
                if kind == "log":
                    level, name, text = message
                    logging.getLogger(name).log(level, "[call process] %s", text)
                    continue
                call_id, ok, payload = message
                answer = self._pending.get(call_id)
                if answer is None or answer.done():
                    continue
                if ok:
                    answer.set_result(payload)
                else:
                    answer.set_exception(payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except Exception:  # a frame this end cannot read: stop the child, fail its calls
            log.exception("unreadable message from the LLM call process %s", self.pid)
            process.kill()
        code = await asyncio.get_running_loop().run_in_executor(None, _wait_exit, process)
        if code is None:  # its socket closed but it lives on: it must not linger
            process.kill()
        self._exited = CallProcessExited(
            f"the LLM call process {self.pid} exited (code {code}) with "
            f"{len(self._pending)} calls in flight; what it said last is in the TaskManager's "
            "log, a crash's traceback in its stderr"
        )
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(self._exited)

    async def aclose(self) -> None:
        """Stop the child: close its socket (it finishes nothing more), then kill if needed."""
        if self._writer is not None:
            self._writer.close()
        if self._process is not None and self._process.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._process.wait), STOP_TIMEOUT_S)
            except TimeoutError:
                self._process.kill()
        if self._reader_task is not None:
            self._reader_task.cancel()


def _wait_exit(process: subprocess.Popen[bytes]) -> int | None:
    """The child's exit code, or None if it still runs after ``STOP_TIMEOUT_S``."""
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


# --- the child ------------------------------------------------------------------------------


async def _serve(sock: socket.socket) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    config: AppConfig = await _read_frame(reader)
    runner = PromptRunner(config)
    calls: set[asyncio.Task[None]] = set()

    async def answer(
        call_id: int, task: PromptTask, run: Callable[[PromptTask], Awaitable[TaskResult]]
    ) -> None:
        reply: tuple[str, int, bool, TaskResult | Exception]
        try:
            reply = ("answer", call_id, True, await run(task))
        except Exception as exc:
            reply = ("answer", call_id, False, exc)
        try:
            frame = _frame(reply)
        except Exception as exc:  # an exception that does not pickle still says what it was
            frame = _frame(("answer", call_id, False, RuntimeError(f"{reply[3]!r} ({exc})")))
        writer.write(frame)

    logging.getLogger().handlers = [_ForwardToParent(writer)]

    try:
        while True:
            try:
                kind, *message = await _read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if kind == "supersede":
                runner.supersede(*message)
                continue
            call_id, task = message
            run = runner.write_rules if kind == "rules" else runner.run
            call = asyncio.create_task(answer(call_id, task, run))
            calls.add(call)
            call.add_done_callback(calls.discard)
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await runner.aclose()


class _ForwardToParent(logging.Handler):
    """Sends the child's log records to the parent (module docstring)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        super().__init__(logging.INFO)
        self._writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        if self._writer.is_closing():
            return
        try:
            self._writer.write(_frame(("log", record.levelno, record.name, self.format(record))))
        except Exception:
            self.handleError(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s call_process %(message)s"
    )
    quiet_http_logs()
    asyncio.run(_serve(socket.socket(fileno=int(args[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
