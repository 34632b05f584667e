"""The `ember` command line's options as environment variables: each option's
``EMBER_*`` variable and how to read it, the built-in defaults, and the secrets an
empty value must not switch off. Read when `main` runs, never at import.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ember.config import KV_CACHE_DTYPES, MODEL_IMPLS

PROG = "ember"
DTYPES = ("auto", "float32", "bfloat16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMPERATURE = 0.0  # greedy: what a one-off prompt wants (`ember serve`'s requests choose their own)


class UsageError(ValueError):
    """Bad input found by the CLI itself (an environment variable it cannot parse)."""


@dataclass(frozen=True)
class EnvOption:
    """One option's environment variable and how to read it."""

    variable: str
    convert: Callable[[str], Any]


def parse_size_option(text: str, error: type[Exception] = argparse.ArgumentTypeError) -> int:
    from ember.api.settings import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise error(str(exc)) from None


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1, true, yes, on, 0, false, no, off")


def parse_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _lora_modules_variable(text: str) -> list:
    from ember.api.lora import parse_lora_modules

    return parse_lora_modules(text, "entry")


def parse_graph_sizes(text: str) -> tuple[int, ...]:
    """TGI's --cuda-graphs: batch sizes separated by commas; 0 alone turns graphs off."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected batch sizes separated by commas (e.g. 1,2,4,8) or 0, got {text!r}") from None
    if sizes == (0,):
        return ()
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"expected positive batch sizes separated by commas (e.g. 1,2,4,8) or 0, got {text!r}")
    return sizes


@dataclass(frozen=True)
class SecretOption:
    """An option whose empty value is a secret that failed to render, not "unset": an
    empty ``EMBER_API_KEY`` must not quietly turn authentication off."""

    flag: str
    variable: str
    what: str  # "the API key"
    if_empty: str  # what an empty value would silently do
    if_unset: str  # what leaving it unset does


SECRET_OPTIONS: dict[str, SecretOption] = {
    "api_key": SecretOption(
        "--api-key", "EMBER_API_KEY", "the API key", "turn API-key authentication off", "run without one"
    ),
    "watermark_key": SecretOption(
        "--watermark-key", "EMBER_WATERMARK_KEY", "the watermark key",
        "fall back to the watermark's public default key", "use that default",
    ),
}


def _empty_secret(secret: SecretOption, source: str) -> UsageError:
    return UsageError(
        f"{secret.what} is empty ({source}): an empty key would {secret.if_empty}. Give a key with "
        f"{secret.flag} or {secret.variable}, or unset both to {secret.if_unset}"
    )


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"choose one of: {', '.join(choices)}")
        return value

    return convert


# dest -> where its default comes from. Options without an entry have no variable.
ENV_OPTIONS: dict[str, EnvOption] = {
    "log_level": EnvOption("EMBER_LOG_LEVEL", _choice(LOG_LEVELS)),
    "model_id": EnvOption("EMBER_MODEL_ID", str),
    "revision": EnvOption("EMBER_REVISION", str),
    "dtype": EnvOption("EMBER_DTYPE", _choice(DTYPES)),
    "max_tokens": EnvOption("EMBER_MAX_TOKENS", int),
    "temperature": EnvOption("EMBER_TEMPERATURE", float),
    "top_p": EnvOption("EMBER_TOP_P", float),
    "top_k": EnvOption("EMBER_TOP_K", int),
    "seed": EnvOption("EMBER_SEED", int),
    "chat": EnvOption("EMBER_CHAT", _parse_bool),
    "disable_plugin": EnvOption("EMBER_DISABLE_PLUGIN", parse_names),
    "plugin": EnvOption("EMBER_PLUGIN", parse_names),
    "json": EnvOption("EMBER_PLUGINS_JSON", _parse_bool),
    "hostname": EnvOption("EMBER_HOSTNAME", str),
    "port": EnvOption("EMBER_PORT", int),
    "max_concurrent_requests": EnvOption("EMBER_MAX_CONCURRENT_REQUESTS", int),
    "max_input_tokens": EnvOption("EMBER_MAX_INPUT_TOKENS", int),
    "max_total_tokens": EnvOption("EMBER_MAX_TOTAL_TOKENS", int),
    "max_batch_prefill_tokens": EnvOption("EMBER_MAX_BATCH_PREFILL_TOKENS", int),
    "max_batch_total_tokens": EnvOption("EMBER_MAX_BATCH_TOTAL_TOKENS", int),
    "kv_cache_memory": EnvOption("EMBER_KV_CACHE_MEMORY", lambda text: parse_size_option(text, ValueError)),
    "max_batch_size": EnvOption("EMBER_MAX_BATCH_SIZE", int),
    "num_threads": EnvOption("EMBER_NUM_THREADS", int),
    "engine_mode": EnvOption("EMBER_ENGINE_MODE", _choice(("thread", "process"))),
    "restart_engine_on_failure": EnvOption("EMBER_RESTART_ENGINE_ON_FAILURE", _parse_bool),
    "max_engine_restarts": EnvOption("EMBER_MAX_ENGINE_RESTARTS", int),
    "max_stop_sequences": EnvOption("EMBER_MAX_STOP_SEQUENCES", int),
    "payload_limit": EnvOption("EMBER_PAYLOAD_LIMIT", int),
    "disable_prefix_caching": EnvOption("EMBER_DISABLE_PREFIX_CACHING", _parse_bool),
    "disable_chunked_prefill": EnvOption("EMBER_DISABLE_CHUNKED_PREFILL", _parse_bool),
    "cuda_graphs": EnvOption("EMBER_CUDA_GRAPHS", parse_graph_sizes),
    "enforce_eager": EnvOption("EMBER_ENFORCE_EAGER", _parse_bool),
    "grammar_backend": EnvOption("EMBER_GRAMMAR_BACKEND", str),
    "reasoning_parser": EnvOption("EMBER_REASONING_PARSER", str),
    "tool_call_parser": EnvOption("EMBER_TOOL_CALL_PARSER", str),
    "quantize": EnvOption("EMBER_QUANTIZE", str),
    "dequantize": EnvOption("EMBER_DEQUANTIZE", _parse_bool),
    "kv_cache_dtype": EnvOption("EMBER_KV_CACHE_DTYPE", _choice(KV_CACHE_DTYPES)),
    "model_impl": EnvOption("EMBER_MODEL_IMPL", _choice(MODEL_IMPLS)),
    "grammar_compile_timeout": EnvOption("EMBER_GRAMMAR_COMPILE_TIMEOUT", float),
    "grammar_compile_workers": EnvOption("EMBER_GRAMMAR_COMPILE_WORKERS", int),
    "grammar_compile_memory": EnvOption("EMBER_GRAMMAR_COMPILE_MEMORY", int),
    "grammar_compile_priority": EnvOption("EMBER_GRAMMAR_COMPILE_PRIORITY", str),
    "grammar_limits": EnvOption("EMBER_GRAMMAR_LIMITS", str),
    "grammar_repetition_limit": EnvOption("EMBER_GRAMMAR_REPETITION_LIMIT", int),
    "disable_grammar_budget": EnvOption("EMBER_DISABLE_GRAMMAR_BUDGET", _parse_bool),
    "watermark_key": EnvOption("EMBER_WATERMARK_KEY", str),
    "watermark_gamma": EnvOption("EMBER_WATERMARK_GAMMA", float),
    "watermark_delta": EnvOption("EMBER_WATERMARK_DELTA", float),
    "api_key": EnvOption("EMBER_API_KEY", str),
    "chat_url": EnvOption("EMBER_CHAT_URL", str),
    "cors_allow_origin": EnvOption("EMBER_CORS_ALLOW_ORIGIN", parse_names),
    "json_output": EnvOption("EMBER_JSON_OUTPUT", _parse_bool),
    "otlp_endpoint": EnvOption("EMBER_OTLP_ENDPOINT", str),
    "otlp_service_name": EnvOption("EMBER_OTLP_SERVICE_NAME", str),
    "graceful_termination_timeout": EnvOption("EMBER_GRACEFUL_TERMINATION_TIMEOUT", float),
    "request_body_timeout": EnvOption("EMBER_REQUEST_BODY_TIMEOUT", float),
    "root_path": EnvOption("EMBER_ROOT_PATH", str),
    "responses_store_size": EnvOption("EMBER_RESPONSES_STORE_SIZE", int),
    "responses_store_ttl": EnvOption("EMBER_RESPONSES_STORE_TTL", float),
    "speculate": EnvOption("EMBER_SPECULATE", int),
    "tensor_parallel_size": EnvOption("EMBER_TENSOR_PARALLEL_SIZE", int),
    "pipeline_parallel_size": EnvOption("EMBER_PIPELINE_PARALLEL_SIZE", int),
    "speculative_config": EnvOption("EMBER_SPECULATIVE_CONFIG", str),
    "enable_lora": EnvOption("EMBER_ENABLE_LORA", _parse_bool),
    "lora_modules": EnvOption("EMBER_LORA_MODULES", _lora_modules_variable),
    "max_loras": EnvOption("EMBER_MAX_LORAS", int),
    "max_lora_rank": EnvOption("EMBER_MAX_LORA_RANK", int),
    "max_cpu_loras": EnvOption("EMBER_MAX_CPU_LORAS", int),
    "lora_dtype": EnvOption("EMBER_LORA_DTYPE", _choice(("auto", "float32", "bfloat16", "float16"))),
    "enable_lora_runtime_updates": EnvOption("EMBER_ENABLE_LORA_RUNTIME_UPDATES", _parse_bool),
    "pooling": EnvOption("EMBER_POOLING", _choice(("auto", "last", "mean", "cls"))),
    "pooling_normalize": EnvOption("EMBER_POOLING_NORMALIZE", _parse_bool),
    "matryoshka": EnvOption("EMBER_MATRYOSHKA", _parse_bool),
    "score_template": EnvOption("EMBER_SCORE_TEMPLATE", str),
    "score_tokens": EnvOption("EMBER_SCORE_TOKENS", str),
    "limit_mm_per_prompt": EnvOption("EMBER_LIMIT_MM_PER_PROMPT", str),
    "allowed_media_domains": EnvOption("EMBER_ALLOWED_MEDIA_DOMAINS", parse_names),
    "allowed_local_media_path": EnvOption("EMBER_ALLOWED_LOCAL_MEDIA_PATH", str),
    "media_fetch_timeout": EnvOption("EMBER_MEDIA_FETCH_TIMEOUT", float),
    "max_image_bytes": EnvOption("EMBER_MAX_IMAGE_BYTES", lambda text: parse_size_option(text, ValueError)),
    "max_image_pixels": EnvOption("EMBER_MAX_IMAGE_PIXELS", int),
    "encoder_cache_size": EnvOption("EMBER_ENCODER_CACHE_SIZE", int),
}

BUILTIN_DEFAULTS: dict[str, Any] = {
    "log_level": "info",
    "model_id": None,
    "revision": None,
    "dtype": "auto",
    "max_tokens": DEFAULT_MAX_TOKENS,
    "temperature": DEFAULT_TEMPERATURE,
    "top_p": 1.0,
    "top_k": -1,
    "seed": None,
    "chat": False,
    "disable_plugin": [],
    "plugin": [],
    "json": False,
    "hostname": "127.0.0.1",
    "port": 3000,
    "max_concurrent_requests": 128,
    "max_input_tokens": None,
    "max_total_tokens": None,
    "max_batch_prefill_tokens": None,
    "max_batch_total_tokens": None,
    "kv_cache_memory": None,
    "max_batch_size": None,
    "num_threads": None,
    "engine_mode": "process",
    "restart_engine_on_failure": False,
    "max_engine_restarts": 3,
    "max_stop_sequences": 4,
    "payload_limit": 2_000_000,
    "disable_prefix_caching": False,
    "disable_chunked_prefill": False,
    "cuda_graphs": None,  # None: the engine's default sizes where the device has graphs
    "enforce_eager": False,
    "grammar_backend": "outlines",
    "reasoning_parser": None,
    "tool_call_parser": None,
    "quantize": None,
    "dequantize": False,
    "kv_cache_dtype": "auto",
    "model_impl": "auto",
    "grammar_compile_timeout": 60.0,
    "grammar_compile_workers": 1,
    "grammar_compile_memory": 2048,
    "grammar_compile_priority": "idle",
    "grammar_limits": None,
    "grammar_repetition_limit": 12,
    "disable_grammar_budget": False,
    "watermark_key": None,  # None: the watermark plugin's own defaults
    "watermark_gamma": None,
    "watermark_delta": None,
    "api_key": None,
    "chat_url": None,  # `ember chat`: None loads the model in-process
    "cors_allow_origin": [],
    "json_output": False,
    "otlp_endpoint": None,
    "otlp_service_name": "ember",
    "graceful_termination_timeout": 30.0,
    "request_body_timeout": 30.0,
    "root_path": "",
    "responses_store_size": 256,
    "responses_store_ttl": 3600.0,
    "speculate": None,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "speculative_config": None,
    "enable_lora": False,
    "lora_modules": [],
    "max_loras": 1,
    "max_lora_rank": 16,
    "max_cpu_loras": None,  # None: --max-loras
    "lora_dtype": "auto",
    "enable_lora_runtime_updates": False,
    "pooling": "auto",
    "pooling_normalize": None,  # None: the model's sentence-transformers config says
    "matryoshka": None,  # None: the model's config.json says
    "score_template": None,
    "score_tokens": None,  # None: yes,no
    "limit_mm_per_prompt": None,  # None: image=4
    "allowed_media_domains": [],  # none: remote image fetching is off
    "allowed_local_media_path": None,  # None: file:// image URLs are off
    "media_fetch_timeout": 10.0,
    "max_image_bytes": 20 * 1024 * 1024,
    "max_image_pixels": 40_000_000,
    "encoder_cache_size": None,  # None: the engine's default (8192 or a step's token budget)
}
# TGI's variable: LoRA adapters to load at start, added to --lora-modules / EMBER_LORA_MODULES
LORA_ADAPTERS_VARIABLE = "LORA_ADAPTERS"


BACKEND_OPTIONS_VARIABLE = "EMBER_BACKEND_OPTIONS"
# variables that set backend options before options existed: no longer read (a warning
# names the option that replaced each); old name -> (backend, option)
RETIRED_VARIABLES: dict[str, tuple[str, str]] = {
    "EMBER_CPU_PATH": ("cpu", "path"),
    "EMBER_CPU_BF16_COMPUTE": ("cpu", "path"),
    "EMBER_CPU_NATIVE": ("cpu", "native"),
    "EMBER_CPU_LINEAR": ("cpu", "linear"),
    "EMBER_CPU_SMALL_BATCH_ROWS": ("cpu", "small_batch_rows"),
    "EMBER_CPU_DECODE_GROUP_BYTES": ("cpu", "decode_group_bytes"),
    "EMBER_BATCH_INVARIANT": ("cpu", "batch_invariant"),
    "EMBER_QUANT_ISA": ("cpu", "quant_isa"),
    "EMBER_GGUF_X8": ("cpu", "gguf_x8"),
    "EMBER_GGUF_PREFILL": ("cpu", "gguf_prefill"),
    "EMBER_ATTENTION": ("cuda, rocm, xpu, gaudi", "attention"),
    "EMBER_GPU_MEMORY_UTILIZATION": ("cuda, rocm, xpu, gaudi", "gpu_memory_utilization"),
    "EMBER_DEVICE_INDEX": ("cuda, rocm, xpu, gaudi", "device_index"),
}


def retired_variable_warnings(environ: Mapping[str, str]) -> list[str]:
    """One line for each retired variable set in ``environ``: it is ignored, and the
    backend option that replaced it."""
    return [
        f"{name} is no longer read; set the {backend} backend's option instead: --backend-option "
        f"{option}=VALUE (or {BACKEND_OPTIONS_VARIABLE}) -- see `ember backends options NAME`"
        for name, (backend, option) in RETIRED_VARIABLES.items() if environ.get(name)
    ]


def parse_backend_option(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> ``(key, value)``; ValueError when there is no ``=`` or no key."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--backend-option {text!r}: expected KEY=VALUE, e.g. --backend-option linear=plain")
    return key.strip(), value.strip()


def parse_backend_options_json(text: str) -> dict[str, str]:
    """``EMBER_BACKEND_OPTIONS``: a JSON object of option names to strings, numbers or
    booleans (kept as their text); ValueError otherwise."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError('expected a JSON object such as {"linear": "plain"}')
    options = {}
    for key, item in value.items():
        if isinstance(item, bool):
            item = "true" if item else "false"
        elif isinstance(item, (int, float)):
            item = json.dumps(item)
        elif not isinstance(item, str):
            raise ValueError(f"option {key!r}: expected a string, number or boolean, got {json.dumps(item)}")
        options[key] = item
    return options


