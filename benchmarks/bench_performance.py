"""Every figure of the performance page in one run (issue 7), SmolLM2-135M-Instruct in
bfloat16 on this machine's CPU. Each figure is a ratio against a baseline measured in
this same run; absolute numbers move with the machine's load.

1. Offline throughput: 128 chat prompts x 128 new tokens, greedy, ignore_eos.
   Ember (`LLM.generate`) / transformers `generate` (static batches of 32, left
   padding, same prompts, same dtype). Peak resident memory after Ember's run.
2. Larger load: 512 such requests, up to 256 running; Ember's tokens/s and its
   ratio to the 128-request figure.
3. Single-request decode: one chat prompt, 256 new tokens; Ember / transformers.
4. Served over HTTP: `ember serve` started with the model cached (time to healthy),
   then `ember bench serve` with 64 concurrent streaming chat requests x 128 tokens,
   against `ember bench offline` with the same 64 requests; TTFT p99.

    python benchmarks/bench_performance.py [--out benchmarks/results/performance.json]
        [--skip-hf] [--plot-dir docs/img/performance]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import cpu_model_name, make_conversations, run_hf  # noqa: E402


def ember_generate(llm, prompt_ids, max_tokens):
    from ember import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, [list(o.outputs[0].token_ids) for o in outs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(model_dir: str, num: int, max_tokens: int, work: Path, plot_dir: str | None) -> dict:
    """Start `ember serve`, time it to healthy, drive it with `ember bench serve`; then
    `ember bench offline` with the same requests (the server stopped by then)."""
    import httpx

    exe = shutil.which("ember", path=os.path.dirname(sys.executable)) or shutil.which("ember")
    port = free_port()
    log = open(work / "serve.log", "w")
    started = time.perf_counter()
    proc = subprocess.Popen(
        [exe, "serve", "--model-id", model_dir, "--dtype", "bfloat16", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ember serve exited: {(work / 'serve.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        startup_s = time.perf_counter() - started
        serve_json = work / "serve.json"
        cmd = [exe, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--dataset", "chat",
               "--num-prompts", str(num), "--max-tokens", str(max_tokens), "--max-concurrency", str(num),
               "--result-file", str(serve_json), "--label", "ember serve (HTTP)", "--no-progress"]
        if plot_dir:
            cmd += ["--plot-dir", plot_dir]
        subprocess.run(cmd, check=True)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    offline_json = work / "offline.json"
    subprocess.run([exe, "bench", "offline", "--model", model_dir, "--dtype", "bfloat16", "--dataset", "chat",
                    "--num-prompts", str(num), "--max-tokens", str(max_tokens), "--result-file", str(offline_json),
                    "--label", "ember offline", "--no-progress"], check=True)
    over_http = json.loads(serve_json.read_text())
    offline = json.loads(offline_json.read_text())
    return {"startup_to_healthy_s": startup_s, "serve": over_http, "offline": offline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "performance.json"))
    parser.add_argument("--plot-dir", default=None, help="PNG plots of the HTTP run (ember bench serve --plot-dir)")
    parser.add_argument("--skip-hf", action="store_true", help="Ember's figures only (no transformers baselines)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--large", type=int, default=512, help="requests of the larger load")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--served", type=int, default=64, help="concurrent requests over HTTP")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ember import LLM
    from ember.weights import resolve_model

    model_dir = str(resolve_model(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    convs = make_conversations(max(args.num_prompts, args.large))
    ids = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False) for c in convs]
    result: dict = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "model": model_dir, "dtype": "bfloat16"}
    print(f"{result['cpu']}, {result['cores']} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)")

    # 1 + 2 + 3, Ember: the KV pool holds 256 running requests of up to 240 tokens
    llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_memory_bytes=3 << 30)
    ember_generate(llm, ids[:2], 4)  # warm-up
    e_tokens, e_time, e_out = ember_generate(llm, ids[: args.num_prompts], args.max_tokens)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    e_tps = e_tokens / e_time
    print(f"1. ember, {args.num_prompts} x {args.max_tokens}: {e_tps:.1f} tok/s ({e_time:.1f} s); "
          f"peak RSS {peak_rss_mib:.0f} MiB")
    preempt0 = llm.engine.scheduler.num_preemptions
    l_tokens, l_time, _ = ember_generate(llm, ids[: args.large], args.max_tokens)
    l_tps = l_tokens / l_time
    preemptions = llm.engine.scheduler.num_preemptions - preempt0
    print(f"2. ember, {args.large} x {args.max_tokens}, up to {llm.engine.scheduler.config.max_num_seqs} running: "
          f"{l_tps:.1f} tok/s ({l_time:.1f} s), {l_tps / e_tps:.2f}x the {args.num_prompts}-request figure; "
          f"{preemptions} preemptions")
    d_tokens, d_time, _ = ember_generate(llm, ids[:1], args.decode_tokens)
    d_tps = d_tokens / d_time
    print(f"3. ember, one request x {args.decode_tokens}: {d_tps:.1f} tok/s")
    result["offline_128"] = {"ember_tokens_per_s": e_tps, "ember_seconds": e_time, "peak_rss_mib": peak_rss_mib}
    result["large_load"] = {"requests": args.large, "max_running": llm.engine.scheduler.config.max_num_seqs,
                            "tokens_per_s": l_tps, "ratio_to_128": l_tps / e_tps, "preemptions": preemptions}
    result["single_decode"] = {"new_tokens": args.decode_tokens, "ember_tokens_per_s": d_tps}
    result["num_threads"] = llm.engine.num_threads
    result["native_kernels"] = llm.engine.runner.attention.kernels is not None
    del llm

    # The same Ember with PyTorch's kernels only (EMBER_CPU_NATIVE=0): what the
    # native kernels (hardware/csrc/ember_cpu.c) bring, measured in this run.
    from ember.hardware import cpu_kernels

    os.environ["EMBER_CPU_NATIVE"] = "0"
    cpu_kernels._TRIED, cpu_kernels._LOADED = False, None  # load() decides once per process
    plain = LLM(model=model_dir, dtype="bfloat16", kv_cache_memory_bytes=3 << 30)
    ember_generate(plain, ids[:2], 4)
    p_tokens, p_time, p_out = ember_generate(plain, ids[: args.num_prompts], args.max_tokens)
    p1_tokens, p1_time, _ = ember_generate(plain, ids[:1], args.decode_tokens)
    del plain
    del os.environ["EMBER_CPU_NATIVE"]
    cpu_kernels._TRIED, cpu_kernels._LOADED = False, None
    result["pytorch_only"] = {
        "offline_128_tokens_per_s": p_tokens / p_time, "native_speedup_128": e_tps / (p_tokens / p_time),
        "single_decode_tokens_per_s": p1_tokens / p1_time, "native_speedup_single": d_tps / (p1_tokens / p1_time),
        "identical_greedy_128": sum(a == b for a, b in zip(e_out, p_out)),
    }
    print(f"1/3. ember with PyTorch kernels only: {p_tokens / p_time:.1f} tok/s offline "
          f"(native {e_tps / (p_tokens / p_time):.2f}x), one request {p1_tokens / p1_time:.1f} tok/s "
          f"(native {d_tps / (p1_tokens / p1_time):.2f}x); "
          f"{result['pytorch_only']['identical_greedy_128']}/{args.num_prompts} identical greedy outputs")

    if not args.skip_hf:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        h_tokens, h_time, h_out = run_hf(model_dir, ids[: args.num_prompts], args.max_tokens, "bfloat16", 32, pad_id)
        h_tps = h_tokens / h_time
        same = sum(a == b for a, b in zip(e_out, h_out))
        result["offline_128"].update(transformers_tokens_per_s=h_tps, ratio=e_tps / h_tps, identical_greedy=same)
        print(f"1. transformers bf16, static batches of 32: {h_tps:.1f} tok/s -> ratio {e_tps / h_tps:.2f}x (bar 5.0)")
        s_tokens, s_time, _ = run_hf(model_dir, ids[:1], args.decode_tokens, "bfloat16", 1, pad_id)
        s_tps = s_tokens / s_time
        result["single_decode"].update(transformers_tokens_per_s=s_tps, ratio=d_tps / s_tps)
        print(f"3. transformers bf16, one request: {s_tps:.1f} tok/s -> ratio {d_tps / s_tps:.2f}x (bar 3.0)")

    with tempfile.TemporaryDirectory() as work:
        s = served(model_dir, args.served, args.max_tokens, Path(work), args.plot_dir)
    http_tps = s["serve"]["output_throughput"]
    off_tps = s["offline"]["output_throughput"]
    ttft = s["serve"]["ttft_ms"]
    result["served"] = {
        "startup_to_healthy_s": s["startup_to_healthy_s"], "concurrent": args.served,
        "http_tokens_per_s": http_tps, "offline_tokens_per_s": off_tps, "ratio": http_tps / off_tps,
        "ttft_ms": ttft, "failed": s["serve"]["num_failed"], "http_result": s["serve"], "offline_result": s["offline"],
    }
    print(f"4. ember serve: healthy {s['startup_to_healthy_s']:.1f} s after start (model cached); "
          f"{args.served} concurrent streams {http_tps:.1f} tok/s vs offline {off_tps:.1f} tok/s -> "
          f"{http_tps / off_tps:.0%} (bar 85%); TTFT p50 {ttft['p50']:.0f} ms, p99 {ttft['p99']:.0f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
