"""Batch-1 decode against the machine's memory-bandwidth limit (issue 36 item 3).

For each weight format on the CPU backend (``q4_1``: the default model's native GGUF;
``float32`` and ``bfloat16``: the same GGUF dequantized), in one run:

* **the limit**: a STREAM-style read, ``torch.sum`` over a float32 buffer of
  ``--buffer-mib`` (1 GiB: larger than any cache here) with the thread count Ember
  decodes with, best of 5, in GB/s;
* **bytes per token**: every tensor the model holds as it is resident (parameters,
  buffers and the tensors of the backend's packed weights, each storage once), except
  the input embedding's table when the LM head has its own weight (a token reads one
  row of it); the KV cache a step reads is reported beside it;
* **decode**: greedy batch-1 tokens/s after a ``--prompt-tokens`` prompt, ``--tokens``
  tokens, median of ``--runs`` runs; **share** = tok/s x bytes/token / GB/s (bar 0.75);
* **where the time goes**: each decode step split into the layers (``forward``, or the
  CPU graph's replay), the LM head (``compute_logits``) and the rest of the step
  (scheduler, sampler, outputs: Python), each against the time its bytes take to read
  at the measured rate.

Prints the figures with the machine (lscpu model name and flags) and writes JSON.

    python benchmarks/bench_decode_bandwidth.py [--formats q4_1,float32] [--out r.json]

Where the backend keeps two forms of a weight (on the bf16 path oneDNN's packed weight
and a plain copy for products of few rows; on the fp32 path a bf16 model's float32
weight and its bf16 copy), a batch-1 step reads one, and only that one is counted (the
linear op's ``weight_read``). Known gap: on a shared VM the read rate can flip between
two levels (34 and 68 GB/s on the 2-core EPYC, 2026-12-05), so the limit is the
highest rate of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ember.api.bench.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {"q4_1": (True, "float32"), "float32": (False, "float32"), "bfloat16": (False, "bfloat16")}


def stream_read_gbps(buffer_mib: int, repeats: int = 5) -> float:
    """GB/s of reading a float32 buffer of ``buffer_mib`` MiB once (best of ``repeats``)."""
    buffer = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)
    buffer.sum()  # pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def _tensors(obj, seen_objects: set[int], depth: int = 0):
    """The tensors an object holds: itself, in containers, or as attributes (two levels)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 3 or id(obj) in seen_objects:
        return
    seen_objects.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, seen_objects, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, seen_objects, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for item in vars(obj).values():
            yield from _tensors(item, seen_objects, depth + 1)


def resident_bytes(model: torch.nn.Module, rows: int = 1) -> dict[str, int]:
    """Bytes of the model's resident tensors a product of ``rows`` rows reads, by part,
    each storage counted once: where the CPU backend keeps two forms of a weight (the
    bf16 path's packed weight and its plain copy for few rows; the fp32 path's float32
    weight and its bf16 copy), the linear op's ``weight_read`` names the one read."""
    seen: set[int] = set()
    op = getattr(model, "linear_op", None)
    weight_read = getattr(op, "weight_read", None)
    parts = {"layers": 0, "lm_head": 0, "embedding": 0, "other": 0}
    embedding = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    for name, module in model.named_modules():
        part = ("embedding" if embedding is not None and (module is embedding or name.startswith("embed_tokens"))
                else "lm_head" if head is not None and name.startswith("lm_head")
                else "layers" if name.startswith("layers") else "other")
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        tensors = [t for _, t in own]
        seen_objects: set[int] = set()
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules", "linear_op"):  # the op: through weight_read
                continue
            tensors.extend(_tensors(value, seen_objects))
        for tensor in tensors:
            if tensor.device.type != "cpu":
                continue
            if weight_read is not None:
                tensor = weight_read(tensor, rows)
            if tensor.is_mkldnn:  # oneDNN's packed weights: no storage to look at, their elements
                key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in seen or nbytes == 0:
                continue
            seen.add(key)
            parts[part] += nbytes
    return parts


