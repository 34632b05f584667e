"""Served against offline, and against llama.cpp's server (issue 36 items 4 and 5), in
one run on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Ember's defaults).

For each load N (``--loads``, default 64 and 128 concurrent streams): the synthetic chat
set of ``ember bench`` (N distinct conversations x ``--max-tokens`` new tokens, greedy,
ignore_eos), all sent at once (at most N unfinished):

1. **offline**: ``ember bench offline`` (the in-process engine, the same requests), run
   before and after the served arms; their mean is the baseline;
2. **served**: ``ember serve`` (its engine process) and ``ember bench serve`` as the
   client on the same cores, then again with the client pinned to one core
   (``taskset -c <last core>``); ratio served / offline (bar 0.95), TTFT p99, ITL p99;
3. **llama.cpp** (``--with-llama-cpp``): ``llama-server`` built from the llama.cpp that
   llama-cpp-python vendors (``peer_llama_cpp.py``; minutes, once) on the very GGUF
   file, N parallel slots with continuous batching, the same client and requests: ratio
   Ember served / llama.cpp served (bar 1.5); and batch 1 (``--batch1-prompts``
   requests one after another, ``--batch1-tokens`` tokens each) for both servers.

Each server runs alone; the script starts and stops them. Prints the figures with the
machine (lscpu model name and flags) and writes JSON.

    python benchmarks/bench_served.py [--loads 64,128] [--with-llama-cpp] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_performance import serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _ember_exe() -> str:
    return shutil.which("ember", path=os.path.dirname(sys.executable)) or shutil.which("ember") or "ember"


def _figures(result: dict) -> dict:
    return {"output_tokens_per_s": result["output_throughput"], "failed": result["num_failed"],
            "duration_s": result["duration_s"], "ttft_ms": result["ttft_ms"], "itl_ms": result["itl_ms"],
            "tpot_ms": result["tpot_ms"]}


def offline(n: int, max_tokens: int, work: Path) -> dict:
    out = work / f"offline_{n}.json"
    subprocess.run([_ember_exe(), "bench", "offline", "--dataset", "chat", "--num-prompts", str(n), "--max-tokens",
                    str(max_tokens), "--max-concurrency", str(n), "--num-warmups", "2", "--result-file", str(out),
                    "--no-progress", "--log-level", "warning"], check=True)
    return _figures(json.loads(out.read_text()))


def client(url: str, n: int, concurrency: int, max_tokens: int, work: Path, label: str,
           pin: str | None = None) -> dict:
    """``ember bench serve``: ``n`` chat requests, at most ``concurrency`` at once."""
    out = work / f"{label}_{n}_{concurrency}.json"
    cmd = [_ember_exe(), "bench", "serve", "--base-url", url, "--dataset", "chat", "--num-prompts", str(n),
           "--max-tokens", str(max_tokens), "--max-concurrency", str(concurrency), "--num-warmups", "2",
           "--result-file", str(out), "--label", label, "--no-progress", "--log-level", "warning"]
    if pin is not None:
        cmd = ["taskset", "-c", pin, *cmd]
    subprocess.run(cmd, check=True)
    return _figures(json.loads(out.read_text()))


def start_ember(port: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([_ember_exe(), "serve", "--port", str(port)], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _line(label: str, r: dict) -> str:
    return (f"{label}: {r['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/"
            f"{r['ttft_ms']['p99']:.0f} ms, ITL p50/p99 {r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f} ms, "
            f"{r['failed']} failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="64,128", help="concurrent streams, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--with-llama-cpp", action="store_true", help="llama.cpp's server as the peer")
    parser.add_argument("--batch1-prompts", type=int, default=4)
    parser.add_argument("--batch1-tokens", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "served.json"))
    args = parser.parse_args()

    from ember.api.bench.machine import machine_info

    loads = [int(n) for n in args.loads.split(",")]
    pin = str((os.cpu_count() or 1) - 1)
    machine = machine_info()
    flags = " ".join(f for f, on in machine["flags"].items() if on)
    print(f"machine: {machine['cpu_model']}; flags {flags}; {os.cpu_count()} cores", flush=True)
    result: dict = {"machine": machine, "loads": loads, "max_tokens": args.max_tokens, "client_pinned_to": pin}
    binary = gguf = None
    if args.with_llama_cpp:
        from peer_llama_cpp import ensure_llama_server, server_command

        binary, why = ensure_llama_server()
        result["llama_cpp"] = {"available": binary is not None, "why_not": why or None}
        if binary is None:
            print(f"llama.cpp's server can't be built here: {why}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if binary is not None:
            from ember.weights.default_model import fetch_default_gguf

            gguf = fetch_default_gguf(work / "gguf", progress=False)
            result["llama_cpp"]["command"] = server_command(binary, gguf, 0, 0, os.cpu_count() or 1)
        for n in loads:
            before = offline(n, args.max_tokens, work)
            print(_line(f"{n} streams, offline", before), flush=True)

            def ember_runs(url: str, _healthy: float, n: int = n) -> dict:
                return {"served": client(url, n, n, args.max_tokens, work, "ember"),
                        "served_client_pinned": client(url, n, n, args.max_tokens, work, "ember_pinned", pin)}

            runs = serving(start_ember, f"ember_{n}", work, ember_runs)
            after = offline(n, args.max_tokens, work)
            print(_line(f"{n} streams, offline again", after), flush=True)
            base = (before["output_tokens_per_s"] + after["output_tokens_per_s"]) / 2
            entry = {"offline": before, "offline_again": after, **runs,
                     "served_over_offline": runs["served"]["output_tokens_per_s"] / base,
                     "served_pinned_over_offline": runs["served_client_pinned"]["output_tokens_per_s"] / base}
            print(_line(f"{n} streams, served", runs["served"]), flush=True)
            print(_line(f"{n} streams, served, client on core {pin}", runs["served_client_pinned"]), flush=True)
            print(f"{n} streams: served / offline x{entry['served_over_offline']:.3f} (client pinned "
                  f"x{entry['served_pinned_over_offline']:.3f}; bar 0.95)", flush=True)
            if binary is not None:
                from peer_llama_cpp import start_llama_server

                peer = serving(lambda port, log, n=n: start_llama_server(binary, gguf, port, n, log),
                               f"llama_cpp_{n}", work,
                               lambda url, _, n=n: client(url, n, n, args.max_tokens, work, "llama_cpp"))
                entry["llama_cpp_served"] = peer
                entry["ember_over_llama_cpp"] = runs["served"]["output_tokens_per_s"] / peer["output_tokens_per_s"]
                print(_line(f"{n} streams, llama.cpp server ({n} slots)", peer), flush=True)
                print(f"{n} streams: Ember served / llama.cpp served x{entry['ember_over_llama_cpp']:.3f} (bar 1.5)",
                      flush=True)
            result[str(n)] = entry
        if binary is not None:
            k, tokens = args.batch1_prompts, args.batch1_tokens
            one = {"ember": serving(start_ember, "ember_1", work,
                                    lambda url, _: client(url, k, 1, tokens, work, "ember_b1")),
                   "llama_cpp": serving(lambda port, log: start_llama_server(binary, gguf, port, 1, log),
                                        "llama_cpp_1", work,
                                        lambda url, _: client(url, k, 1, tokens, work, "llama_b1"))}
            one["ember_over_llama_cpp"] = one["ember"]["output_tokens_per_s"] / one["llama_cpp"]["output_tokens_per_s"]
            result["batch1"] = one
            print(_line(f"batch 1 ({k} x {tokens} tokens), Ember served", one["ember"]), flush=True)
            print(_line(f"batch 1 ({k} x {tokens} tokens), llama.cpp server", one["llama_cpp"]), flush=True)
            print(f"batch 1: Ember / llama.cpp x{one['ember_over_llama_cpp']:.3f} (bar 1.5)", flush=True)
    result["load_average"] = list(os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
