"""The engine: resolves plugins, loads the model, and runs scheduler steps."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from ember.backend import AttentionBatch, BaseBackend, SequenceSlice
from ember.config import EngineConfig, SchedulerConfig
from ember.kv_cache_manager import KVCacheManager
from ember.kv_sizing import check_kv_cache, resolve_max_model_len
from ember.logits_pipeline import LogitsPipeline
from ember.logits_processor import LogitsProcessorContext
from ember.model_loader import get_model_class, load_hf_config, load_model, model_dtype
from ember.model_runner import ModelRunner
from ember.models.base import KVCacheSpec
from ember.output_processor import EngineCoreOutput, OutputKind, OutputProcessor
from ember.outputs import RequestOutput
from ember.parallel_sampling import SampleGroup, child_id, child_params
from ember.plugin import create_plugin_manager
from ember.plugin.manager import EmberPluginManager
from ember.request import Request, RequestStatus, check_priority
from ember.sampling_params import SamplingParams
from ember.scheduler import Scheduler
from ember.step import SchedulerOutput
from ember.stats import StepStats, record_step
from ember.tokenizer import eos_token_ids, load_tokenizer
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


class LLMEngine:
    """Single-process engine. Not thread-safe: one thread calls add/abort/step."""

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
        self.output_processor = OutputProcessor(self.tokenizer)
        # parallel sampling: groups whose siblings wait for the first child's prompt
        self._pending_groups: dict[str, SampleGroup] = {}
        self._counter = itertools.count()
        self.last_step_stats: StepStats | None = None
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)",
            num_blocks, block_size, num_blocks * block_size,
            num_blocks * block_size * bytes_per_token / 2**20, self.kv_dtype,
        )

    @property
    def num_kv_cache_tokens(self) -> int:
        return self.kv_manager.num_blocks * self.kv_manager.block_size

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

    # -- requests -------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt)

    def validate_request(
        self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> list[int]:
        """Tokenize and check a request without changing any state (safe from any thread).

        Returns the prompt's token ids. Raises ValueError for an empty prompt, token ids
        outside the vocabulary, a prompt longer than the context, a request larger
        than the whole KV cache, or sampling parameters a logits processor refuses
        (or whose processor is not loaded).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self.runner.sampler.validate(params)
        if prompt_token_ids is None:
            if prompt is None or (isinstance(prompt, str) and not prompt):
                raise ValueError("prompt is empty: give a non-empty prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        probe = Request("<validate>", prompt_token_ids, params)
        self.scheduler.check_request_fits(probe)
        return prompt_token_ids

    def add_request(
        self,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        validated: bool = False,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> str:
        """Queue a request; it joins the running batch at the next step.

        ``priority``: lower is scheduled first and preempted last; equal priorities
        are first come, first served. Raises ValueError as :meth:`validate_request`
        does, and for a priority that is not an integer. ``validated``: the caller
        already ran :meth:`validate_request` on exactly these ids and params (the
        async engine does, in the request's thread), so it is not run twice.
        """
        check_priority(priority)  # before any state: a group would be half-registered
        if not validated:
            prompt_token_ids = self.validate_request(prompt, params, prompt_token_ids)
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self.output_processor or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.num_samples > 1:
            return self._add_group(request_id, prompt, prompt_token_ids, params, priority)
        return self._add_single(request_id, prompt, prompt_token_ids, params, priority, output_kind)

    def _add_single(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> str:
        self._add_core(request_id, prompt, prompt_token_ids, params, priority)
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, kind)
        return request_id

    def _add_core(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> None:
        self.scheduler.add_request(Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            prompt=prompt,
            priority=priority,
        ))

    def _add_group(
        self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> str:
        group = SampleGroup(parent_id, prompt, prompt_token_ids, params, priority)
        self.output_processor.add_group(group, [child_params(params, i) for i in range(group.num_samples)])
        self._add_core(group.child_ids()[0], prompt, prompt_token_ids, child_params(params, 0), priority)
        group.pending = list(range(1, group.num_samples))
        self._pending_groups[parent_id] = group
        if not self.kv_manager.enable_prefix_caching:
            self._admit_siblings(group)  # nothing to share: no reason to wait
        return parent_id

    def _admit_siblings(self, group: SampleGroup) -> None:
        for index in group.pending:
            self._add_core(
                child_id(group.parent_id, index), group.prompt, group.prompt_token_ids,
                child_params(group.params, index), group.priority,
            )
        group.pending = []
        self._pending_groups.pop(group.parent_id, None)

    def _admit_ready_siblings(self) -> None:
        """Siblings join once the first child computed the prompt (its full blocks are cached)."""
        for group in list(self._pending_groups.values()):
            first = self.scheduler.requests.get(child_id(group.parent_id, 0))
            if first is None or first.num_computed_tokens >= len(group.prompt_token_ids):
                self._admit_siblings(group)

    def abort_request(self, request_id: str) -> bool:
        group = self._pending_groups.pop(request_id, None)
        if group is not None:
            group.pending = []
        aborted = False
        for rid in self.output_processor.abort(request_id):
            aborted = self._finish_core(rid, RequestStatus.FINISHED_ABORTED) or aborted
        return aborted

    def abort_all(self) -> None:
        """Abort every request, parallel-sampling groups (and their pending siblings) included."""
        for parent_id in list(self._pending_groups):
            self.abort_request(parent_id)
        for request_id in list(self.scheduler.requests):
            self.abort_request(request_id)
            self._finish_core(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish_core(self, request_id: str, status: RequestStatus) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.scheduler.finish_request(request_id, status):
            return False
        self._notify_finished(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_groups)

    # -- the loop -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine-core step and turn its outputs into the callers' outputs
        (the output processor); a stop string found there finishes the request.

        `last_step_stats` describes the step afterwards (duration, prefill/decode tokens)."""
        outputs, stopped = self.output_processor.process(self.core_step())
        for request_id in stopped:
            self._finish_core(request_id, RequestStatus.FINISHED_STOPPED)
        return outputs

    def core_step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report what is new for each request
        that changed (plain values: see ember.output_processor.EngineCoreOutput)."""
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
        prompt_lps = runner_output.prompt_logprobs or []
        prompt_lps_of = dict(zip(runner_output.request_ids, prompt_lps))
        for update in updates:
            request = update.request
            new_ids = update.new_token_ids
            n = len(new_ids)
            params = request.sampling_params
            outputs.append(EngineCoreOutput(
                request.request_id, new_ids, request.output_logprobs[len(request.output_logprobs) - n :] if n else [],
                request.output_top_logprobs[len(request.output_top_logprobs) - n :] if n and params.logprobs is not None else [],
                self._new_prompt_logprobs(request, prompt_lps_of.get(request.request_id)),
                request.finish_reason, request.stop_token_id, request.metrics.copy(),
            ))
            if request.is_finished:
                self._notify_finished(request)
        if self._pending_groups:
            self._admit_ready_siblings()
        return outputs

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
