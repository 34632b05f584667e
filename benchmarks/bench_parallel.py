"""Tensor parallelism on this machine's CPU (issue 19): SmolLM2-135M (the default model)
at tensor_parallel_size 1 and 2, and pipeline_parallel_size 2, fp32, in one run.

For each configuration: start-up seconds, batch-1 decode tokens/s (one prompt, 128
tokens) and offline tokens/s (16 prompts x 64 tokens in one ``generate``), greedy, plus
each rank's resident weight bytes; the greedy outputs of every configuration are
compared with TP=1's.

Expect no speedup on a 2-core machine: the ranks share the same two cores (each rank
gets one thread where one process had two), each rank's all-reduces (two per layer,
60 per forward pass of SmolLM2's 30 layers) and the per-step broadcast of the
scheduler's output are pure overhead on the host's memory, and a 135M-parameter model
is too small for half of it to be worth the messages. Tensor parallelism pays where
each rank has its own device (and its own memory bandwidth): benchmarks/device_check.py
measures that on a multi-GPU machine.

    python benchmarks/bench_parallel.py [--out benchmarks/results/parallel.json]

Run it only while /tmp/ember-quiet does not exist (it creates it and removes it after).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

QUIET = Path("/tmp/ember-quiet")
PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):", "Once upon a time",
    "The three laws of thermodynamics are", "List five fruits:", "Translate to French: good morning",
    "Why is the sky blue?", "The quick brown fox", "In 1969, the first", "A recipe for pancakes:",
    "The largest planet is", "import numpy as np\n", "Dear team,", "Summarize: cats are mammals.", "Q: 2+2? A:",
]


def run(parallel: dict, max_decode: int, max_offline: int) -> dict:
    from ember import LLM, SamplingParams

    started = time.perf_counter()
    from ember.weights import resolve_model

    # the float32 conversion of the default GGUF in every configuration (TP=1 would
    # otherwise run the Q4_1 weights natively; sharded engines load the float form)
    model = str(resolve_model(None, gguf_native=False))
    with LLM(model, dtype="float32", num_kv_blocks=512, block_size=16, seed=0, **parallel) as llm:
        startup = time.perf_counter() - started
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(PROMPTS[:2], warm)
        params = SamplingParams(temperature=0, max_tokens=max_decode, ignore_eos=True)
        t = time.perf_counter()
        single = llm.generate(PROMPTS[0], params)
        decode_tps = max_decode / (time.perf_counter() - t)
        params = SamplingParams(temperature=0, max_tokens=max_offline, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        offline_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
        core = llm.engine.core
        if core.parallel is not None:
            ranks = [r.weight_bytes for r in core.parallel.describe_ranks()]
        else:
            ranks = [sum(p.numel() * p.element_size() for p in core.model.parameters())]
        threads = core.num_threads
    return {
        **parallel, "startup_seconds": round(startup, 1), "threads_per_rank": threads,
        "decode_batch1_tokens_per_s": round(decode_tps, 2), "offline_16x64_tokens_per_s": round(offline_tps, 2),
        "rank_weight_bytes": ranks,
        "_tokens": [single[0].outputs[0].token_ids] + [o.outputs[0].token_ids for o in outs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/parallel.json")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--offline-tokens", type=int, default=64)
    args = parser.parse_args()
    if QUIET.exists():
        print(f"{QUIET} exists ({QUIET.read_text().strip()} is benchmarking): try again when it is gone")
        return 1
    QUIET.write_text("bench_parallel\n")
    try:
        from ember.api.bench.machine import machine_info

        machine = machine_info()
        print(f"machine: {machine}", flush=True)
        results = []
        for parallel in ({}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
            result = run(parallel, args.decode_tokens, args.offline_tokens)
            results.append(result)
            shown = {k: v for k, v in result.items() if not k.startswith("_")}
            print(json.dumps(shown), flush=True)
        reference = results[0].pop("_tokens")
        for result in results[1:]:
            tokens = result.pop("_tokens")
            result["identical_to_tp1"] = sum(a == b for a, b in zip(tokens, reference))
            result["of"] = len(reference)
            for key in ("decode_batch1_tokens_per_s", "offline_16x64_tokens_per_s"):
                result[key.replace("tokens_per_s", "vs_tp1")] = round(result[key] / results[0][key], 3)
        out = {"model": "SmolLM2-135M-Instruct (default model), float32", "machine": machine, "results": results,
               "command": "python benchmarks/bench_parallel.py"}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    finally:
        QUIET.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
