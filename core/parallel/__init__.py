"""Tensor and pipeline parallelism over ``torch.distributed`` (docs/parallel.md): the
ranks at run time. How a model is split (process groups, parallel layers, stages,
micro-batches, one rank's shard of the checkpoint) is ``ember.models.parallel``.

Module map:
    worker    a rank > 0: its shard, its KV cache, the loop running the driver's steps
    executor  rank 0 (the driver, inside the engine core): starts the workers, broadcasts each step
"""

from __future__ import annotations

import logging

from ember.models.parallel.loader import check_parallel_model
from ember.models.parallel.state import ParallelConfig, ParallelContext, torchrun_environment
from ember.parallel.executor import ParallelExecutor, WorkerFailedError
from ember.parallel.worker import WorkerArgs, worker_main

__all__ = [
    "ParallelConfig", "ParallelContext", "ParallelExecutor", "WorkerFailedError", "is_torchrun_worker",
    "run_torchrun_worker", "start_parallel",
]

logger = logging.getLogger(__name__)


def start_parallel(config, model_dir, hf_config, backend, plugin_manager, num_threads: int) -> ParallelExecutor:
    """Rank 0 of ``config.tensor_parallel_size x config.pipeline_parallel_size`` ranks:
    checks what cannot be split (ValueError), then starts or joins the workers."""
    check_parallel_model(hf_config, plugin_manager.registries.model_architectures, getattr(config, "quantize", None))
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":
        raise ValueError(
            f"speculative method {spec.method!r} runs a model beside the target's and cannot run with tensor or "
            "pipeline parallelism yet; 'ngram' can"
        )
    return ParallelExecutor(config, model_dir, backend, plugin_manager, num_threads)


def is_torchrun_worker() -> bool:
    """Whether this process is a rank > 0 started by torchrun (it serves no requests)."""
    env = torchrun_environment()
    return env is not None and int(env["RANK"]) != 0


def run_torchrun_worker(config) -> None:
    """Serve as rank ``RANK`` of a torchrun job until the driver (rank 0) shuts down.
    Each machine resolves the model itself (its own copy of the files)."""
    import os

    from ember.weights import resolve_model

    env = torchrun_environment()
    model_dir = resolve_model(config.model, config.revision, gguf_native=False)  # as the driver: float shards
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // local_world)
    worker_main(WorkerArgs(
        config, str(model_dir), int(env["RANK"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
        config.parallel_timeout_s, (), threads, logging.getLogger().getEffectiveLevel(),
        local_rank=int(env["LOCAL_RANK"]),
    ))
