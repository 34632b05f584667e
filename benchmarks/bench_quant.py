"""GGUF weights kept quantized (issue 18), in one run on SmolLM2-135M-Instruct.

Arms, each in its own subprocess (peak RSS is the child's own ru_maxrss):

* ``ember_q4_1``: the default model's GGUF served natively (Q4_1 layers, Q8_0 LM head,
  ``resolve_model(None, gguf_native=True)``);
* ``ember_q4_1_one_row``: the same with the CPU backend's option ``gguf_x8=false`` (the one-row kernels, the
  weights as read: the baseline of the x8 layout);
* ``ember_bf16``: its float conversion loaded as bfloat16 (Ember's bf16 model; on a
  CPU without AVX512-BF16/AMX that is the fp32 compute path with bf16 weight copies);
* ``transformers_bf16``: transformers ``generate`` on the float conversion in bfloat16;
* ``llama_cpp`` (``--llama-cpp``): llama-cpp-python on the very GGUF file, built once
  from its PyPI sdist in a side venv (``<Ember cache>/bench/llama-cpp-python-<version>``,
  ``$EMBER_BENCH_LLAMA_CPP_VENV``), with as many threads as Ember uses.

Figures: batch-1 decode tokens/s (one chat prompt, ``--decode-tokens`` new tokens,
greedy, end of text ignored; tokens / wall time of the whole request, prompt
included, the same for every arm), offline throughput (``--num-prompts`` chat prompts
x ``--max-tokens``) for the Ember arms, each the arm's best of ``--rounds`` runs with
the arms taking turns, peak RSS of each arm, and the ratios
the issue asks for: Q4_1 decode / transformers bf16 (bar 5.0), Q4_1 decode /
llama.cpp (bar 1.0), Q4_1 offline / bf16 offline (bar 1.0). ``--profile`` adds a
torch profiler table of Ember's decode steps (where a step's time goes).

    python benchmarks/bench_quant.py [--llama-cpp] [--profile] [--out benchmarks/results/quant.json]
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

LLAMA_CPP_VERSION = "0.3.36"
ARMS = ("ember_q4_1", "ember_q4_1_one_row", "ember_bf16", "transformers_bf16", "llama_cpp")


# llama.cpp's AMX backend (GGML_NATIVE turns it on where the CPU has AMX) crashed with
# SIGSEGV in its first decode here (Intel Xeon with AMX-INT8, llama-cpp-python 0.3.36;
# upstream: ggml-org/llama.cpp#20824, "segfault in ggml_backend_amx_mul_mat"). On such a
# CPU the peer is built for every other ISA extension the CPU has, without AMX, as Ember
# runs without it too.
_GGML_ISA_OPTIONS = {  # ggml CMake option: /proc/cpuinfo flag
    "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
    "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16",
}


def llama_cpp_cmake_args() -> tuple[str, str]:
    """(CMAKE_ARGS for the peer's build, a tag naming the variant)."""
    from ember.hardware.cpu_paths import cpu_flags

    base = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
    flags = cpu_flags()
    if not any(f.startswith("amx") for f in flags):
        return f"-DGGML_NATIVE=ON {base}", "native"
    isa = " ".join(f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in _GGML_ISA_OPTIONS.items())
    return f"-DGGML_NATIVE=OFF {isa} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF {base}", "noamx"


def llama_cpp_build_dir(variable: str, stem: str) -> Path:
    """``$variable``, else ``<Ember cache>/bench/<stem>-<version>[-tag]``: where a llama.cpp
    build for this CPU lives (the tag names a variant other than native)."""
    if env := os.environ.get(variable):
        return Path(env).expanduser()
    from ember.weights import ember_cache_dir

    _, tag = llama_cpp_cmake_args()
    suffix = "" if tag == "native" else f"-{tag}"
    return ember_cache_dir() / "bench" / f"{stem}-{LLAMA_CPP_VERSION}{suffix}"


def llama_cpp_venv_dir() -> Path:
    return llama_cpp_build_dir("EMBER_BENCH_LLAMA_CPP_VENV", "llama-cpp-python")


def ensure_llama_cpp(log=print) -> tuple[Path | None, str]:
    """The side venv's python with llama-cpp-python importable, built once from the
    PyPI sdist (for this CPU: GGML_NATIVE); (None, why) if that fails."""
    venv = llama_cpp_venv_dir()
    python = venv / "bin" / "python"
    marker = venv / "ember-llama-cpp-ok"
    if marker.is_file():
        return python, ""
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmake_args, _ = llama_cpp_cmake_args()
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    log(f"building llama-cpp-python {LLAMA_CPP_VERSION} from its sdist into {venv} (minutes; CMAKE_ARGS {cmake_args})")
    # --no-cache-dir: pip caches the wheel it built by the sdist alone, whatever CMAKE_ARGS were
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                           f"llama-cpp-python=={LLAMA_CPP_VERSION}"], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return None, f"pip install llama-cpp-python failed: {proc.stderr.strip()[-800:]}"
    check = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True, check=False)
    if check.returncode != 0:
        return None, f"import llama_cpp failed: {check.stderr.strip()[-800:]}"
    marker.write_text(check.stdout)
    return python, ""


