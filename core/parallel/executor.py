"""The driver's side of a parallel engine: rank 0, inside the engine core.

The driver starts the other ranks (``spawn``ed processes on this machine, or finds
them started by ``torchrun``), loads its own shard, and for each step broadcasts
the scheduler's output to the workers before running it itself; it samples, and
the tokens it emitted travel with the next step. A watchdog thread checks the
spawned workers every half second: a worker that dies makes ``failure`` say so,
and the next step (or the engine's idle loop) raises :class:`WorkerFailedError`,
which ends the engine (``ember.errors.EngineFatalError``). A collective
with a dead peer fails at once (gloo reports the closed connection); one with a
hung peer fails after ``parallel_timeout_s``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
import weakref

import torch.distributed as dist

from ember.errors import EngineFatalError
from ember.models.parallel.state import ParallelConfig, destroy_parallel, torchrun_environment
from ember.parallel.worker import RankInfo, RankState, WorkerArgs, worker_main
from ember.sched.step import ModelRunnerOutput, SchedulerOutput
from ember.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WorkerFailedError(EngineFatalError):
    """A worker rank died or a collective with it failed: the engine cannot go on."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_plugin_refs(plugin_manager) -> tuple[tuple[str, str], ...]:
    """Plugins the driver registered programmatically (not through entry points), by
    the module (or ``module:attr``) the workers import to register them too;
    ValueError for one that cannot be imported by name."""
    refs = []
    for info in plugin_manager.plugin_infos:
        if info.value != "<direct>" or info.status != "loaded":
            continue
        plugin = plugin_manager.get_plugin(info.name)
        if plugin is None:
            continue
        if type(plugin).__name__ == "module":
            refs.append((info.name, plugin.__name__))
            continue
        module, qualname = getattr(plugin, "__module__", None), getattr(plugin, "__qualname__", None)
        if module and qualname and "<" not in qualname and module != "__main__":
            refs.append((info.name, f"{module}:{qualname}"))
            continue
        raise ValueError(
            f"plugin {info.name!r} was registered programmatically as {plugin!r}, which the worker processes "
            "cannot import by name: register a module (or a module-level object) or an entry point"
        )
    return tuple(refs)


