"""A worker rank: its backend, its shard of the weights and of the KV cache, and a
loop that runs each step the driver broadcasts.

Commands arrive over the command group (``broadcast_object_list`` from rank 0,
pickled values only):

* ``("profile", num_tokens, block_size, max_num_seqs)``: a profiling forward pass on
  every rank; each sizes its KV pool from its own memory and the smallest wins;
* ``("runner", num_blocks, block_size, seed, max_num_seqs, max_model_len)``: build
  the model runner (the KV cache of this rank's heads and layers);
* ``("step", SchedulerOutput, emitted)``: apply the tokens the driver emitted last
  step (``emitted[request_id]``; a worker's own samples are discarded), then run
  the step: the forward pass and the logits collectives, exactly as the driver does;
* ``("shutdown",)``.

A worker exits when the driver says so, when the driver's connection breaks (gloo
reports a closed peer) or when the process that spawned it is gone.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ember.config import EngineConfig
from ember.models.loader import load_hf_config, model_dtype
from ember.models.parallel.layers import resident_weight_bytes
from ember.models.parallel.loader import load_model_shard
from ember.models.parallel.pipeline import MicroBatchAttention
from ember.models.parallel.state import (
    ParallelConfig,
    ParallelContext,
    all_reduce_min,
    destroy_parallel,
    init_parallel,
)
from ember.models.tokenizer import eos_token_ids, load_tokenizer
from ember.plugin import create_plugin_manager
from ember.plugin.backend import select_backend
from ember.plugin.logits_processor import LogitsProcessorContext
from ember.worker.kv_sizing import profile_kv_budget
from ember.worker.logits_pipeline import LogitsPipeline
from ember.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    """What a rank needs to join: everything picklable (spawned with ``spawn``)."""

    config: EngineConfig
    model_dir: str
    rank: int
    master_addr: str
    master_port: int
    timeout_s: float
    # plugins the driver registered programmatically, as (name, "module" or "module:attr")
    direct_plugins: tuple[tuple[str, str], ...] = ()
    num_threads: int | None = None
    log_level: int = logging.INFO
    parent_pid: int | None = None  # exit when this process is gone (spawned workers)
    # this rank's device on its machine (a device backend's option device_index); None: the config's
    local_rank: int | None = None


@dataclass(frozen=True)
class RankInfo:
    """What one rank holds (``ParallelExecutor.describe_ranks``: tests, logs, the benchmark)."""

    rank: int
    tp_rank: int
    pp_rank: int
    layer_range: tuple[int, int]
    num_heads: int  # attention heads of this rank (per layer)
    num_kv_heads: int
    weight_bytes: int  # its parameters' bytes: its share of the model
    num_threads: int
    plugins: tuple[str, ...]  # the plugins loaded in its process
    num_kv_blocks: int


def import_plugin(ref: str):
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


class RankState:
    """One rank's backend, model and runner (the driver holds one too)."""

    def __init__(self, args: WorkerArgs, plugin_manager=None) -> None:
        config = args.config
        self.config = config
        self.plugin_manager = plugin_manager or create_plugin_manager(
            disabled=config.disabled_plugins, required=config.required_plugins,
            extra_plugins=[(name, import_plugin(ref)) for name, ref in args.direct_plugins],
        )
        self.backend = select_backend(self.plugin_manager.registries.backends, config.backend,
                                      dict(config.backend_options), device_index=args.local_rank)
        self.num_threads = self.backend.configure_threads(args.num_threads)
        self.model_dir = args.model_dir
        self.hf_config = load_hf_config(args.model_dir)
        self.dtype = self.backend.resolve_dtype(config.dtype, model_dtype(self.hf_config))
        self.kv_dtype = self.backend.kv_cache_dtype(self.dtype, config.kv_cache_dtype)
        self.ctx: ParallelContext | None = None
        self.model = None
        self.attention = self.backend.create_attention()
        self.runner: ModelRunner | None = None

    def join(self, args: WorkerArgs) -> ParallelContext:
        parallel = ParallelConfig(args.config.tensor_parallel_size, args.config.pipeline_parallel_size)
        self.ctx = init_parallel(self.backend.distributed_backend, args.rank, parallel, args.master_addr,
                                 args.master_port, args.timeout_s)
        return self.ctx

    @property
    def runner_attention(self):
        """What the runner prepares each step with: micro-batches on pipeline stages."""
        if self.ctx.pp_size > 1:
            return MicroBatchAttention(self.attention, self.ctx.pp_size)
        return self.attention

    def load(self) -> str | None:
        """Load this rank's shard; the error's text when it failed (reported to the driver)."""
        try:
            self.model = load_model_shard(self.model_dir, self.hf_config, self.backend, self.attention, self.dtype,
                                          self.plugin_manager.registries.model_architectures, self.ctx)
        except Exception as exc:
            logger.exception("rank %d could not load its shard", self.ctx.rank)
            return f"rank {self.ctx.rank}: {type(exc).__name__}: {exc}"
        return None

    def describe(self) -> RankInfo:
        attn = self.model.layers[self.model.layer_range[0]].self_attn
        return RankInfo(
            self.ctx.rank, self.ctx.tp_rank, self.ctx.pp_rank, tuple(self.model.layer_range), attn.num_heads,
            attn.num_kv_heads, resident_weight_bytes(self.model), self.num_threads,
            tuple(sorted(info.name for info in self.plugin_manager.plugin_infos if info.status == "loaded")),
            self.runner.kv_caches[0].shape[1] if self.runner is not None else 0,
        )

    def profile(self, num_tokens: int, block_size: int, max_num_seqs: int) -> tuple[int, int]:
        """(the smallest number of KV blocks any rank can hold, this rank's budget in bytes)."""
        budget = profile_kv_budget(self.model, self.backend, self.runner_attention, self.kv_dtype, num_tokens,
                                   block_size, max_num_seqs)
        local = budget // (self.model.kv_cache_spec.bytes_per_token(self.kv_dtype) * block_size)
        return all_reduce_min(local, self.ctx.command_group), budget

    def create_runner(self, num_blocks: int, block_size: int, seed: int | None, max_num_seqs: int,
                      max_model_len: int, logits_pipeline: LogitsPipeline | None = None) -> ModelRunner:
        if logits_pipeline is None:  # a worker's own processors (it samples as the driver does, then discards)
            tokenizer = load_tokenizer(self.model_dir)
            logits_pipeline = LogitsPipeline.from_registry(
                self.plugin_manager.registries.logits_processors,
                LogitsProcessorContext(self.hf_config.vocab_size, eos_token_ids(self.model_dir, tokenizer), tokenizer),
                self.config.processor_options,
            )
        self.runner = ModelRunner(
            self.model, self.backend, self.runner_attention, num_blocks, block_size, self.kv_dtype, seed,
            logits_pipeline, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            vocab_size=self.hf_config.vocab_size,
        )
        return self.runner


