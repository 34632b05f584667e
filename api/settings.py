"""Server settings: the `ember serve` options, validated before anything loads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ember.api.lora import LoRAModule, lora_modules
from ember.api.media import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    check_media_options,
)
from ember.config import compile_priority
from ember.grammar_limits import GrammarLimits

API_KEY_PATTERN = re.compile(r"[!-~]{1,512}")
SIZE_PATTERN = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` (ValueError naming the text)."""
    match = SIZE_PATTERN.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with KiB, MiB, GiB, KB, MB or GB")
    number, unit = match.groups()
    size = int(float(number) * SIZE_UNITS[(unit or "b").lower()])
    if size < 1:
        raise ValueError(f"{text!r} is not a size of at least 1 byte")
    return size


def format_size(num_bytes: int) -> str:
    """The largest unit that divides ``num_bytes`` exactly: ``"256MiB"``, ``"1500MB"``,
    ``"1000B"``; `parse_size` reads it back."""
    for unit in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB"):
        if num_bytes % SIZE_UNITS[unit.lower()] == 0:
            return f"{num_bytes // SIZE_UNITS[unit.lower()]}{unit}"
    return f"{num_bytes}B"


def _round_up_size(num_bytes: int) -> int:
    """Up to whole MiB, or whole KiB below 1 MiB: a size worth suggesting."""
    unit = 2**20 if num_bytes >= 2**20 else 2**10
    return -(-num_bytes // unit) * unit


ORIGIN_PATTERN = re.compile(r"https?://[^\s/]+")
ROOT_PATH_PATTERN = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)+")


