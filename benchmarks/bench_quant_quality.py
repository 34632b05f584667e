"""Perplexity of SmolLM2-135M on a fixed public-domain text, float against weight-only
quantization at load (issue 18): the float32 model (Ember's float32 conversion of the
default GGUF), ``--quantize int8`` (per channel) and ``--quantize int4`` (groups of 64).

The text is chapters I and II of Lewis Carroll's *Alice's Adventures in Wonderland*
(1865, public domain; benchmarks/data/alice_ch1_2.txt). It is tokenized once (no BOS)
and cut into non-overlapping windows of ``--window`` tokens; every token of a window but
its first is scored given the window's tokens before it. Perplexity is
``exp(mean negative log-likelihood)`` over all scored tokens.

    python benchmarks/bench_quant_quality.py [--arms float32,int8,int4] [--window 1024]

Writes benchmarks/results/quant_quality.json, keeping other keys already there (the
GGUF-native figures are added by benchmarks/bench_quant.py under their own keys).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "alice_ch1_2.txt"
RESULT = ROOT / "results" / "quant_quality.json"
QUANTIZE = {"float32": None, "int8": "int8", "int4": "int4", "int4-g32": "int4-g32"}


def load(model_dir: Path, quantize: str | None):
    from ember.models.loader import load_hf_config, load_model
    from ember.plugin import create_plugin_manager
    from ember.plugin.backend import select_backend
    from ember.plugin.quantizer import select_quantizer

    registries = create_plugin_manager().registries
    backend = select_backend(registries.backends, "cpu")
    backend.configure_threads(None)
    hf_config = load_hf_config(model_dir)
    quantizer = select_quantizer(registries.quantizers, getattr(hf_config, "quantization_config", None), quantize)
    attention = backend.create_attention()
    model = load_model(model_dir, hf_config, backend, attention, torch.float32, registries.model_architectures,
                       quantizer)
    return model, attention, backend


def window_nll(model, attention, backend, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ``ids[1:]`` given the tokens before each."""
    from ember.plugin.backend import AttentionBatch, SequenceSlice

    spec, block = model.kv_cache_spec, 16
    blocks = -(-len(ids) // block)
    caches = [torch.zeros(2, blocks, block, spec.num_kv_heads, spec.head_dim,
                          dtype=backend.kv_cache_dtype(torch.float32)) for _ in range(spec.num_layers)]
    metadata = attention.prepare(AttentionBatch.from_slices(
        [SequenceSlice(len(ids), 0, list(range(blocks)))], block, torch.device("cpu")))
    tokens = torch.tensor(ids)
    with torch.no_grad():
        hidden = model(tokens, torch.arange(len(ids)), caches, metadata)
        total = 0.0
        for start in range(0, len(ids) - 1, 256):  # logits a slice at a time: vocab 49152
            end = min(start + 256, len(ids) - 1)
            logprobs = torch.log_softmax(model.compute_logits(hidden[start:end]), dim=-1)
            total -= logprobs.gather(1, tokens[start + 1 : end + 1, None]).sum().item()
    return total, len(ids) - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="float32,int8,int4", help=f"comma-separated, of {', '.join(QUANTIZE)}")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--max-text-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in QUANTIZE]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(QUANTIZE)}")

    from ember.api.bench.machine import machine_info
    from ember.models.loader import model_weight_bytes
    from ember.models.tokenizer import load_tokenizer
    from ember.weights import DEFAULT_MODEL_ID, resolve_model

    model_dir = resolve_model(None, gguf_native=False)  # the float32 conversion of the default GGUF
    ids = load_tokenizer(model_dir).encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    ids = ids[: args.max_text_tokens]
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update({
        "model": DEFAULT_MODEL_ID,
        "text": f"{TEXT.relative_to(ROOT.parent)} (Alice's Adventures in Wonderland, chapters I-II, public domain)",
        "num_text_tokens": len(ids),
        "method": f"non-overlapping windows of {args.window} tokens, each token but a window's first scored; "
                  "perplexity = exp(mean NLL)",
        "machine": machine_info(),
        "command": "python benchmarks/bench_quant_quality.py --arms " + args.arms + f" --window {args.window}"
                   + (f" --max-text-tokens {args.max_text_tokens}" if args.max_text_tokens else ""),
    })
    for arm in arms:
        t0 = time.perf_counter()
        model, attention, backend = load(model_dir, QUANTIZE[arm])
        t1 = time.perf_counter()
        nll = count = 0
        for window in windows:
            n, c = window_nll(model, attention, backend, window)
            nll, count = nll + n, count + c
        t2 = time.perf_counter()
        total, packed, formats = model_weight_bytes(model)
        results[arm] = {
            "quantize": QUANTIZE[arm], "perplexity": math.exp(nll / count), "mean_nll": nll / count,
            "scored_tokens": count, "weight_bytes": total, "packed_bytes": packed, "quantized_linears": formats,
            "load_s": round(t1 - t0, 2), "eval_s": round(t2 - t1, 2),
        }
        print(f"{arm:>9}: perplexity {results[arm]['perplexity']:.3f} over {count} tokens, weights "
              f"{total / 2**20:.1f} MiB (packed {packed / 2**20:.1f}), eval {t2 - t1:.1f} s", flush=True)
        del model
    if "float32" in results:
        base = results["float32"]["perplexity"]
        for arm in QUANTIZE:
            if arm in results and arm != "float32":
                results[arm]["perplexity_vs_float32"] = results[arm]["perplexity"] / base
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"machine: {results['machine']}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
