"""The engine core in a process of its own (`ember serve --engine-mode process`):
started with ``spawn``, since a forked copy of a process running torch threads can
deadlock. The core loads plugins from the ``ember`` entry points itself and talks over
a `multiprocessing` pipe, everything pickled by `multiprocessing.connection` (no
protocol of our own); it exits when the parent closes the pipe or dies:

* parent -> core: ``("add", EngineCoreRequest)``, ``("abort", ids, status)``,
  ``("adapter", "add" | "remove", name, path, AdapterWeights | None)``, ``("shutdown",)``;
* core -> parent: ``("ready", ModelInfo)`` or ``("failed", exception)`` once at start,
  then ``("outputs", EngineCoreOutputs)`` per step, ``("stats", EngineStats)`` when it
  goes idle, ``("add_failed", request_id, message)`` for a request the core refused,
  ``("step_failed", message, ids)`` when a step raised (its requests are aborted).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import sys
import threading
from multiprocessing.connection import Connection

import torch

from ember.config import EngineConfig
from ember.engine.adapters import apply_adapter_command
from ember.engine.client import ModelInfo
from ember.engine.core import EngineCore
from ember.errors import EngineFatalError
from ember.sched.request import RequestStatus

logger = logging.getLogger("ember.engine.core")  # the core's log lines, whichever process it runs in


def _core_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s",
                        datefmt="%H:%M:%S")
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
    try:
        with torch.inference_mode():  # for good in this process: no tensor here needs autograd
            _serve(core, conn)
    except EngineFatalError as exc:  # a parallel worker died: report it, stop the workers, exit non-zero
        logger.error("engine stops: %s", exc)
        try:
            conn.send(("fatal", str(exc), list(core.scheduler.requests)))
        except OSError:
            pass
        core.close()
        sys.exit(1)
    core.close()


def _serve(core: EngineCore, conn: Connection) -> None:
    while True:
        # Block for a command when idle; between steps take whatever has arrived.
        while not core.has_unfinished_requests() or conn.poll(0):
            if not core.has_unfinished_requests() and not conn.poll(0):
                conn.send(("stats", core.stats()))  # idle now: the counts after the last aborts
            while core.parallel is not None and not conn.poll(0.5):  # idle: watch the parallel workers
                if core.fatal_error is not None:
                    raise EngineFatalError(core.fatal_error)
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
            elif kind == "adapter":
                apply_adapter_command(core, *message[1:])
        try:
            outputs = core.step()
        except EngineFatalError:
            raise
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
        # a daemonic process may not start processes: one with parallel workers is not
        # daemonic (it still exits when this process closes the pipe or dies)
        is_parallel = config.tensor_parallel_size * config.pipeline_parallel_size > 1
        self.process = ctx.Process(
            target=_core_main, args=(config, child_conn, level), name="ember-engine-core", daemon=not is_parallel
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

    def adapter(self, action: str, name: str, path: str, weights) -> None:
        """Load (``action`` "add", ``weights`` already read and checked) or unload an adapter."""
        with self._send_lock:
            self.conn.send(("adapter", action, name, path, weights))

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
