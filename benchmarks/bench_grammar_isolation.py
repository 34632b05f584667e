"""Plain chat latency while clients send pathological grammars (issue 35 item 1).

Runs ``ember serve`` as a subprocess and a loop of plain 16-token chat requests
(``--plain-clients`` clients, one request at a time each). Time is cut into blocks of
``--block-s`` seconds; the arms alternate block by block: ``quiet`` (plain requests
only) and ``hostile`` (the same plain load, plus ``--hostile-clients`` clients each
sending, back to back, a distinct pathological schema: a large enum, deep nesting, a
long pattern or many properties, each new so the grammar cache cannot help; all built
before the clock starts, and each given up at the end of its block, so that the server
abandons its compile and the quiet block after it is quiet). The
server runs with the size limits raised by default (``--keep-limits`` keeps the
defaults, which refuse most of them at once), so every pathological schema reaches a
compile worker and is stopped there at ``--grammar-compile-timeout``.

Bar: p99 of the plain requests under ``hostile`` within 1.5x of ``quiet`` (ratio in one
run). Prints the figures, the machine (lscpu model name, uptime) and writes JSON.

    python benchmarks/bench_grammar_isolation.py [--model DIR] [--blocks 6] [--block-s 20] [--out r.json]
        [--compile-workers 0]   # compiles on threads of the engine's process, as before: the comparison
        [--compile-priority 10] # the workers at nice +10 instead of SCHED_IDLE

Without ``--model`` a tiny random Llama (ember.testing.tiny_models) is made and served.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pathological(rng: random.Random, n: int) -> dict:
    """A distinct schema that is slow to compile."""
    tag = f"{n}-{rng.random():.9f}"
    kind = n % 4
    if kind == 0:  # a large enum
        return {"type": "object", "properties": {"v": {"enum": [f"{tag}-value-{i}" for i in range(30_000)]}},
                "required": ["v"]}
    if kind == 1:  # deep nesting
        schema: dict = {"type": "object", "properties": {"x": {"type": "string", "pattern": f"{tag[:8]}[a-z]{{1,40}}"}}}
        for i in range(25):  # 2 JSON levels each: under the HTTP layer's 64
            schema = {"type": "object", "properties": {f"l{i}": schema, f"s{i}": {"type": "string", "maxLength": 30}},
                      "required": [f"l{i}", f"s{i}"]}
        return schema
    if kind == 2:  # a long pattern
        alternatives = "|".join(f"{tag}-{i}-[a-z]{{2,9}}" for i in range(800))
        return {"type": "object", "properties": {"p": {"type": "string", "pattern": f"^({alternatives})$"}},
                "required": ["p"]}
    return {"type": "object", "properties": {f"p{i}_{tag}": {"type": "string", "maxLength": 20} for i in range(400)}}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--blocks", type=int, default=6, help="time blocks, alternating quiet/hostile")
    parser.add_argument("--block-s", type=float, default=20.0)
    parser.add_argument("--plain-clients", type=int, default=2)
    parser.add_argument("--hostile-clients", type=int, default=4)
    parser.add_argument("--compile-timeout", type=float, default=10.0)
    parser.add_argument("--keep-limits", action="store_true", help="keep the default --grammar-limits")
    parser.add_argument("--compile-workers", type=int, default=1,
                        help="--grammar-compile-workers (0: threads in the engine's process, as before)")
    parser.add_argument("--compile-priority", default="idle", help="--grammar-compile-priority: idle or a niceness")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench-grammar-isolation-")
    model = args.model
    if model is None:
        from ember.testing.tiny_models import make_tiny_model

        model = str(Path(tmp) / "tiny-llama")
        make_tiny_model("llama", Path(model))
    port = _free_port()
    command = [str(Path(sys.executable).with_name("ember")), "serve", "--model-id", model, "--port", str(port),
               "--grammar-compile-timeout", str(args.compile_timeout),
               "--grammar-compile-workers", str(args.compile_workers),
               "--grammar-compile-priority", args.compile_priority]
    if not args.keep_limits:
        command += ["--grammar-limits", "properties=100000,enum_values=1000000,depth=1000,pattern_length=1000000,"
                    "schema_bytes=100000000"]
    log = open(Path(tmp) / "server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"ember serve exited {server.returncode}; see {log.name}")
            time.sleep(0.5)
        result = _run(url, args)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    result["machine"] = _machine()
    result["command"] = command
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _run(url: str, args) -> dict:
    plain_body = {"model": "m", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16,
                  "ignore_eos": True}
    # every pathological schema distinct (the grammar cache cannot help) and encoded before the clock starts,
    # so that building a megabyte of JSON in this process does not slow the plain clients' timing
    rng = random.Random(0)
    bodies = [(n % 4, json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _pathological(rng, n)}},
    }).encode()) for n in range(args.hostile_clients * (4 * args.blocks + 8))]
    arm = {"name": "warmup", "ends": 0.0}
    stop = threading.Event()
    samples: list[tuple[str, float, float]] = []  # (arm, latency, start)
    hostile_outcomes: dict[str, int] = {}
    lock = threading.Lock()
    hostile_events: list = []
    t0 = time.perf_counter()
    t0_wall = time.time()

    def plain() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                name = arm["name"]
                started = time.perf_counter()
                response = client.post("/v1/chat/completions", json=plain_body)
                elapsed = time.perf_counter() - started
                if response.status_code != 200:
                    raise SystemExit(f"plain request: {response.status_code} {response.text[:200]}")
                if name == arm["name"] and name != "warmup":  # a request across blocks is not counted
                    with lock:
                        samples.append((name, elapsed, started - t0))

    def hostile(index: int) -> None:
        with httpx.Client(base_url=url) as client:
            while not stop.is_set():
                if arm["name"] != "hostile":
                    time.sleep(0.05)
                    continue
                with lock:
                    body = bodies.pop() if bodies else None
                if body is None:
                    raise SystemExit("out of pre-built pathological schemas: raise their number")
                kind, content = body
                sent = time.perf_counter()
                # given up at the block's end: the server abandons the compile, and the quiet block after is quiet
                remaining = max(0.5, arm["ends"] - sent)
                try:
                    response = client.post("/v1/chat/completions", content=content, timeout=remaining,
                                           headers={"content-type": "application/json"})
                except httpx.TimeoutException:
                    outcome = "given up at the block's end"
                else:
                    message = response.json().get("error", {}).get("message", "") if response.status_code != 200 else ""
                    outcome = f"{response.status_code} " + ("timeout" if "grammar-compile-timeout" in message else
                                                            "limit" if "grammar-limits" in message else
                                                            "memory" if "memory" in message else
                                                            "cpu" if "CPU-time" in message else "")
                with lock:
                    hostile_outcomes[outcome.strip()] = hostile_outcomes.get(outcome.strip(), 0) + 1
                    hostile_events.append((sent - t0, time.perf_counter() - t0, outcome.strip(), kind))

    threads = [threading.Thread(target=plain, daemon=True) for _ in range(args.plain_clients)]
    threads += [threading.Thread(target=hostile, args=(i,), daemon=True) for i in range(args.hostile_clients)]
    for t in threads:
        t.start()
    time.sleep(5)  # warm-up, not counted
    blocks = []
    for b in range(args.blocks):
        arm["ends"] = time.perf_counter() + args.block_s
        arm["name"] = "quiet" if b % 2 == 0 else "hostile"
        blocks.append(arm["name"])
        time.sleep(args.block_s)
    stop.set()
    arm["name"] = "done"
    for t in threads:
        t.join(timeout=5)
    figures = {}
    for name in ("quiet", "hostile"):
        values = [s for a, s, *_ in samples if a == name]
        figures[name] = {"n": len(values), "p50_s": _percentile(values, 0.5), "p95_s": _percentile(values, 0.95),
                         "p99_s": _percentile(values, 0.99), "mean_s": statistics.fmean(values) if values else None}
    ratio = figures["hostile"]["p99_s"] / figures["quiet"]["p99_s"]
    return {"blocks": blocks, "block_s": args.block_s, "arms": figures, "p99_ratio": ratio, "bar": 1.5,
            "within_bar": ratio <= 1.5, "hostile_outcomes": hostile_outcomes, "samples": samples,
            "hostile_events": hostile_events, "t0_unix": t0_wall}


def _machine() -> dict:
    model = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "uptime": subprocess.run(["uptime"], capture_output=True,
                                                                          text=True).stdout.strip()}


if __name__ == "__main__":
    sys.exit(main())
