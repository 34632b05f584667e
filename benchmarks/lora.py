"""Multi-LoRA serving cost (issue 32), as ratios within one process: the same engine serves
the base model and random LoRA adapters (rank 8 on q, k, v, o, gate, up and down of every
layer, as ``peft`` saves them) of the default model unless ``--model`` says otherwise.

1. **mixed**: 64 concurrent requests spread over 8 adapters (8 each) against 64 on the
   base model: generated tokens per second, ratio adapters / base (bar >= 0.8);
2. **batch 1**: one request's decode with an adapter against the base (bar >= 0.85), for
   an adapter on all seven projections and one on peft's default targets for Llama
   models (``q_proj``, ``v_proj``); a batch-1 decode streams the adapter's bytes beside
   the base's, so the ratio follows adapter bytes / base bytes;
3. **load**: the time to read and check an adapter (``add_adapter``) and to put one in a
   slot (``AdapterSlots``);
4. **many**: 32 adapters registered on an engine with ``--max-loras 4``; 64 requests
   round-robin over all 32: every one must finish (none fails for want of a slot),
   throughput and slot loads reported.

Runs alternate (base, adapters, base, ...) and the best of each is kept: the machine is
shared. Greedy (that a request's tokens do not depend on its batch mates is tested in
tests/test_lora_engine.py, in fp32; the default quantized path picks kernels by batch
size). Prints the figures and writes a JSON result.

    python benchmarks/lora.py [--model ID] [--max-tokens 64] [--repeats 2]
        [--result-file benchmarks/results/lora.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import cpu_model_name  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.models.lora import LoRAKind  # noqa: E402


def prompts(tokenizer, n: int) -> list[list[int]]:
    topics = ["the sea", "a city at night", "mountains", "an old library", "rain", "a train journey",
              "the first snow", "a market", "a lighthouse", "the desert"]
    return [tokenizer.encode(f"Write a short story about {topics[i % len(topics)]} and a {i}-year-old friend.")
            for i in range(n)]


def run(llm: LLM, ids: list[list[int]], params: SamplingParams, adapters: list[str | None]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params, lora_request=adapters)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def best_rate(llm, ids, params, adapters, repeats) -> float:
    best = 0.0
    for _ in range(repeats):
        elapsed, tokens = run(llm, ids, params, adapters)
        best = max(best, tokens / elapsed)
    return best


def write_adapters(root: Path, targets: dict, count: int, rank: int) -> list[Path]:
    kind = LoRAKind()
    paths = []
    for i in range(count):
        path = root / f"adapter{i}"
        kind.write_example(path, targets, rank=rank, seed=i)
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct, Q4_1)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--result-file", default="benchmarks/results/lora.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result: dict = {"cpu": cpu_model_name(), "model": args.model or "default (SmolLM2-135M-Instruct)",
                    "rank": args.rank, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(args.model, enable_lora=True, max_loras=8, max_lora_rank=args.rank, max_cpu_loras=32,
                  max_num_seqs=64)
        engine = llm.engine
        targets = dict(engine.adapters.targets)
        paths = write_adapters(Path(tmp), targets, 32, args.rank)
        names = [f"a{i}" for i in range(32)]
        started = time.perf_counter()
        for name, path in zip(names[:8], paths[:8]):
            engine.add_adapter(name, str(path))
        result["load_s_per_adapter"] = (time.perf_counter() - started) / 8
        qv = {m: shape for m, shape in targets.items() if m.endswith(("q_proj", "v_proj"))}
        LoRAKind().write_example(Path(tmp) / "qv", qv, rank=args.rank, seed=99)
        engine.add_adapter("qv", str(Path(tmp) / "qv"))
        ids = prompts(llm.get_tokenizer(), 64)

        # 1. mixed: 64 requests over 8 adapters against 64 on the base
        spread = [names[i % 8] for i in range(64)]
        run(llm, ids[:8], params, spread[:8])  # warm-up: every slot seated once
        slots = engine.runner.adapter_slots
        result["slot_load_s_per_adapter"] = slots.load_seconds / max(slots.num_loads, 1)
        base = mixed = 0.0
        for _ in range(args.repeats):
            base = max(base, best_rate(llm, ids, params, [None] * 64, 1))
            mixed = max(mixed, best_rate(llm, ids, params, spread, 1))
        result["mixed"] = {"base_tok_s": base, "adapters_tok_s": mixed, "ratio": mixed / base}
        # 2. batch 1: one decode with an adapter against the base
        one = SamplingParams(temperature=0, max_tokens=2 * args.max_tokens, ignore_eos=True)
        b1_base = b1_adapter = b1_qv = 0.0
        for _ in range(args.repeats + 1):
            b1_base = max(b1_base, best_rate(llm, ids[:1], one, [None], 1))
            b1_adapter = max(b1_adapter, best_rate(llm, ids[:1], one, ["a3"], 1))
            b1_qv = max(b1_qv, best_rate(llm, ids[:1], one, ["qv"], 1))
        result["batch1"] = {"base_tok_s": b1_base, "adapter_tok_s": b1_adapter, "ratio": b1_adapter / b1_base,
                            "qv_adapter_tok_s": b1_qv, "qv_ratio": b1_qv / b1_base}
        del llm, engine

        # 4. many adapters, few slots
        llm = LLM(args.model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, max_cpu_loras=8,
                  max_num_seqs=64)
        for name, path in zip(names, paths):
            llm.engine.add_adapter(name, str(path))
        round_robin = [names[i % 32] for i in range(64)]
        started = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params, lora_request=round_robin)
        elapsed = time.perf_counter() - started
        finished = sum(o.finished and len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
        slots = llm.engine.runner.adapter_slots
        result["many"] = {"adapters": 32, "max_loras": 4, "requests": 64, "finished": finished,
                          "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
                          "slot_loads": slots.num_loads, "adapter_reads": llm.engine.adapters.num_reads}
    print(json.dumps(result, indent=2))
    print(f"mixed 64 over 8 adapters / base: {result['mixed']['ratio']:.3f} (bar 0.8); "
          f"batch 1 adapter / base: {result['batch1']['ratio']:.3f} all projections, "
          f"{result['batch1']['qv_ratio']:.3f} q/v (bar 0.85); "
          f"32 adapters on 4 slots: {finished}/64 finished")
    Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if finished == 64 else 1


if __name__ == "__main__":
    raise SystemExit(main())
