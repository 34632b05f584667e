"""Long prompts on the default model (SmolLM2-135M-Instruct), each figure a ratio of
two runs in this one process:

1. Prefill: one request of N prompt tokens (random ids, prefix caching off), time
   to its first token in Ember against one transformers forward pass over the same
   ids (`logits_to_keep=1`), for each dtype asked (the CPU paths: float32 and
   bfloat16).
2. A long prompt beside streams: 16 requests decode, then an N-token prompt arrives;
   the worst gap between two steps (every stream gets a token per step) while it is
   prefilled, with Ember's context-weighted chunks and without them
   (`SchedulerConfig.prefill_context_scale = None`).

Prints the figures and writes a JSON result (with lscpu's model name and flags).

    python benchmarks/bench_prefill.py [--dtypes float32,bfloat16] [--lengths 512,2048,4096]
        [--gap-length 4096] [--out benchmarks/results/prefill.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import cpu_model_name  # noqa: E402


def cpu_flags() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return [f for f in line.split(":", 1)[1].split() if f in wanted]
    except OSError:
        pass
    return []


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(100, 40000) for _ in range(n)]


def ember_prefill(llm, ids: list[int]) -> float:
    from ember import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def transformers_forward(model, ids: list[int]) -> float:
    import torch

    with torch.inference_mode():
        model(torch.tensor([ids[:64]]))  # warm
        start = time.perf_counter()
        model(torch.tensor([ids]), logits_to_keep=1)
        return time.perf_counter() - start


def gap_beside_streams(llm, length: int, weighted: bool, seed: int) -> dict:
    from ember import SamplingParams

    engine = llm.engine
    sched = engine.core.scheduler
    config = sched.config
    if not weighted:
        sched.config = dataclasses.replace(config, prefill_context_scale=None)
    try:
        streams = [
            engine.add_request(None, SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True),
                               prompt_token_ids=random_ids(20, seed + i))
            for i in range(16)
        ]
        for _ in range(5):
            engine.step()
        long_id = engine.add_request(None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                     prompt_token_ids=random_ids(length, seed))
        gaps, start = [], time.perf_counter()
        while True:
            t0 = time.perf_counter()
            outputs = engine.step()
            gaps.append(time.perf_counter() - t0)
            if any(o.request_id == long_id and o.finished for o in outputs):
                break
        ttft = time.perf_counter() - start
        for request_id in streams:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        sched.config = config
    return {"worst_gap_s": max(gaps), "steps": len(gaps), "long_prompt_ttft_s": ttft}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--gap-length", type=int, default=4096, help="0: skip the streams scenario")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill.json"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from ember import LLM
    from ember.config import EngineConfig
    from ember.weights import resolve_model

    lengths = [int(x) for x in args.lengths.split(",") if x]
    result = {"cpu": cpu_model_name(), "flags": cpu_flags(), "torch": torch.__version__, "prefill": {}, "gap": {}}
    print(f"machine: {result['cpu']}; flags {' '.join(result['flags'])}; torch {torch.__version__}")
    path = resolve_model(EngineConfig().model, None)
    for dtype in [d for d in args.dtypes.split(",") if d]:
        llm = LLM(dtype=dtype, enable_prefix_caching=False, max_model_len=max(lengths + [args.gap_length]) + 64)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        rows = []
        for n in lengths:
            ids = random_ids(n, n)
            ember_s = ember_prefill(llm, ids)
            hf_s = transformers_forward(hf, ids)
            rows.append({"tokens": n, "ember_tok_s": n / ember_s, "transformers_tok_s": n / hf_s,
                         "ratio": hf_s / ember_s})
            print(f"prefill {dtype:8s} {n:6d} tokens: Ember {n / ember_s:7.0f} tok/s, transformers forward "
                  f"{n / hf_s:7.0f} tok/s, ratio {hf_s / ember_s:.2f} (bar 1.5)", flush=True)
        result["prefill"][dtype] = rows
        del hf
        if args.gap_length:
            off = gap_beside_streams(llm, args.gap_length, False, 7)
            on = gap_beside_streams(llm, args.gap_length, True, 7)
            result["gap"][dtype] = {"length": args.gap_length, "unweighted": off, "weighted": on}
            print(f"{dtype}: {args.gap_length}-token prompt beside 16 streams, worst gap: unweighted "
                  f"{off['worst_gap_s']:.2f} s, context-weighted {on['worst_gap_s']:.2f} s (bar < 1 s); its TTFT "
                  f"{off['long_prompt_ttft_s']:.1f} s / {on['long_prompt_ttft_s']:.1f} s", flush=True)
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
