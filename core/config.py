"""Engine configuration: frozen dataclasses, validated once at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # EngineConfig.kv_cache_dtype


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
    # Decode batch sizes captured in device graphs (CUDA/HPU graphs, ember.graphs) where
    # the backend and its attention have them; None: ember.graphs.default_graph_sizes;
    # () or enforce_eager: none (every step eager, as vLLM's --enforce-eager)
    graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False
    # Speculative decoding (docs/speculative.md): an ember.speculative.SpeculativeConfig,
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

    def __post_init__(self) -> None:
        if not isinstance(self.processor_options, Mapping) or not all(
            isinstance(v, Mapping) for v in self.processor_options.values()
        ):
            raise ValueError(f"processor_options must map processor names to dicts, got {self.processor_options!r}")
        object.__setattr__(self, "disabled_plugins", tuple(self.disabled_plugins))
        object.__setattr__(self, "required_plugins", tuple(self.required_plugins))
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a string such as 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.grammar_backend, str) or not self.grammar_backend:
            raise ValueError(f"grammar_backend must be a grammar backend's name, got {self.grammar_backend!r}")
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout_s must be a number of seconds > 0, got {timeout!r}")
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
            from ember.speculative import SpeculativeConfig

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
        timeout = self.parallel_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"parallel_timeout_s must be a number of seconds > 0, got {timeout!r}")
        if self.num_kv_tokens is not None:
            if self.num_kv_blocks is not None:
                raise ValueError("give num_kv_blocks or num_kv_tokens, not both")
            if self.num_kv_tokens < 1:
                raise ValueError(f"num_kv_tokens must be >= 1, got {self.num_kv_tokens}")
