"""Grammar compiles in worker processes, isolated from serving.

A schema's compile can take a minute of CPU (a 30,000-value enum in outlines-core). On
threads of the engine's process it took the step's and the event loop's CPU, and the
GIL between the two: with two clients sending such schemas, plain chat latency rose
eightfold. Here each compile runs in a worker process:

* **Priority**: the worker runs under ``SCHED_IDLE`` (``--grammar-compile-priority``,
  default ``idle``): it gets the CPU only where the engine and the event loop leave it
  idle, so a compile cannot take their share; or at a nice level (``0``..``19``) where
  compiles should progress on a machine kept busy. Set from the engine's side the moment
  the worker is started, before its imports: a worker's start-up (torch and the backend,
  about 3 CPU seconds) at the engine's priority slowed plain requests by 2x for 3 s.
* **Timeout**: a compile that has used ``compile_timeout_s`` seconds of CPU, or is
  still running `WALL_FACTOR` times that long after it started, is stopped by killing
  its worker (SIGKILL); a new worker is started for the next one, and the request
  fails with the timeout named (``--grammar-compile-timeout``). CPU time, not wall
  time, because at lowered priority a compile's pace follows the machine's load (an
  outlines ``json_object`` compile, 5.5 CPU seconds, took over 60 s at load 6.6 on 2 cores).
* **Limits**: before each compile the worker lowers its own ``RLIMIT_AS`` to its
  current address space plus ``memory_mb`` (a compile that allocates more fails, or
  the worker dies and is replaced) and ``RLIMIT_CPU`` to its CPU time so far plus the
  timeout (a backstop for compiles whose threads outrun the wall clock).
* **Coming back**: the worker serializes the compiled grammar
  (`BaseGrammarBackend.dump_grammar`), the engine's process loads it
  (`load_grammar`), and the engine caches it as before. Only backends that set
  ``serializes_grammars`` compile here (both built-in ones do); the grammar manager
  compiles the others on threads, as before.

The workers are plain subprocesses (``python -m ember.engine.grammar_workers``)
talking pickles over a socket: the engine core may itself be a daemonic process, which
multiprocessing forbids to have children. A worker exits when the engine's end of its
socket closes. Each of the ``num_workers`` slots is one thread here (waiting on its
worker, no CPU) and one process there, started with the first compile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from ember.plugin.grammar import (
    BaseCompiledGrammar,
    BaseGrammarBackend,
    Constraint,
    GrammarCompileTimeout,
    GrammarContext,
    GrammarError,
    UnsupportedFeatureError,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker's imports and its first backend's tables
NICE_WITHOUT_SCHED_IDLE = 19  # where the platform has no SCHED_IDLE
POLL_S = 0.05
# a compile is stopped past the timeout in CPU seconds, or past this many times it in wall
# seconds (at lowered priority on a busy machine it may get a fraction of a CPU)
WALL_FACTOR = 4
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # how often a slot looks whether its job was given up


class CompileWorkerDied(GrammarError):
    """The worker died while compiling: killed by its memory or CPU limit, or a crash."""


@dataclass
class _Job:
    backend: str
    constraint: Constraint
    fallbacks: tuple[str, ...]
    description: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started_at: float | None = None
    abandoned: bool = False


class CompilePool:
    """``num_workers`` worker processes compiling grammars, with a queue in front.

    ``load(backend, data)`` turns a worker's serialized grammar into the engine's;
    ``on_compiled(seconds)`` counts each compile the workers ran (for the metrics).
    """

    def __init__(
        self, backends: dict[str, type[BaseGrammarBackend]], context: GrammarContext, num_workers: int,
        timeout_s: float, memory_mb: int, load: Callable[[str, bytes], BaseCompiledGrammar],
        on_compiled: Callable[[float], None] = lambda seconds: None, priority: str = "idle",
    ) -> None:
        self.backends = backends
        self.context = context
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.priority = priority
        self.load = load
        self.on_compiled = on_compiled
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._jobs: dict[concurrent.futures.Future, _Job] = {}
        self.num_killed = 0  # workers killed at the timeout or found dead
        self.slots = [_Slot(self, i) for i in range(num_workers)]
        for slot in self.slots:
            slot.thread.start()

    def submit(self, backend: str, constraint: Constraint, fallbacks: tuple[str, ...], description: str,
               ) -> concurrent.futures.Future:
        job = _Job(backend, constraint, fallbacks, description)
        self._jobs[job.future] = job
        job.future.add_done_callback(lambda future: self._jobs.pop(future, None))
        self._queue.put(job)
        return job.future

    def owns(self, future: concurrent.futures.Future) -> bool:
        """Whether ``future`` is a compile of this pool, not yet finished."""
        return future in self._jobs

    def started_at(self, future: concurrent.futures.Future) -> float | None:
        """When a worker began ``future``'s compile (monotonic), None while it is queued."""
        job = self._jobs.get(future)
        return None if job is None else job.started_at

    def abandon(self, future: concurrent.futures.Future) -> None:
        """Nobody waits for ``future`` any more: drop it from the queue, or stop its compile."""
        job = self._jobs.get(future)
        if job is not None and not future.cancel():
            job.abandoned = True

    def close(self) -> None:
        for _ in self.slots:
            self._queue.put(None)
        for slot in self.slots:
            slot.stop()

    def worker_pids(self) -> list[int]:
        return [slot.process.pid for slot in self.slots if slot.process is not None]


