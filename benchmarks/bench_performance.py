"""Every figure of issue 14 in one run: SmolLM2-135M-Instruct in bfloat16 on this
machine's CPU, against transformers and (with --with-vllm) vLLM's CPU build, each a
ratio of runs made back to back in this one script.

1. Prefill: one request of N prompt tokens (512, 2048, 4096, 8192 ...: the lengths
   the model's context allows), time to its first token, against one transformers
   forward over the same ids in the path's compute dtype; then the worst gap between
   the tokens of 16 decoding streams while a 4096-token prompt arrives. On both CPU
   paths (ember.hardware.cpu_paths): the one this CPU selects and the other, forced.
2. Offline: 128 chat prompts x 128 new tokens, greedy, ignore_eos. Ember on both
   paths; transformers bf16 `generate` in static batches of 32 (and how many of its
   greedy outputs Ember's equal); vLLM `LLM.generate`, default and with
   VLLM_CPU_NUM_OF_RESERVED_CPU=0 (both cores compute).
3. Batch-1 decode: one chat prompt, 256 new tokens: Ember (both paths),
   transformers bf16, vLLM (both settings).
4. Served: 64 and 128 concurrent streaming chat requests x 128 tokens through
   `ember bench serve` against `ember serve` and vLLM's OpenAI server (at its better
   offline setting): output tok/s and TTFT.

5. With --with-llama-cpp: llama.cpp on the default model's own GGUF (Q4_1), where
   precision is equal: ``bench_served.py --with-llama-cpp`` run from here, its figures
   under "llama_cpp" (Ember served against llama.cpp's server with a parallel slot per
   stream at the served loads, batch 1 over HTTP, and served against offline).

Without --with-vllm, or where vLLM cannot run here (the script says why), the vLLM
figures are absent and transformers is the baseline. Prints the figures and writes
JSON with lscpu's model name and flags.

    python benchmarks/bench_performance.py [--with-vllm] [--with-llama-cpp] [--out benchmarks/results/performance.json]
        [--skip SECTION ...] [--lengths 512,2048,4096,8192,16384] [--served 64,128] [--plot-dir DIR]
    python benchmarks/bench_performance.py --replot RESULT_JSON --plot-dir DIR
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
from bench_prefill import cpu_flags, ember_prefill, gap_beside_streams, random_ids, transformers_forward  # noqa: E402

SECTIONS = ("prefill", "offline", "decode", "served")
PATHS = ("bf16", "fp32")
GAP_PROMPT = 4096  # tokens of the prompt arriving beside 16 decoding streams


def ember_generate(llm, prompt_ids, max_tokens):
    from ember import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, [list(o.outputs[0].token_ids) for o in outs]


def cpu_path(path: str) -> dict:
    """LLM arguments putting Ember's CPU backend on `path` (its option path)."""
    return {"backend_options": {"path": path}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> float:
    import httpx

    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy in {timeout_s:.0f} s: {log.read_text(errors='replace')[-2000:]}")


def bench_serve(url: str, label: str, concurrency: int, max_tokens: int, work: Path) -> dict:
    """`ember bench serve` with `concurrency` streaming chat requests, all at once."""
    exe = shutil.which("ember", path=os.path.dirname(sys.executable)) or shutil.which("ember")
    out = work / f"{label.replace(' ', '_')}_{concurrency}.json"
    subprocess.run([exe, "bench", "serve", "--base-url", url, "--dataset", "chat", "--num-prompts", str(concurrency),
                    "--max-tokens", str(max_tokens), "--max-concurrency", str(concurrency), "--result-file", str(out),
                    "--label", label, "--no-progress"], check=True)
    result = json.loads(out.read_text())
    return {"output_tokens_per_s": result["output_throughput"], "ttft_ms": result["ttft_ms"],
            "failed": result["num_failed"], "duration_s": result["duration_s"]}


def serving(start, label: str, work: Path, run):
    """Start a server (`start(port, log)` -> Popen), wait for /health, return
    `run(url, seconds_to_healthy)`, stop the server."""
    port, log = free_port(), work / f"{label.replace(' ', '_')}.log"
    proc = start(port, log)
    try:
        healthy = wait_healthy(f"http://127.0.0.1:{port}", proc, log)  # from the process's start
        return run(f"http://127.0.0.1:{port}", healthy)
    finally:
        stop_server(proc)


def served(start, label: str, concurrencies: list[int], max_tokens: int, work: Path) -> dict:
    """Start a server, time it to healthy, run each load."""
    def run(url: str, healthy: float) -> dict:
        result = {"startup_to_healthy_s": healthy}
        for n in concurrencies:
            result[str(n)] = r = bench_serve(url, label, n, max_tokens, work)
            print(f"4. {label}, {n} concurrent: {r['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{r['ttft_ms']['p50']:.0f} ms, p99 {r['ttft_ms']['p99']:.0f} ms, {r['failed']} failed", flush=True)
        return result
    return serving(start, label, work, run)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server's process group (started with start_new_session), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def start_ember(model_dir: str):
    exe = shutil.which("ember", path=os.path.dirname(sys.executable)) or shutil.which("ember")

    def start(port: int, log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            return subprocess.Popen([exe, "serve", "--model-id", model_dir, "--dtype", "bfloat16", "--port", str(port)],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return start


def prefill_section(model_dir: str, lengths: list[int], result: dict) -> None:
    import transformers

    from ember import LLM

    hf_models = {}
    for path in PATHS:
        llm = LLM(model=model_dir, dtype="bfloat16", enable_prefix_caching=False,
                  max_model_len=max(lengths + [GAP_PROMPT]) + 1, **cpu_path(path))
        dtype = llm.engine.model.compute_dtype
        if dtype not in hf_models:
            hf_models[dtype] = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        ember_prefill(llm, random_ids(64, 0))  # warm
        rows = result.setdefault("prefill", {})[path] = {"compute_dtype": str(dtype).removeprefix("torch.")}
        for n in lengths:
            ids = random_ids(n, n)
            e = n / ember_prefill(llm, ids)
            h = n / transformers_forward(hf_models[dtype], ids)
            rows[str(n)] = {"ember_tokens_per_s": e, "transformers_tokens_per_s": h, "ratio": e / h}
            print(f"1. prefill {n} tokens, {path} path: ember {e:.0f} tok/s, transformers {dtype} forward "
                  f"{h:.0f} tok/s -> {e / h:.2f}x (bar 1.5)", flush=True)
        gap = gap_beside_streams(llm, GAP_PROMPT, weighted=True, seed=1)
        rows["gap_4096_beside_16"] = gap
        print(f"1. 4096-token prompt beside 16 streams, {path} path: worst gap {gap['worst_gap_s']:.2f} s "
              f"(bar 1 s), its TTFT {gap['long_prompt_ttft_s']:.1f} s", flush=True)
        del llm


def plot(result: dict, plot_dir: Path) -> list[Path]:
    """Bar charts of one result: tok/s per system for offline, batch-1 decode and the
    served loads, and Ember's prefill ratio to transformers by prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    title = f"SmolLM2-135M bf16, {result['cpu']} ({', '.join(result['flags'])}), {result['cores']} cores"
    panels = [("offline 128 x 128", result.get("offline", {})), ("one request x 256", result.get("decode", {}))]
    for n, runs in sorted(((k, v) for k, v in _served_by_load(result).items()), key=lambda kv: int(kv[0])):
        panels.append((f"served, {n} streams", runs))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], panels):
        labels = [k for k, v in runs.items() if isinstance(v, dict) and "tokens_per_s" in v]
        ax.bar(range(len(labels)), [runs[k]["tokens_per_s"] for k in labels],
               color=["tab:orange" if k.startswith("ember") else "tab:gray" for k in labels])
        ax.set_xticks(range(len(labels)), [k.replace("_", "\n", 1) for k in labels], fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("output tok/s")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths = [plot_dir / "throughput.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    if result.get("prefill"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for path, rows in result["prefill"].items():
            lengths = [int(n) for n in rows if n.isdigit()]
            ax.plot(lengths, [rows[str(n)]["ratio"] for n in lengths], marker="o", label=f"{path} path")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("Ember prefill / transformers forward")
        ax.legend()
        ax.set_title(title, fontsize=8)
        fig.tight_layout()
        paths.append(plot_dir / "prefill.png")
        fig.savefig(paths[1], dpi=110)
        plt.close(fig)
    return paths


def _served_by_load(result: dict) -> dict[str, dict]:
    """{concurrency: {server: {"tokens_per_s"}}} from result["served"]."""
    loads: dict[str, dict] = {}
    for server, runs in result.get("served", {}).items():
        for n, run in runs.items():
            if n.isdigit():
                loads.setdefault(n, {})[server] = {"tokens_per_s": run["output_tokens_per_s"]}
    return loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "performance.json"))
    parser.add_argument("--with-vllm", action="store_true",
                        help="vLLM's CPU build as the peer (installed once, cached)")
    parser.add_argument("--with-llama-cpp", action="store_true",
                        help="llama.cpp's server on the default GGUF as the Q4_1 peer (bench_served.py; built once)")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--lengths", default="512,2048,4096,8192,16384", help="prefill lengths (within the context)")
    parser.add_argument("--served", default="64,128", help="concurrent streams of the served runs")
    parser.add_argument("--plot-dir", default=None, help="bar charts of the figures (PNG)")
    parser.add_argument("--replot", default=None, metavar="RESULT_JSON", help="only plot a saved result")
    args = parser.parse_args()
    if args.replot:
        for path in plot(json.loads(Path(args.replot).read_text()), Path(args.plot_dir or ".")):
            print(f"wrote {path}")
        return

    from transformers import AutoConfig, AutoTokenizer

    from ember import LLM
    from ember.weights import resolve_model

    # the float conversion of the default GGUF, run in bfloat16 by every arm (equal precision:
    # vLLM cannot run the native Q4_1 form, which llama.cpp's arm takes: --with-llama-cpp)
    model_dir = str(resolve_model(None, gguf_native=False))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    ids = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False) for c in make_conversations(args.num_prompts)]
    result: dict = {"cpu": cpu_model_name(), "flags": cpu_flags(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "model": model_dir, "dtype": "bfloat16"}
    print(f"{result['cpu']} ({' '.join(result['flags'])}), {result['cores']} cores, torch {torch.__version__}",
          flush=True)

    vllm_python = None
    if args.with_vllm:
        from peer_vllm import ensure_vllm_venv

        vllm_python, why = ensure_vllm_venv()
        result["vllm"] = {"available": vllm_python is not None, "why_not": why or None}
        if vllm_python is None:
            print(f"vLLM can't run here ({why}); transformers is the baseline", flush=True)

    if "prefill" not in args.skip:
        # a prompt of the whole context leaves no room for its token: one fewer
        asked = [int(n) for n in args.lengths.split(",")]
        lengths = [min(n, context - 1) for n in asked if n <= context]
        result["prefill_lengths_beyond_context"] = {"context": context, "lengths": [n for n in asked if n > context]}
        prefill_section(model_dir, lengths, result)

    offline, decode = result.setdefault("offline", {}), result.setdefault("decode", {})
    outputs = {}
    for path in PATHS:
        if "offline" in args.skip and "decode" in args.skip:
            break
        llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_memory_bytes=3 << 30, **cpu_path(path))
        ember_generate(llm, ids[:2], 4)  # warm-up
        if "offline" not in args.skip:
            tokens, seconds, outputs[path] = ember_generate(llm, ids, args.max_tokens)
            offline[f"ember_{path}"] = {"tokens_per_s": tokens / seconds, "seconds": seconds,
                                        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            print(f"2. ember {path} path, {len(ids)} x {args.max_tokens}: {tokens / seconds:.1f} tok/s", flush=True)
        if "decode" not in args.skip:
            tokens, seconds, _ = ember_generate(llm, ids[:1], args.decode_tokens)
            decode[f"ember_{path}"] = {"tokens_per_s": tokens / seconds}
            print(f"3. ember {path} path, one request x {args.decode_tokens}: {tokens / seconds:.1f} tok/s", flush=True)
        del llm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if "offline" not in args.skip:
        tokens, seconds, hf_out = run_hf(model_dir, ids, args.max_tokens, "bfloat16", 32, pad_id)
        offline["transformers_static32"] = {"tokens_per_s": tokens / seconds, "seconds": seconds}
        for path, outs in outputs.items():
            offline[f"ember_{path}"]["identical_greedy_to_transformers"] = sum(a == b for a, b in zip(outs, hf_out))
        print(f"2. transformers bf16, static batches of 32: {tokens / seconds:.1f} tok/s; identical greedy outputs: "
              + ", ".join(f"{p} path {offline[f'ember_{p}']['identical_greedy_to_transformers']}/{len(ids)}"
                          for p in outputs), flush=True)
    if "decode" not in args.skip:
        tokens, seconds, _ = run_hf(model_dir, ids[:1], args.decode_tokens, "bfloat16", 1, pad_id)
        decode["transformers"] = {"tokens_per_s": tokens / seconds}
        print(f"3. transformers bf16, one request: {tokens / seconds:.1f} tok/s", flush=True)

    best_vllm = None
    if vllm_python is not None and not {"offline", "decode"} <= set(args.skip):
        from peer_vllm import run_vllm_offline

        for setting, reserved0 in (("default", False), ("reserved_cpu_0", True)):
            runs = [(ids, args.max_tokens), (ids[:1], args.decode_tokens)]
            res = run_vllm_offline(vllm_python, model_dir, runs, reserved_cpu0=reserved0)
            if "error" in res:
                result["vllm"][setting] = res
                print(f"vLLM ({setting}) failed: {res['error'][-500:]}", flush=True)
                continue
            off, one = res["runs"]
            offline[f"vllm_{setting}"] = {"tokens_per_s": off["tokens_per_s"], "seconds": off["seconds"],
                                          "env": res["env"]}
            if "bf16" in outputs:
                offline[f"vllm_{setting}"]["identical_greedy_to_ember_bf16"] = sum(
                    a == b for a, b in zip(outputs["bf16"], off["outputs"]))
            decode[f"vllm_{setting}"] = {"tokens_per_s": one["tokens_per_s"]}
            print(f"2/3. vLLM ({setting}): offline {off['tokens_per_s']:.1f} tok/s, one request "
                  f"{one['tokens_per_s']:.1f} tok/s", flush=True)
            if best_vllm is None or off["tokens_per_s"] > offline[f"vllm_{best_vllm}"]["tokens_per_s"]:
                best_vllm = setting

    result["ratios"] = ratios = {}
    for path in PATHS:
        e_off = offline.get(f"ember_{path}", {}).get("tokens_per_s")
        e_one = decode.get(f"ember_{path}", {}).get("tokens_per_s")
        for name, table, value in (("offline", offline, e_off), ("decode", decode, e_one)):
            if value is None:
                continue
            for peer in ("transformers_static32", "transformers", "vllm_default", "vllm_reserved_cpu_0"):
                if peer in table:
                    ratios[f"{name}_{path}_over_{peer}"] = value / table[peer]["tokens_per_s"]
    for key, value in ratios.items():
        print(f"ratio {key}: {value:.2f}x", flush=True)

    if "served" not in args.skip:
        concurrencies = [int(n) for n in args.served.split(",")]
        with tempfile.TemporaryDirectory() as work:
            result["served"] = {"ember": served(start_ember(model_dir), "ember serve", concurrencies, args.max_tokens,
                                                Path(work))}
            if best_vllm is not None:
                from peer_vllm import start_vllm_server

                reserved0 = best_vllm == "reserved_cpu_0"
                result["served"][f"vllm_{best_vllm}"] = served(
                    lambda port, log: start_vllm_server(vllm_python, model_dir, port, reserved0, log),
                    f"vllm {best_vllm}", concurrencies, args.max_tokens, Path(work))
        for n in concurrencies:
            if best_vllm is not None:
                e = result["served"]["ember"][str(n)]["output_tokens_per_s"]
                v = result["served"][f"vllm_{best_vllm}"][str(n)]["output_tokens_per_s"]
                ratios[f"served_{n}_ember_over_vllm"] = e / v
                print(f"ratio served {n}: ember / vLLM {e / v:.2f}x (bar 1.5, issue 36)", flush=True)

    if args.with_llama_cpp:
        with tempfile.TemporaryDirectory() as work:
            served_json = Path(work) / "served.json"
            subprocess.run([sys.executable, str(Path(__file__).with_name("bench_served.py")), "--with-llama-cpp",
                            "--loads", args.served, "--max-tokens", str(args.max_tokens), "--out", str(served_json)],
                           check=True)
            result["llama_cpp"] = json.loads(served_json.read_text())

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if args.plot_dir:
        for path in plot(result, Path(args.plot_dir)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