def replace_emitted(runner: ModelRunner, own, emitted: dict[str, list[int]]) -> None:
    """Put the driver's emitted tokens in place of this rank's own samples of the last step."""
    if own is None:
        return
    requests = runner.batch.requests
    for request_id, mine in zip(own.request_ids, own.sampled_token_ids):
        theirs = emitted.get(request_id, [])
        request = requests.get(request_id)
        if request is None or (not mine and not theirs) or mine == theirs:
            continue
        kept = len(request.output_token_ids) - len(mine)
        del request.output_token_ids[kept:]
        request.output_token_ids.extend(theirs)
        request.num_written = min(request.num_written, request.num_prompt_tokens + kept)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except OSError:
            os._exit(1)  # orphaned: the driver is gone
        if os.getppid() != parent_pid:
            os._exit(1)


def serve_worker(state: RankState) -> None:
    """Run the driver's commands until it shuts down (or its connection breaks)."""
    runner, own = None, None
    group = state.ctx.command_group
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=group)
            command = message[0]
            kind = command[0]
            if kind == "step":
                replace_emitted(runner, own, command[2])
                own = runner.execute(command[1])
            elif kind == "profile":
                state.profile(*command[1:])
            elif kind == "runner":
                runner = state.create_runner(*command[1:])
            elif kind == "describe":
                dist.all_gather_object([None] * state.ctx.world_size, state.describe(), group=group)
            elif kind == "shutdown":
                return
            else:  # pragma: no cover - a bug in the driver
                raise RuntimeError(f"unknown command {kind!r}")


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a rank > 0 (spawned by the driver, or started by torchrun)."""
    logging.basicConfig(level=args.log_level, datefmt="%H:%M:%S",
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {args.rank}]: %(message)s")
    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True, name="ember-parent").start()
    try:
        state = RankState(args)
        state.join(args)
    except Exception:
        logger.exception("rank %d failed to start", args.rank)
        sys.exit(1)
    error = state.load()
    errors = [None] * state.ctx.world_size
    dist.all_gather_object(errors, error, group=state.ctx.command_group)
    if any(errors):
        destroy_parallel()
        sys.exit(1)
    try:
        serve_worker(state)
    except Exception as exc:  # noqa: BLE001 - the driver's connection broke, or a step failed here
        logger.error("rank %d stops: %s", args.rank, exc)
        sys.exit(1)
    destroy_parallel()