@dataclass(frozen=True)
class ServerSettings:
    """Limits in TGI's vocabulary. ``None`` means: derive from the model and backend.

    * ``max_input_tokens``: longest prompt accepted (after ``truncate``).
    * ``max_total_tokens``: prompt + generated tokens of one request (the context).
    * ``max_batch_prefill_tokens``: tokens one engine step may compute.
    * ``max_batch_total_tokens``: tokens the KV cache holds across all requests.
    """

    model_id: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    hostname: str = "127.0.0.1"
    port: int = 3000
    max_concurrent_requests: int = 128
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV cache (default: the backend's share of free memory)
    max_batch_size: int | None = None  # requests running at once (the engine's max_num_seqs)
    num_threads: int | None = None  # host threads of the backend (the engine's num_threads)
    # Where the engine core runs: "process" (its own, the default: measured faster when
    # served, docs/engine-core.md) or "thread" (beside the event loop).
    engine_mode: str = "process"
    # a dead engine-core process is restarted in place, at most max_engine_restarts times an hour
    # (docs/operations.md); off: the server drains and exits non-zero for its orchestrator to restart
    restart_engine_on_failure: bool = False
    max_engine_restarts: int = 3
    max_stop_sequences: int = 4
    payload_limit: int = 2_000_000
    disabled_plugins: tuple[str, ...] = field(default_factory=tuple)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # decode batch sizes in device graphs (TGI's --cuda-graphs; () turns them off); None: the engine's
    graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False
    # grammar-guided decoding (docs/grammar.md): the backend of requests that name none,
    # and how long a request may wait for its grammar
    grammar_backend: str = "outlines"
    grammar_compile_timeout: float = 60.0
    # compiles isolated from serving (docs/grammar.md): --grammar-compile-workers N, --grammar-compile-memory MIB,
    # --grammar-limits KEY=VALUE,... (None: the defaults)
    grammar_compile_workers: int = 1
    grammar_compile_memory: int = 2048
    grammar_compile_priority: str = "idle"  # --grammar-compile-priority idle|0..19
    grammar_limits: str | None = None
    # constrained outputs that close (docs/grammar.md): --grammar-repetition-limit N (0: off), --disable-grammar-budget
    grammar_repetition_limit: int = 12
    disable_grammar_budget: bool = False
    # --reasoning-parser NAME (docs/reasoning.md): chat answers' reasoning as reasoning_content; None: off
    reasoning_parser: str | None = None
    # --tool-call-parser NAME (docs/grammar.md): the parser of `tool_choice: "auto"` answers; None: the chat template's
    tool_call_parser: str | None = None
    # quantized weights (docs/quantization.md): --quantize NAME, --dequantize
    quantize: str | None = None
    dequantize: bool = False
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (EngineConfig.kv_cache_dtype)
    model_impl: str = "auto"  # --model-impl (EngineConfig.model_impl)
    # the backend's options by name (--backend-option KEY=VALUE, EMBER_BACKEND_OPTIONS;
    # EngineConfig.backend_options), strings parsed and checked by the backend
    backend_options: dict = field(default_factory=dict)
    required_plugins: tuple[str, ...] = field(default_factory=tuple)
    served_model_name: str | None = None
    # Server-side logits-processor settings by name (e.g. the watermark's key, gamma, delta).
    processor_options: dict = field(default_factory=dict)
    # Production (docs/operations.md): access, CORS, logs, traces, shutdown.
    api_key: str | None = None
    cors_allow_origins: tuple[str, ...] = field(default_factory=tuple)
    json_output: bool = False
    otlp_endpoint: str | None = None
    otlp_service_name: str = "ember"
    graceful_termination_timeout: float = 30.0
    # Seconds a client gets to send a request's whole body once its headers arrived
    # (slow or stalled uploads are answered 408 and do not count as in flight).
    request_body_timeout: float = 30.0
    # --root-path PREFIX: the path prefix a reverse proxy serves Ember under ("" none); requests
    # may arrive with it or stripped, and the playground's links and API calls follow it
    root_path: str = ""
    # the Responses API's stored responses (docs/api.md): at most this many (0: store none), each this many seconds
    responses_store_size: int = 256
    responses_store_ttl: float = 3600.0
    # speculative decoding (docs/speculative.md): an ember.plugin.speculator.SpeculativeConfig or None
    speculative_config: Any = None
    # tensor and pipeline parallelism (docs/parallel.md): worker processes per stage, stages
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # LoRA adapters (docs/lora.md, vLLM's flags): on with --enable-lora or any --lora-modules
    # (LORA_ADAPTERS adds to them); /v1/load_lora_adapter and /v1/unload_lora_adapter only
    # with --enable-lora-runtime-updates
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = field(default_factory=tuple)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"  # --lora-dtype (EngineConfig.lora_dtype)
    enable_lora_runtime_updates: bool = False
    # pooling (docs/embeddings.md): --pooling, --pooling-normalize, --matryoshka (EngineConfig's
    # fields of those names; None: the model's own config says); rerank/score by yes/no
    # logits under --score-template (a file or the text) with --score-tokens (None: embedding cosine)
    pooling: str = "auto"
    pooling_normalize: bool | None = None
    matryoshka: bool | None = None
    score_template: str | None = None
    score_tokens: str | None = None
    # images (docs/multimodal.md, vLLM's flags): --limit-mm-per-prompt image=N (None: 4), --allowed-media-domains
    # (empty: remote fetching off), --allowed-local-media-path (None: file:// off), --media-fetch-timeout,
    # --max-image-bytes, --max-image-pixels, --encoder-cache-size (None: the engine's default)
    limit_mm_per_prompt: str | dict | None = None
    allowed_media_domains: tuple[str, ...] = field(default_factory=tuple)
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # bytes (or a size's text: "5MiB")
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    encoder_cache_size: int | None = None

    @property
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora or self.lora_modules)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", lora_modules(self.lora_modules))
        object.__setattr__(self, "disabled_plugins", tuple(self.disabled_plugins))
        object.__setattr__(self, "required_plugins", tuple(self.required_plugins))
        object.__setattr__(self, "cors_allow_origins", tuple(self.cors_allow_origins))
        domains = self.allowed_media_domains  # "a,b" as the flag and its variable write it
        object.__setattr__(self, "allowed_media_domains", tuple(
            (d.strip() for d in domains.split(",") if d.strip()) if isinstance(domains, str) else domains))
        self.check_production_options()
        if isinstance(self.max_image_bytes, str):  # --max-image-bytes 5MiB
            try:
                object.__setattr__(self, "max_image_bytes", parse_size(self.max_image_bytes))
            except ValueError as exc:
                raise ValueError(f"--max-image-bytes: {exc}") from None
        check_media_options(self)
        positive = {
            "port": self.port,
            "max_concurrent_requests": self.max_concurrent_requests,
            "payload_limit": self.payload_limit,
        }
        optional_positive = {
            "max_input_tokens": self.max_input_tokens,
            "max_total_tokens": self.max_total_tokens,
            "max_batch_prefill_tokens": self.max_batch_prefill_tokens,
            "max_batch_total_tokens": self.max_batch_total_tokens,
            "kv_cache_memory": self.kv_cache_memory,
            "max_batch_size": self.max_batch_size,
            "num_threads": self.num_threads,
        }
        positive["tensor_parallel_size"] = self.tensor_parallel_size
        positive["pipeline_parallel_size"] = self.pipeline_parallel_size
        positive["max_loras"] = self.max_loras
        positive["max_lora_rank"] = self.max_lora_rank
        optional_positive["max_cpu_loras"] = self.max_cpu_loras
        if self.engine_mode not in ("thread", "process"):
            raise ValueError(f"--engine-mode must be 'thread' or 'process', got {self.engine_mode!r}")
        if self.restart_engine_on_failure and self.engine_mode != "process":
            raise ValueError("--restart-engine-on-failure needs --engine-mode process: a core in a thread dies "
                             "with the server's own process (a step that raises already fails only its requests)")
        if not isinstance(self.max_engine_restarts, int) or self.max_engine_restarts < 0:
            raise ValueError(f"--max-engine-restarts must be an integer >= 0, got {self.max_engine_restarts!r}")
        for name, value in {**positive, **{k: v for k, v in optional_positive.items() if v is not None}}.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.port > 65535:
            raise ValueError(f"--port must be at most 65535, got {self.port}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras}): "
                             "the adapters running at once are held in host memory too")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout!r}")
        for name, least in (("grammar_compile_workers", 0), ("grammar_compile_memory", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {least}, got {value!r}")
        object.__setattr__(self, "grammar_compile_priority",
                           compile_priority(self.grammar_compile_priority, "--grammar-compile-priority"))
        GrammarLimits.parse(self.grammar_limits)  # ValueError naming --grammar-limits
        limit = self.grammar_repetition_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"--grammar-repetition-limit must be an integer >= 0 (0: off), got {limit!r}")
        if self.max_stop_sequences < 0:
            raise ValueError(f"--max-stop-sequences must be >= 0, got {self.max_stop_sequences}")
        if self.kv_cache_memory is not None and self.max_batch_total_tokens is not None:
            raise ValueError(
                f"give --kv-cache-memory ({self.kv_cache_memory} bytes) or --max-batch-total-tokens "
                f"({self.max_batch_total_tokens} tokens), not both: each sizes the KV cache"
            )
        self.check_consistency()

    def check_production_options(self) -> None:
        if self.api_key is not None and not API_KEY_PATTERN.fullmatch(self.api_key):
            raise ValueError("--api-key must be 1 to 512 visible ASCII characters without spaces")
        for origin in self.cors_allow_origins:
            if origin != "*" and not ORIGIN_PATTERN.fullmatch(origin):
                raise ValueError(
                    f"--cors-allow-origin {origin!r} is not an origin: give scheme://host[:port] (no path) or *"
                )
        if self.otlp_endpoint is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.otlp_endpoint):
            raise ValueError(
                f"--otlp-endpoint {self.otlp_endpoint!r} must be an http(s) URL, e.g. http://localhost:4318"
            )
        if not self.otlp_service_name.strip():
            raise ValueError("--otlp-service-name must not be empty")
        timeout = self.graceful_termination_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
            raise ValueError(f"--graceful-termination-timeout must be a number of seconds >= 0, got {timeout!r}")
        timeout = self.request_body_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"--request-body-timeout must be a number of seconds > 0, got {timeout!r}")
        if self.root_path and not ROOT_PATH_PATTERN.fullmatch(self.root_path):
            raise ValueError(f"--root-path must be a URL path such as /ember (a leading /, no trailing /, "
                             f"no spaces, query or fragment), got {self.root_path[:100]!r}")
        size, ttl = self.responses_store_size, self.responses_store_ttl
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"--responses-store-size must be an integer >= 0 (0: store none), got {size!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
            raise ValueError(f"--responses-store-ttl must be a number of seconds > 0, got {ttl!r}")

    def check_consistency(self) -> None:
        """Refuse limits that contradict each other, naming both."""
        check_limits(
            self.max_input_tokens, self.max_total_tokens, self.max_batch_prefill_tokens,
            self.max_batch_total_tokens, self.enable_chunked_prefill,
        )