def decode(engine, prompt_ids: list[int], tokens: int, runs: int) -> dict:
    """Greedy batch-1 decode, timed per step: the layers, the LM head, the rest."""
    from ember import SamplingParams

    model, runner = engine.model, engine.core.runner
    timers = {"layers": 0.0, "lm_head": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - start
        return wrapper

    # the layers run eagerly (model.forward) or as a CPU graph's replay (runner.graphs.run, decodes)
    patched = [(model, "forward", "layers"), (model, "compute_logits", "lm_head")]
    if runner.graphs is not None:
        patched.append((runner.graphs, "run", "layers"))
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]
    for owner, attr, name in patched:
        setattr(owner, attr, timed(name, getattr(owner, attr)))

    def run(max_tokens: int) -> list[tuple[float, float, float, int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(None, params, prompt_token_ids=list(prompt_ids))
        steps = []
        while engine.has_unfinished_requests():
            timers["layers"] = timers["lm_head"] = 0.0
            start = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - start
            produced = max((len(o.outputs[0].token_ids) for o in outputs), default=0)
            steps.append((wall, timers["layers"], timers["lm_head"], produced))
        return steps

    try:
        run(8)
        rates, decode_steps = [], []
        for _ in range(runs):
            steps = run(tokens)[1:]  # the first step is the prefill
            rates.append(len(steps) / sum(s[0] for s in steps))
            decode_steps.extend(steps)
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    mean_ms = lambda i: 1000 * statistics.fmean(s[i] for s in decode_steps)  # noqa: E731
    step, layers, head = mean_ms(0), mean_ms(1), mean_ms(2)
    return {"decode_tok_s": statistics.median(rates), "runs_tok_s": rates, "step_ms": step, "layers_ms": layers,
            "lm_head_ms": head, "rest_of_step_ms": step - layers - head, "graphs": runner.graphs is not None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="q4_1,float32,bfloat16", help="any of q4_1, float32, bfloat16")
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_bandwidth.json"))
    args = parser.parse_args()

    from ember.config import EngineConfig
    from ember.engine import LLMEngine
    from ember.weights.resolver import resolve_model

    result = {"machine": machine_info(), "torch": torch.__version__, "load_average_before": os.getloadavg(),
              "formats": {}}
    # the read rate moves between runs on a shared machine (31 to 58 GB/s here within minutes): it is
    # measured before the models and beside each, and the highest of all is the limit (the strictest bar)
    reads = [stream_read_gbps(args.buffer_mib)]

    for name in args.formats.split(","):
        native, dtype = FORMATS[name]
        model_dir = resolve_model(None, gguf_native=native, progress=False)
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype,
                                        num_kv_tokens=args.prompt_tokens + args.tokens + 64))
        threads = torch.get_num_threads()
        reads.append(stream_read_gbps(args.buffer_mib))  # in the engine's process, with its threads
        parts = resident_bytes(engine.model)
        per_token = parts["layers"] + parts["lm_head"] + parts["other"]
        if getattr(engine.model, "lm_head", None) is None:  # tied: the LM head reads the embedding table
            per_token += parts["embedding"]
        prompt_ids = [(7 * i + 11) % 1000 + 100 for i in range(args.prompt_tokens)]
        figures = decode(engine, prompt_ids, args.tokens, args.runs)
        cfg = engine.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
        head_bytes = parts["lm_head"] if getattr(engine.model, "lm_head", None) is not None else parts["embedding"]
        result["formats"][name] = {
            "model_dir": str(model_dir), "dtype": dtype, "threads": threads, "stream_read_gb_s": reads[-1],
            "resident_bytes": parts, "bytes_per_token": per_token,
            "kv_bytes_read_per_step_at_mid_context": kv_per_token * (args.prompt_tokens + args.tokens // 2),
            **figures, "bar": 0.75,
            # each part's time, and below the time its bytes take at the limit's read rate: where the rest goes
            "parts": {"layers": {"ms": figures["layers_ms"], "bytes": parts["layers"]},
                      "lm_head": {"ms": figures["lm_head_ms"], "bytes": head_bytes},
                      "rest_of_step": {"ms": figures["rest_of_step_ms"], "bytes": 0}},
        }
        del engine
    gbps = max(reads)
    result["stream_read_gb_s"] = {"all": reads, "limit_from": gbps}
    for name, entry in result["formats"].items():
        limit = gbps * 1e9 / entry["bytes_per_token"]
        entry["limit_tok_s"], entry["share_of_limit"] = limit, entry["decode_tok_s"] / limit
        for times in entry["parts"].values():
            times["at_bandwidth_ms"] = 1000 * times["bytes"] / (gbps * 1e9)
        print(f"{name}: {entry['bytes_per_token'] / 2**20:.1f} MiB a token at {gbps:.1f} GB/s -> limit "
              f"{limit:.1f} tok/s; decode {entry['decode_tok_s']:.1f} tok/s = {entry['share_of_limit']:.0%} of it "
              f"(bar 75%); step {entry['step_ms']:.2f} ms: layers {entry['layers_ms']:.2f}, LM head "
              f"{entry['lm_head_ms']:.2f}, rest {entry['rest_of_step_ms']:.2f}")
        for part, times in entry["parts"].items():
            print(f"    {part:13s} {times['ms']:7.2f} ms a step; at the read rate {times['at_bandwidth_ms']:6.2f} ms")
    print(f"read rates measured (GB/s, {torch.get_num_threads()} threads): {', '.join(f'{r:.1f}' for r in reads)}")
    result["load_average_after"] = os.getloadavg()
    machine = result["machine"]
    flags = " ".join(f for f, on in machine.get("flags", {}).items() if on)
    print(f"machine: {machine.get('cpu_model')}; flags {flags}")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
