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
import signal
import sys
import threading
from multiprocessing.connection import Connection

import torch

from ember.config import EngineConfig
from ember.engine.adapters import apply_adapter_command
from ember.engine.client import EngineStats, ModelInfo
from ember.engine.core import EngineCore
from ember.errors import EngineDeadError, EngineFatalError
from ember.sched.request import RequestStatus

logger = logging.getLogger("ember.engine.core")  # the core's log lines, whichever process it runs in


def describe_exit(exitcode: int | None) -> str:
    """``exit code -9`` as an operator reads it: the signal's name when one killed it."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


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


class CoreProcessReader:
    """`AsyncLLMEngine`'s side of a core in a process (a mixin: it uses the engine's
    ``_process``, ``_handle``, ``_fail``, ``_die``, ``_supervisor``): the reader thread
    that hands the core's messages on, and notices at once when the process is gone (the
    pipe's EOF) — then the server stops, or a supervisor restarts the core in place."""

    def _run_reader(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    message = self._process.recv(0.5)
                except (EOFError, OSError):
                    if self._stop.is_set():
                        return
                    self._process.process.join(1)  # EOF comes as it exits: reap it for its exit code
                    exit_code = self._process.process.exitcode
                    self._core_lost(EngineDeadError(f"the engine-core process exited ({describe_exit(exit_code)})"))
                    continue
                if message is None:
                    continue
                kind = message[0]
                if kind == "outputs":
                    self._handle(message[1])
                elif kind == "stats":
                    self._stats = message[1]
                elif kind == "add_failed":
                    self._fail([message[1]], ValueError(message[2]))
                elif kind == "step_failed":
                    self._fail(message[2], RuntimeError(f"engine step failed: {message[1]}"))
                elif kind == "fatal":  # the core stops for good (a parallel worker died)
                    self._core_lost(EngineDeadError(f"engine stopped: {message[1]}"))
        except BaseException as exc:
            logger.error("engine core lost: %s", exc)
            self._die(exc)

    def _core_lost(self, cause: EngineDeadError) -> None:
        """The core process is gone: raise ``cause`` (the server stops), or with a supervisor
        end the requests it held and start a fresh core (/health 503 meanwhile)."""
        if self._supervisor is None:
            raise cause
        self._restart_cause = cause
        with self._lock:
            held = list(self._streams)
        self._fail(held, cause)
        try:
            process = self._supervisor.replace(self._process, cause)
        except Exception as exc:
            raise EngineDeadError(f"{cause}; restarting the engine core failed: {exc!r}") from exc
        if process is None:
            raise EngineDeadError(f"{cause}; no restart left (--max-engine-restarts "
                                  f"{self._supervisor.policy.max_restarts} within an hour)")
        info = self._model_info
        self._process = process
        self._stats = EngineStats(0, 0, info.num_kv_blocks, info.num_kv_blocks, 0, 0, 0)
        # the new core serves the adapters of its config; those loaded at run time are gone
        self._adapters = {a.name: a for a in info.lora.adapters} if info.lora is not None else {}
        self._restart_cause = None