def check_limits(
    max_input_tokens: int | None,
    max_total_tokens: int | None,
    max_batch_prefill_tokens: int | None,
    max_batch_total_tokens: int | None,
    enable_chunked_prefill: bool,
    derived: dict[str, str] | None = None,
) -> None:
    """Refuse limits that contradict each other, naming both flags. ``derived``: for a
    value the user did not set, where it came from (said next to it, so that a message
    never blames a flag the user never gave without saying so)."""
    derived = derived or {}

    def show(name: str, value: int) -> str:
        note = derived.get(name)
        return f"--{name.replace('_', '-')} ({value}{', ' + note if note else ''})"

    if max_input_tokens is not None and max_total_tokens is not None and max_input_tokens >= max_total_tokens:
        raise ValueError(
            f"{show('max_input_tokens', max_input_tokens)} must be < {show('max_total_tokens', max_total_tokens)}: "
            "a request needs room for at least one generated token"
        )
    if max_batch_prefill_tokens is not None and max_input_tokens is not None:
        if max_batch_prefill_tokens < max_input_tokens and not enable_chunked_prefill:
            raise ValueError(
                f"{show('max_batch_prefill_tokens', max_batch_prefill_tokens)} must be >= "
                f"{show('max_input_tokens', max_input_tokens)}: without chunked prefill a prompt is "
                "prefilled in one step"
            )
    if max_batch_total_tokens is not None and max_total_tokens is not None:
        if max_batch_total_tokens < max_total_tokens:
            raise ValueError(
                f"{show('max_batch_total_tokens', max_batch_total_tokens)} must be >= "
                f"{show('max_total_tokens', max_total_tokens)}: the KV cache must hold one full request"
            )


