"""The engine-core benchmark's batch-1 decode measurement (`ember.api.bench.core_step`,
figures 3 and 4): `measure_decode` is self-contained, shipped to a fresh interpreter
with ``python -c`` (`run_decode`), so that it also runs under an older install of Ember
(the baseline of a comparison)."""

from __future__ import annotations

import inspect
import json
import subprocess
import tempfile
import textwrap
from typing import Any

RESULT_MARKER = "EMBER_CORE_STEP_RESULT "


def measure_decode(spec):
    """Batch-1 decode of `spec["prompt_token_ids"]` for `spec["decode_tokens"]` tokens,
    `spec["runs"]` times after one short warm-up run, with the model's forward timed.

    Self-contained on purpose (imports inside, no annotations, only APIs that every
    Ember version this compares has): its source is sent to other interpreters."""
    import os
    import statistics
    import time

    import ember
    from ember import SamplingParams
    from ember.config import EngineConfig
    from ember.engine import LLMEngine  # the name every version has

    prompt_ids = list(spec["prompt_token_ids"])
    decode_tokens = int(spec["decode_tokens"])
    warmup_tokens = min(decode_tokens, 8)
    kwargs = {"model": spec["model"], "dtype": spec["dtype"]}
    if spec.get("num_threads") is not None:
        kwargs["num_threads"] = int(spec["num_threads"])
    # One request at a time: a KV pool of its size, not the backend's share of memory.
    num_tokens = len(prompt_ids) + decode_tokens + 1
    block_size = getattr(EngineConfig, "block_size", None) or 16  # versions before num_kv_tokens
    try:
        config = EngineConfig(num_kv_tokens=num_tokens, **kwargs)
    except TypeError:  # an EngineConfig without num_kv_tokens
        try:
            config = EngineConfig(num_kv_blocks=-(-num_tokens // block_size) + 1, **kwargs)
        except TypeError:  # nor num_kv_blocks
            config = EngineConfig(**kwargs)
    engine = LLMEngine(config)

    backend = getattr(engine, "backend", None)
    sync = getattr(backend, "synchronize", None) or (lambda: None)
    timer = {"seconds": 0.0, "calls": 0, "depth": 0}

    def timed(fn):
        def wrapper(*args, **kw):
            if timer["depth"]:  # one inside another: counted once, by the outer one
                return fn(*args, **kw)
            timer["depth"] += 1
            sync()
            start = time.perf_counter()
            try:
                out = fn(*args, **kw)
                sync()
                return out
            finally:
                timer["seconds"] += time.perf_counter() - start
                timer["calls"] += 1
                timer["depth"] -= 1

        return wrapper

    model = getattr(engine, "model", None)  # None: nothing to time (reported as a warning)
    wrapped = []
    for name in ("forward", "compute_logits"):
        fn = getattr(model, name, None) if model is not None else None
        if callable(fn):
            setattr(model, name, timed(fn))  # an instance attribute: model(...) calls it
            wrapped.append(name)

    def num_tokens(out):
        try:
            return len(out.outputs[0].token_ids)
        except (AttributeError, IndexError, TypeError):
            return len(getattr(out, "new_token_ids", ()) or ())

    def run(max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(None, params, prompt_token_ids=list(prompt_ids))
        steps = []  # (wall s, model s, model calls, tokens so far, end time)
        produced = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            timer["seconds"], timer["calls"] = 0.0, 0
            t0 = time.perf_counter()
            outputs = engine.step()
            t1 = time.perf_counter()
            for out in outputs:
                produced = max(produced, num_tokens(out))
            steps.append((t1 - t0, timer["seconds"], timer["calls"], produced, t1 - start))
        return steps

    run(warmup_tokens)
    runs = []
    decode_steps = []
    for _ in range(int(spec["runs"])):
        steps = run(decode_tokens)
        first = next(i for i, s in enumerate(steps) if s[3] >= 1)  # the step of the first token (prefill)
        decode = steps[first + 1:]
        tokens_after_first = steps[-1][3] - 1
        decode_s = steps[-1][4] - steps[first][4]
        runs.append({
            "output_tokens": steps[-1][3],
            "ttft_ms": 1000 * steps[first][4],
            "decode_s": decode_s,
            "decode_tok_s": tokens_after_first / decode_s if decode_s > 0 else None,
            "num_decode_steps": len(decode),
        })
        decode_steps.extend(decode)

    def ms(values, how):
        return 1000 * how(values) if values else None

    overhead = [wall - model_s for wall, model_s, _, _, _ in decode_steps]
    walls = [s[0] for s in decode_steps]
    model_times = [s[1] for s in decode_steps]
    rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"] is not None]
    try:
        import torch

        torch_info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    except Exception:  # noqa: BLE001 - informative only
        torch_info = {}
    return {
        "ember_path": os.path.dirname(ember.__file__),
        **torch_info,
        "prompt_tokens": len(prompt_ids),
        "decode_tokens": decode_tokens,
        "runs": runs,
        "decode_tok_s": statistics.median(rates) if rates else None,
        "num_decode_steps": len(decode_steps),
        "timed_methods": wrapped,
        "model_calls_per_step": statistics.mean(s[2] for s in decode_steps) if decode_steps else None,
        "step_ms_mean": ms(walls, statistics.mean),
        "step_ms_p50": ms(walls, statistics.median),
        "model_ms_mean": ms(model_times, statistics.mean),
        "model_ms_p50": ms(model_times, statistics.median),
        "step_overhead_ms_mean": ms(overhead, statistics.mean),
        "step_overhead_ms_p50": ms(overhead, statistics.median),
    }


def _decode_snippet() -> str:
    """Python source that runs `measure_decode` on the JSON spec in ``sys.argv[1]`` and
    prints its result after `RESULT_MARKER`."""
    return "\n".join([
        textwrap.dedent(inspect.getsource(measure_decode)),
        "import json, sys",
        "result = measure_decode(json.loads(sys.argv[1]))",
        f"print({RESULT_MARKER!r} + json.dumps(result), flush=True)",
    ])


def run_decode(python: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """`measure_decode(spec)` in a fresh `python` (from a neutral folder, so that it
    imports its own install of Ember); its log goes to our stderr."""
    with tempfile.TemporaryDirectory(prefix="ember-core-step-") as cwd:
        try:
            proc = subprocess.run([python, "-c", _decode_snippet(), json.dumps(spec)], cwd=cwd, text=True,
                                  capture_output=True, timeout=timeout_s, check=False)
        except FileNotFoundError:
            raise ValueError(f"{python!r}: no such interpreter") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"the batch-1 decode run under {python} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    result["python"] = python
    result["git_commit"] = _git_commit(result.get("ember_path"))
    return result


def _git_commit(path: str | None) -> str | None:
    if not path:
        return None
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