class _Slot:
    """One worker process and the thread here that feeds it jobs one at a time."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.thread = threading.Thread(target=self._run, name=f"ember-grammar-worker-{index}", daemon=True)

    def _run(self) -> None:
        while (job := self.pool._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # abandoned while queued
            try:
                self._serve(job)
            except BaseException as exc:  # noqa: BLE001  (the future carries it to the request)
                if not job.future.done():
                    job.future.set_exception(exc)

    def _serve(self, job: _Job) -> None:
        pool = self.pool
        conn = self._ready()
        job.started_at = time.monotonic()
        cpu_before = _cpu_seconds(self.process.pid)
        conn.send((job.backend, job.constraint, job.fallbacks, pool.timeout_s, pool.memory_mb))
        deadline = job.started_at + pool.timeout_s * WALL_FACTOR
        while not conn.poll(POLL_S):
            if job.abandoned or time.monotonic() > deadline or self.process.poll() is not None:
                break
            if _cpu_seconds(self.process.pid) - cpu_before > pool.timeout_s:
                break
        else:
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                reply = None
            if reply is not None:
                return self._answer(job, reply)
        timed_out = self.process.poll() is None
        code = self._kill()
        if timed_out:
            if job.abandoned:
                raise GrammarCompileTimeout(f"compiling {job.description} was stopped: no request waits for it")
            raise GrammarCompileTimeout(
                f"compiling {job.description} took longer than {pool.timeout_s:g} s of CPU time (or "
                f"{pool.timeout_s * WALL_FACTOR:g} s in all) and was stopped (--grammar-compile-timeout, "
                "grammar_compile_timeout_s)"
            )
        raise CompileWorkerDied(f"compiling {job.description} ended its worker process ({_death(code, pool)})")

    def _answer(self, job: _Job, reply: tuple) -> None:
        status, payload, seconds = reply
        self.pool.on_compiled(seconds)
        if status == "ok":
            backend, data = payload
            job.future.set_result(self.pool.load(backend, data))
        elif status == "memory":
            self._kill()  # a worker that ran out of memory may be left in any state
            raise CompileWorkerDied(
                f"compiling {job.description} needed more than {self.pool.memory_mb} MiB "
                "(--grammar-compile-memory) and was stopped"
            )
        elif status == "grammar":
            raise payload  # GrammarError, UnsupportedFeatureError: the constraint's fault
        else:
            raise RuntimeError(payload)  # the backend's own failure

    def _ready(self) -> Connection:
        """This slot's worker, started (imports, priority) if there is none."""
        if self.process is not None and self.process.poll() is None:
            return self.conn
        pool = self.pool
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.engine.grammar_workers", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
        )
        theirs.close()
        priority = _lower_priority(self.process.pid, pool.priority)
        self.conn = Connection(ours.detach())
        self.conn.send((pool.backends, _portable(pool.context)))
        if not self.conn.poll(START_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"a grammar compile worker did not start within {START_TIMEOUT_S:g} s")
        self.conn.recv()
        logger.info("grammar compile worker %d started (%s)", self.process.pid, priority)
        return self.conn

    def _kill(self) -> int | None:
        process, self.process = self.process, None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
            self.pool.num_killed += 1
        return process.wait()

    def stop(self) -> None:
        self._kill()


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _death(code: int | None, pool: CompilePool) -> str:
    """Why a worker died, from its exit status."""
    if code == -signal.SIGXCPU:
        return f"SIGXCPU: past its CPU-time limit, the --grammar-compile-timeout of {pool.timeout_s:g} s in CPU seconds"
    if code in (-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGKILL, -signal.SIGBUS):
        return (f"{signal.Signals(-code).name}: most likely an allocation over its memory limit of {pool.memory_mb} MiB "
                "(--grammar-compile-memory), else a crash of the backend")
    return f"exit status {code}: a crash of the grammar backend"


