"""The engine core: the model, the KV cache, the scheduler and the runner behind one
step. Everything that crosses its boundary is a plain value — `EngineCoreRequest` in,
`EngineCoreOutputs` out — so the core runs in the caller's thread (`LLMEngine`), in
a thread beside an event loop or in a process of its own (`ember.async_engine`).
Tokenizing, validation and detokenization happen outside it, once.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from ember.backend import AttentionBatch, BaseBackend, SequenceSlice
from ember.config import EngineConfig, SchedulerConfig
from ember.engine_client import EngineStats, ModelInfo
from ember.kv_cache_manager import KVCacheManager
from ember.kv_sizing import check_kv_cache, resolve_max_model_len
from ember.logits_processor import LogitsPipeline, LogitsProcessorContext
from ember.model_loader import get_model_class, load_hf_config, load_model, model_dtype
from ember.model_runner import ModelRunner
from ember.models.base import KVCacheSpec
from ember.output_processor import EngineCoreOutput
from ember.parallel_sampling import child_id, child_params
from ember.plugin import create_plugin_manager
from ember.plugin.manager import EmberPluginManager
from ember.scheduler import Request, RequestStatus
from ember.sampling_params import SamplingParams
from ember.scheduler import Scheduler
from ember.step import StepStats, record_step
from ember.step import SchedulerOutput
from ember.tokenizer import eos_token_ids, load_tokenizer, max_chars_per_token
from ember.weights import resolve_model

logger = logging.getLogger(__name__)


def select_backend(pm: EmberPluginManager, name: str | None) -> BaseBackend:
    registry = pm.registries.backends
    if name is not None:
        cls = registry.get(name)
        if not cls.is_available():
            raise ValueError(f"backend {name!r} is not available on this machine")
        return cls()
    available = [cls for _, cls in registry.items() if cls.is_available()]
    if not available:
        raise RuntimeError(f"no hardware backend is available; registered: {registry.names()}")
    return max(available, key=lambda c: c.priority)()


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A validated request (its prompt already token ids). ``params.num_samples > 1``
    makes the core run that many children, ``child_id(request_id, i)``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True)
class EngineCoreOutputs:
    """One step: what is new per changed request, the step's figures and the counts after it."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step_stats: StepStats | None = None
    stats: EngineStats | None = None


@dataclass
class _PendingGroup:
    """Parallel sampling: siblings wait until the first child computed the prompt, so
    that with prefix caching they take its full blocks instead of computing them."""

    request: EngineCoreRequest
    num_prompt_tokens: int