def kv_shortfall_message(
    settings: ServerSettings,
    num_kv_tokens: int,
    max_total_tokens: int,
    *,
    bytes_per_token: int | None = None,
    block_size: int = 16,
    default_budget_bytes: int | None = None,
) -> str:
    """Why a KV cache of ``num_kv_tokens`` cannot serve one request of ``max_total_tokens``,
    and what to change, in the terms of the options the user set (`ember serve`'s flags)
    rather than the values derived from them. ``bytes_per_token`` (the model's KV bytes
    per token, once known) lets the message say how much memory would do."""
    request = f"--max-total-tokens {max_total_tokens}"
    if settings.max_total_tokens is None:
        request += " (the model's context, the default)"
    if settings.max_batch_total_tokens is not None:
        given = settings.max_batch_total_tokens
        return (
            f"--max-batch-total-tokens {given} is less than one request of {request}; lower --max-total-tokens "
            f"to at most {given} or raise --max-batch-total-tokens to at least {max_total_tokens}"
        )
    lower = f"lower --max-total-tokens to at most {num_kv_tokens}"
    needed = None
    if bytes_per_token is not None:  # whole blocks: what the engine allocates
        needed = format_size(_round_up_size(-(-max_total_tokens // block_size) * block_size * bytes_per_token))
    if settings.kv_cache_memory is not None:
        return (
            f"the KV cache budget (--kv-cache-memory {format_size(settings.kv_cache_memory)}) holds {num_kv_tokens} "
            f"tokens, less than one request of {request}; {lower} or raise --kv-cache-memory"
            + (f" to at least {needed}" if needed else "")
        )
    budget = f"{format_size(default_budget_bytes)}, " if default_budget_bytes is not None else ""
    return (
        f"the KV cache ({budget}the backend's default share of memory) holds {num_kv_tokens} tokens, less than "
        f"one request of {request}; {lower} or give --kv-cache-memory" + (f" of at least {needed}" if needed else "")
    )


@dataclass(frozen=True)
class ResolvedLimits:
    """The limits in force once the model is loaded (what /info reports)."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_concurrent_requests: int
    max_stop_sequences: int
    payload_limit: int


def engine_config_kwargs(settings: ServerSettings) -> dict:
    """EngineConfig fields that follow from the settings (the rest use engine defaults)."""
    kwargs: dict = {
        "model": settings.model_id,
        "revision": settings.revision,
        "dtype": settings.dtype,
        "disabled_plugins": settings.disabled_plugins,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "required_plugins": settings.required_plugins,
        "processor_options": settings.processor_options,
        "backend_options": settings.backend_options,
        # the server promises that a request of max_total_tokens fits: refuse a smaller
        # KV cache at start (before the weights are read when the budget is explicit)
        "require_kv_for_max_model_len": True,
    }
    if settings.max_total_tokens is not None:
        kwargs["max_model_len"] = settings.max_total_tokens
    if settings.max_batch_prefill_tokens is not None:
        kwargs["max_num_batched_tokens"] = (
            settings.max_batch_prefill_tokens if settings.enable_chunked_prefill
            else max(settings.max_batch_prefill_tokens, settings.max_total_tokens or 0)
        )
    if settings.max_batch_total_tokens is not None:
        kwargs["num_kv_tokens"] = settings.max_batch_total_tokens
    if settings.kv_cache_memory is not None:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory
    if settings.max_batch_size is not None:
        kwargs["max_num_seqs"] = settings.max_batch_size
    if settings.speculative_config is not None:
        kwargs["speculative_config"] = settings.speculative_config
    if settings.tensor_parallel_size * settings.pipeline_parallel_size > 1:
        kwargs["tensor_parallel_size"] = settings.tensor_parallel_size
        kwargs["pipeline_parallel_size"] = settings.pipeline_parallel_size
    if settings.num_threads is not None:
        kwargs["num_threads"] = settings.num_threads
    if settings.graph_sizes is not None:
        kwargs["graph_sizes"] = settings.graph_sizes
    if settings.enforce_eager:
        kwargs["enforce_eager"] = True
    kwargs["grammar_backend"] = settings.grammar_backend
    kwargs["grammar_compile_timeout_s"] = settings.grammar_compile_timeout
    kwargs["grammar_compile_workers"] = settings.grammar_compile_workers
    kwargs["grammar_compile_memory_mb"] = settings.grammar_compile_memory
    kwargs["grammar_compile_priority"] = settings.grammar_compile_priority
    kwargs["grammar_limits"] = GrammarLimits.parse(settings.grammar_limits)
    kwargs["grammar_repetition_limit"] = settings.grammar_repetition_limit
    kwargs["grammar_budget"] = not settings.disable_grammar_budget
    if settings.quantize is not None:
        kwargs["quantize"] = settings.quantize
    if settings.dequantize:
        kwargs["dequantize"] = True
    if settings.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = settings.kv_cache_dtype
    if settings.model_impl != "auto":
        kwargs["model_impl"] = settings.model_impl
    if settings.lora_enabled:
        kwargs.update(
            enable_lora=True, lora_modules=tuple((m.name, m.path) for m in settings.lora_modules),
            max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank, max_cpu_loras=settings.max_cpu_loras,
            lora_dtype=settings.lora_dtype,
        )
    kwargs.update(pooling=settings.pooling, pooling_normalize=settings.pooling_normalize, matryoshka=settings.matryoshka)
    kwargs.update(limit_mm_per_prompt=settings.limit_mm_per_prompt, encoder_cache_size=settings.encoder_cache_size)
    return kwargs


def resolve_limits(
    settings: ServerSettings, max_model_len: int, num_kv_tokens: int, step_tokens: int | None = None
) -> ResolvedLimits:
    """Fill the derived limits from the loaded engine (``step_tokens``: its per-step
    token budget) and check them against it."""
    max_total = settings.max_total_tokens or max_model_len
    if max_total > max_model_len:
        raise ValueError(f"--max-total-tokens ({max_total}) exceeds the model's context ({max_model_len})")
    max_input = settings.max_input_tokens or max_total - 1
    limits = ResolvedLimits(
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_prefill_tokens=settings.max_batch_prefill_tokens or step_tokens or max(max_input, 4096),
        max_batch_total_tokens=settings.max_batch_total_tokens or num_kv_tokens,
        max_concurrent_requests=settings.max_concurrent_requests,
        max_stop_sequences=settings.max_stop_sequences,
        payload_limit=settings.payload_limit,
    )
    if limits.max_batch_total_tokens < max_total:
        raise ValueError(kv_shortfall_message(settings, num_kv_tokens, max_total))
    derived = {}
    if settings.max_total_tokens is None:
        derived["max_total_tokens"] = "the model's context, the default"
    if settings.max_input_tokens is None:
        derived["max_input_tokens"] = "the default: --max-total-tokens - 1"
    if settings.max_batch_prefill_tokens is None:
        derived["max_batch_prefill_tokens"] = "the engine's step budget, the default"
    check_limits(
        limits.max_input_tokens, limits.max_total_tokens, limits.max_batch_prefill_tokens,
        limits.max_batch_total_tokens, settings.enable_chunked_prefill, derived,
    )  # the same consistency checks on the derived values
    if limits.max_batch_total_tokens > num_kv_tokens:
        raise ValueError(
            f"--max-batch-total-tokens ({limits.max_batch_total_tokens}) exceeds the KV cache "
            f"({num_kv_tokens} tokens)"
        )
    return limits
