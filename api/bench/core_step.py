"""The engine-core benchmark (Ember issue 13): one run, the same requests back to back.

    python -m ember.api.bench.core_step --dtype bfloat16 --baseline-python /tmp/base/.venv/bin/python \\
        --out core_step.json

Four figures, in this order:

1. **Offline throughput**: the chat set (``--num-prompts`` x ``--max-tokens``, greedy,
   ``ignore_eos``) through the in-process engine (`benchmark_offline`), at most
   ``--offline-concurrency`` requests running (default: the first ``--concurrency``).
2. **Served throughput and latency**: ``ember serve`` started as a subprocess on a free
   port with the same model and dtype; the same requests as streaming chat requests
   (`benchmark_serve`) at each ``--concurrency`` (default 64 and 128), then SIGTERM.
   The ratio served/offline is taken at the first concurrency (the issue's bar: >= 0.95).
   TTFT and ITL p50/p99 are reported per concurrency.
3. **Batch-1 decode** tok/s: one request (the first chat prompt), ``--decode-tokens``
   new tokens, greedy, ``ignore_eos``; tokens after the first divided by the time
   from the first token to the last.
4. **Per-step Python overhead** of those batch-1 decode steps: the wall time of
   ``engine.step()`` minus the time spent in the model (``engine.model.forward`` and
   ``compute_logits``, wrapped with timers; the backend is synchronized around them).

3 and 4 run in a fresh interpreter through a self-contained snippet (`measure_decode`,
shipped with ``python -c``) that uses only APIs that older installs have too
(``LLMEngine``, ``EngineConfig``, ``SamplingParams``, ``add_request``, ``step``,
``model``): once with this Python ("after") and, with ``--baseline-python``, once with
another install's Python ("before", e.g. a worktree of an earlier commit).

The result JSON (``--out``) holds the machine, every figure (``figures``), and the
details of each part. Exit status: 0; 1 when a request failed or the served and
offline runs made different numbers of tokens; 2 for bad input. See docs/bench.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ember.api.bench.decode_step import run_decode
from ember.api.bench.machine import machine_info

SCHEMA = "ember-core-step/1"
RATIO_BAR = 0.95


# -- offline and served ------------------------------------------------------------------------


def _strip(result: dict[str, Any]) -> dict[str, Any]:
    """A bench result without its per-request records (large; `ember bench` writes them)."""
    return {k: v for k, v in result.items() if k != "requests"}


def run_offline(model_dir: str, dtype: str, requests: list, concurrency: int | None, num_warmups: int,
                engine_args: dict[str, Any], progress: bool) -> dict[str, Any]:
    """`benchmark_offline` of `requests` on a fresh engine, freed afterwards."""
    from ember.api.bench.offline import benchmark_offline
    from ember.api.bench.serve import LoadConfig
    from ember.config import EngineConfig
    from ember.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, **engine_args))
    try:
        load = LoadConfig(max_concurrency=concurrency, num_warmups=num_warmups, show_progress=progress)
        return benchmark_offline(engine, requests, load, 0.0, True, "offline",
                                 {"model": model_dir, "dtype": dtype, "engine_args": engine_args})
    finally:
        del engine
        gc.collect()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ember_command() -> list[str]:
    exe = shutil.which("ember", path=os.path.dirname(sys.executable))
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from ember.api.cli import main; sys.exit(main())"]


def run_served(model_dir: str, dtype: str, requests: list, concurrencies: list[int], num_warmups: int,
               serve_args: list[str], startup_timeout_s: float, progress: bool) -> dict[str, Any]:
    """Start `ember serve`, run the requests at each concurrency, stop it (SIGTERM)."""
    import httpx

    from ember.api.bench.client import ClientConfig
    from ember.api.bench.serve import LoadConfig, benchmark_serve

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*_ember_command(), "serve", "--model-id", model_dir, "--dtype", dtype, "--hostname", "127.0.0.1",
               "--port", str(port), "--max-concurrent-requests", str(max(128, *concurrencies)), *serve_args]
    with tempfile.TemporaryDirectory(prefix="ember-core-step-serve-") as work:
        log_path = Path(work) / "serve.log"
        with open(log_path, "w") as log:
            started = time.perf_counter()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = started + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"ember serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"ember serve was not healthy within {startup_timeout_s:.0f} s:\n"
                                       f"{log_path.read_text()[-3000:]}")
                time.sleep(0.1)
            startup_s = time.perf_counter() - started
            results = {}
            for concurrency in concurrencies:
                load = LoadConfig(max_concurrency=concurrency, num_warmups=num_warmups, show_progress=progress)
                client = ClientConfig(base_url=url, model="", endpoint="chat", temperature=0.0, ignore_eos=True)
                results[str(concurrency)] = benchmark_serve(client, load, requests, None, f"served@{concurrency}",
                                                            {"model": model_dir, "dtype": dtype})
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return {"command": command, "startup_to_healthy_s": startup_s, "results": results}


# -- figures, table ----------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def build_figures(offline: dict | None, served: dict | None, ratio_concurrency: int | None,
                  after: dict | None, before: dict | None) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    if offline is not None:
        figures["offline_tok_s"] = offline["output_throughput"]
    if served is not None:
        figures["served"] = {
            c: {
                "tok_s": r["output_throughput"],
                "ttft_ms_p50": r["ttft_ms"]["p50"], "ttft_ms_p99": r["ttft_ms"]["p99"],
                "itl_ms_p50": r["itl_ms"]["p50"], "itl_ms_p99": r["itl_ms"]["p99"],
            }
            for c, r in served["results"].items()
        }
    if offline is not None and served is not None:
        ratio = _ratio(served["results"][str(ratio_concurrency)]["output_throughput"], offline["output_throughput"])
        figures["served_over_offline"] = {"concurrency": ratio_concurrency, "ratio": ratio, "bar": RATIO_BAR,
                                          "met": ratio is not None and ratio >= RATIO_BAR}
    if after is not None:
        for key in ("decode_tok_s", "step_overhead_ms_mean", "step_overhead_ms_p50"):
            b = before.get(key) if before else None
            figures[key] = {"before": b, "after": after.get(key), "after_over_before": _ratio(after.get(key), b)}
    return figures


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(result: dict[str, Any]) -> str:
    m = result["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    lines = [f"============ ember core_step: {result['config']['model']} ({result['config']['dtype']}) ============",
             f"machine: {m['cpu_model']}; {m['usable_cores']} of {m['cores']} cores; {flags}"]
    f = result["figures"]
    if "offline_tok_s" in f:
        lines.append(f"{'offline output throughput (tok/s)':<44}{_fmt(f['offline_tok_s']):>12}"
                     f"   (at most {_fmt(result['offline']['concurrency'])} running)")
    if "served" in f:
        lines.append(f"{'served, streaming chat':<24}{'tok/s':>10}{'TTFT p50':>11}{'TTFT p99':>11}"
                     f"{'ITL p50':>11}{'ITL p99':>11}  (ms)")
        for c, s in f["served"].items():
            lines.append(f"{'  concurrency ' + c:<24}{_fmt(s['tok_s']):>10}{_fmt(s['ttft_ms_p50']):>11}"
                         f"{_fmt(s['ttft_ms_p99']):>11}{_fmt(s['itl_ms_p50']):>11}{_fmt(s['itl_ms_p99']):>11}")
    if "served_over_offline" in f:
        r = f["served_over_offline"]
        lines.append(f"{'served@' + str(r['concurrency']) + ' / offline':<44}{_fmt(r['ratio'], 3):>12}"
                     f"   (bar >= {r['bar']}: {'met' if r['met'] else 'NOT met'})")
    if "decode_tok_s" in f:
        lines.append(f"{'batch-1 decode':<32}{'before':>12}{'after':>12}{'after/before':>14}")
        for key, label in (("decode_tok_s", "decode tok/s"), ("step_overhead_ms_mean", "step overhead ms, mean"),
                           ("step_overhead_ms_p50", "step overhead ms, p50")):
            v = f[key]
            lines.append(f"{'  ' + label:<32}{_fmt(v['before'], 3):>12}{_fmt(v['after'], 3):>12}"
                         f"{_fmt(v['after_over_before'], 3):>14}")
        for which in ("after", "before"):
            d = result["decode"].get(which)
            if d:
                lines.append(f"  {which}: {d['python']} (commit {d.get('git_commit') or '?'}); step {_fmt(d['step_ms_mean'], 3)}"
                             f" ms = model {_fmt(d['model_ms_mean'], 3)} ms + overhead; timed {'+'.join(d['timed_methods'])}")
    for warning in result["warnings"]:
        lines.append(f"WARNING: {warning}")
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    from ember.api.bench.cli import _engine_arg

    p = argparse.ArgumentParser(prog="python -m ember.api.bench.core_step",
                                description=__doc__.split("\n\n")[0] + " See docs/bench.md.")
    p.add_argument("--model", default=None,
                   help="model directory, .gguf file or cached hub id (default: as `ember serve`: EMBER_MODEL_ID, "
                   "else SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="weights dtype (default: EMBER_DTYPE, else auto)")
    p.add_argument("--num-prompts", type=int, default=128, help="requests of the chat set (default 128)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--concurrency", type=_concurrencies, default=[64, 128],
                   help="served concurrencies, comma-separated (default 64,128); the ratio is taken at the first")
    p.add_argument("--offline-concurrency", type=int, default=None,
                   help="offline: requests running at most (default: the first --concurrency; 0: no cap)")
    p.add_argument("--num-warmups", type=int, default=2,
                   help="requests sent one by one before each offline and served run, not counted (default 2)")
    p.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode: new tokens (default 128)")
    p.add_argument("--decode-runs", type=int, default=3,
                   help="batch-1 decode: measured runs, after a warm-up (default 3; tok/s is their median)")
    p.add_argument("--baseline-python", metavar="PATH", default=None,
                   help="the Python of another install, for the 'before' batch-1 figures")
    p.add_argument("--only", choices=("served", "decode"), default=None,
                   help="run only offline+served, or only the batch-1 decode part")
    p.add_argument("--num-threads", type=int, default=None,
                   help="host threads of every engine: offline, `ember serve --num-threads`, batch-1 decode "
                   "(default: the backend's own choice, as `ember serve`)")
    p.add_argument("--engine-arg", metavar="KEY=VALUE", type=_engine_arg, action="append", default=[],
                   help="offline: an EngineConfig field (repeatable), as `ember bench offline`")
    p.add_argument("--serve-args", metavar="ARGS", default="",
                   help="more `ember serve` options, one string, e.g. '--max-batch-total-tokens 4096'")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for `ember serve` to be healthy")
    p.add_argument("--decode-timeout", type=float, default=1800.0, help="seconds for each batch-1 decode run")
    p.add_argument("--out", metavar="FILE", default=None, help="write the result JSON here ('-': stdout)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ember.api.bench.datasets import DatasetSpec, create_requests
    from ember.engine.input_processor import apply_chat_template
    from ember.models.tokenizer import load_tokenizer
    from ember.weights import resolve_model

    for flag, value in (("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens),
                        ("--decode-tokens", args.decode_tokens), ("--decode-runs", args.decode_runs)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.out not in (None, "-") and not Path(args.out).resolve().parent.is_dir():
        raise ValueError(f"--out {args.out!r}: its folder does not exist")
    if args.baseline_python is not None and not os.access(args.baseline_python, os.X_OK):
        raise ValueError(f"--baseline-python {args.baseline_python!r} is not an executable")
    dtype = args.dtype or os.environ.get("EMBER_DTYPE") or "auto"
    model_id = args.model or os.environ.get("EMBER_MODEL_ID") or None
    model_dir = str(resolve_model(model_id, progress=args.progress))
    offline_concurrency = args.concurrency[0] if args.offline_concurrency is None else (args.offline_concurrency or None)
    engine_args = dict(args.engine_arg)
    serve_args = shlex.split(args.serve_args)
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        engine_args.setdefault("num_threads", args.num_threads)
        serve_args += ["--num-threads", str(args.num_threads)]
    tokenizer = load_tokenizer(Path(model_dir))
    requests = create_requests(DatasetSpec(name="chat", num_prompts=args.num_prompts, max_tokens=args.max_tokens))

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "model": model_id or "default", "model_dir": model_dir, "dtype": dtype, "dataset": "chat",
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "concurrency": args.concurrency, "offline_concurrency": offline_concurrency,
            "num_warmups": args.num_warmups, "num_threads": args.num_threads, "engine_args": engine_args,
            "serve_args": serve_args,
            "decode_tokens": args.decode_tokens, "decode_runs": args.decode_runs,
            "baseline_python": args.baseline_python, "only": args.only,
        },
        "machine": machine_info(),
        "warnings": [],
    }
    offline = served = after = before = None
    status = 0
    if args.only != "decode":
        print(f"offline: {len(requests)} requests x {args.max_tokens} tokens ...", file=sys.stderr, flush=True)
        offline = run_offline(model_dir, dtype, requests, offline_concurrency, args.num_warmups, engine_args,
                              args.progress)
        print(f"served at concurrency {', '.join(map(str, args.concurrency))} ...", file=sys.stderr, flush=True)
        served = run_served(model_dir, dtype, requests, args.concurrency, args.num_warmups,
                            serve_args, args.startup_timeout, args.progress)
        runs = {"offline": offline, **{f"served@{c}": r for c, r in served["results"].items()}}
        for name, r in runs.items():
            if r["num_failed"]:
                status = 1
                result["warnings"].append(f"{name}: {r['num_failed']} request(s) failed: {r['errors']}")
        tokens = {name: r["total_output_tokens"] for name, r in runs.items()}
        if len(set(tokens.values())) > 1:
            status = 1
            result["warnings"].append(f"the runs made different numbers of output tokens: {tokens}")
        result["offline"] = {"concurrency": offline_concurrency, "result": _strip(offline)}
        result["served"] = {"command": served["command"], "startup_to_healthy_s": served["startup_to_healthy_s"],
                            "results": {c: _strip(r) for c, r in served["results"].items()}}
    if args.only != "served":
        messages = requests[0].as_messages()
        prompt_ids = tokenizer.encode(apply_chat_template(tokenizer, messages), add_special_tokens=False)
        spec = {"model": model_dir, "dtype": dtype, "prompt_token_ids": prompt_ids,
                "decode_tokens": args.decode_tokens, "runs": args.decode_runs, "num_threads": args.num_threads}
        print("batch-1 decode, after (this install) ...", file=sys.stderr, flush=True)
        after = run_decode(sys.executable, spec, args.decode_timeout)
        if args.baseline_python is not None:
            print(f"batch-1 decode, before ({args.baseline_python}) ...", file=sys.stderr, flush=True)
            before = run_decode(args.baseline_python, spec, args.decode_timeout)
        for which, d in (("after", after), ("before", before)):
            if d is not None and not d["model_ms_mean"]:
                result["warnings"].append(f"{which}: no model time was measured (the engine does not call "
                                          f"engine.model.forward/compute_logits): its step overhead is the whole step")
        result["decode"] = {"prompt_tokens": len(prompt_ids), "after": after, "before": before}
    result["figures"] = build_figures(offline, served, args.concurrency[0], after, before)

    print(format_table(result), file=sys.stderr if args.out == "-" else sys.stdout, flush=True)
    text = json.dumps(result, indent=1) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    elif args.out is not None:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"result written to {args.out}", flush=True)
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