# --- arms (run in a child: `--arm NAME --arm-in JSON --arm-out JSON`) ---------------------------


def _ember_arm(spec: dict) -> dict:
    from ember import LLM, SamplingParams

    kwargs = {"dtype": spec["dtype"]} if spec.get("dtype") else {}
    if spec.get("backend_options"):
        kwargs["backend_options"] = spec["backend_options"]
    start = time.perf_counter()
    llm = LLM(model=spec["model"], kv_cache_memory_bytes=2 << 30, **kwargs)
    out: dict = {"load_seconds": time.perf_counter() - start}
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=spec["prompts"][:2], sampling_params=greedy)  # warm-up
    one = spec["prompts"][:1]
    params = SamplingParams(temperature=0.0, max_tokens=spec["decode_tokens"], ignore_eos=True)
    start = time.perf_counter()
    res = llm.generate(prompt_token_ids=one, sampling_params=params)
    seconds = time.perf_counter() - start
    out["decode"] = {"tokens": len(res[0].outputs[0].token_ids), "seconds": seconds,
                     "tokens_per_s": len(res[0].outputs[0].token_ids) / seconds,
                     "text": res[0].outputs[0].text[:200]}
    if spec.get("profile"):
        out["profile"] = _profile_decode(llm, one)
    if spec.get("offline"):
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        res = llm.generate(prompt_token_ids=spec["prompts"], sampling_params=params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in res)
        out["offline"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    from ember.models.loader import model_weight_bytes

    total, packed, formats = model_weight_bytes(llm.engine.model)
    out["weights_mib"] = {"total": total / 2**20, "packed": packed / 2**20, "formats": formats}
    core = llm.engine.core
    graphs = core.runner.graphs
    out["kv_cache_dtype"] = str(core.kv_dtype).removeprefix("torch.")
    out["cpu_graph_sizes"] = list(graphs.sizes) if graphs is not None else []
    return out


def _profile_decode(llm, prompt) -> dict:
    """A torch profiler table of 64 decode steps of one request: self CPU time by op."""
    from torch.profiler import ProfilerActivity, profile

    from ember import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=params)
        seconds = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table, flush=True)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    return {"seconds_profiled": seconds, "steps": 64,
            "top_self_cpu_ms": {e.key: e.self_cpu_time_total / 1000 for e in events}}


def _transformers_arm(spec: dict) -> dict:
    from bench_offline import run_hf

    tokens, seconds, _ = run_hf(spec["model"], spec["prompts"][:1], spec["decode_tokens"], "bfloat16", 1,
                                spec["pad_id"])
    return {"decode": {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}}


LLAMA_CPP_SNIPPET = r"""
import json, sys, time
from llama_cpp import Llama
spec = json.load(open(sys.argv[1]))
llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_ctx=2048, verbose=False)
def run(n):
    llm.reset()
    start = time.perf_counter()
    count = 0
    for _ in llm.generate(spec["prompt"], temp=0.0, top_k=1, reset=True):
        count += 1
        if count == n:
            break
    return count, time.perf_counter() - start
run(4)
tokens, seconds = run(spec["decode_tokens"])
import resource
json.dump({"decode": {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds},
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "version": __import__("llama_cpp").__version__}, open(sys.argv[2], "w"))
"""