def resolve_backend_options(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """``args.backend_option`` (the raw --backend-option texts) becomes a dict: the
    options of ``EMBER_BACKEND_OPTIONS``, then each flag's, which wins per key."""
    if not hasattr(args, "backend_option"):
        return
    options: dict[str, str] = {}
    text = environ.get(BACKEND_OPTIONS_VARIABLE, "")
    if text.strip():
        try:
            options.update(parse_backend_options_json(text))
        except ValueError as exc:
            raise UsageError(f"environment variable {BACKEND_OPTIONS_VARIABLE}={text!r} is invalid: {exc}") from None
    for item in args.backend_option or []:
        try:
            key, value = parse_backend_option(item)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        options[key] = value
    args.backend_option = options


def resolve_lora_adapters(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """TGI's ``LORA_ADAPTERS`` adds its adapters to ``args.lora_modules`` (after those of
    --lora-modules, or of EMBER_LORA_MODULES when the flag is not given)."""
    if not hasattr(args, "lora_modules"):
        return
    text = environ.get(LORA_ADAPTERS_VARIABLE, "")
    if not text.strip():
        return
    from ember.api.lora import parse_lora_adapters

    try:
        args.lora_modules = list(args.lora_modules) + parse_lora_adapters(text, "entry")
    except ValueError as exc:
        raise UsageError(f"environment variable {LORA_ADAPTERS_VARIABLE}={text!r} is invalid: {exc}") from None


def apply_defaults(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill every option the command line left unset (None) from its variable, else
    from `BUILTIN_DEFAULTS`. An empty variable is unset, except for a secret: an empty
    secret, from its flag or its variable, is refused (`SECRET_OPTIONS`)."""
    if not hasattr(args, "log_level"):  # SUPPRESSed: given neither before nor after the command
        args.log_level = None
    for dest, default in BUILTIN_DEFAULTS.items():
        if not hasattr(args, dest):
            continue  # not an option of this command
        secret = SECRET_OPTIONS.get(dest)
        if getattr(args, dest) is not None:  # given on the command line
            if secret is not None and getattr(args, dest) == "":
                raise _empty_secret(secret, f"{secret.flag} ''")
            continue
        option = ENV_OPTIONS.get(dest)
        text = environ.get(option.variable) if option else None
        if secret is not None and text == "":
            raise _empty_secret(secret, f"{option.variable}=''")
        if text is None or (text == "" and option.convert is str):
            setattr(args, dest, default)
            continue
        try:
            setattr(args, dest, option.convert(text))
        except ValueError as exc:
            raise UsageError(f"environment variable {option.variable}={text!r} is invalid: {exc}") from None
    resolve_backend_options(args, environ)
    resolve_lora_adapters(args, environ)
