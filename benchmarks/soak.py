"""Soak test (issue 35 item 2): `ember serve` at saturation for `--minutes` (default 60),
with a mix of what clients send, checked against the bars an operator relies on.

The server runs as a subprocess (the default model unless `--model-id`; n-gram
speculation on; a random LoRA adapter on a share of the requests with `--lora random`),
and `--clients` asynchronous clients keep it busy with:

* plain chat, streaming chat (30% of streams disconnect at a random chunk), completions
  with n=2, JSON-schema chat (response_format), forced tool calls, prompts sharing a long
  prefix (the prefix cache), and 1% bad requests (oversized, malformed JSON, unknown
  fields: each must get a 4xx).

A sampler records, every `--sample-seconds`: the server's RSS (all its processes), the
KV blocks in use, the requests running/waiting and the engine restarts (/metrics),
/health's latency, and the server's child processes (the engine core's pid must live on).

Bars (the windows scale with `--minutes`; for 60 they are the issue's):
  * no 5xx response;
  * KV blocks in use back to 0 once the load stops;
  * RSS growth under 2% between minute 10 and the end;
  * no engine restart (ember_engine_restarts_total stays 0, the children there at the start
    live on, the server never exits);
  * TTFT p99 of the last 10 minutes within 10% of minutes 5-15;
  * /health under 1 s at every sample.

Prints the figures, writes a JSON result (`--json-out`) and, with `--plot-dir`, plots of
RSS, KV use, throughput and latency over time. Exit status 0 when every bar holds.

    python benchmarks/soak.py --minutes 60 --plot-dir benchmarks/results/soak
    python benchmarks/soak.py --minutes 5 --model-id /path/to/tiny-model  # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from ember.api.bench.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "temperature", "sunny"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string", "maxLength": 16}},
                                                          "required": ["city"]}}}]
SHARED_PREFIX = ("You are a helpful assistant for a travel agency. Answer in one or two sentences, politely, and "
                 "never invent prices. The agency sells trips to Paris, Rome, Lisbon, Kyoto and Lima. ") * 6
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "Why is the sky blue?", "Give me a recipe for pancakes.", "What is 17 times 23?",
             "Tell me a fact about octopuses.", "Translate 'good morning' to Spanish.",
             "What should I pack for Kyoto in spring?", "Summarise the plot of Hamlet in one line."]
MIX = (("chat", 0.24), ("stream", 0.30), ("completions_n", 0.10), ("json", 0.10), ("tool", 0.10),
       ("shared_prefix", 0.15), ("bad", 0.01))


@dataclass
class Record:
    kind: str
    start: float  # seconds since the run began
    latency: float = 0.0
    ttft: float | None = None
    status: int = 0
    tokens: int = 0
    disconnected: bool = False
    error: str | None = None


@dataclass
class Sample:
    t: float
    rss_mb: float
    kv_used: float | None
    running: float | None
    waiting: float | None
    health_s: float | None
    health_status: int | None
    restarts: float | None = None  # ember_engine_restarts_total
    child_pids: list[int] = field(default_factory=list)  # the engine core, grammar compile workers, ...


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric(text: str, name: str) -> float | None:
    """The sum of a Prometheus family's samples without suffix (None when absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def random_lora(model_dir: str, out: Path) -> Path:
    """A rank-8 LoRA with random weights on the model's q/v projections (peft): real
    adapter traffic, whatever it says. Built on the model's config alone (an adapter needs
    only the shapes; the default model's directory holds packed GGUF weights)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir),
                                                          torch_dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.records: list[Record] = []
        self.samples: list[Sample] = []
        self.t0 = 0.0
        self.url = ""
        self.server: subprocess.Popen | None = None
        self.lora_name: str | None = None
        self.model = ""  # the served name (/v1/models)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the server --------------------------------------------------------------------
    def start_server(self) -> None:
        args, port = self.args, free_port()
        command = [sys.executable, "-m", "ember.api.cli", "serve", "--port", str(port),
                   "--max-concurrent-requests", "1024", "--max-total-tokens", str(args.max_total_tokens)]
        if args.model_id:
            command += ["--model-id", args.model_id]
        if args.speculate:
            command += ["--speculate", str(args.speculate)]
        if args.lora == "random":
            model_dir = subprocess.run([sys.executable, "-m", "ember.api.cli", "download"]
                                       + ([args.model_id] if args.model_id else []),
                                       check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            adapter = random_lora(model_dir, Path(tempfile.mkdtemp(prefix="soak-lora-")))
            self.lora_name = "soak-lora"
            command += ["--lora-modules", f"{self.lora_name}={adapter}", "--max-lora-rank", "8"]
        command += args.serve_args
        log = open(Path(args.log), "w") if args.log else subprocess.DEVNULL
        self.server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise SystemExit(f"the server exited with {self.server.returncode} while starting: {' '.join(command)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("the server did not become healthy within 600 s")

    def stop_server(self) -> int:
        assert self.server is not None
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        return self.server.returncode

    def process_tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.server.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    # -- load --------------------------------------------------------------------------
    def body(self, kind: str, rng: random.Random) -> tuple[str, dict | bytes]:
        question = rng.choice(QUESTIONS)
        model = self.lora_name if self.lora_name and rng.random() < 0.25 else self.model
        chat = {"model": model, "messages": [{"role": "user", "content": question}],
                "max_tokens": rng.randint(16, self.args.max_tokens), "temperature": rng.choice([0.0, 0.7])}
        if kind == "completions_n":
            return "/v1/completions", {"model": model, "prompt": question, "n": 2, "max_tokens": chat["max_tokens"],
                                       "temperature": 0.8}
        if kind == "json":
            return "/v1/chat/completions", {**chat, "max_tokens": 120, "response_format": {
                "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}
        if kind == "tool":
            return "/v1/chat/completions", {**chat, "max_tokens": 80, "tools": TOOLS, "tool_choice": "required"}
        if kind == "shared_prefix":
            return "/v1/chat/completions", {**chat, "messages": [{"role": "system", "content": SHARED_PREFIX},
                                                                 {"role": "user", "content": question}]}
        if kind == "bad":
            choice = rng.randrange(3)
            if choice == 0:
                return "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * 400_000}]}
            if choice == 1:
                return "/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": '
            return "/v1/chat/completions", {**chat, "no_such_field": 1}
        return "/v1/chat/completions", {**chat, "stream": kind == "stream"}

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
        path, body = self.body(kind, rng)
        record = Record(kind, self.now())
        start = time.monotonic()
        try:
            if isinstance(body, dict) and body.get("stream"):
                cut = rng.randint(1, 20) if rng.random() < 0.3 else None
                async with client.stream("POST", path, json=body) as response:
                    record.status = response.status_code
                    chunks = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks += 1
                            if record.ttft is None:
                                record.ttft = time.monotonic() - start
                            if cut is not None and chunks >= cut:
                                record.disconnected = True
                                break
                    record.tokens = chunks
            else:
                kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
                response = await client.post(path, headers={"Content-Type": "application/json"}, **kwargs)
                record.status = response.status_code
                record.ttft = time.monotonic() - start  # whole answers: the time to the answer
                if response.status_code == 200:
                    record.tokens = response.json().get("usage", {}).get("completion_tokens", 0)
                elif response.status_code >= 500:
                    record.error = response.text[:300]
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.latency = time.monotonic() - start
        self.records.append(record)

    async def client_loop(self, index: int, end: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        kinds, weights = zip(*MIX)
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(300, connect=30)) as client:
            while self.now() < end:
                await self.one(client, rng.choices(kinds, weights)[0], rng)

    async def sampler(self, end: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            while self.now() < end:
                await self.sample(client)
                await asyncio.sleep(self.args.sample_seconds)

    async def sample(self, client: httpx.AsyncClient) -> Sample:
        tree = self.process_tree()
        rss = sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20
        start = time.monotonic()
        health_s = health_status = None
        try:
            health = await client.get("/health")
            health_s, health_status = time.monotonic() - start, health.status_code
        except httpx.HTTPError:
            pass
        kv = running = waiting = restarts = None
        try:
            text = (await client.get("/metrics")).text
            kv, running = metric(text, "ember_kv_cache_blocks_used"), metric(text, "ember_requests_running")
            waiting, restarts = metric(text, "ember_requests_waiting"), metric(text, "ember_engine_restarts_total")
        except httpx.HTTPError:
            pass
        sample = Sample(self.now(), rss, kv, running, waiting, health_s, health_status, restarts,
                        sorted(p.pid for p in tree[1:]))
        self.samples.append(sample)
        return sample

    async def run_load(self) -> None:
        end = self.args.minutes * 60
        await asyncio.gather(self.sampler(end), *(self.client_loop(i, end) for i in range(self.args.clients)))

    async def drain_check(self) -> Sample:
        """Once the load stopped: wait until nothing runs, then the idle sample."""
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                sample = await self.sample(client)
                if (sample.running == 0 and sample.waiting == 0 and sample.kv_used == 0) or time.monotonic() > deadline:
                    return sample
                await asyncio.sleep(1)


def _window(records: list[Record], lo: float, hi: float) -> list[float]:
    return [r.ttft for r in records if lo <= r.start < hi and r.ttft is not None and r.status == 200
            and r.kind in ("stream", "chat", "shared_prefix")]


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def report(soak: Soak, idle: Sample, alive: bool, exit_code: int) -> dict:
    minutes = soak.args.minutes
    scale = minutes / 60
    records, samples = soak.records, soak.samples
    server_errors = [r for r in records if r.status >= 500]
    transport_errors = [r for r in records if r.status == 0]
    bad = [r for r in records if r.kind == "bad"]
    rss_at = lambda t: min(samples, key=lambda s: abs(s.t - t)).rss_mb  # noqa: E731
    rss_base, rss_end = rss_at(10 * 60 * scale), rss_at(minutes * 60)
    early, late = _window(records, 5 * 60 * scale, 15 * 60 * scale), _window(records, (minutes - 10 * scale) * 60, 1e9)
    early_p99, late_p99 = _p99(early), _p99(late)
    health = [s.health_s for s in samples if s.health_s is not None]
    first_children = set(samples[0].child_pids) if samples else set()
    lost = sorted(first_children - set(samples[-1].child_pids)) if samples else []  # children there from the start
    restarts = max((s.restarts or 0.0 for s in samples), default=0.0)
    seconds = max(r.start + r.latency for r in records) if records else 1.0
    tokens = sum(r.tokens for r in records if r.status == 200)
    bars = {
        "no_5xx": not server_errors,
        "kv_blocks_back_to_0": idle.kv_used == 0,
        "rss_growth_under_2pct": rss_end <= rss_base * 1.02,
        # the restart counter stayed 0 and every child process there at the start (the engine core) lived on;
        # children that appear later are grammar compile workers, started at the first compile
        "no_engine_restart": restarts == 0 and not lost and alive,
        "ttft_p99_late_within_10pct": early_p99 is not None and late_p99 is not None and late_p99 <= early_p99 * 1.10,
        "health_under_1s": bool(health) and max(health) < 1.0 and all(s.health_status == 200 for s in samples
                                                                        if s.health_status is not None),
        "bad_requests_4xx": all(400 <= r.status < 500 for r in bad),
    }
    return {
        "minutes": minutes, "clients": soak.args.clients, "model": soak.args.model_id or "default (SmolLM2 Q4_1)",
        "speculate": soak.args.speculate, "lora": soak.lora_name,
        "machine": {**machine_info(), "python": platform.python_version()},
        "requests": len(records), "by_kind": {k: sum(r.kind == k for r in records) for k, _ in MIX},
        "disconnected": sum(r.disconnected for r in records), "server_errors": len(server_errors),
        "server_error_examples": [asdict(r) for r in server_errors[:5]],
        "transport_errors": len(transport_errors), "transport_error_examples": [asdict(r) for r in transport_errors[:5]],
        "bad_requests": len(bad), "bad_statuses": sorted({r.status for r in bad}),
        "output_tokens_per_s": tokens / seconds,
        "rss_mb": {"at_10min_mark": rss_base, "end": rss_end, "growth": rss_end / rss_base - 1 if rss_base else None},
        "ttft_p99_s": {"minutes_5_15": early_p99, "last_10": late_p99, "samples": [len(early), len(late)]},
        "health_s": {"max": max(health) if health else None, "samples": len(health)},
        "idle": {"kv_blocks_used": idle.kv_used, "running": idle.running, "waiting": idle.waiting},
        "children_at_start": sorted(first_children), "children_lost": lost, "engine_restarts": restarts,
        "alive_after_load": alive,
        "server_exit_code_after_sigterm": exit_code,
        "bars": bars, "passed": all(bars.values()),
        "samples": [asdict(s) for s in samples], "records": [asdict(r) for r in records],
    }


def plot(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    samples, records = result["samples"], result["records"]
    minutes = [s["t"] / 60 for s in samples]
    made = []
    for name, key, label in (("rss", "rss_mb", "RSS of the server's processes (MiB)"),
                             ("kv", "kv_used", "KV blocks in use"), ("health", "health_s", "/health latency (s)")):
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(minutes, [s[key] for s in samples])
        ax.set_xlabel("minute")
        ax.set_ylabel(label)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        made.append(out / f"{name}.png")
    width = max(10.0, result["minutes"])  # seconds a point covers: 60 points over the run, at least 10 s each
    last = int(max((r["start"] for r in records), default=0) // width) + 1
    bins = [[r for r in records if int(r["start"] // width) == b] for b in range(last)]
    x = [(b + 0.5) * width / 60 for b in range(last)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.plot(x, [sum(r["tokens"] for r in rs if r["status"] == 200) / width for rs in bins], marker=".")
    top.set_ylabel("output tokens/s")
    for q, style in ((0.5, "-"), (0.99, "--")):
        values = []
        for rs in bins:
            ttfts = sorted(r["ttft"] for r in rs if r["ttft"] is not None and r["status"] == 200)
            values.append(ttfts[min(len(ttfts) - 1, int(q * (len(ttfts) - 1)))] if ttfts else None)
        bottom.plot(x, values, style, marker=".", label=f"TTFT p{int(q * 100)}")
    bottom.set_xlabel("minute")
    bottom.set_ylabel("seconds")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_latency.png")
    plt.close(fig)
    return made + [out / "throughput_latency.png"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=24, help="concurrent clients (saturation on a small CPU)")
    parser.add_argument("--model-id", default=None, help="default: Ember's default model")
    parser.add_argument("--speculate", type=int, default=3, help="n-gram speculation tokens (0: off)")
    parser.add_argument("--lora", choices=("none", "random"), default="none",
                        help="random: a random rank-8 adapter (peft) served beside the base, on 25%% of requests")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--sample-seconds", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, help="default: benchmarks/results/soak-<minutes>min.json")
    parser.add_argument("--plot-dir", default=None)
    parser.add_argument("--log", default=None, help="the server's log file")
    parser.add_argument("serve_args", nargs="*", help="more `ember serve` flags, after --")
    args = parser.parse_args(argv)
    soak = Soak(args)
    soak.start_server()
    print(f"soak: {args.minutes:g} min, {args.clients} clients against {soak.url}", flush=True)
    soak.t0 = time.monotonic()
    try:
        asyncio.run(soak.run_load())
        idle = asyncio.run(soak.drain_check())
        alive = soak.server.poll() is None
    finally:
        exit_code = soak.stop_server()
    result = report(soak, idle, alive, exit_code)
    out = Path(args.json_out or ROOT / "benchmarks" / "results" / f"soak-{args.minutes:g}min.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("samples", "records")}
    print(json.dumps(summary, indent=1))
    if args.plot_dir:
        for path in plot(result, Path(args.plot_dir)):
            print(f"plot: {path}")
    print("PASSED" if result["passed"] else f"FAILED: {[k for k, v in result['bars'].items() if not v]}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