def _quality_arm(spec: dict) -> dict:
    """Perplexity of the Q4_1-native model with bench_quant_quality.py's text and method."""
    import math

    import bench_quant_quality as quality

    from ember.models.tokenizer import load_tokenizer

    model_dir = Path(spec["model"])
    ids = load_tokenizer(model_dir).encode(quality.TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    windows = [w for w in (ids[i : i + spec["window"]] for i in range(0, len(ids), spec["window"])) if len(w) > 1]
    model, attention, backend = quality.load(model_dir, None)  # the gguf quantizer, from config.json
    nll = count = 0
    start = time.perf_counter()
    for window in windows:
        n, c = quality.window_nll(model, attention, backend, window)
        nll, count = nll + n, count + c
    from ember.models.loader import model_weight_bytes

    total, packed, formats = model_weight_bytes(model)
    return {"quantize": "gguf (Q4_1 layers, Q8_0 LM head), native kernels", "perplexity": math.exp(nll / count),
            "mean_nll": nll / count, "scored_tokens": count, "weight_bytes": total, "packed_bytes": packed,
            "quantized_linears": formats, "eval_s": round(time.perf_counter() - start, 2)}


def run_arm(name: str, spec: dict, work: Path, python: str | None = None) -> dict:
    """Run arm ``name`` in a child process; its result with the child's peak RSS."""
    spec_path, out_path = work / f"{name}.in.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    if name == "llama_cpp":
        script = work / "llama_cpp_arm.py"
        script.write_text(LLAMA_CPP_SNIPPET)
        command = [python, str(script), str(spec_path), str(out_path)]
    else:
        command = [sys.executable, __file__, "--arm", name, "--arm-in", str(spec_path), "--arm-out", str(out_path)]
    print(f"--- {name}", flush=True)
    proc = subprocess.run(command, check=False)
    if proc.returncode != 0 or not out_path.exists():
        return {"error": f"exit status {proc.returncode}"}
    return json.loads(out_path.read_text())


def child(name: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if name == "transformers_bf16":
        out = _transformers_arm(spec)
    elif name == "q4_1_quality":
        out = _quality_arm(spec)
    else:
        out = _ember_arm(spec)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_path).write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant.json"))
    parser.add_argument("--llama-cpp", action="store_true", help="llama-cpp-python as a peer (built once, cached)")
    parser.add_argument("--profile", action="store_true", help="profile Ember's Q4_1 decode steps")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--skip", nargs="*", default=[], choices=ARMS + ("quality",))
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per arm, the arms taking turns; each arm's best figures count")
    parser.add_argument("--window", type=int, default=1024, help="perplexity windows (bench_quant_quality.py's)")
    parser.add_argument("--quality-out", default=str(Path(__file__).parent / "results" / "quant_quality.json"))
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--arm-in", help=argparse.SUPPRESS)
    parser.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        child(args.arm, args.arm_in, args.arm_out)
        return

    import tempfile

    from bench_offline import make_conversations
    from transformers import AutoTokenizer

    from ember.api.bench.machine import machine_info
    from ember.hardware.cpu import cpu_thread_count
    from ember.weights import resolve_model
    from ember.weights.default_model import fetch_default_gguf

    float_dir = str(resolve_model(None, gguf_native=False))
    native_dir = str(resolve_model(None, gguf_native=True))
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    convs = make_conversations(args.num_prompts)
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    result: dict = {"machine": machine_info(), "model": "SmolLM2-135M-Instruct", "float_dir": float_dir,
                    "native_dir": native_dir, "decode_tokens": args.decode_tokens,
                    "offline": {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens}, "arms": {}}
    from ember.hardware.cpu_gguf import LARGE_ROWS, select_prefill

    result["gguf_prefill_mode"] = dict(zip(("mode", "why"), select_prefill()))
    common = {"prompts": ids, "decode_tokens": args.decode_tokens, "max_tokens": args.max_tokens, "pad_id": pad_id}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        arms = result["arms"]
        specs: dict[str, tuple[dict, str | None]] = {}  # arm -> (spec, python), in running order
        if "ember_q4_1" not in args.skip:
            specs["ember_q4_1"] = ({**common, "model": native_dir, "offline": True, "profile": args.profile}, None)
        if "ember_q4_1_one_row" not in args.skip:
            specs["ember_q4_1_one_row"] = ({**common, "model": native_dir, "offline": True,
                                            "backend_options": {"gguf_x8": "false"}}, None)
        if "ember_bf16" not in args.skip:
            specs["ember_bf16"] = ({**common, "model": float_dir, "dtype": "bfloat16", "offline": True}, None)
        if "transformers_bf16" not in args.skip:
            specs["transformers_bf16"] = ({**common, "model": float_dir}, None)
        if args.llama_cpp and "llama_cpp" not in args.skip:
            python, why = ensure_llama_cpp()
            if python is None:
                arms["llama_cpp"] = {"error": why}
            else:
                gguf_path = fetch_default_gguf(work / "gguf", progress=False)
                result["llama_cpp_cmake_args"] = llama_cpp_cmake_args()[0]
                specs["llama_cpp"] = ({"gguf": str(gguf_path), "prompt": ids[0], "decode_tokens": args.decode_tokens,
                                       "threads": cpu_thread_count()}, str(python))
        # Every arm runs --rounds times, the arms taking turns, and each figure (decode,
        # offline) is the arm's best round: the machine's noise (other tenants) only ever
        # slows a run, and falls on every arm alike.
        for round_ in range(args.rounds):
            for name, (spec, python) in specs.items():
                if round_ == 0:
                    arms[name] = run_arm(name, spec, work, python)
                    for kind in ("decode", "offline"):
                        if kind in arms[name]:
                            arms[name][f"{kind}_rounds"] = [arms[name][kind]["tokens_per_s"]]
                    continue
                if "decode" not in arms[name]:
                    continue
                again = run_arm(name, {**spec, "profile": False}, work, python)
                for kind in ("decode", "offline"):
                    if kind in again and kind in arms[name]:
                        arms[name][f"{kind}_rounds"].append(again[kind]["tokens_per_s"])
                        if again[kind]["tokens_per_s"] > arms[name][kind]["tokens_per_s"]:
                            arms[name][kind] = again[kind]

        if "quality" not in args.skip:
            q = run_arm("q4_1_quality", {"model": native_dir, "window": args.window}, work)
            quality_path = Path(args.quality_out)
            table = json.loads(quality_path.read_text()) if quality_path.exists() else {}
            if "perplexity" in q and "float32" in table:
                q["perplexity_vs_float32"] = q["perplexity"] / table["float32"]["perplexity"]
            q["command"] = f"python benchmarks/bench_quant.py (window {args.window})"
            mode, why = result["gguf_prefill_mode"]["mode"], result["gguf_prefill_mode"]["why"]
            q["prefill_mode"] = mode
            q["note"] = (f"each window is one prefill: products of more than {LARGE_ROWS} rows ran in {mode} mode "
                         f"({why}; bf16: dequantized bfloat16 tiles, int8: the integer kernels, float32: exact "
                         "float tiles); tests/test_gguf_quant.py bounds each mode against the float model")
            table["q4_1_native"] = q
            quality_path.write_text(json.dumps(table, indent=2) + "\n")
            result["q4_1_native_perplexity"] = q.get("perplexity")
            print(f"q4_1_native perplexity: {q.get('perplexity')} ({q.get('perplexity_vs_float32')} x float32)")

    def rate(arm: str, kind: str) -> float | None:
        return result["arms"].get(arm, {}).get(kind, {}).get("tokens_per_s")

    ratios, bars = {}, {}
    for key, (a, b, kind, bar) in {
        "q4_1_decode_over_transformers_bf16": ("ember_q4_1", "transformers_bf16", "decode", 5.0),
        "q4_1_decode_over_llama_cpp": ("ember_q4_1", "llama_cpp", "decode", 1.0),
        "q4_1_offline_over_bf16_offline": ("ember_q4_1", "ember_bf16", "offline", 1.0),
        "q4_1_decode_over_bf16_decode": ("ember_q4_1", "ember_bf16", "decode", None),
        "x8_decode_over_one_row_decode": ("ember_q4_1", "ember_q4_1_one_row", "decode", None),
        "x8_offline_over_one_row_offline": ("ember_q4_1", "ember_q4_1_one_row", "offline", None),
    }.items():
        if rate(a, kind) and rate(b, kind):
            ratios[key] = rate(a, kind) / rate(b, kind)
            if bar is not None:
                bars[key] = {"bar": bar, "met": ratios[key] >= bar}
    result["ratios"], result["bars"] = ratios, bars
    for name, arm in result["arms"].items():
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