class EngineCore:
    """Not thread-safe: one thread calls add/abort/step."""

    def __init__(self, config: EngineConfig, plugin_manager: EmberPluginManager | None = None) -> None:
        self.config = config
        self.plugin_manager = plugin_manager or create_plugin_manager(
            disabled=config.disabled_plugins, required=config.required_plugins
        )
        self.plugin_manager.hook.ember_configure(config=config)
        self.backend = select_backend(self.plugin_manager, config.backend)
        self.num_threads = self.backend.configure_threads(config.num_threads)

        self.model_dir = resolve_model(config.model, config.revision)
        self.hf_config = load_hf_config(self.model_dir)
        self.dtype = self.backend.resolve_dtype(config.dtype, model_dtype(self.hf_config))
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)

        self.max_model_len = resolve_max_model_len(self.hf_config, config.max_model_len)
        self.kv_dtype = self.backend.kv_cache_dtype(self.dtype)

        attention = self.backend.create_attention()
        architectures = self.plugin_manager.registries.model_architectures
        block_size = config.block_size
        # An explicit budget sizes the pool before the weights are read, so that one
        # too small is refused in seconds, not after loading.
        num_blocks = config.num_kv_blocks
        if num_blocks is not None:
            check_kv_cache(num_blocks, config, self.max_model_len)
        elif config.kv_cache_memory_bytes is not None:
            spec = self._kv_cache_spec_before_loading(attention, architectures)
            budget = config.kv_cache_memory_bytes
            num_blocks = budget // (spec.bytes_per_token(self.kv_dtype) * block_size)
            check_kv_cache(num_blocks, config, self.max_model_len, spec.bytes_per_token(self.kv_dtype), budget)
        self.model = load_model(self.model_dir, self.hf_config, self.backend, attention, self.dtype, architectures)

        max_model_len = self.max_model_len
        if config.max_num_batched_tokens is not None:
            max_batched = config.max_num_batched_tokens
        elif config.enable_chunked_prefill:
            # at least one decode token for every running request fits a step
            max_batched = max(self.backend.default_step_tokens, config.max_num_seqs)
        else:
            max_batched = max(8192, max_model_len)

        bytes_per_token = self.model.kv_cache_spec.bytes_per_token(self.kv_dtype)
        if num_blocks is None:
            # The backend's share of the memory left after the weights and the peak of
            # a profiling forward pass at the largest step (vLLM's approach).
            model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            num_profile = min(max_batched, max_model_len)
            started = time.perf_counter()
            activation_bytes = self.backend.peak_memory_of(
                lambda: self._profile_forward(attention, num_profile, block_size, config.max_num_seqs)
            )
            logger.info(
                "profiling forward pass of %d tokens: peak %s in %.2f s", num_profile,
                "unknown" if activation_bytes is None else f"{activation_bytes / 2**20:.1f} MiB",
                time.perf_counter() - started,
            )
            budget = self.backend.kv_cache_memory_bytes(model_bytes, activation_bytes or 0)
            num_blocks = budget // (bytes_per_token * block_size)
            check_kv_cache(num_blocks, config, self.max_model_len, bytes_per_token, budget)
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, max_batched, max_model_len, config.enable_chunked_prefill),
            self.kv_manager,
        )
        # Processors are resolved once, here; per step the runner calls them directly.
        self.logits_pipeline = LogitsPipeline.from_registry(
            self.plugin_manager.registries.logits_processors,
            LogitsProcessorContext(self.hf_config.vocab_size, self.eos_token_ids, self.tokenizer),
            config.processor_options,
        )
        self.runner = ModelRunner(
            self.model, self.backend, attention, num_blocks, block_size, self.kv_dtype, config.seed,
            self.logits_pipeline, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            vocab_size=self.hf_config.vocab_size,
        )
        # The step's slots for the plugin kinds built on it (ember.step): a speculator
        # proposes draft tokens per decoding request, a token masker gives allowed-token
        # masks. Unset until those plugins exist; tests set fakes.
        self.speculator = None
        self.token_masker = None
        self._pending_groups: dict[str, _PendingGroup] = {}
        self.last_step_stats: StepStats | None = None
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)",
            num_blocks, block_size, num_blocks * block_size,
            num_blocks * block_size * bytes_per_token / 2**20, self.kv_dtype,
        )
        # Everything alive now (the model's modules, the tokenizer's tables, imports)
        # lives as long as the engine: keep it out of the garbage collector's scans,
        # which otherwise walk it on every full collection during the steps (as vLLM's
        # engine core does after start-up).
        gc.collect()
        gc.freeze()

    @torch.inference_mode()
    def _profile_forward(self, attention, num_tokens: int, block_size: int, max_num_seqs: int) -> None:
        """One forward pass over ``num_tokens`` dummy tokens (one sequence: prefill
        attention's peak), with logits for ``max_num_seqs`` rows, into a throwaway cache."""
        spec = self.model.kv_cache_spec
        num_blocks = -(-num_tokens // block_size)
        caches = [
            torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=self.kv_dtype,
                        device=self.backend.device)
            for _ in range(spec.num_layers)
        ]
        device = self.backend.device
        batch = AttentionBatch.from_slices([SequenceSlice(num_tokens, 0, list(range(num_blocks)))], block_size, device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = self.model(ids, torch.arange(num_tokens, device=device), caches, attention.prepare(batch))
        self.model.compute_logits(hidden[-min(max_num_seqs, num_tokens):])
        self.backend.synchronize()

    def _kv_cache_spec_before_loading(self, attention, architectures) -> KVCacheSpec:
        """The model's KV shape from its config alone: the model built on the meta device."""
        cls = get_model_class(self.hf_config, architectures)
        model = cls(
            self.hf_config, attention, self.backend.compute_dtype(self.dtype),
            dtype=self.backend.weight_dtype(self.dtype), device="meta",
        )
        return model.kv_cache_spec

    # -- facts ------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        kv, scheduler_config = self.kv_manager, self.scheduler.config
        return ModelInfo(
            model=self.config.model,
            model_dir=str(self.model_dir),
            vocab_size=self.hf_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.eos_token_ids),
            special_token_ids=frozenset(self.tokenizer.all_special_ids),
            max_chars_per_token=max_chars_per_token(self.tokenizer),
            dtype=str(self.dtype).removeprefix("torch."),
            backend_name=self.backend.name,
            backend_description=self.backend.describe(),
            num_threads=self.num_threads,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            is_chunked_prefill=scheduler_config.enable_chunked_prefill,
            is_prefix_caching=kv.enable_prefix_caching,
            block_size=kv.block_size,
            num_kv_blocks=kv.num_blocks,
        )

    def stats(self) -> EngineStats:
        counts = self.scheduler.stats()
        return EngineStats(
            num_running=counts.num_running,
            num_waiting=counts.num_waiting,
            num_free_blocks=counts.num_free_blocks,
            num_total_blocks=counts.num_total_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_queries=self.kv_manager.num_prefix_queries,
            num_prefix_hits=self.kv_manager.num_prefix_hits,
        )

    # -- requests -------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request (ValueError for an id in use or one that does not fit)."""
        if request.request_id in self.scheduler.requests or request.request_id in self._pending_groups:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.params.num_samples == 1:
            self._add(request.request_id, request.prompt_token_ids, request.params, request.priority)
            return
        self._add(child_id(request.request_id, 0), request.prompt_token_ids, child_params(request.params, 0),
                  request.priority)
        group = _PendingGroup(request, len(request.prompt_token_ids))
        if self.kv_manager.enable_prefix_caching:
            self._pending_groups[request.request_id] = group
        else:
            self._admit_siblings(group)  # nothing to share: no reason to wait

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int) -> None:
        self.scheduler.add_request(Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
        ))

    def _admit_siblings(self, group: _PendingGroup) -> None:
        r = group.request
        for index in range(1, r.params.num_samples):
            self._add(child_id(r.request_id, index), r.prompt_token_ids, child_params(r.params, index), r.priority)

    def _admit_ready_siblings(self) -> None:
        for parent_id, group in list(self._pending_groups.items()):
            first = self.scheduler.requests.get(child_id(parent_id, 0))
            # (a first child that already finished computed the prompt too; an aborted
            # group left _pending_groups with it)
            if first is None or first.num_computed_tokens >= group.num_prompt_tokens:
                del self._pending_groups[parent_id]
                self._admit_siblings(group)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> int:
        """Finish these requests now (aborted, or ``FINISHED_STOPPED`` for a stop string
        found outside the core); a parallel-sampling parent id covers its children.
        Unknown ids are skipped. Returns how many requests ended."""
        ended = 0
        for request_id in request_ids:
            group = self._pending_groups.pop(request_id, None)
            if group is None:
                ids = [request_id]
            else:  # a parent whose siblings were not admitted yet
                ids = [child_id(request_id, i) for i in range(group.request.params.num_samples)]
            for rid in ids:
                request = self.scheduler.requests.get(rid)
                if request is not None and self.scheduler.finish_request(rid, status):
                    self._notify_finished(request)
                    ended += 1
        return ended

    def abort_all(self) -> int:
        ids = list(self._pending_groups) + list(self.scheduler.requests)
        return self.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_groups)

    # -- the step ---------------------------------------------------------------
    def step(self, with_stats: bool = True) -> EngineCoreOutputs:
        """Schedule, run the model once, and report what is new for each request
        that changed (and, ``with_stats``, the counts after the step)."""
        started_at = time.perf_counter()
        if self.speculator is not None:
            self._propose_drafts()
        scheduler_output = self.scheduler.schedule()
        if self.token_masker is not None:
            scheduler_output = self._add_masks(scheduler_output)
        runner_output = self.runner.execute(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_step_stats = record_step(self.scheduler.last_scheduled, updates, started_at)
        outputs: list[EngineCoreOutput] = []
        prompt_lps_of = dict(zip(runner_output.request_ids, runner_output.prompt_logprobs or []))
        for update in updates:
            request = update.request
            new_ids = update.new_token_ids
            n = len(new_ids)
            asks_top = n and request.sampling_params.logprobs is not None
            outputs.append(EngineCoreOutput(
                request.request_id, new_ids, request.output_logprobs[len(request.output_logprobs) - n :] if n else [],
                request.output_top_logprobs[len(request.output_top_logprobs) - n :] if asks_top else [],
                self._new_prompt_logprobs(request, prompt_lps_of.get(request.request_id)),
                request.finish_reason, request.stop_token_id, request.metrics.copy(),
            ))
            if request.is_finished:
                self._notify_finished(request)
        if self._pending_groups:
            self._admit_ready_siblings()
        return EngineCoreOutputs(outputs, self.last_step_stats, self.stats() if with_stats else None)

    @staticmethod
    def _new_prompt_logprobs(request: Request, step_entries) -> list:
        if not step_entries or request.sampling_params.prompt_logprobs is None:
            return []
        sent = request.num_prompt_logprobs_sent
        request.num_prompt_logprobs_sent = len(request.prompt_logprobs)
        return request.prompt_logprobs[sent:]

    def _propose_drafts(self) -> None:
        for request in self.scheduler.running:
            if request.num_computed_tokens == request.num_tokens - 1:  # decoding
                request.draft_token_ids = list(
                    self.speculator.propose(request.request_id, request.prompt_token_ids, request.output_token_ids)
                )

    def _add_masks(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        masks: dict[str, torch.Tensor] = {}
        for request_id in scheduler_output.sampling_request_ids:
            request = self.scheduler.requests[request_id]
            num_positions = 1 + len(scheduler_output.draft_token_ids.get(request_id, ()))
            mask = self.token_masker.allowed_tokens(
                request_id, request.prompt_token_ids, request.output_token_ids, num_positions
            )
            if mask is not None:
                masks[request_id] = mask
        return replace(scheduler_output, allowed_token_masks=masks)

    def _notify_finished(self, request: Request) -> None:
        self.plugin_manager.hook.ember_request_finished(
            request_id=request.request_id,
            finish_reason=request.finish_reason,
            num_output_tokens=request.num_output_tokens,
        )
