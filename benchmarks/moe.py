"""Grouped sparse-MoE experts against a dense loop over all experts, on a tiny-but-not-trivial
Mixtral (hidden 256, experts of 512, 8 experts, top-2, 4 layers, float32, CPU).

Grouped (Ember's ``StackedExperts.forward``): the (token, expert) pairs sorted by expert,
each expert that got tokens runs once on its rows. Dense: every expert runs on every
token and its output is weighted by the token's routing weight (zero where not routed),
what a naive port does. Two measurements:

* the MoE block alone on batches of 1, 8, 64 and 512 tokens (best of ``--repeats``
  interleaved runs each), outputs checked equal (1e-4);
* whole generation: a continuous batch of greedy requests through ``LLM.generate``
  with each form installed in turn (interleaved, best of ``--repeats``), tokens/s,
  same tokens checked.

Prints the figures and writes a JSON result (the ratio is grouped / dense tokens/s).

    python benchmarks/moe.py [--repeats 3] [--threads 1] [--result-file benchmarks/results/moe.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from ember import LLM, SamplingParams
from ember.models.moe import MoeSpec, SparseMoeBlock, StackedExperts
from ember.testing.tiny_models import make_tiny_model

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
             initializer_range=0.05)
BATCHES = (1, 8, 64, 512)


def dense_forward(self: StackedExperts, x, topk_ids, topk_weights, grouped_mm=None):
    """Every expert on every token, weighted (zero where the token did not pick it)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(self.num_experts):
        weight = (topk_weights * (topk_ids == expert)).sum(-1, keepdim=True)
        out += self.run_expert(expert, x) * weight
    return out.to(x.dtype)


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_block(repeats: int) -> list[dict]:
    torch.manual_seed(0)
    spec = MoeSpec(MODEL["num_local_experts"], MODEL["num_experts_per_tok"], MODEL["intermediate_size"],
                   renormalize=True, float32_weights=True)
    block = SparseMoeBlock(spec, MODEL["hidden_size"], torch.float32, torch.float32, None)
    for tensor in (block.gate.weight, block.experts.w13, block.experts.w2):
        tensor.data.normal_(0, 0.05)
    rows = []
    for num_tokens in BATCHES:
        x = torch.randn(num_tokens, MODEL["hidden_size"])
        ids, weights = block.route(x)
        inner = max(1, 256 // num_tokens)  # enough calls per timing to be above the clock's noise

        def grouped():
            for _ in range(inner):
                block.experts.forward(x, ids, weights, grouped_mm=False)

        def dense():
            for _ in range(inner):
                dense_forward(block.experts, x, ids, weights)

        with torch.inference_mode():
            diff = (block.experts.forward(x, ids, weights, grouped_mm=False)
                    - dense_forward(block.experts, x, ids, weights)).abs().max().item()
            assert diff <= 1e-4, f"grouped and dense differ by {diff} at {num_tokens} tokens"
            times = {"grouped": float("inf"), "dense": float("inf")}
            for _ in range(repeats):  # interleaved: the machine is shared
                times["grouped"] = min(times["grouped"], best_seconds(grouped, 1))
                times["dense"] = min(times["dense"], best_seconds(dense, 1))
        tps = {k: num_tokens * inner / v for k, v in times.items()}
        rows.append({"num_tokens": num_tokens, "experts_hit": int(ids.unique().numel()),
                     "grouped_tokens_per_s": round(tps["grouped"], 1), "dense_tokens_per_s": round(tps["dense"], 1),
                     "ratio": round(tps["grouped"] / tps["dense"], 3)})
        print(f"block, {num_tokens:4d} tokens ({rows[-1]['experts_hit']} of 8 experts hit): grouped "
              f"{tps['grouped']:9.0f} tok/s, dense {tps['dense']:9.0f} tok/s, ratio {rows[-1]['ratio']:.2f}")
    return rows


def bench_generate(repeats: int, num_prompts: int, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model("mixtral", Path(tmp), seed=0, **MODEL)
        llm = LLM(model=tmp, dtype="float32", num_kv_blocks=512, block_size=16)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 300, (16 + 16 * i,), generator=gen).tolist() for i in range(num_prompts)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        grouped_forward = StackedExperts.forward
        best, tokens = {"grouped": float("inf"), "dense": float("inf")}, {}
        try:
            for _ in range(repeats):
                for name, forward in (("grouped", grouped_forward), ("dense", dense_forward)):
                    StackedExperts.forward = forward
                    start = time.perf_counter()
                    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                    best[name] = min(best[name], time.perf_counter() - start)
                    tokens[name] = [o.outputs[0].token_ids for o in outs]
        finally:
            StackedExperts.forward = grouped_forward
    assert tokens["grouped"] == tokens["dense"], "grouped and dense experts gave different tokens"
    total = num_prompts * max_tokens
    tps = {k: total / v for k, v in best.items()}
    print(f"generate, {num_prompts} prompts x {max_tokens} tokens: grouped {tps['grouped']:.0f} tok/s, "
          f"dense {tps['dense']:.0f} tok/s, ratio {tps['grouped'] / tps['dense']:.2f} (same tokens)")
    return {"num_prompts": num_prompts, "max_tokens": max_tokens, "grouped_tokens_per_s": round(tps["grouped"], 1),
            "dense_tokens_per_s": round(tps["dense"], 1), "ratio": round(tps["grouped"] / tps["dense"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch threads (1: steady figures on a shared machine, where threads oversubscribe)")
    parser.add_argument("--result-file", default="benchmarks/results/moe.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    block = bench_block(args.repeats)
    generate = bench_generate(args.repeats, args.num_prompts, args.max_tokens)
    result = {
        "benchmark": "moe_grouped_vs_dense",
        "model": {**MODEL, "dtype": "float32"},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "block": block,
        "generate": generate,
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.result_file} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
