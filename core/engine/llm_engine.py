"""The synchronous engine: validation, the engine core and the output processor in the
caller's thread.

``LLMEngine`` is what the offline `LLM` and the tests drive: `add_request` validates
once (`ember.engine.input_processor`), the core runs a step (`ember.engine.core`), and the
output processor turns the step's values into `RequestOutput`s
(`ember.engine.output_processor`). The server runs the same three pieces with the core in
a thread or a process of its own (`ember.engine.async_engine`).
"""

from __future__ import annotations

import functools
import itertools

from ember.config import EngineConfig
from ember.engine.core import EngineCore, EngineCoreRequest
from ember.engine.input_processor import InputProcessor
from ember.engine.output_processor import OutputKind, OutputProcessor
from ember.models.vision_language import create_multimodal_processor
from ember.multimodal.limits import MediaLimits, parse_limit_mm_per_prompt
from ember.outputs import RequestOutput
from ember.plugin.manager import EmberPluginManager
from ember.sampling_params import SamplingParams
from ember.sched.request import RequestStatus, check_priority

__all__ = ["LLMEngine"]


class LLMEngine:
    """Single-thread engine. Not thread-safe: one thread calls add/abort/step, except
    :meth:`validate_request`, which is safe from any thread.

    The core's parts (``scheduler``, ``runner``, ``model``, ``kv_manager``, ``backend``,
    ``hf_config``, ``max_model_len``, ...) are reachable as attributes of the engine,
    for tests and benchmarks.
    """

    def __init__(self, config: EngineConfig, plugin_manager: EmberPluginManager | None = None) -> None:
        self.core = EngineCore(config, plugin_manager)
        self.tokenizer = self.core.tokenizer
        self.model_info = self.core.model_info()
        self.input_processor = InputProcessor(self.tokenizer, self.model_info, self.core.runner.sampler.validate)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    def __getattr__(self, name: str):
        # only called for attributes the engine itself lacks: the core's parts
        if name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    @property
    def num_kv_cache_tokens(self) -> int:
        return self.model_info.num_kv_cache_tokens

    # -- requests -------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def validate_request(
        self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> list[int]:
        """Tokenize and check a request without changing any state (safe from any
        thread): see :class:`ember.engine.input_processor.InputProcessor`."""
        return self.input_processor.validate(prompt, params, prompt_token_ids)

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
        adapter: str | None = None,
        mm_items: tuple = (),
    ) -> str:
        """Queue a request; it joins the running batch at the next step.

        ``priority``: lower is scheduled first and preempted last; equal priorities
        are first come, first served. Raises ValueError as :meth:`validate_request`
        does, and for a priority that is not an integer. ``validated``: the caller
        already validated exactly these ids and params, so it is not done twice.
        ``adapter``: the name of a loaded adapter (LoRA) to run under (`add_adapter`).
        ``mm_items``: the prompt's images as `process_images` made them (the ids expanded).
        """
        check_priority(priority)  # before any state: a group would be half-registered
        if not validated:
            prompt_token_ids = self.validate_request(prompt, params, prompt_token_ids)
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.core.add_request(EngineCoreRequest(request_id, prompt_token_ids, params, priority, adapter,
                                                mm_items=tuple(mm_items)))
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, output_kind)
        return request_id

    def process_images(self, prompt_token_ids: list[int] | None, images: list, **text) -> tuple[list[int], tuple]:
        """The prompt's ids with each image placeholder expanded, and the images' items
        (`MultiModalProcessor.process`; ``text=``, ``add_special_tokens=``: expanded in
        the text); ValueError for a model that takes none."""
        processor = self.multimodal_processor
        if processor is None:
            raise ValueError(f"model {self.model_info.model or 'the default model'!r} takes no images "
                             "(it is a text-only model)")
        return processor.process(prompt_token_ids, images, **text)

    @functools.cached_property
    def multimodal_processor(self):
        """The model's media processor, None for a text-only model (built at first use)."""
        core = self.core
        limits = MediaLimits(parse_limit_mm_per_prompt(core.config.limit_mm_per_prompt))
        return create_multimodal_processor(core.model_dir, core.hf_config, core.plugin_manager.registries.model_architectures,
                                           limits, core.config.model_impl, self.tokenizer)

    def abort_request(self, request_id: str) -> bool:
        ids = self.output_processor.abort(request_id)
        return self.core.abort_requests([request_id, *ids]) > 0

    def abort_all(self) -> None:
        """Abort every request, parallel-sampling groups (and their pending siblings) included."""
        self.output_processor.abort_all()
        self.core.abort_all()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -- the loop -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine-core step and turn its outputs into the callers' outputs;
        a stop string found there finishes the request in the core.

        `last_step_stats` describes the step afterwards (duration, prefill/decode tokens)."""
        outputs, stopped = self.output_processor.process(self.core.step(with_stats=False).outputs)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
