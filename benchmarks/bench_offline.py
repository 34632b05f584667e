"""Offline throughput: Ember's continuous batching vs transformers' static batches.

128 chat prompts of varied length, 128 new tokens each (ignore_eos, greedy), the
default model (SmolLM2-135M-Instruct) in bfloat16. Both run in this process on
the same weights; the figure that matters is the ratio, since the machine is
shared and absolute numbers move. Prints the figures and writes a JSON result.

    python benchmarks/bench_offline.py [--num-prompts 128] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

# The chat set, shared with `ember bench ... --dataset chat` (one definition).
from ember.api.bench.datasets import STYLES, TOPICS  # noqa: E402


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_conversations(n: int) -> list[list[dict]]:
    convs = []
    for i in range(n):
        text = STYLES[i % len(STYLES)].format(t=TOPICS[(i // len(STYLES)) % len(TOPICS)])
        convs.append([{"role": "user", "content": text}])
    return convs


def run_ember(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, dtype: str):
    from ember import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompt_ids[:2], sampling_params=SamplingParams(temperature=0, max_tokens=4))
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens, elapsed, [o.outputs[0].token_ids for o in outs], llm


def run_hf(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, dtype: str, batch_size: int, pad_id: int):
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    results: list[list[int]] = []
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[b : b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
            )
            new = out[:, width:]
            tokens += new.numel()
            results.extend(new.tolist())
            print(f"  transformers batch {b // batch_size + 1}: {tokens} tokens, {time.perf_counter() - start:.0f} s", flush=True)
    return tokens, time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-dtype", default=None, help="dtype for transformers (default: same as --dtype)")
    parser.add_argument("--also-hf-float32", action="store_true",
                        help="also time transformers in float32 (a reference for the CPU's bf16 handling)")
    parser.add_argument("--output", default="benchmarks/results/offline.json")
    args = parser.parse_args()

    from ember.weights import resolve_model
    from transformers import AutoTokenizer

    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in make_conversations(args.num_prompts)
    ]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    lengths = [len(p) for p in prompt_ids]
    print(f"model {model_dir}; {len(prompt_ids)} prompts, {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f}); {args.max_tokens} new tokens each; torch threads {torch.get_num_threads()}")

    e_tokens, e_time, e_out, llm = run_ember(model_dir, prompt_ids, args.max_tokens, args.dtype)
    e_tps = e_tokens / e_time
    print(f"ember        ({args.dtype}): {e_tokens} tokens in {e_time:.1f} s = {e_tps:.1f} tokens/s "
          f"(compute dtype {llm.engine.model.compute_dtype})")
    del llm

    hf_dtype = args.hf_dtype or args.dtype
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    h_tokens, h_time, h_out = run_hf(model_dir, prompt_ids, args.max_tokens, hf_dtype, args.hf_batch_size, pad_id)
    h_tps = h_tokens / h_time
    print(f"transformers ({hf_dtype}, static batches of {args.hf_batch_size}, left padding): "
          f"{h_tokens} tokens in {h_time:.1f} s = {h_tps:.1f} tokens/s")
    ratio = e_tps / h_tps
    same = sum(a == b for a, b in zip(e_out, h_out))
    print(f"ratio ember/transformers: {ratio:.2f}x; identical greedy outputs: {same}/{len(e_out)}")
    extra = None
    if args.also_hf_float32 and hf_dtype != "float32":
        f_tokens, f_time, _ = run_hf(model_dir, prompt_ids, args.max_tokens, "float32", args.hf_batch_size, pad_id)
        extra = {"dtype": "float32", "tokens": f_tokens, "seconds": f_time, "tokens_per_s": f_tokens / f_time,
                 "ratio": e_tps / (f_tokens / f_time)}
        print(f"transformers (float32, static batches of {args.hf_batch_size}): {f_tokens / f_time:.1f} tokens/s; "
              f"ratio ember/transformers-fp32: {extra['ratio']:.2f}x")

    result = {
        "benchmark": "offline_throughput",
        "model": model_dir,
        "num_prompts": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
        "ember": {"dtype": args.dtype, "tokens": e_tokens, "seconds": e_time, "tokens_per_s": e_tps},
        "transformers": {"dtype": hf_dtype, "batch_size": args.hf_batch_size, "tokens": h_tokens,
                         "seconds": h_time, "tokens_per_s": h_tps},
        "ratio": ratio,
        "transformers_float32": extra,
        "identical_greedy_outputs": same,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": cpu_model_name(),
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