def _portable(context: GrammarContext) -> GrammarContext:
    """``context`` with its vocabulary's bytes computed (the workers need not decode them
    again), and without its tokenizer when that does not pickle."""
    import pickle

    context.token_bytes  # noqa: B018  (computed once, carried in the pickle)
    try:
        pickle.dumps(context.tokenizer)
        return context
    except Exception:  # noqa: BLE001  (a tokenizer that does not pickle: the bytes are what backends use)
        portable = GrammarContext(None, context.vocab_size, context.eos_token_ids)
        portable.__dict__["token_bytes"] = context.token_bytes
        return portable


# -- the worker process -------------------------------------------------------------------


def _lower_priority(pid: int, priority: str) -> str:
    """Run worker ``pid`` at ``priority`` ("idle": SCHED_IDLE; "0".."19": that much nicer
    than this process), set from here before the worker's imports begin."""
    if priority == "idle" and hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    niceness = NICE_WITHOUT_SCHED_IDLE if priority == "idle" else int(priority)
    os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness))
    return f"nice +{niceness}"


def _set_limits(timeout_s: float, memory_mb: int) -> None:
    """Address space: what the worker holds now plus ``memory_mb``; CPU: used so far plus the timeout."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = size + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu = int(usage.ru_utime + usage.ru_stime + timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))


def _unlimit() -> None:
    for which in (resource.RLIMIT_AS, resource.RLIMIT_CPU):
        _, hard = resource.getrlimit(which)
        resource.setrlimit(which, (hard, hard))


def _compile(backends: dict[str, BaseGrammarBackend], classes, context, name: str, constraint: Constraint,
             fallbacks: tuple[str, ...]) -> tuple[str, bytes]:
    """With backend ``name``, else the first of ``fallbacks`` that does not refuse a feature
    of the constraint (the first refusal is raised if all do), as the grammar manager does."""

    def compile_with(backend_name: str) -> tuple[str, bytes]:
        backend = backends.get(backend_name)
        if backend is None:
            backend = backends[backend_name] = classes[backend_name](context)
        return backend_name, backend.dump_grammar(backend.compile(constraint))

    try:
        return compile_with(name)
    except UnsupportedFeatureError as refusal:
        for other in fallbacks:
            cls = classes[other]
            if constraint.kind not in cls.supported_kinds or not cls.serializes_grammars:
                continue
            try:
                compiled = compile_with(other)
            except UnsupportedFeatureError:
                continue
            logger.info("%s; compiled %s with grammar backend %r instead", refusal, constraint.describe(), other)
            return compiled
        raise


def worker_main(fd: int) -> None:
    conn = Connection(fd)
    classes, context = conn.recv()
    conn.send("ready")
    backends: dict[str, BaseGrammarBackend] = {}
    while True:
        try:
            name, constraint, fallbacks, timeout_s, memory_mb = conn.recv()
        except EOFError:  # the engine closed its end, or died: nothing to tidy (and no exit-time noise)
            os._exit(0)
        started = time.perf_counter()
        try:
            _set_limits(timeout_s, memory_mb)
            reply = ("ok", _compile(backends, classes, context, name, constraint, fallbacks))
        except MemoryError:
            reply = ("memory", None)
        except GrammarError as exc:
            reply = ("grammar", exc)
        except Exception as exc:  # noqa: BLE001  (the backend's own failure, reported by the engine)
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        finally:
            _unlimit()
        conn.send((*reply, time.perf_counter() - started))
        if reply[0] == "memory":
            os._exit(0)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
