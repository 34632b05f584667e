"""The engine core: the model, the KV cache, the scheduler and the runner behind one
step. Everything that crosses its boundary is a plain value — `EngineCoreRequest` in,
`EngineCoreOutputs` out — so the core runs in the caller's thread (`LLMEngine`), in
a thread beside an event loop or in a process of its own
(`ember.engine.core_process.EngineCoreProcess`). Tokenizing, validation and
detokenization happen outside it, once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, replace

import torch

from ember.config import EngineConfig, SchedulerConfig
from ember.engine.adapters import AdapterEntry, AdapterRegistry, create_adapters
from ember.engine.client import EngineStats, ModelInfo
from ember.engine.grammar_guard import GuardSettings
from ember.engine.grammar_manager import GrammarManager
from ember.engine.output_processor import EngineCoreOutput, EngineCoreOutputs
from ember.engine.parallel_sampling import child_id, child_params
from ember.engine.speculative import SpeculativeDecoder, create_speculator
from ember.models.base import uniform_sliding_window
from ember.models.loader import load_hf_config, load_model, model_dtype, prefill_context_scale
from ember.models.pooling_config import resolve_pooling_defaults
from ember.models.tokenizer import eos_token_ids, load_tokenizer, max_chars_per_token
from ember.outputs import RequestMetrics
from ember.parallel import ParallelExecutor, start_parallel
from ember.plugin import create_plugin_manager
from ember.plugin.adapter import AdapterError, AdapterWeights
from ember.plugin.backend import select_backend
from ember.plugin.grammar import BaseCompiledGrammar, GrammarContext
from ember.plugin.logits_processor import LogitsProcessorContext
from ember.plugin.manager import EmberPluginManager
from ember.plugin.quantizer import select_quantizer
from ember.plugin.speculator import SpeculatorContext
from ember.sampling_params import SamplingParams
from ember.sched.encoder_cache import encoder_cache_for
from ember.sched.kv_cache_manager import KVCacheManager
from ember.sched.request import Request, RequestStatus
from ember.sched.scheduler import Scheduler, record_step
from ember.sched.step import SchedulerOutput, StepStats
from ember.weights import resolve_model
from ember.worker.adapter_slots import AdapterSlots
from ember.worker.graphs import capture_decode_graphs
from ember.worker.kv_sizing import (
    check_kv_cache,
    explicit_num_blocks,
    kv_cache_spec_from_config,
    profile_kv_budget,
    resolve_block_size,
    resolve_max_model_len,
    step_token_budgets,
)
from ember.worker.logits_pipeline import LogitsPipeline
from ember.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A validated request (its prompt already token ids). ``params.num_samples > 1``
    makes the core run that many children, ``child_id(request_id, i)``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    adapter: str | None = None  # the adapter (LoRA) it runs under, by name; None: the base model
    adapter_id: int = 0  # set by the core from ``adapter`` (ember.engine.adapters)
    mm_items: tuple = ()  # its images, processed (ember.multimodal.inputs.MultiModalItem), prompt expanded


@dataclass
class _PendingGroup:
    """Parallel sampling: siblings wait until the first child computed the prompt, so
    that with prefix caching they take its full blocks instead of computing them."""

    request: EngineCoreRequest
    num_prompt_tokens: int
    grammar: BaseCompiledGrammar | None = None  # the siblings' compiled constraint


class EngineCore:
    """Not thread-safe: one thread calls add/abort/step."""

    def __init__(self, config: EngineConfig, plugin_manager: EmberPluginManager | None = None) -> None:
        self.config = config
        self.plugin_manager = plugin_manager or create_plugin_manager(
            disabled=config.disabled_plugins, required=config.required_plugins
        )
        self.plugin_manager.hook.ember_configure(config=config)
        self.backend = select_backend(self.plugin_manager.registries.backends, config.backend,
                                      dict(config.backend_options))
        self.num_threads = self.backend.configure_threads(config.num_threads)

        # tensor/pipeline parallelism shards float weights only: a GGUF file (the default
        # model included) loads as its float32 conversion there
        sharded = config.tensor_parallel_size * config.pipeline_parallel_size > 1
        self.model_dir = resolve_model(config.model, config.revision, gguf_native=False if sharded else None)
        self.hf_config = load_hf_config(self.model_dir)
        self.dtype = self.backend.resolve_dtype(config.dtype, model_dtype(self.hf_config))
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)

        self.max_model_len = resolve_max_model_len(self.hf_config, config.max_model_len)
        self.pooling = resolve_pooling_defaults(self.model_dir, self.hf_config, config)

        attention = self.backend.create_attention()
        architectures = self.plugin_manager.registries.model_architectures
        # refused (an unknown name, a format nothing reads) before any weight is read
        quantizer = select_quantizer(self.plugin_manager.registries.quantizers,
                                     getattr(self.hf_config, "quantization_config", None), config.quantize)
        self.kv_dtype = self.backend.kv_cache_dtype(self.dtype, config.kv_cache_dtype, quantizer is not None)
        block_size = resolve_block_size(config.block_size, attention)
        # An explicit budget sizes the pool before the weights are read, so that one
        # too small is refused in seconds, not after loading.
        num_blocks = explicit_num_blocks(config, block_size, self.max_model_len, lambda: kv_cache_spec_from_config(
            self.hf_config, self.backend, self.dtype, attention, architectures).bytes_per_token(self.kv_dtype))
        # Tensor/pipeline parallelism (ember.parallel): this process is rank 0, the driver
        self.parallel: ParallelExecutor | None = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.parallel = start_parallel(config, self.model_dir, self.hf_config, self.backend, self.plugin_manager,
                                           self.num_threads)
            self.num_threads = self.parallel.num_threads
            self.model = self.parallel.load_model()
        else:
            self.model = load_model(self.model_dir, self.hf_config, self.backend, attention, self.dtype, architectures,
                                    quantizer, config.dequantize, config.model_impl)
        # LoRA adapters (docs/lora.md): slots in the model's linears before the KV cache is
        # sized (they take memory), the registry of adapters by name; (None, None) when off
        self.adapters, adapter_model = create_adapters(config, self.model, self.backend,
                                                       self.plugin_manager.registries.adapter_kinds)

        max_model_len = self.max_model_len
        max_batched, prefill_batched = step_token_budgets(config, self.backend, self.hf_config, self.dtype, max_model_len)

        bytes_per_token = self.model.kv_cache_spec.bytes_per_token(self.kv_dtype)
        if num_blocks is None and self.parallel is not None:  # each rank profiles its shard; the smallest pool wins
            num_blocks, budget = self.parallel.agree_num_blocks(
                min(max(max_batched, prefill_batched or 0), max_model_len), block_size, config.max_num_seqs,
            )
            check_kv_cache(num_blocks, block_size, config, self.max_model_len, bytes_per_token, budget)
        if num_blocks is None:
            # The backend's share of the memory left after the weights and the peak of
            # a profiling forward pass at the largest step (vLLM's approach).
            budget = profile_kv_budget(
                self.model, self.backend, attention, self.kv_dtype,
                min(max(max_batched, prefill_batched or 0), max_model_len), block_size,
                config.max_num_seqs,
            )
            num_blocks = budget // (bytes_per_token * block_size)
            check_kv_cache(num_blocks, block_size, config, self.max_model_len, bytes_per_token, budget)
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching,
                                         sliding_window=uniform_sliding_window(self.hf_config))
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, max_batched, max_model_len, config.enable_chunked_prefill,
                prefill_context_scale(self.hf_config), prefill_batched,
                config.max_loras if config.lora_enabled else None,
            ),
            self.kv_manager, encoder_cache_for(self.model, config.encoder_cache_size, max_batched),
        )
        # Processors are resolved once, here; per step the runner calls them directly.
        self.logits_pipeline = LogitsPipeline.from_registry(
            self.plugin_manager.registries.logits_processors,
            LogitsProcessorContext(self.hf_config.vocab_size, self.eos_token_ids, self.tokenizer),
            config.processor_options,
        )
        if self.parallel is not None:  # the driver's runner sends each step to the workers first
            self.runner = self.parallel.create_runner(num_blocks, block_size, config.seed, self.logits_pipeline,
                                                      config.max_num_seqs, max_model_len)
        else:
            self.runner = ModelRunner(
                self.model, self.backend, attention, num_blocks, block_size, self.kv_dtype, config.seed,
                self.logits_pipeline, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                vocab_size=self.hf_config.vocab_size,
            )
        if adapter_model is not None:
            self.runner.adapter_slots = AdapterSlots(adapter_model, self.adapters.weights, self.backend.device)
        self.graph_capture_seconds = (None if self.parallel is not None  # the seconds, None without graphs
                                      else capture_decode_graphs(self.runner, self.backend, attention, config))
        # The step's slots for the plugin kinds built on it (ember.sched.step): the speculative
        # decoder (config.speculative_config, ember.plugin.speculator) proposes draft tokens per
        # decoding request; a token masker gives allowed-token masks (tests set fakes). Grammar
        # backends fill the mask slot through the grammar manager (constrained requests only).
        self.speculator: SpeculativeDecoder | None = None
        if config.speculative_config is not None:
            self.speculator = create_speculator(
                self.plugin_manager.registries.speculators, config.speculative_config,
                SpeculatorContext(
                    config.speculative_config, self.hf_config.vocab_size, tuple(self.eos_token_ids), self.model_dir,
                    self.hf_config, self.dtype, self.backend, self.model, architectures, self.tokenizer,
                ),
            )
            self.runner.collect_hidden = self.speculator.uses_hidden_states
            self.runner.collect_all_hidden = self.speculator.uses_all_hidden_states
        self.token_masker = None
        self.grammar = GrammarManager(
            self.plugin_manager.registries.grammar_backends,
            GrammarContext(self.tokenizer, self.hf_config.vocab_size, tuple(self.eos_token_ids)),
            config.grammar_backend, config.grammar_compile_timeout_s,
            GuardSettings(config.grammar_budget, config.grammar_repetition_limit),
            config.grammar_compile_workers, config.grammar_compile_memory_mb, config.grammar_compile_priority,
        )
        self._pending_groups: dict[str, _PendingGroup] = {}
        self.last_step_stats: StepStats | None = None
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)", num_blocks, block_size,
                    num_blocks * block_size, num_blocks * block_size * bytes_per_token / 2**20, self.kv_dtype)
        # Everything alive now (the model's modules, the tokenizer's tables, imports) lives as long as
        # the engine: keep it out of the garbage collector's scans, which otherwise walk it on every
        # full collection during the steps (as vLLM's engine core does after start-up).
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        """Stop the parallel workers and the grammar compile workers, if any (idempotent)."""
        self.grammar.close()
        if self.parallel is not None:
            self.parallel.close()

    @property
    def fatal_error(self) -> str | None:
        """Why the engine cannot go on (a parallel worker died), or None."""
        return self.parallel.failure if self.parallel is not None else None

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
            lora=None if self.adapters is None else self.adapters.info(self.config.max_loras),
            pooling=self.pooling, grammar_limits=self.config.grammar_limits,
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
            grammar_compile_time_s=self.grammar.compile_time_s,
            num_grammar_compiles=self.grammar.num_compiles,
            num_grammar_cache_hits=self.grammar.num_cache_hits,
            num_grammar_compile_errors=self.grammar.num_compile_errors,
            num_grammar_compile_timeouts=self.grammar.num_compile_timeouts,
            speculation=self.speculator.stats.to_dict() if self.speculator is not None else None,
            running_adapters=self.adapters.names_of(r.adapter_id for r in self.scheduler.running) if self.adapters else (),
            waiting_adapters=self.adapters.names_of(r.adapter_id for r in self.scheduler.waiting) if self.adapters else (),
        )

    # -- requests -------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request (ValueError for an id in use, one that does not fit,
        or a constraint its grammar backend refuses). A constrained request waits in the
        grammar manager until its grammar is compiled."""
        rid = request.request_id
        if rid in self.scheduler.requests or rid in self._pending_groups or rid in self.grammar.waiting:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.adapter is not None:
            request = replace(request, adapter_id=self._adapters_on(request.adapter).resolve(request.adapter))
        if request.params.pooling is not None:  # the model's pooling where the request left it open
            request = replace(request, params=replace(request.params, pooling=self.pooling.apply(request.params.pooling)))
        if request.params.constraint is not None:
            self.scheduler.check_request_fits(Request(rid, request.prompt_token_ids, request.params, mm_items=request.mm_items))
            self.grammar.submit(rid, request.params, request)
            return
        self._admit(request)

    def _admit(self, request: EngineCoreRequest, grammar: BaseCompiledGrammar | None = None) -> None:
        if request.params.num_samples == 1:
            self._add(request.request_id, request.prompt_token_ids, request.params, request.priority, grammar,
                      request.adapter_id, request.mm_items)
            return
        self._add(child_id(request.request_id, 0), request.prompt_token_ids, child_params(request.params, 0),
                  request.priority, grammar, request.adapter_id, request.mm_items)
        group = _PendingGroup(request, len(request.prompt_token_ids), grammar)
        if self.kv_manager.enable_prefix_caching:
            self._pending_groups[request.request_id] = group
        else:
            self._admit_siblings(group)  # nothing to share: no reason to wait

    def _add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
        grammar: BaseCompiledGrammar | None = None, adapter_id: int = 0, mm_items: tuple = (),
    ) -> None:
        self.scheduler.add_request(Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids, priority=priority, adapter_id=adapter_id, mm_items=mm_items,
        ))
        if grammar is not None:
            self.grammar.add_matcher(request_id, grammar, params, self.max_model_len - len(prompt_token_ids))

    def _admit_siblings(self, group: _PendingGroup) -> None:
        r = group.request
        for index in range(1, r.params.num_samples):
            self._add(
                child_id(r.request_id, index), r.prompt_token_ids, child_params(r.params, index), r.priority,
                group.grammar, r.adapter_id, r.mm_items,
            )

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
            held = self.grammar.discard(request_id) if self.grammar.waiting else None
            if held is not None:  # still waiting for its grammar
                self._notify_unscheduled(held, "abort")
                ended += 1
                continue
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
        ids = list(self._pending_groups) + list(self.scheduler.requests) + self.grammar.waiting_ids()
        return self.abort_requests(ids)

    # -- adapters ---------------------------------------------------------------
    def add_adapter(self, name: str, path: str, weights: AdapterWeights | None = None) -> AdapterEntry:
        """Serve adapter ``name`` from now on (read from ``path`` unless ``weights`` were read
        and checked by the caller); `AdapterError` if it cannot be, or adapters are off."""
        return self._adapters_on(name).add(name, path, weights)

    def remove_adapter(self, name: str) -> None:
        """Refuse new requests of ``name`` at once; it is dropped (its slot freed) once the
        requests using it have finished. `UnknownAdapterError` if it is not loaded."""
        self._adapters_on(name).unload(name)
        self._drop_unloaded_adapters()

    def _adapters_on(self, name: str) -> AdapterRegistry:
        if self.adapters is None:
            raise AdapterError(f"adapter {name!r}: LoRA adapters are off (start with --enable-lora or --lora-modules)")
        return self.adapters

    def _drop_unloaded_adapters(self) -> None:
        in_use = {r.adapter_id for r in self.scheduler.requests.values()}
        in_use.update(g.request.adapter_id for g in self._pending_groups.values())
        in_use.update(getattr(w.item, "adapter_id", 0) for w in self.grammar.waiting.values())
        for adapter_id in self.adapters.drop_unused(in_use):
            self.runner.adapter_slots.forget(adapter_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_groups) or bool(self.grammar.waiting)

    # -- the step ---------------------------------------------------------------
    def step(self, with_stats: bool = True) -> EngineCoreOutputs:
        """Schedule, run the model once, and report what is new for each request
        that changed (and, ``with_stats``, the counts after the step)."""
        started_at = time.perf_counter()
        outputs: list[EngineCoreOutput] = self._admit_compiled() if self.grammar.waiting else []
        if self.speculator is not None:
            self.speculator.propose_for(self.scheduler.running, self.max_model_len, self.runner.last_hidden)
        scheduler_output = self.scheduler.schedule()
        if self.token_masker is not None or self.grammar.matchers:
            scheduler_output = self._add_masks(scheduler_output)
        if self.speculator is not None and scheduler_output.draft_token_ids:
            scheduler_output = self.speculator.with_draft_probs(scheduler_output)
        runner_output = self.runner.execute(scheduler_output)
        if self.speculator is not None:
            self.speculator.observe_step(scheduler_output, runner_output,
                                         self.runner.step_hidden if self.runner.collect_all_hidden else ())
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        grammar_errors = self._advance_grammars(updates) if self.grammar.matchers else None
        self.last_step_stats = record_step(self.scheduler.last_scheduled, updates, started_at)
        prompt_lps_of = (
            dict(zip(runner_output.request_ids, runner_output.prompt_logprobs))
            if runner_output.prompt_logprobs else None
        )
        for update in updates:
            request = update.request
            new_ids = update.new_token_ids
            n = len(new_ids)
            asks_top = n and request.sampling_params.logprobs is not None
            outputs.append(EngineCoreOutput(
                request.request_id, new_ids, request.output_logprobs[len(request.output_logprobs) - n :] if n else [],
                request.output_top_logprobs[len(request.output_top_logprobs) - n :] if asks_top else [],
                self._new_prompt_logprobs(request, prompt_lps_of.get(request.request_id)) if prompt_lps_of else [],
                request.finish_reason, request.stop_token_id, dataclasses.replace(request.metrics),
                grammar_errors.get(request.request_id) if grammar_errors else None, request.pooled,
            ))
            if request.is_finished:
                self._notify_finished(request)
        if self._pending_groups:
            self._admit_ready_siblings()
        if self.adapters is not None and len(self.adapters.entries) > len(self.adapters.names()):
            self._drop_unloaded_adapters()  # an unloading adapter whose last request just ended
        return EngineCoreOutputs(outputs, self.last_step_stats, self.stats() if with_stats else None)

    @staticmethod
    def _new_prompt_logprobs(request: Request, step_entries) -> list:
        if not step_entries or request.sampling_params.prompt_logprobs is None:
            return []
        sent = request.num_prompt_logprobs_sent
        request.num_prompt_logprobs_sent = len(request.prompt_logprobs)
        return request.prompt_logprobs[sent:]

    def _add_masks(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        masks: dict[str, torch.Tensor] = self.grammar.masks(scheduler_output) if self.grammar.matchers else {}
        if self.token_masker is not None:
            for request_id in scheduler_output.sampling_request_ids:
                request = self.scheduler.requests[request_id]
                num_positions = 1 + len(scheduler_output.draft_token_ids.get(request_id, ()))
                mask = self.token_masker.allowed_tokens(
                    request_id, request.prompt_token_ids, request.output_token_ids, num_positions
                )
                if mask is not None:
                    masks[request_id] = mask
        return replace(scheduler_output, allowed_token_masks=masks)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is ready; end those whose grammar failed
        (their outputs, finish reason "error"). With nothing else to run, wait a little
        for a compile rather than spin."""
        idle = not self.scheduler.has_unfinished_requests()
        ready, failed = self.grammar.collect(wait_s=0.05 if idle else 0.0)
        for request, grammar in ready:
            self._admit(request, grammar)
        outputs = []
        for request, message in failed:
            for rid in self._notify_unscheduled(request, "error"):
                metrics = RequestMetrics(finished_time=time.time())
                outputs.append(EngineCoreOutput(rid, [], [], finish_reason="error", metrics=metrics, error=message))
        return outputs

    def _advance_grammars(self, updates) -> dict[str, str]:
        """Advance the matchers by the step's tokens; a request whose grammar is complete
        stops there (no EOS needed), one that broke its grammar ends with an error."""
        finished, errors = self.grammar.advance(updates)
        for request_id in finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        for request_id in errors:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        return errors

    def _notify_unscheduled(self, request: EngineCoreRequest, finish_reason: str) -> list[str]:
        """A request that ended before the scheduler saw it: the hook, per core request id."""
        n = request.params.num_samples
        ids = [request.request_id] if n == 1 else [child_id(request.request_id, i) for i in range(n)]
        for rid in ids:
            self.plugin_manager.hook.ember_request_finished(request_id=rid, finish_reason=finish_reason,
                                                            num_output_tokens=0)
        return ids

    def _notify_finished(self, request: Request) -> None:
        if self.grammar.matchers:
            self.grammar.release(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        self.plugin_manager.hook.ember_request_finished(
            request_id=request.request_id,
            finish_reason=request.finish_reason,
            num_output_tokens=request.num_output_tokens,
        )
