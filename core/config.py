"""Engine configuration: frozen dataclasses, validated once at construction."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # EngineConfig.kv_cache_dtype
MODEL_IMPLS = ("auto", "ember", "transformers")  # EngineConfig.model_impl
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")  # EngineConfig.lora_dtype


@dataclass(frozen=True)
class CacheConfig:
    """KV cache shape. `num_blocks=None` means: size the pool from the memory budget."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the continuous batch."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # Split prompts longer than the step's remaining token budget across steps.
    enable_chunked_prefill: bool = True
    # While requests decode, a prompt chunk's token at position s costs
    # 1 + s / prefill_context_scale budget tokens (its attention grows with its
    # context; the scale is the context at which attention costs as much as the
    # linear layers), so a long prompt's late chunks shrink and a step's time stays
    # bounded for the streams beside it. None: every token costs 1.
    prefill_context_scale: float | None = None
    # The step budget while no request decodes (prompts only): larger products run
    # faster per token and nobody waits between steps. None: max_num_batched_tokens.
    prefill_step_tokens: int | None = None
    # adapters (LoRA) with requests running at once, at most (the model's adapter
    # slots); None: adapters are off. A request of another adapter waits for a slot.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_step_tokens ({self.prefill_step_tokens}) must be >= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) or None"
            )
        if self.prefill_context_scale is not None and not self.prefill_context_scale > 0:
            raise ValueError(f"prefill_context_scale must be > 0 or None, got {self.prefill_context_scale}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunked prefill a prompt is prefilled in one step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so that any prompt fits one step"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from. `model=None` is the default model."""

    model: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    backend: str | None = None  # None: the available backend with the highest priority
    # The backend's options by name (``ember backends options NAME`` lists them; the
    # CLI's --backend-option KEY=VALUE, EMBER_BACKEND_OPTIONS): a mapping of str to str
    # (numbers and booleans are turned into their text), kept as sorted (key, value)
    # pairs; the backend parses and checks them when the engine builds it
    backend_options: Mapping[str, Any] | tuple[tuple[str, str], ...] = ()
    # tokens per KV block; None: the attention's default (16; flash-attn's paged KV: 256)
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    # the KV pool in tokens, rounded up to whole blocks (whatever the block size);
    # exclusive with num_kv_blocks
    num_kv_tokens: int | None = None
    max_num_seqs: int = 256
    # tokens one step computes; None: the backend's default_step_tokens with chunked
    # prefill (CPU 512), else max(8192, max_model_len)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True  # reuse cached KV blocks of shared prompt prefixes
    enable_chunked_prefill: bool = True  # split prompts across steps within the token budget
    seed: int | None = None
    # threads the backend computes with; None: the backend's choice (CPU: the physical
    # cores this process may use, within its cgroup quota; OMP_NUM_THREADS wins)
    num_threads: int | None = None
    disabled_plugins: tuple[str, ...] = ()
    required_plugins: tuple[str, ...] = ()
    # Server-side settings of logits processors by name, e.g. {"watermark": {"key": "..."}}:
    # each processor gets its own as `LogitsProcessorContext.options`.
    processor_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Decode batch sizes captured in device graphs (CUDA/HPU graphs, ember.worker.graphs) where
    # the backend and its attention have them; None: ember.worker.graphs.default_graph_sizes;
    # () or enforce_eager: none (every step eager, as vLLM's --enforce-eager)
    graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False
    # Speculative decoding (docs/speculative.md): an ember.plugin.speculator.SpeculativeConfig,
    # a mapping of its fields or their JSON (vLLM's --speculative-config); None: off
    speculative_config: Any = None
    # Refuse a KV cache that cannot hold one request of max_model_len tokens
    # (`KVCacheTooSmallError`), as a server that promises that limit must. Off for
    # offline use, where a smaller cache only refuses the requests that do not fit.
    require_kv_for_max_model_len: bool = False
    # Grammar-guided decoding (docs/grammar.md): the backend of requests that name none,
    # and how long a request waits for its grammar to compile before it fails.
    grammar_backend: str = "outlines"
    grammar_compile_timeout_s: float = 60.0
    # Compiles isolated from serving (docs/grammar.md): worker processes (lowered
    # priority, killed at the timeout; 0: threads of the engine's process), the memory
    # one compile may add to its worker, and the size limits checked before compiling
    # (an ember.grammar_limits.GrammarLimits or its "KEY=VALUE,..." text; None: the defaults)
    grammar_compile_workers: int = 1
    grammar_compile_memory_mb: int = 2048
    # the workers' CPU priority: "idle" (SCHED_IDLE: only CPU the engine leaves idle) or a
    # niceness "0".."19" above the engine's, for compiles that must progress on a busy machine
    grammar_compile_priority: str = "idle"
    grammar_limits: Any = None
    # Constrained outputs that close (docs/grammar.md): keep each closable within its
    # max_tokens and context; mask a token that would extend a run of this many repeating
    # tokens in a constrained string or number (0: no bound).
    grammar_budget: bool = True
    grammar_repetition_limit: int = 12
    # Quantized weights (docs/quantization.md): a quantizer by name (--quantize: int8,
    # int4, ...; a quantized checkpoint's own is found from its config.json), and whether
    # a format the backend has no kernel for is dequantized at load (else refused)
    quantize: str | None = None
    dequantize: bool = False
    # The KV cache's dtype (--kv-cache-dtype): "auto" (the backend's choice; the cpu
    # backend keeps a quantized model's KV in float16 beside float32 compute, else the
    # compute dtype) or float32, bfloat16, float16 where the backend stores it
    kv_cache_dtype: str = "auto"
    # Tensor and pipeline parallelism (docs/parallel.md, ember.parallel): the model split
    # over tensor_parallel_size x pipeline_parallel_size ranks, one process each; a
    # collective that waits longer than parallel_timeout_s on a peer is an error
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    parallel_timeout_s: float = 300.0
    # Which code runs the model (--model-impl, vLLM's flag; docs/model-impl.md): "ember"
    # its native architecture (refused when there is none), "transformers" the fallback
    # through transformers' modeling code with Ember's paged attention, "auto" native
    # where it exists, else the fallback
    model_impl: str = "auto"
    # LoRA adapters (docs/lora.md, vLLM's flags): served when enable_lora is set or
    # lora_modules names any (name -> a local directory or a Hub id, loaded at start);
    # max_loras adapters in one step (their requests share it with the base model's),
    # ranks up to max_lora_rank, max_cpu_loras adapters kept read in host memory (None:
    # max_loras; the others are read again from their path when a request needs them)
    enable_lora: bool = False
    lora_modules: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the adapters' weights in the model (vLLM's --lora-dtype): "auto" is the compute dtype,
    # except bfloat16 beside quantized base weights computed in float32 (a 4-bit base's
    # own rounding is far larger; a batch-1 decode then streams half the adapter bytes)
    lora_dtype: str = "auto"
    # Pooling requests (embeddings, docs/embeddings.md): "auto" reads the model's
    # sentence-transformers config (modules.json, 1_Pooling/config.json), else "last";
    # pooling_normalize None: normalised when that config has a Normalize module (or has
    # none); matryoshka None: as the model's config.json says (is_matryoshka / matryoshka_dimensions)
    pooling: str = "auto"
    pooling_normalize: bool | None = None
    matryoshka: bool | None = None
    # Images (docs/multimodal.md): items of each modality one prompt may hold (vLLM's
    # --limit-mm-per-prompt: {"image": 4}, or "image=4"; empty: 4 images), and the encoder
    # cache's size in embeddings (None: 8192 or a step's token budget, the larger)
    limit_mm_per_prompt: Mapping[str, int] | str | None = None
    encoder_cache_size: int | None = None

    @property
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora or self.lora_modules)

    def __post_init__(self) -> None:
        if not isinstance(self.processor_options, Mapping) or not all(
            isinstance(v, Mapping) for v in self.processor_options.values()
        ):
            raise ValueError(f"processor_options must map processor names to dicts, got {self.processor_options!r}")
        object.__setattr__(self, "backend_options", _backend_options(self.backend_options))
        object.__setattr__(self, "disabled_plugins", tuple(self.disabled_plugins))
        object.__setattr__(self, "required_plugins", tuple(self.required_plugins))
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a string such as 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.grammar_backend, str) or not self.grammar_backend:
            raise ValueError(f"grammar_backend must be a grammar backend's name, got {self.grammar_backend!r}")
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout_s must be a number of seconds > 0, got {timeout!r}")
        limit = self.grammar_repetition_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"grammar_repetition_limit must be an integer >= 0 (0: no bound), got {limit!r}")
        _grammar_isolation(self)
        if self.quantize is not None and (not isinstance(self.quantize, str) or not self.quantize):
            raise ValueError(f"quantize must be a quantizer's name such as 'int8' or 'int4', got {self.quantize!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.dequantize, bool):
            raise ValueError(f"dequantize must be True or False, got {self.dequantize!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        CacheConfig(16 if self.block_size is None else self.block_size, self.kv_cache_memory_bytes, self.num_kv_blocks)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.graph_sizes is not None:
            sizes = tuple(self.graph_sizes)
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
                raise ValueError(f"graph_sizes must be positive integers, got {list(sizes)}")
            object.__setattr__(self, "graph_sizes", tuple(sorted(set(sizes))))
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.model_impl == "transformers" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                f"model_impl 'transformers' (the transformers fallback) does not support tensor or pipeline "
                f"parallelism: got tensor_parallel_size={self.tensor_parallel_size}, "
                f"pipeline_parallel_size={self.pipeline_parallel_size}"
            )
        timeout = self.parallel_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"parallel_timeout_s must be a number of seconds > 0, got {timeout!r}")
        self._check_lora()
        size = self.encoder_cache_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"encoder_cache_size must be a positive number of embeddings, got {size!r}")
        if self.num_kv_tokens is not None:
            if self.num_kv_blocks is not None:
                raise ValueError("give num_kv_blocks or num_kv_tokens, not both")
            if self.num_kv_tokens < 1:
                raise ValueError(f"num_kv_tokens must be >= 1, got {self.num_kv_tokens}")


    def _check_lora(self) -> None:
        modules = self.lora_modules
        pairs = list(modules.items()) if isinstance(modules, Mapping) else [tuple(p) for p in modules or ()]
        if any(len(p) != 2 or not all(isinstance(v, str) and v for v in p) for p in pairs):
            raise ValueError(f"lora_modules must map adapter names to paths (or Hub ids), got {modules!r}")
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)}")
        object.__setattr__(self, "lora_modules", tuple(pairs))
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if self.pooling not in ("auto", "last", "mean", "cls"):
            raise ValueError(f"pooling must be one of auto, last, mean, cls, got {self.pooling!r}")
        for name in ("pooling_normalize", "matryoshka"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.lora_enabled:
            if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
                raise ValueError("LoRA adapters do not combine with tensor or pipeline parallelism yet: got "
                                 f"tensor_parallel_size={self.tensor_parallel_size}, "
                                 f"pipeline_parallel_size={self.pipeline_parallel_size} with LoRA enabled")
            if self.model_impl == "transformers":
                raise ValueError("LoRA adapters do not combine with model_impl 'transformers' (the transformers "
                                 "fallback); use Ember's native architecture (model_impl 'auto' or 'ember')")


def _backend_options(value: Any) -> tuple[tuple[str, str], ...]:
    """``EngineConfig.backend_options`` as sorted (key, text) pairs; ValueError for
    anything but a mapping (or pairs) of names to strings, numbers or booleans."""
    if value is None:
        return ()
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        pairs = None
    if pairs is None or isinstance(value, (str, bytes)) or any(len(p) != 2 for p in pairs):
        raise ValueError(f"backend_options must map option names to values, got {value!r}")
    options: dict[str, str] = {}
    for key, item in pairs:
        if not isinstance(key, str) or not key:
            raise ValueError(f"backend_options: option names must be non-empty strings, got {key!r}")
        if isinstance(item, bool):
            item = "true" if item else "false"
        elif isinstance(item, (int, float)):
            item = str(item)
        elif not isinstance(item, str):
            raise ValueError(f"backend_options: {key}={item!r} must be a string, number or boolean")
        options[key] = item
    return tuple(sorted(options.items()))


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates, in vLLM's terms (``--speculative-config`` takes
    these keys as JSON; TGI's ``--speculate N`` is ``{"method": "ngram",
    "num_speculative_tokens": N}``).

    ``disable_by_batch_size``: no speculation in a step where at least this many
    requests run (verifying drafts costs compute a large batch no longer has to
    spare); None never steps aside. ``min_acceptance_rate``: a request whose recent
    drafts were accepted less often than this (an exponential average over
    ``acceptance_window`` proposals) stops being offered drafts for
    ``backoff_steps`` steps, then tries again; 0 keeps offering.

    ``draft_length_schedule``: ``constant`` offers every request
    ``num_speculative_tokens`` drafts a step (vLLM); ``heuristic`` (Hugging Face's
    ``num_assistant_tokens_schedule``) starts each request there and adapts it: two
    more after a step that accepted all its drafts, one fewer (not under 1) after one
    that did not, up to ``max_speculative_tokens`` (default three times
    ``num_speculative_tokens``). Long copied runs then verify many drafts a step,
    where a step costs little more than a plain decode (a CPU at batch 1), while free
    text shrinks back to few."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    # ngram (prompt lookup): the longest and shortest suffix matched against the
    # request's tokens, longest first
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft_model, eagle, medusa: the draft model's or the heads' directory
    model: str | None = None
    # suffix (suffix decoding; vLLM's names): the trees' depth (match + drafts), the
    # earlier responses kept in the global tree (0: none), drafts per matched token and
    # added to them, and the estimated probability a draft must keep
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 0
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_max_spec_offset: float = 0.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = 8
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 16
    backoff_steps: int = 16
    draft_length_schedule: str = "constant"
    max_speculative_tokens: int | None = None
    # cost-aware (docs/speculative.md): per step and request, only the drafts whose
    # expected tokens per second beat a plain step, by the step costs measured online;
    # a probe step at most every cost_probe_interval decode steps keeps them measured
    cost_aware: bool = True
    cost_probe_interval: int = 32

    SCHEDULES: ClassVar[tuple[str, ...]] = ("constant", "heuristic")

    @property
    def max_drafts(self) -> int:
        """The most drafts a request is ever offered in one step."""
        if self.draft_length_schedule == "constant":
            return self.num_speculative_tokens
        return self.max_speculative_tokens or 3 * self.num_speculative_tokens

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative method must be a speculator's name, got {self.method!r}")
        positive = {"num_speculative_tokens": self.num_speculative_tokens, "prompt_lookup_max": self.prompt_lookup_max,
                    "prompt_lookup_min": self.prompt_lookup_min, "acceptance_window": self.acceptance_window,
                    "backoff_steps": self.backoff_steps, "cost_probe_interval": self.cost_probe_interval}
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.cost_aware, bool):
            raise ValueError(f"speculative config: cost_aware must be true or false, got {self.cost_aware!r}")
        if self.draft_length_schedule not in self.SCHEDULES:
            raise ValueError(f"speculative config: draft_length_schedule must be one of {', '.join(self.SCHEDULES)}, "
                             f"got {self.draft_length_schedule!r}")
        most = self.max_speculative_tokens
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < self.num_speculative_tokens):
            raise ValueError(f"speculative config: max_speculative_tokens must be an integer of at least "
                             f"num_speculative_tokens ({self.num_speculative_tokens}), got {most!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        self._check_suffix()
        size = self.disable_by_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"speculative config: disable_by_batch_size must be a positive integer or null, got {size!r}")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"speculative config: min_acceptance_rate must lie in [0, 1], got {rate!r}")

    def _check_suffix(self) -> None:
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"speculative config: suffix_decoding_max_tree_depth must be an integer of at least 2, "
                             f"got {depth!r}")
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"speculative config: suffix_decoding_max_cached_requests must be a non-negative integer, "
                             f"got {cached!r}")
        bounds = {"suffix_decoding_max_spec_factor": (0, None), "suffix_decoding_max_spec_offset": (None, None),
                  "suffix_decoding_min_token_prob": (0, 1)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or (low is not None and value < low) or (high is not None and value > high):
                where = f"in [{low}, {high}]" if high is not None else "a finite number" + (" >= 0" if low == 0 else "")
                raise ValueError(f"speculative config: {name} must be {where}, got {value!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a mapping of its fields, or their JSON; None stays None.
        An unknown key is a ValueError naming it."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _grammar_isolation(config: EngineConfig) -> None:
    """Check the compile workers and memory, and make ``grammar_limits`` a GrammarLimits."""
    from ember.grammar_limits import GrammarLimits

    for name, least in (("grammar_compile_workers", 0), ("grammar_compile_memory_mb", 1)):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    object.__setattr__(config, "grammar_compile_priority", compile_priority(config.grammar_compile_priority,
                                                                            "grammar_compile_priority"))
    limits = config.grammar_limits
    if limits is None or isinstance(limits, str):
        limits = GrammarLimits.parse(limits)
    elif isinstance(limits, Mapping):
        limits = GrammarLimits(**limits)
    elif not isinstance(limits, GrammarLimits):
        raise ValueError(f"grammar_limits must be a GrammarLimits, a mapping or 'KEY=VALUE,...', got {limits!r}")
    object.__setattr__(config, "grammar_limits", limits)


def compile_priority(value: Any, name: str) -> str:
    """A grammar compile worker's priority as text: "idle", or a niceness "0".."19"."""
    text = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text == "idle" or (text is not None and text.isdigit() and int(text) <= 19):
        return text if text == "idle" else str(int(text))
    raise ValueError(f"{name} must be 'idle' (SCHED_IDLE) or a niceness from 0 to 19, got {value!r}")
