"""The engine: resolves plugins, loads the model, and runs scheduler steps."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from ember.backend import BaseBackend
from ember.config import EngineConfig, SchedulerConfig
from ember.kv_cache_manager import KVCacheManager
from ember.kv_sizing import check_kv_cache, resolve_max_model_len
from ember.logits_pipeline import LogitsPipeline
from ember.logits_processor import LogitsProcessorContext
from ember.logprobs import Logprob, to_logprob_dict
from ember.model_loader import get_model_class, load_hf_config, load_model, model_dtype
from ember.model_runner import ModelRunner
from ember.models.base import KVCacheSpec
from ember.outputs import CompletionOutput, RequestOutput
from ember.parallel_sampling import SampleGroup, child_id, child_params
from ember.plugin import create_plugin_manager
from ember.plugin.manager import EmberPluginManager
from ember.request import Request, RequestStatus, check_priority
from ember.sampling_params import SamplingParams
from ember.scheduler import Scheduler
from ember.stats import StepStats, record_step
from ember.tokenizer import IncrementalDetokenizer, eos_token_ids, load_tokenizer
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


@dataclass
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""  # the output text so far, cut at a stop string
    num_emitted_chars: int = 0  # how much of `text` was streamed already
    # request.output_top_logprobs / prompt_logprobs in the callers' shape, converted
    # once per position (not once per step)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])


def find_stop_string(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """Earliest occurrence at or after ``start`` of any of ``stops`` in ``text``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


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

        bytes_per_token = self.model.kv_cache_spec.bytes_per_token(self.kv_dtype)
        if num_blocks is None:  # the backend's share of memory, which depends on the weights' size
            model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            budget = self.backend.kv_cache_memory_bytes(model_bytes)
            num_blocks = budget // (bytes_per_token * block_size)
            check_kv_cache(num_blocks, config, self.max_model_len, bytes_per_token, budget)
        max_model_len = self.max_model_len
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
        if config.max_num_batched_tokens is not None:
            max_batched = config.max_num_batched_tokens
        elif config.enable_chunked_prefill:
            # at least one decode token for every running request fits a step
            max_batched = max(self.backend.default_step_tokens, config.max_num_seqs)
        else:
            max_batched = max(8192, max_model_len)
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
            self.logits_pipeline,
        )
        self._states: dict[str, _RequestState] = {}
        self._groups: dict[str, SampleGroup] = {}  # parallel sampling, by parent id
        self._child_to_group: dict[str, tuple[str, int]] = {}
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
        self.logits_pipeline.validate(params)
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
    ) -> str:
        """Queue a request; it joins the running batch at the next step.

        ``priority``: lower is scheduled first and preempted last; equal priorities
        are first come, first served. Raises ValueError as :meth:`validate_request`
        does, and for a priority that is not an integer.
        """
        check_priority(priority)  # before any state: a group would be half-registered
        prompt_token_ids = self.validate_request(prompt, params, prompt_token_ids)
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self._groups or request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.num_samples > 1:
            return self._add_group(request_id, prompt, prompt_token_ids, params, priority)
        return self._add_single(request_id, prompt, prompt_token_ids, params, priority)

    def _add_single(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> str:
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            prompt=prompt,
            priority=priority,
        )
        self.scheduler.add_request(request)
        self._states[request_id] = _RequestState(
            request, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        )
        return request_id

    def _add_group(
        self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> str:
        group = SampleGroup(parent_id, prompt, prompt_token_ids, params, priority)
        self._groups[parent_id] = group
        for index, cid in enumerate(group.child_ids()):
            self._child_to_group[cid] = (parent_id, index)
        self._add_single(group.child_ids()[0], prompt, prompt_token_ids, child_params(params, 0), priority)
        group.pending = list(range(1, group.num_samples))
        if not self.kv_manager.enable_prefix_caching:
            self._admit_siblings(group)  # nothing to share: no reason to wait
        return parent_id

    def _admit_siblings(self, group: SampleGroup) -> None:
        for index in group.pending:
            self._add_single(
                child_id(group.parent_id, index), group.prompt, group.prompt_token_ids,
                child_params(group.params, index), group.priority,
            )
        group.pending = []

    def _admit_ready_siblings(self) -> None:
        """Siblings join once the first child computed the prompt (its full blocks are cached)."""
        for group in self._groups.values():
            if not group.pending:
                continue
            first = self.scheduler.requests.get(child_id(group.parent_id, 0))
            if first is None or first.num_computed_tokens >= len(group.prompt_token_ids):
                self._admit_siblings(group)

    def abort_request(self, request_id: str) -> bool:
        group = self._groups.pop(request_id, None)
        if group is not None:
            group.pending = []
            aborted = False
            for cid in group.child_ids():
                self._child_to_group.pop(cid, None)
                aborted = self._abort_single(cid) or aborted
            return aborted
        return self._abort_single(request_id)

    def abort_all(self) -> None:
        """Abort every request, parallel-sampling groups (and their pending siblings) included."""
        for parent_id in list(self._groups):
            self.abort_request(parent_id)
        for request_id in list(self.scheduler.requests):
            self.abort_request(request_id)

    def _abort_single(self, request_id: str) -> bool:
        aborted = self.scheduler.abort_request(request_id)
        state = self._states.pop(request_id, None)
        if state is not None:
            self._notify_finished(state.request)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or any(g.pending for g in self._groups.values())

    # -- the loop -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the requests that changed.

        `last_step_stats` describes the step afterwards (duration, prefill/decode tokens)."""
        started_at = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_step_stats = record_step(scheduler_output, updates, started_at)
        outputs: list[RequestOutput] = []
        for update in updates:
            request = update.request
            state = self._states.get(request.request_id)
            if state is None:
                continue
            if not update.new_token_ids and not request.is_finished:
                continue
            detokenize_started = time.perf_counter()
            new_text = self._update_text(state, update.new_token_ids)
            request.metrics.detokenize_time += time.perf_counter() - detokenize_started
            if request.is_finished:
                del self._states[request.request_id]
                self._notify_finished(request)
            outputs.append(self._make_output(request, state, update.new_token_ids, new_text))
        if self._groups:
            outputs = [self._to_parent(out) for out in outputs]
            self._admit_ready_siblings()
        return outputs

    def _to_parent(self, out: RequestOutput) -> RequestOutput:
        """A child's output, as an output of its group (parallel sampling)."""
        link = self._child_to_group.get(out.request_id)
        if link is None:
            return out
        parent_id, index = link
        group = self._groups[parent_id]
        merged = group.merge(index, out)
        if group.is_finished:
            del self._groups[parent_id]
            for cid in group.child_ids():
                self._child_to_group.pop(cid, None)
        return merged

    def _update_text(self, state: _RequestState, new_token_ids: list[int]) -> str:
        """Detokenize, apply stop strings, and return the text that is safe to stream.

        While a request runs, the last ``len(longest stop) - 1`` characters are held
        back (they may begin a stop string), so streamed pieces always concatenate to
        the final text.
        """
        request = state.request
        params = request.sampling_params
        detok = state.detokenizer
        checked = len(state.text)
        if new_token_ids:
            detok.add_tokens(new_token_ids)
        if request.is_finished:
            detok.flush()
        state.text = detok.text if request.stop_string is None else state.text
        if params.stop and request.stop_string is None:
            longest = max(len(s) for s in params.stop)
            hit = find_stop_string(state.text, params.stop, max(0, checked - longest + 1))
            if hit is not None:
                index, stop = hit
                state.text = state.text[: index + len(stop) if params.include_stop_str_in_output else index]
                request.stop_string = stop
                if not request.is_finished:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        safe = len(state.text)
        if params.stop and not request.is_finished:
            safe = max(state.num_emitted_chars, safe - (max(len(s) for s in params.stop) - 1))
        piece = state.text[state.num_emitted_chars : safe]
        state.num_emitted_chars = safe
        return piece

    def _make_output(self, request: Request, state: _RequestState, new_ids: list[int], new_text: str) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_string if request.stop_string is not None else request.stop_token_id,
            token_logprobs=list(request.output_logprobs),
            logprobs=self._logprobs(state) if request.sampling_params.logprobs is not None else None,
        )
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            for entry in request.prompt_logprobs[len(state.prompt_logprobs) - 1 :]:
                state.prompt_logprobs.append(to_logprob_dict(entry, self._decode_token))
            prompt_logprobs = list(state.prompt_logprobs)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            new_token_ids=list(new_ids),
            new_text=new_text,
            prompt_logprobs=prompt_logprobs,
            metrics=request.metrics.copy(),
        )

    def _logprobs(self, state: _RequestState) -> list[dict[int, Logprob]]:
        for entry in state.request.output_top_logprobs[len(state.logprobs) :]:
            state.logprobs.append(to_logprob_dict(entry, self._decode_token))
        return list(state.logprobs)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _notify_finished(self, request: Request) -> None:
        self.plugin_manager.hook.ember_request_finished(
            request_id=request.request_id,
            finish_reason=request.finish_reason,
            num_output_tokens=request.num_output_tokens,
        )