def threads_per_rank(num_threads: int, local_world_size: int) -> int:
    """The driver's thread count shared by the ranks on this machine (at least 1 each)."""
    return max(1, num_threads // local_world_size)


class ParallelExecutor:
    """Rank 0: the workers, the process groups and the driver's own shard."""

    def __init__(self, config, model_dir, backend, plugin_manager, num_threads: int) -> None:
        self.config = config
        parallel = ParallelConfig(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.world_size = parallel.world_size
        self.processes: list[multiprocessing.Process] = []
        self.failure: str | None = None
        self._closed = False
        env = torchrun_environment()
        if env is not None:  # started by torchrun: the other ranks run `ember serve` / the script too
            if int(env["WORLD_SIZE"]) != self.world_size:
                raise ValueError(
                    f"torchrun started WORLD_SIZE={env['WORLD_SIZE']} processes, but tensor_parallel_size x "
                    f"pipeline_parallel_size is {self.world_size}"
                )
            if int(env["RANK"]) != 0:
                raise RuntimeError("only rank 0 drives the engine; ranks > 0 run ember.parallel.run_worker")
            addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            local_world = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        else:
            addr, port, local_world = "127.0.0.1", free_port(), self.world_size
        # one device per rank on a machine with several: rank r takes the driver's index + r
        device_index = getattr(getattr(backend, "options", None), "device_index", 0)
        threads = threads_per_rank(num_threads, local_world) if config.num_threads is None else config.num_threads
        level = logging.getLogger().getEffectiveLevel()
        args = WorkerArgs(
            config, str(model_dir), 0, addr, port, config.parallel_timeout_s, direct_plugin_refs(plugin_manager),
            threads, level,
        )
        if env is None:
            ctx = multiprocessing.get_context("spawn")
            for rank in range(1, self.world_size):
                process = ctx.Process(
                    target=worker_main, name=f"ember-rank-{rank}", daemon=True,
                    args=(WorkerArgs(config, str(model_dir), rank, addr, port, config.parallel_timeout_s,
                                     args.direct_plugins, threads, level, os.getpid(), rank + device_index),),
                )
                process.start()
                self.processes.append(process)
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.processes))
        self.state = RankState(args, plugin_manager)
        self.state.backend = backend
        backend.configure_threads(threads)
        self.num_threads = threads
        try:
            self.ctx = self.state.join(args)
        except Exception as exc:
            self.close()
            raise RuntimeError(f"the parallel ranks did not join at {addr}:{port}: {exc}") from exc
        self._watchdog = threading.Thread(target=self._watch, name="ember-rank-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("parallel engine: %d ranks (tensor %d x pipeline %d) over %s, %d threads each",
                    self.world_size, self.ctx.tp_size, self.ctx.pp_size, backend.distributed_backend, threads)

    # -- start-up --------------------------------------------------------------
    def load_model(self):
        """The driver's shard, once every rank loaded its own (ValueError with the first error otherwise)."""
        error = self.state.load()
        errors = [None] * self.world_size
        try:
            dist.all_gather_object(errors, error, group=self.ctx.command_group)
        except RuntimeError as exc:
            self.close()
            raise WorkerFailedError(f"a worker failed while loading: {self._describe(exc)}") from exc
        failed = [e for e in errors if e]
        if failed:
            self.close()
            raise ValueError(failed[0])
        return self.state.model

    def agree_num_blocks(self, num_tokens: int, block_size: int, max_num_seqs: int) -> tuple[int, int]:
        """Every rank profiles its shard; (the smallest KV pool in blocks, the driver's budget)."""
        self._broadcast(("profile", num_tokens, block_size, max_num_seqs))
        return self.state.profile(num_tokens, block_size, max_num_seqs)

    def create_runner(self, num_blocks: int, block_size: int, seed, logits_pipeline, max_num_seqs: int,
                      max_model_len: int) -> DriverRunner:
        self._broadcast(("runner", num_blocks, block_size, seed, max_num_seqs, max_model_len))
        runner = self.state.create_runner(num_blocks, block_size, seed, max_num_seqs, max_model_len, logits_pipeline)
        return DriverRunner(runner, self)

    def describe_ranks(self) -> list[RankInfo]:
        """What every rank holds, rank by rank (asked of the workers between steps)."""
        self._broadcast(("describe",))
        infos = [None] * self.world_size
        dist.all_gather_object(infos, self.state.describe(), group=self.ctx.command_group)
        return infos

    # -- running -----------------------------------------------------------------
    def _broadcast(self, command) -> None:
        if self.failure is not None:
            raise WorkerFailedError(self.failure)
        try:
            dist.broadcast_object_list([command], src=0, group=self.ctx.command_group)
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: BaseException) -> WorkerFailedError:
        if self.failure is None:
            self.failure = self._describe(exc)
        return WorkerFailedError(self.failure)

    def _describe(self, exc: BaseException) -> str:
        dead = [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(self.processes)
                if not p.is_alive()]
        return f"worker {', '.join(dead)} died" if dead else f"a parallel step failed: {exc!r}"

    def _watch(self) -> None:
        while not self._closed:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive() and not self._closed and self.failure is None:
                    self.failure = f"worker rank {rank} (pid {process.pid}) died with exit code {process.exitcode}"
                    logger.error("%s; the engine stops", self.failure)
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the workers and leave the process groups (idempotent)."""
        if self._closed:
            return
        self._closed = True  # first: the watchdog must not take the workers' exit for a failure
        if self.failure is None and getattr(self, "ctx", None) is not None:
            try:
                dist.broadcast_object_list([("shutdown",)], src=0, group=self.ctx.command_group)
            except RuntimeError:
                pass  # a worker is gone already: nothing to tell it
        for process in self.processes:
            process.join(10)
        self._finalizer()
        destroy_parallel()


def _stop_processes(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


class DriverRunner:
    """The driver's ``ModelRunner``: each step goes to the workers first."""

    def __init__(self, runner: ModelRunner, executor: ParallelExecutor) -> None:
        self.runner = runner
        self.executor = executor
        self._emitted: dict[str, list[int]] = {}

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.executor._broadcast(("step", scheduler_output, self._emitted))
        try:
            output = self.runner.execute(scheduler_output)
        except Exception as exc:
            # the ranks' batches may now differ (a rank may have stopped): nothing
            # after this step could be trusted
            raise self.executor._failed(exc) from exc
        self._emitted = {rid: ids for rid, ids in zip(output.request_ids, output.sampled_token_ids) if ids}
        return output
