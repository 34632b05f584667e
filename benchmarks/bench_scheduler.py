"""Scheduler v2 on the default model (SmolLM2-135M-Instruct): what prefix caching and
chunked prefill buy, each as a ratio of two runs in this one process.

1. Prefix caching: 64 requests share a 1,000-token system prompt, each with its own
   20-token question, all arriving at once after one earlier request with the same
   system prompt. Time to first token (arrival to first token) with caching vs
   without.
2. Chunked prefill: 16 requests are streaming when one 3,000-token prompt arrives.
   The worst gap between two tokens of any streaming request, with chunked prefill
   (the backend's default step budget) vs without (the whole prompt in one step).

Token times are taken at each engine step, in the engine's own loop (no HTTP).
Prints the figures and writes a JSON result.

    python benchmarks/bench_scheduler.py [--only prefix|chunked] [--out benchmarks/results/scheduler.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import cpu_model_name  # noqa: E402

SYSTEM_TEXT = (
    "You are a careful assistant for a public library. Answer questions about opening hours, "
    "borrowing rules, fines, events, the reading rooms and the catalogue. Be polite and brief. "
    "If you do not know an answer, say so and suggest asking the front desk. "
)
QUESTION_WORDS = [
    "opening", "hours", "weekend", "children", "books", "renew", "online", "fine", "lost", "card",
    "printer", "wifi", "study", "room", "event", "poetry", "history", "map", "parking", "coffee",
]


def exact_tokens(tokenizer, text: str, n: int) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
        "max": max(values), "min": min(values),
    }


# -- 1. prefix caching -------------------------------------------------------------------------


def ttft_run(model: str | None, enable_prefix_caching: bool, num_requests: int, system_len: int, question_len: int):
    from ember import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=4096, enable_prefix_caching=enable_prefix_caching)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    system = exact_tokens(tokenizer, SYSTEM_TEXT, system_len)
    questions = [
        exact_tokens(tokenizer, " ".join(QUESTION_WORDS[(i + k) % len(QUESTION_WORDS)] for k in range(i % 7, i % 7 + 40)),
                     question_len)
        for i in range(num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # an earlier conversation with the same system prompt (the cache's only source)
    llm.generate(prompt_token_ids=[system + exact_tokens(tokenizer, "What time is it?", question_len)],
                 sampling_params=params)
    start = time.perf_counter()
    ids = [engine.add_request(None, params, prompt_token_ids=system + q) for q in questions]
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
    total = time.perf_counter() - start
    ttft = [first[i] for i in ids]
    return {
        "prefix_caching": enable_prefix_caching, "ttft_s": summary(ttft), "total_s": total,
        "prefix_cache_hit_rate": engine.kv_manager.prefix_hit_rate,
        "step_tokens": engine.scheduler.config.max_num_batched_tokens,
    }


# -- 2. chunked prefill ------------------------------------------------------------------------


def gap_run(model: str | None, chunked: bool, num_streams: int, long_len: int, stream_tokens: int):
    from ember import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=4096, enable_chunked_prefill=chunked, enable_prefix_caching=False)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    stream_params = SamplingParams(temperature=0, max_tokens=stream_tokens, ignore_eos=True)
    streams = [
        engine.add_request(None, stream_params, prompt_token_ids=exact_tokens(tokenizer, f"Story number {i}: once", 24))
        for i in range(num_streams)
    ]
    times: dict[str, list[float]] = {s: [] for s in streams}
    long_id = None
    long_first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in times:
                times[out.request_id].extend([now] * len(out.new_token_ids))
            elif out.request_id == long_id and long_first is None:
                long_first = now - long_arrival
        if long_id is None and min(len(t) for t in times.values()) >= 8:
            long_prompt = exact_tokens(tokenizer, SYSTEM_TEXT, long_len)
            long_arrival = time.perf_counter()
            long_id = engine.add_request(None, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                         prompt_token_ids=long_prompt)
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    return {
        "chunked_prefill": chunked, "step_tokens": engine.scheduler.config.max_num_batched_tokens,
        "worst_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
        "long_prompt_ttft_s": long_first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--only", choices=["prefix", "chunked"], default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=20)
    parser.add_argument("--num-streams", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--stream-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scheduler.json"))
    args = parser.parse_args()

    import torch

    result: dict = {"cpu": cpu_model_name(), "torch_threads": torch.get_num_threads()}
    if args.only in (None, "prefix"):
        on = ttft_run(args.model, True, args.num_requests, args.system_tokens, args.question_tokens)
        off = ttft_run(args.model, False, args.num_requests, args.system_tokens, args.question_tokens)
        ratio = off["ttft_s"]["mean"] / on["ttft_s"]["mean"]
        result["prefix_caching"] = {"with": on, "without": off, "mean_ttft_ratio": ratio,
                                    "p90_ttft_ratio": off["ttft_s"]["p90"] / on["ttft_s"]["p90"]}
        print(f"prefix caching: {args.num_requests} requests, {args.system_tokens}-token shared system prompt")
        for run in (on, off):
            t = run["ttft_s"]
            print(f"  caching {'on ' if run['prefix_caching'] else 'off'}: TTFT mean {t['mean']:.2f} s, "
                  f"p50 {t['p50']:.2f} s, p90 {t['p90']:.2f} s, max {t['max']:.2f} s; all done in {run['total_s']:.1f} s; "
                  f"hit rate {run['prefix_cache_hit_rate']:.2f}")
        print(f"  mean TTFT {ratio:.1f}x faster with caching (bar 4x)")
    if args.only in (None, "chunked"):
        on = gap_run(args.model, True, args.num_streams, args.long_tokens, args.stream_tokens)
        off = gap_run(args.model, False, args.num_streams, args.long_tokens, args.stream_tokens)
        ratio = off["worst_gap_s"] / on["worst_gap_s"]
        result["chunked_prefill"] = {"with": on, "without": off, "worst_gap_ratio": ratio}
        print(f"chunked prefill: a {args.long_tokens}-token prompt arrives while {args.num_streams} requests stream")
        for run in (on, off):
            print(f"  chunked {'on ' if run['chunked_prefill'] else 'off'} (step budget {run['step_tokens']}): "
                  f"worst inter-token gap {run['worst_gap_s']:.2f} s, median {run['median_gap_s'] * 1000:.0f} ms; "
                  f"long prompt's TTFT {run['long_prompt_ttft_s']:.2f} s")
        print(f"  worst gap {ratio:.1f}x smaller with chunked prefill (bar 3x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
