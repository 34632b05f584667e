"""CPU graphs against eager decode steps, in one run, on SmolLM2-135M-Instruct.

For each model form (the default GGUF served natively: Q4_1 layers and Q8_0 head,
float32 compute, float16 KV; its float conversion in bfloat16) two engines are built in
this process, one with CPU graphs (the default) and one with ``enforce_eager=True``,
and each decodes ``--tokens`` greedy tokens for 1, 4 and 16 concurrent requests (chat
prompts, end of text ignored), the two engines taking turns ``--rounds`` times. Each
figure is the best round (the machine's noise only slows a run); the ratio graphs /
eager is the point. Also recorded: the graph sizes captured and the capture time.

    python benchmarks/bench_cpu_graphs.py [--tokens 128] [--rounds 3] [--out benchmarks/results/cpu_graphs.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

BATCHES = (1, 4, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_graphs.json"))
    args = parser.parse_args()

    from bench_offline import make_conversations
    from ember import LLM, SamplingParams
    from ember.api.bench.machine import machine_info
    from ember.weights import resolve_model
    from transformers import AutoTokenizer

    float_dir = str(resolve_model(None, gguf_native=False))
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
               for c in make_conversations(max(BATCHES))]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    result: dict = {"machine": machine_info(), "tokens": args.tokens, "rounds": args.rounds, "models": {}}
    forms = {"q4_1_native": {"model": str(resolve_model(None, gguf_native=True))},
             "bf16": {"model": float_dir, "dtype": "bfloat16"}}
    for form, kwargs in forms.items():
        engines = {}
        for mode in ("graphs", "eager"):
            started = time.perf_counter()
            engines[mode] = LLM(kv_cache_memory_bytes=1 << 30, enforce_eager=mode == "eager", **kwargs)
            core = engines[mode].engine.core
            engines[mode].generate(prompt_token_ids=ids[:2], sampling_params=params)  # warm-up
            if mode == "graphs":
                graphs = core.runner.graphs
                result["models"][form] = {
                    "graph_sizes": list(graphs.sizes) if graphs is not None else [],
                    "capture_seconds": core.graph_capture_seconds, "kv_cache_dtype": str(core.kv_dtype),
                    "load_seconds": time.perf_counter() - started,
                }
        rates: dict[str, dict[int, list[float]]] = {m: {b: [] for b in BATCHES} for m in engines}
        outputs: dict[str, dict[int, list]] = {m: {} for m in engines}
        for _ in range(args.rounds):
            for batch in BATCHES:
                for mode, llm in engines.items():
                    start = time.perf_counter()
                    res = llm.generate(prompt_token_ids=ids[:batch], sampling_params=params)
                    seconds = time.perf_counter() - start
                    rates[mode][batch].append(sum(len(o.outputs[0].token_ids) for o in res) / seconds)
                    outputs[mode][batch] = [list(o.outputs[0].token_ids) for o in res]
        entry = result["models"][form]
        for batch in BATCHES:
            best = {mode: max(rates[mode][batch]) for mode in engines}
            entry[f"batch_{batch}"] = {
                "graphs_tok_s": best["graphs"], "eager_tok_s": best["eager"], "ratio": best["graphs"] / best["eager"],
                "rounds": {m: rates[m][batch] for m in engines},
                "same_tokens": outputs["graphs"][batch] == outputs["eager"][batch],
            }
            print(f"{form} batch {batch}: graphs {best['graphs']:.1f} tok/s, eager {best['eager']:.1f} tok/s, "
                  f"x{best['graphs'] / best['eager']:.2f}, same tokens {entry[f'batch_{batch}']['same_tokens']}",
                  flush=True)
        for llm in engines.values():
            llm.close()
    machine = result["machine"]
    print(f"machine: {machine['cpu_model']}; flags {', '.join(f for f, has in machine['flags'].items() if has)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
