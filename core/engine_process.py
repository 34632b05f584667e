"""The engine core in a process of its own, talking over a `multiprocessing` pipe.

The parent sends commands and receives `EngineCoreOutputs`, all pickled by
`multiprocessing.connection` (no protocol of our own):

* parent -> core: ``("add", EngineCoreRequest)``, ``("abort", ids, status)``,
  ``("shutdown",)``;
* core -> parent: ``("ready", ModelInfo)`` or ``("failed", exception)`` once at start,
  then ``("outputs", EngineCoreOutputs)`` per step, ``("stats", EngineStats)`` when it
  goes idle, ``("add_failed", request_id,
  message)`` for a request the core refused, ``("step_failed", message, ids)`` when a
  step raised (the core aborted its requests and goes on).

The child is started with the ``spawn`` method (a forked copy of a process running
torch threads can deadlock), loads plugins from the ``ember`` entry points itself,
and exits when the parent closes the pipe or dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
from multiprocessing.connection import Connection

from ember.config import EngineConfig
from ember.engine_client import ModelInfo
from ember.scheduler import RequestStatus

logger = logging.getLogger(__name__)


def _core_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s",
                        datefmt="%H:%M:%S")
    from ember.engine_core import EngineCore  # heavy imports in the child only

    try:
        core = EngineCore(config)
    except Exception as exc:
        try:  # the exception itself when it round-trips (the CLI turns some into messages)
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = (ValueError if isinstance(exc, ValueError) else RuntimeError)(f"{type(exc).__name__}: {exc}")
        conn.send(("failed", exc))
        return
    conn.send(("ready", core.model_info()))
    while True:
        # Block for a command when idle; between steps take whatever has arrived.
        while not core.has_unfinished_requests() or conn.poll(0):
            if not core.has_unfinished_requests() and not conn.poll(0):
                conn.send(("stats", core.stats()))  # idle now: the counts after the last aborts
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            kind = message[0]
            if kind == "shutdown":
                return
            if kind == "add":
                try:
                    core.add_request(message[1])
                except ValueError as exc:
                    conn.send(("add_failed", message[1].request_id, str(exc)))
            elif kind == "abort":
                core.abort_requests(message[1], message[2])
        try:
            outputs = core.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting the requests in flight")
            ids = list(core.scheduler.requests)
            core.abort_all()
            conn.send(("step_failed", repr(exc), ids))
            continue
        conn.send(("outputs", outputs))


class EngineCoreProcess:
    """The parent's handle on the engine-core process."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        # the event loop (new requests, aborts) and the reader thread (stop strings)
        # both send: one message at a time on the pipe
        self._send_lock = threading.Lock()
        level = logging.getLogger().getEffectiveLevel()
        self.process = ctx.Process(
            target=_core_main, args=(config, child_conn, level), name="ember-engine-core", daemon=True
        )
        self.process.start()
        child_conn.close()
        if not self.conn.poll(startup_timeout):
            self.close()
            raise RuntimeError(f"the engine-core process did not start within {startup_timeout:.0f} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine-core process exited at start (exit code {self.process.exitcode})") from None
        if message[0] == "failed":
            self.process.join(5)
            raise message[1]
        self.model_info: ModelInfo = message[1]
        logger.info("engine core runs in process %d", self.process.pid)

    def add(self, request) -> None:
        with self._send_lock:
            self.conn.send(("add", request))

    def abort(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        with self._send_lock:
            self.conn.send(("abort", list(request_ids), status))

    def recv(self, timeout: float) -> tuple | None:
        """The next message from the core, or None after ``timeout`` seconds.
        EOFError when the core is gone."""
        if not self.conn.poll(timeout):
            return None
        return self.conn.recv()

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        try:
            with self._send_lock:
                self.conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
