"""The accelerator check of issue 15, prepared for a machine with one GPU, PyTorch and
Triton but no network (Ember's other dependencies travel as wheels; no model can be
downloaded there, so the model is random weights in SmolLM2-135M's shapes, built from
its config: throughput does not depend on the weights' values, and greedy equality
with transformers holds for any weights).

1. Conformance on the real kernels: `ember backends check BACKEND` (contract,
   attention against float64 in every dtype, a tiny Llama's greedy tokens against the
   CPU backend's).
2. Greedy tokens of the SmolLM2-shaped model, bf16 on the device, against transformers
   `generate` on the same device: how many of 16 prompts x 32 tokens are identical.
3. Offline throughput, 128 and 1024 prompts x 128 tokens, Ember against transformers
   `generate` in static batches of 32 on the same device, in this run.
4. Batch-1 decode tokens/s (256 tokens), Ember against transformers, and the share of
   the device's memory bandwidth it reaches (weight bytes per token x tokens/s over a
   device-to-device copy's GB/s measured here); Ember with its decode graphs (the
   default; their capture time reported) and with --enforce-eager, in this run.

5. Optional, on a machine with several devices (``--tensor-parallel N``, default: every
   device when there are 2 or more): the same model with tensor_parallel_size=N, one
   process per device over NCCL/RCCL (docs/parallel.md): its greedy tokens against
   the single-device engine's, and batch-1 decode and 128-prompt offline tokens/s
   against one device.

The attention in use (flash-attn where installed, else Triton) is recorded; pass
--backend-option attention=triton to measure the Triton kernels where flash-attn is installed.

    python benchmarks/device_check.py [--backend cuda] [--out $OUT/device_check.json]
    python benchmarks/device_check.py --dry-run   # the same steps, tiny, on the CPU backend

Prints each figure as it goes and writes JSON; a step that fails is recorded with
its error and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SMOLLM2_CONFIG = dict(  # SmolLM2-135M-Instruct's shapes
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=320, max_position_embeddings=512, tie_word_embeddings=True)


def build_model(out_dir: Path, shapes: dict) -> None:
    """A random Llama with `shapes`, saved with the tiny byte tokenizer (ids are all
    the check needs), as transformers saves it."""
    import transformers

    from ember.testing.tiny_models import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = transformers.LlamaConfig(**shapes, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, initializer_range=0.02)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(36, 98))] for _ in range(n)]


def ember_run(llm, ids: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from ember import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def hf_run(model, ids: list[list[int]], max_tokens: int, batch_size: int, device) -> tuple[float, list[list[int]]]:
    results, tokens, start = [], 0, time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(ids), batch_size):
            batch = ids[b : b + batch_size]
            width = max(map(len, batch))
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[:, width:]
            tokens += out.numel()
            results.extend(out.tolist())
    return tokens / (time.perf_counter() - start), results


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy of 1 GiB (read + write)."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    sync()
    return 5 * 2 * x.numel() * 4 / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend (checks the script)")
    parser.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the backend (repeatable; `ember backends options NAME` lists them)")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="also run with N devices (default: all of them when there are 2 or more; 1: skip)")
    args = parser.parse_args()
    options = dict(item.split("=", 1) for item in args.backend_option)

    import transformers

    from ember import LLM
    from ember.plugin import create_plugin_manager
    from ember.testing import check_backend, check_end_to_end

    backend = "cpu" if args.dry_run else args.backend
    shapes = TINY_CONFIG if args.dry_run else SMOLLM2_CONFIG
    sizes = {"greedy": (4, 8), "offline": (8, 16), "decode": 16} if args.dry_run else {
        "greedy": (16, 32), "offline": (128, 1024), "decode": 256}
    result: dict = {"backend": backend, "torch": torch.__version__, "dry_run": args.dry_run, "steps": {}}
    cls = create_plugin_manager().registries.backends.get(backend)
    if not cls.is_available():
        print(f"backend {backend!r} is not available here: {cls.unavailable_reason()}")
        return 1
    device = cls().device
    if device.type == "cuda":
        result["device"] = torch.cuda.get_device_name(device)
    print(f"device check: backend {backend} on {result.get('device', device)}, torch {torch.__version__}", flush=True)

    def step(name, run):
        started = time.perf_counter()
        try:
            result["steps"][name] = {**run(), "seconds": round(time.perf_counter() - started, 1)}
        except Exception as exc:  # a failed step is recorded; the others still run
            result["steps"][name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        print(f"{name}: {json.dumps(result['steps'][name])[:400]}", flush=True)

    with tempfile.TemporaryDirectory(prefix="ember-device-check-") as work:
        model_dir = Path(work) / "model"
        build_model(model_dir, shapes)

        def conformance():
            check_backend(cls)
            check_end_to_end(cls, work)
            return {"passed": True}

        step("conformance", conformance)
        max_model_len = min(2048, shapes["max_position_embeddings"])
        started = time.perf_counter()
        llm = LLM(model=str(model_dir), dtype="bfloat16", backend=backend, max_model_len=max_model_len,
                  backend_options=options)
        engine = llm.engine
        result["attention"] = engine.runner.attention.name
        result["startup_seconds"] = round(time.perf_counter() - started, 1)
        result["graph_capture_seconds"] = engine.graph_capture_seconds
        result["graph_sizes"] = list(engine.runner.graphs.sizes) if engine.runner.graphs else None
        print(f"attention {result['attention']}; decode graphs {result['graph_sizes']} captured in "
              f"{result['graph_capture_seconds']} s", flush=True)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
        vocab = shapes["vocab_size"]

        def greedy():
            n, new = sizes["greedy"]
            ids = prompts(n, vocab, 1)
            _, ours = ember_run(llm, ids, new)
            _, theirs = hf_run(hf, ids, new, 1, device)
            return {"identical": sum(a == b for a, b in zip(ours, theirs)), "of": n,
                    "first_token_equal": sum(a[0] == b[0] for a, b in zip(ours, theirs))}

        def offline():
            figures = {}
            ember_run(llm, prompts(2, vocab, 0), 4)  # warm-up
            for n in sizes["offline"]:
                ids = prompts(n, vocab, n)
                ember_tps, _ = ember_run(llm, ids, 128 if not args.dry_run else 8)
                hf_tps, _ = hf_run(hf, ids, 128 if not args.dry_run else 8, 32, device)
                figures[str(n)] = {"ember_tokens_per_s": ember_tps, "transformers_tokens_per_s": hf_tps,
                                   "ratio": ember_tps / hf_tps}
            return figures

        def decode():
            ids = prompts(1, vocab, 7)
            ember_tps, graphed_tokens = ember_run(llm, ids, sizes["decode"])
            eager_llm = LLM(model=str(model_dir), dtype="bfloat16", backend=backend, max_model_len=max_model_len,
                            enforce_eager=True, backend_options=options)
            ember_run(eager_llm, ids, 4)  # warm-up
            eager_tps, eager_tokens = ember_run(eager_llm, ids, sizes["decode"])
            del eager_llm
            hf_tps, _ = hf_run(hf, ids, sizes["decode"], 1, device)
            weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
            bandwidth = copy_bandwidth(device)
            return {"ember_tokens_per_s": ember_tps, "transformers_tokens_per_s": hf_tps, "ratio": ember_tps / hf_tps,
                    "copy_gb_per_s": bandwidth, "bandwidth_share": weight_bytes * ember_tps / 1e9 / bandwidth,
                    "eager_tokens_per_s": eager_tps, "graphs_over_eager": ember_tps / eager_tps,
                    "graphs_tokens_equal_eager": graphed_tokens == eager_tokens}

        step("greedy_vs_transformers", greedy)
        step("offline", offline)
        step("decode_batch1", decode)

        num_devices = cls.device_module().device_count() if hasattr(cls, "device_module") and not args.dry_run else 1
        tp = args.tensor_parallel if args.tensor_parallel is not None else (num_devices if num_devices >= 2 else 1)
        if args.dry_run and args.tensor_parallel:  # the dry run checks the step on gloo with CPU ranks
            num_devices = tp

        def tensor_parallel():
            if tp > num_devices:
                raise ValueError(f"--tensor-parallel {tp}: only {num_devices} device(s) here")
            n, new = sizes["greedy"]
            ids = prompts(n, vocab, 1)
            _, single = ember_run(llm, ids, new)
            single_decode, _ = ember_run(llm, prompts(1, vocab, 7), sizes["decode"])
            offline_ids = prompts(sizes["offline"][0], vocab, 3)
            single_offline, _ = ember_run(llm, offline_ids, 128 if not args.dry_run else 8)
            started = time.perf_counter()
            with LLM(model=str(model_dir), dtype="bfloat16", backend=backend, max_model_len=max_model_len,
                     tensor_parallel_size=tp, backend_options=options) as tp_llm:
                startup = time.perf_counter() - started
                _, sharded = ember_run(tp_llm, ids, new)
                ember_run(tp_llm, prompts(2, vocab, 0), 4)  # warm-up
                tp_decode, _ = ember_run(tp_llm, prompts(1, vocab, 7), sizes["decode"])
                tp_offline, _ = ember_run(tp_llm, offline_ids, 128 if not args.dry_run else 8)
                ranks = tp_llm.engine.core.parallel.describe_ranks()
            return {"tensor_parallel_size": tp, "startup_seconds": round(startup, 1),
                    "identical_to_one_device": sum(a == b for a, b in zip(sharded, single)), "of": n,
                    "decode_tokens_per_s": tp_decode, "one_device_decode_tokens_per_s": single_decode,
                    "offline_tokens_per_s": tp_offline, "one_device_offline_tokens_per_s": single_offline,
                    "rank_weight_bytes": [r.weight_bytes for r in ranks]}

        if tp > 1:
            step("tensor_parallel", tensor_parallel)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in s for s in result["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
