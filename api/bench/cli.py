"""The ``ember bench`` subcommands: ``serve``, ``offline`` and ``compare``.

Registered by `ember.api.cli.build_parser`; handlers return the exit status: 0, or 1
when a request failed (the result is still printed and written). Bad input raises
ValueError (exit 2). Options have no ``EMBER_*`` variables, except that `offline`
reads --model, --revision and --dtype defaults as `ember generate` does, and `serve`
takes --api-key from ``EMBER_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ember.api.bench.datasets import DATASETS

ENDPOINT_CHOICES = ("chat", "completions")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests per second or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().replace("-", "_"), value


def _add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("requests")
    group.add_argument("--dataset", choices=DATASETS, default="chat",
                       help="chat: the synthetic chat set (default); random: random prompts; jsonl: --dataset-path")
    group.add_argument("--num-prompts", metavar="N", type=int, default=None,
                       help="requests to send (default 64; jsonl: every line, repeated to reach N)")
    group.add_argument("--max-tokens", metavar="N", type=int, default=128,
                       help="output tokens per request, chat and jsonl (default 128; a jsonl line may set its own)")
    group.add_argument("--random-input-len", metavar="N", type=int, default=128,
                       help="random: prompt length, in tokens with a tokenizer, else in words (default 128)")
    group.add_argument("--random-output-len", metavar="N", type=int, default=128,
                       help="random: output tokens per request (default 128)")
    group.add_argument("--random-range-ratio", metavar="R", type=float, default=0.0,
                       help="random: lengths uniform in [len*(1-R), len*(1+R)] (default 0: fixed)")
    group.add_argument("--dataset-path", metavar="FILE", default=None,
                       help='jsonl: one {"prompt": str} or {"messages": [...]} per line, optional "max_tokens"')
    group.add_argument("--seed", metavar="S", type=int, default=0, help="seeds prompts and arrival times (default 0)")
    group.add_argument("--temperature", metavar="T", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    group.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="let requests stop at EOS (default: ignore_eos, so every request yields its max_tokens)")


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--request-rate", metavar="R", type=_rate, default=math.inf,
                       help="requests per second (default inf: all at once)")
    group.add_argument("--burstiness", metavar="B", type=float, default=1.0,
                       help="gamma shape of the gaps between arrivals: 1 Poisson (default), <1 burstier, >1 steadier")
    group.add_argument("--max-concurrency", metavar="N", type=int, default=None,
                       help="requests in flight at most (default: no cap)")
    group.add_argument("--num-warmups", metavar="N", type=int, default=0,
                       help="requests sent one by one before the run and not counted (default 0)")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--result-file", metavar="FILE", default=None, help="write the result JSON here")
    group.add_argument("--plot-dir", metavar="DIR", default=None,
                       help='write latency_cdf.png and throughput.png here (needs matplotlib: pip install "ember-serve[bench]")')
    group.add_argument("--label", metavar="NAME", default=None, help="name of this run in the result and in `compare`")
    group.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")


def add_bench_parser(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    bench = commands.add_parser(
        "bench", parents=[common], help="benchmark a server (`serve`), the engine (`offline`), or `compare` results",
        description="Throughput and latency benchmarks. See docs/bench.md.",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve", parents=[common], help="drive an OpenAI-compatible server with streaming requests",
        description="Send streaming chat or completion requests to any OpenAI-compatible server "
        "(Ember, vLLM, TGI, llama.cpp) and report throughput, TTFT, TPOT, ITL and end-to-end latency.",
    )
    target = serve.add_argument_group("server")
    target.add_argument("--base-url", metavar="URL", required=True, help="e.g. http://127.0.0.1:3000 (a trailing /v1 is fine)")
    target.add_argument("--model", dest="model_name", metavar="NAME", default=None,
                        help="model name sent with each request (default: the first of GET /v1/models)")
    target.add_argument("--endpoint", choices=ENDPOINT_CHOICES, default="chat",
                        help="chat: /v1/chat/completions (default); completions: /v1/completions")
    target.add_argument("--api-key", metavar="KEY", default=None,
                        help="sent as `Authorization: Bearer KEY` [EMBER_API_KEY, as `ember serve` reads it]")
    target.add_argument("--extra-body", metavar="JSON", type=_json_object, default={},
                        help="fields merged into every request body, e.g. '{\"top_p\": 0.9}'")
    target.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="a model directory or cached hub id whose tokenizer makes random prompts of exact token "
                        "lengths and counts tokens when the server sends no usage")
    target.add_argument("--timeout", metavar="S", type=float, default=600.0,
                        help="seconds to wait for the server's next bytes before a request fails (default 600)")
    _add_dataset_arguments(serve)
    _add_load_arguments(serve)
    _add_output_arguments(serve)
    serve.set_defaults(handler=run_bench_serve)

    offline = sub.add_parser(
        "offline", parents=[common], help="the same figures for the in-process engine",
        description="Run the same requests through the in-process engine (no HTTP) and report the same figures.",
    )
    model = offline.add_argument_group("model")
    model.add_argument("--model", dest="model_id", metavar="M", default=None,
                       help="model directory, .gguf file or cached hub id (default: SmolLM2-135M-Instruct) [EMBER_MODEL_ID]")
    model.add_argument("--revision", metavar="R", default=None, help="hub revision [EMBER_REVISION]")
    model.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                       help="weights dtype (default auto) [EMBER_DTYPE]")
    model.add_argument("--engine-arg", metavar="KEY=VALUE", type=_engine_arg, action="append", default=[],
                       help="an EngineConfig field, e.g. max_num_seqs=64 (repeatable; VALUE is read as JSON if it can be)")
    _add_dataset_arguments(offline)
    _add_load_arguments(offline)
    _add_output_arguments(offline)
    offline.set_defaults(handler=run_bench_offline)

    compare = sub.add_parser(
        "compare", parents=[common], help="a side-by-side table of result files",
        description="Print the figures of two or more result files side by side, with each one's ratio to the first.",
    )
    compare.add_argument("result_files", metavar="RESULT", nargs="+", help="result JSON files (the first is the base)")
    compare.add_argument("--labels", metavar="NAME", nargs="+", default=None, help="column names (default: each result's label)")
    compare.add_argument("--plot-dir", metavar="DIR", default=None, help="also plot the results together here")
    compare.set_defaults(handler=run_bench_compare)


# -- handlers ----------------------------------------------------------------------------------


def _dataset_spec(args: argparse.Namespace):
    from ember.api.bench.datasets import DatasetSpec

    return DatasetSpec(
        name=args.dataset, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
        input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, path=args.dataset_path, seed=args.seed,
    )


def _load_config(args: argparse.Namespace):
    from ember.api.bench.serve import LoadConfig

    return LoadConfig(
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        seed=args.seed, num_warmups=args.num_warmups, show_progress=args.progress,
        **({"timeout_s": args.timeout} if hasattr(args, "timeout") else {}),
    )


def _dataset_config(spec) -> dict[str, Any]:
    config = {"dataset": spec.name, "num_prompts": spec.num_prompts, "seed": spec.seed}
    if spec.name == "random":
        config.update(random_input_len=spec.input_len, random_output_len=spec.output_len,
                      random_range_ratio=spec.range_ratio)
    else:
        config["max_tokens"] = spec.max_tokens
    if spec.name == "jsonl":
        config["dataset_path"] = spec.path
    return config


def _check_output_paths(args: argparse.Namespace) -> None:
    """Fail before the run, not after it, on outputs that cannot be written."""
    if args.plot_dir is not None:
        from ember.api.bench.plots import require_matplotlib

        require_matplotlib()
    if args.result_file is not None:
        parent = Path(args.result_file).resolve().parent
        if not parent.is_dir():
            raise ValueError(f"--result-file {args.result_file!r}: folder {str(parent)!r} does not exist")


def _finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    from ember.api.bench.report import format_summary

    print(format_summary(result))
    spec = result.get("speculation")
    if spec:
        print(f"speculation ({spec['method']}): {spec['num_draft_tokens']} draft tokens, acceptance rate "
              f"{spec['acceptance_rate']:.2f}, mean accepted length {spec['mean_accepted_length']:.2f}")
    if args.result_file is not None:
        try:
            Path(args.result_file).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--result-file {args.result_file!r} could not be written: {exc}") from None
        print(f"result written to {args.result_file}")
    if args.plot_dir is not None:
        from ember.api.bench.plots import write_plots

        for path in write_plots([result], args.plot_dir):
            print(f"plot written to {path}")
    sys.stdout.flush()
    return 1 if result["num_failed"] else 0


def run_bench_serve(args: argparse.Namespace) -> int:
    from ember.api.bench.client import ClientConfig, normalize_base_url
    from ember.api.bench.datasets import create_requests
    from ember.api.bench.serve import benchmark_serve

    _check_output_paths(args)
    spec = _dataset_spec(args)
    load = _load_config(args)
    client = ClientConfig(
        base_url=normalize_base_url(args.base_url), model=args.model_name or "", endpoint=args.endpoint,
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body,
        api_key=args.api_key or os.environ.get("EMBER_API_KEY") or None,
    )
    tokenizer = None
    if args.tokenizer is not None:
        from ember.models.tokenizer import load_tokenizer
        from ember.weights import resolve_model

        tokenizer = load_tokenizer(resolve_model(args.tokenizer, progress=args.progress))
    requests = create_requests(spec, tokenizer)
    extra = {**_dataset_config(spec), "tokenizer": args.tokenizer}
    before = _server_speculation(client)
    result = benchmark_serve(client, load, requests, tokenizer, args.label, extra)
    after = _server_speculation(client)
    if before is not None and after is not None:
        result["speculation"] = speculation_delta(before, after)
    return _finish(result, args)


def _server_speculation(client) -> dict | None:
    """The server's speculation counters from its ``/info`` (Ember's), or None where it
    has none (speculation off, or a server without them)."""
    import httpx

    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    try:
        info = httpx.get(client.base_url.rstrip("/") + "/info", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    spec = info.get("speculation") if isinstance(info, dict) else None
    return spec if isinstance(spec, dict) else None


def speculation_delta(before: dict, after: dict) -> dict:
    """Speculation figures of what ran between two snapshots of the counters."""
    counts = ("num_steps", "num_proposals", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")
    delta = {key: after[key] - before[key] for key in counts}
    delta["method"] = after["method"]
    delta["acceptance_rate"] = delta["num_accepted_tokens"] / delta["num_draft_tokens"] if delta["num_draft_tokens"] else 0.0
    delta["mean_accepted_length"] = delta["num_emitted_tokens"] / delta["num_proposals"] if delta["num_proposals"] else 0.0
    return delta


def run_bench_offline(args: argparse.Namespace) -> int:
    from ember.api.bench.datasets import create_requests
    from ember.api.bench.offline import benchmark_offline
    from ember.config import EngineConfig
    from ember.engine.llm_engine import LLMEngine

    _check_output_paths(args)
    spec = _dataset_spec(args)
    load = _load_config(args)
    engine_args = dict(args.engine_arg)
    try:
        config = EngineConfig(model=args.model_id, revision=args.revision, dtype=args.dtype, **engine_args)
    except TypeError as exc:  # an unknown field
        raise ValueError(f"--engine-arg: {exc}") from None
    engine = LLMEngine(config)
    requests = create_requests(spec, engine.tokenizer)
    extra = {**_dataset_config(spec), "model": args.model_id, "dtype": args.dtype, "engine_args": engine_args}
    label = args.label or f"offline:{Path(str(args.model_id)).name if args.model_id else 'default'}"
    result = benchmark_offline(engine, requests, load, args.temperature, args.ignore_eos, label, extra)
    speculator = engine.core.speculator
    if speculator is not None:
        result["speculation"] = speculator.stats.to_dict()
    return _finish(result, args)


def run_bench_compare(args: argparse.Namespace) -> int:
    from ember.api.bench.report import format_comparison, load_result

    if len(args.result_files) < 2:
        raise ValueError("compare needs at least two result files")
    if args.labels is not None and len(args.labels) != len(args.result_files):
        raise ValueError(f"{len(args.result_files)} result files but {len(args.labels)} --labels")
    results = [load_result(path) for path in args.result_files]
    labels = args.labels or [str(r.get("label") or Path(p).stem) for r, p in zip(results, args.result_files)]
    if len(set(labels)) < len(labels):
        labels = [Path(p).name for p in args.result_files]
    if args.plot_dir is not None:
        from ember.api.bench.plots import write_plots

        results_for_plot = [{**r, "label": label} for r, label in zip(results, labels)]
        paths = write_plots(results_for_plot, args.plot_dir)
    print(format_comparison(results, labels))
    if args.plot_dir is not None:
        for path in paths:
            print(f"plot written to {path}")
    return 0
