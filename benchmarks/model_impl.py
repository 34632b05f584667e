"""The transformers fallback (--model-impl transformers) against Ember's native code on the
same model: a tiny random Llama (4 layers, hidden 256, 8 heads / 4 KV heads, vocabulary
320) in float32, both engines in this process, the same greedy requests (a continuous
batch of prompts of 16..128 tokens, 32 new tokens each, ignore_eos). Runs are
interleaved (native, fallback, native, ...) and the best of each kept, since the machine
is shared; the figure that matters is the throughput ratio. Also checks that both give
the same tokens. Prints the figures and writes a JSON result.

    python benchmarks/model_impl.py [--num-prompts 8] [--max-tokens 32] [--repeats 3]
        [--result-file benchmarks/results/model_impl.json] [--backend NAME]
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
from ember.testing.tiny_models import make_tiny_model

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.05)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (16 + (i * 37) % 113,), generator=gen).tolist() for i in range(n)]


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return elapsed, sum(len(t) for t in tokens), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result-file", default="benchmarks/results/model_impl.json")
    parser.add_argument("--backend", default=None, help="a backend by name (default: the available one of highest "
                        "priority)")
    args = parser.parse_args()
    if min(args.num_prompts, args.max_tokens, args.repeats) < 1:
        parser.error(f"--num-prompts, --max-tokens and --repeats must be >= 1, got {args.num_prompts}, "
                     f"{args.max_tokens}, {args.repeats}")

    prompts = make_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as model_dir:
        make_tiny_model("llama", Path(model_dir), seed=0, **MODEL)
        engines = {
            impl: LLM(model=model_dir, dtype="float32", num_kv_tokens=args.num_prompts * (128 + args.max_tokens),
                      model_impl=impl, backend=args.backend)
            for impl in ("ember", "transformers")
        }
        for llm in engines.values():  # warm-up: first-call costs out of the timings
            llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(temperature=0, max_tokens=4))
        best = {impl: float("inf") for impl in engines}
        tokens = {}
        for _ in range(args.repeats):
            for impl, llm in engines.items():
                elapsed, num_tokens, tokens[impl] = timed_run(llm, prompts, params)
                best[impl] = min(best[impl], elapsed)

    num_tokens = args.num_prompts * args.max_tokens
    native_tps, fallback_tps = num_tokens / best["ember"], num_tokens / best["transformers"]
    same = tokens["ember"] == tokens["transformers"]
    result = {
        "benchmark": "model_impl",
        "model": {"architecture": "LlamaForCausalLM (tiny, random)", **MODEL, "dtype": "float32"},
        "workload": {"num_prompts": args.num_prompts, "prompt_tokens": [len(p) for p in prompts],
                     "max_tokens": args.max_tokens, "repeats": args.repeats},
        "native_seconds": round(best["ember"], 3),
        "fallback_seconds": round(best["transformers"], 3),
        "native_tokens_per_s": round(native_tps, 1),
        "fallback_tokens_per_s": round(fallback_tps, 1),
        "fallback_over_native": round(fallback_tps / native_tps, 3),
        "same_tokens": same,
        "backend": engines["ember"].engine.core.backend.describe(),
        "machine": {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    print(f"native (ember):          {native_tps:8.1f} tokens/s ({best['ember']:.2f} s)")
    print(f"fallback (transformers): {fallback_tps:8.1f} tokens/s ({best['transformers']:.2f} s)")
    print(f"fallback / native:       {fallback_tps / native_tps:8.3f}; same greedy tokens: {same}")
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
