"""What a caller outside core (the HTTP API, a plugin's route) may use of an engine.

`EngineClient` is the whole surface: submit and abort requests, the tokenizer's few
operations the API needs, facts about the served model (`ModelInfo`, fixed once the
engine is built) and counters read at a moment (`EngineStats`). Values cross this
boundary, never the engine's live objects (scheduler, KV manager, tokenizer), so the
engine can change its insides without the API noticing. `ember.engine.async_engine.
AsyncLLMEngine` implements it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.errors import EngineDeadError, EngineFatalError, RequestAbortedError  # noqa: F401  (callers import them from here too)
from ember.grammar_limits import GrammarLimits
from ember.outputs import OutputKind, PoolingOutput
from ember.pooling_params import PoolingDefaults, PoolingParams
from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember.outputs import RequestOutput
    from ember.plugin.logits_processor import BaseLogitsProcessor
    from ember.sched.step import StepStats


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter the engine serves (``/v1/models`` lists it with the base model as parent)."""

    name: str
    path: str
    kind: str = "lora"
    rank: int = 0


@dataclass(frozen=True)
class LoRAInfo:
    """The engine's adapter settings (None in `ModelInfo` when adapters are off) and the
    modules an adapter may change (checkpoint name -> (in, out)), so that a front in
    another process reads and checks an adapter before it sends it."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    targets: dict[str, tuple[int, int]]
    adapters: tuple[AdapterInfo, ...] = ()  # those loaded at start (--lora-modules)


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model and the engine built around it; none changes while it runs."""

    model: str | None  # as configured (a hub id or a path), None if not given
    model_dir: str  # where its files were loaded from
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    # the longest text one token can stand for (see `ember.models.tokenizer.max_chars_per_token`), None if unbounded
    max_chars_per_token: int | None
    dtype: str  # "float32", "bfloat16", ... (no "torch." prefix)
    backend_name: str  # "cpu", ...
    backend_description: str  # for the log: device, threads, kernels
    num_threads: int
    max_num_seqs: int
    max_num_batched_tokens: int
    is_chunked_prefill: bool
    is_prefix_caching: bool
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    lora: LoRAInfo | None = None  # adapters (docs/lora.md); None when off
    # what a pooling request's open fields become, Matryoshka support, embedding size (docs/embeddings.md)
    pooling: PoolingDefaults = PoolingDefaults()
    # the size limits a constraint is checked against before it compiles (docs/grammar.md)
    grammar_limits: GrammarLimits = GrammarLimits()

    @property
    def num_kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class EngineStats:
    """The engine's counts at one moment (read between or during steps: each is a plain count)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since start
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    num_prefix_hits: int  # prompt tokens found there, since start
    # grammar-guided decoding (ember.engine.grammar_manager), since start
    grammar_compile_time_s: float = 0.0
    num_grammar_compiles: int = 0
    num_grammar_cache_hits: int = 0
    num_grammar_compile_errors: int = 0
    num_grammar_compile_timeouts: int = 0
    # speculative decoding (ember.engine.speculative.SpeculationStats.to_dict()), None when off
    speculation: dict | None = None
    # adapters with requests running / waiting now, by name (vLLM's lora_requests_info)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0


class EngineClient(ABC):
    """An engine as its callers see it. Every method may be called from the event
    loop's thread; the tokenizer methods may also be called from other threads (the
    API tokenizes big prompts off the event loop)."""

    # -- lifecycle -------------------------------------------------------------------
    @abstractmethod
    def start(self) -> None:
        """Start serving (idempotent)."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving; wait up to ``timeout`` seconds for the engine to stop."""

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """Started, not shut down, and not dead."""

    @property
    @abstractmethod
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped on its own, or None."""

    @property
    def restart_cause(self) -> BaseException | None:
        """Why the engine core is being restarted now (``--restart-engine-on-failure``), or
        None; `is_running` is False meanwhile."""
        return None

    @property
    def num_restarts(self) -> int:
        """Engine-core restarts since start."""
        return 0

    # -- requests --------------------------------------------------------------------
    @abstractmethod
    def generate(
        self,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        validated: bool = False,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Validate, queue and stream one request's outputs; the last has ``finished``.
        ``priority``: lower is scheduled first. ``validated``: these exact token ids and
        params already passed `validate` (so it is not run twice). ``output_kind``:
        ``DELTA`` outputs carry only what each step added (streaming), ``CUMULATIVE``
        everything so far. Leaving the iterator early aborts the request. Raises
        ValueError for a request `validate` refuses, `EngineDeadError` if the engine is
        not running, `RequestAbortedError` for a request `abort_all` ended."""

    async def pool(
        self, prompt_token_ids: list[int], pooling: PoolingParams | None = None, request_id: str | None = None,
        priority: int = 0,
    ) -> PoolingOutput:
        """Compute a prompt and pool it into one vector (an embedding, or the logits of
        ``pooling.logit_token_ids`` at its last position; docs/embeddings.md): a request
        scheduled like a prompt beside the others, that generates nothing. Raises as
        `generate` does (ValueError naming ``dimensions`` for a model without Matryoshka
        support)."""
        final = None
        async for output in self.generate(None, SamplingParams.for_pooling(pooling), prompt_token_ids, request_id,
                                          priority):
            final = output
        return PoolingOutput.from_request_output(final)

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """End one request and free its blocks (nothing if it already ended)."""

    @abstractmethod
    def abort_all(self, reason: str) -> int:
        """End every request in flight with `RequestAbortedError(reason)` (its caller sees
        the error, never a silent end); return how many there were."""

    @property
    @abstractmethod
    def num_requests(self) -> int:
        """Requests queued or running whose caller still waits for outputs."""

    @abstractmethod
    def validate(self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None) -> list[int]:
        """The prompt's token ids if the engine would take the request (vocabulary,
        context length, KV capacity, processors' parameters); ValueError naming the
        problem otherwise. Changes nothing."""

    # -- the tokenizer ---------------------------------------------------------------
    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``."""

    @abstractmethod
    def encode_with_offsets(self, text: str, keep_last: int) -> tuple[int, list[int], list[tuple[int, int]]]:
        """The number of tokens of ``text``, and the ids and (start, stop) character
        offsets of its last ``keep_last`` tokens ((0, 0) for a special token)."""

    @abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of a chat (the model's template, with the generation prompt;
        ``tools`` for a template that renders them). ValueError if the model has no
        template or a message lacks role or content; an error the template itself raises
        (``jinja2.TemplateError``) passes through."""

    @property
    @abstractmethod
    def chat_template(self) -> str | None:
        """The model's chat template source (its tool-call syntax picks the parser), or None."""

    # -- adapters (LoRA) --------------------------------------------------------------
    def adapters(self) -> dict[str, AdapterInfo]:
        """The adapters served now, by name (empty when adapters are off)."""
        return {}

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Read and check the adapter at ``path`` (a directory or a Hub id) and serve it
        as ``name``; blocking (reads files: call it off the event loop). `AdapterError`
        (a ValueError) naming the problem; adapters off: an `AdapterError` too."""
        from ember.plugin.adapter import AdapterError

        raise AdapterError("LoRA adapters are off (start with --enable-lora or --lora-modules NAME=PATH)")

    def unload_adapter(self, name: str) -> None:
        """Stop taking requests of ``name`` (those running finish); `UnknownAdapterError`
        if it is not served."""
        from ember.plugin.adapter import UnknownAdapterError

        raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded adapters: none")

    # -- facts and counts ------------------------------------------------------------
    @property
    @abstractmethod
    def model_info(self) -> ModelInfo:
        """The served model's facts (the same value every call)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """The counts now."""

    @abstractmethod
    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener(stats)`` after each engine step that computed tokens, in the
        engine's thread: it must be quick and thread-safe. One that raises is logged."""

    # -- plugins -----------------------------------------------------------------------
    @abstractmethod
    def logits_processor(self, name: str) -> BaseLogitsProcessor:
        """The engine's instance of the logits processor ``name`` (a plugin's route
        reads its own processor's settings through it); LookupError if not loaded."""

    @property
    @abstractmethod
    def plugin_manager(self) -> Any:
        """The engine's plugin manager (`ember.plugin.EmberPluginManager`): the API calls
        its ``ember_api_routes`` hook."""
