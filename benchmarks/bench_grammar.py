"""Grammar-guided decoding on SmolLM2 (issue 16): the per-token cost of JSON-schema
decoding against unconstrained decoding, and the compile time of a 50-property schema,
for each grammar backend (outlines, xgrammar), in one run, one engine.

1. Per-token cost. One JSON schema the model fills with many tokens (an object of 11
   required fields: bounded strings, integers, a number, a boolean, two bounded string
   arrays; no ranges, so both backends compile the same schema), greedy, the same
   ``max_tokens`` for every arm, ``ignore_eos`` so the unconstrained arm writes
   ``max_tokens`` tokens (a constrained request still ends when its grammar is
   complete). Three arms: unconstrained, outlines, xgrammar (chosen per request).
   * batch 1: 8 prompts, each alone, the arms alternating prompt by prompt (their
     order rotating, so the machine's noise falls on all of them);
   * batch 32: the 8 prompts four times in one ``generate`` call per arm, the arms
     alternating, ``--rounds`` rounds.
   Every prompt is prefilled once before timing, so each arm finds the same prompt
   blocks in the prefix cache, and each backend's grammar is compiled before timing
   (compiles are part 2). Figures: ms per generated token (wall time / tokens) per
   arm, the ratio constrained / unconstrained (goal <= 1.25), tokens and finish
   reasons per arm, and the time spent in the grammar manager's masks and advance.
2. Compile time of a 50-property schema (strings with lengths, formats and a pattern,
   integers, numbers, booleans, enums, arrays, nested objects; all required). Integer
   ranges only for xgrammar: outlines refuses ``minimum``/``maximum`` (its refusal is
   recorded), so outlines compiles the schema without them, and xgrammar compiles both.
   * cold: the backend's ``compile`` called directly (neither backend caches: Ember's
     engine does), ``--compile-repeats`` times, a fresh ``Constraint`` each time;
   * through the engine: a request with the schema (max_tokens 1) the first time
     (a compile on the manager's thread, ``compile_time_s`` from its counters) and the
     second time (a cache hit), each against the same request without a constraint.

    python benchmarks/bench_grammar.py [--dtype auto] [--max-tokens 64] [--out result.json]

Prints the figures with the machine (lscpu model name and flags) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

BACKENDS = ("outlines", "xgrammar")

STR = {"type": "string", "maxLength": 32}
# filled with many tokens; no ranges, so outlines and xgrammar compile the same schema
DECODE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": STR,
        "age": {"type": "integer"},
        "city": STR,
        "country": STR,
        "occupation": STR,
        "years_of_experience": {"type": "integer"},
        "height_m": {"type": "number"},
        "married": {"type": "boolean"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 2, "maxItems": 5},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 2, "maxItems": 5},
        "bio": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "age", "city", "country", "occupation", "years_of_experience", "height_m", "married",
                 "skills", "hobbies", "bio"],
}
SUBJECTS = ["a chef from Lyon", "a retired airline pilot", "a marine biologist in Australia", "a young violinist",
            "a software engineer in Nairobi", "a farmer in Iowa", "a museum curator in Madrid", "a firefighter"]
FIELDS = "name, age, city, country, occupation, years of experience, height in metres, married, skills, hobbies, bio"


def fifty_property_schema(ranges: bool) -> dict:
    """50 required properties, ten kinds in turn; ``ranges``: integers get minimum/maximum."""
    properties: dict[str, dict] = {}
    for i in range(50):
        kind = i % 10
        if kind == 0:
            prop = {"type": "string", "maxLength": 24}
        elif kind == 1:
            prop = {"type": "integer", "minimum": 0, "maximum": 100 * (i + 1)} if ranges else {"type": "integer"}
        elif kind == 2:
            prop = {"enum": [f"option_{i}_{j}" for j in range(4)]}
        elif kind == 3:
            prop = {"type": "boolean"}
        elif kind == 4:
            prop = {"type": "number"}
        elif kind == 5:
            prop = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4}
        elif kind == 6:
            inner_int = {"type": "integer", "minimum": -10, "maximum": 10} if ranges else {"type": "integer"}
            prop = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 16}, "value": inner_int,
                                                     "active": {"type": "boolean"}},
                    "required": ["label", "value", "active"]}
        elif kind == 7:
            prop = {"type": "string", "format": "date"}
        elif kind == 8:
            prop = {"type": "array", "items": {"type": "integer"}, "maxItems": 5}
        else:
            prop = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}
        properties[f"field_{i:02d}"] = prop
    return {"type": "object", "properties": properties, "required": list(properties)}


class GrammarTimer:
    """Wraps the engine's grammar manager's ``masks`` and ``advance`` (instance
    attributes shadow the methods) to add up the time the step spends in them."""

    def __init__(self, manager) -> None:
        self.seconds = 0.0
        for name in ("masks", "advance"):
            setattr(manager, name, self._timed(getattr(manager, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return wrapper


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the batch arms")
    parser.add_argument("--compile-repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/grammar.json")
    args = parser.parse_args()

    import torch

    from ember import LLM, SamplingParams
    from ember.api.bench.machine import machine_info
    from ember.engine.llm import encode_chat
    from ember.constraint import Constraint
    from ember.plugin.grammar import UnsupportedFeatureError
    from ember.weights import resolve_model

    run_started = time.perf_counter()
    model_dir = resolve_model(None, None)
    llm = LLM(str(model_dir), dtype=args.dtype, grammar_compile_timeout_s=600.0)
    core = llm.engine.core
    manager = core.grammar
    tokenizer = llm.get_tokenizer()

    def chat(text: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])[1]

    prompts = [chat(f"Write a JSON profile of {s}, with these fields: {FIELDS}.") for s in SUBJECTS]
    constraint = Constraint.json_schema(DECODE_SCHEMA)

    def params(arm: str, max_tokens: int = args.max_tokens) -> SamplingParams:
        if arm == "unconstrained":
            return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, constraint=constraint,
                              grammar_backend=arm)

    arms = ("unconstrained", *BACKENDS)
    # prefill every prompt once (the prefix cache then serves all arms alike), compile
    # the decoding schema on both backends, warm the batch path
    llm.generate(prompt_token_ids=prompts, sampling_params=params("unconstrained", 1))
    for arm in arms:
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=params(arm, 4))
    timer = GrammarTimer(manager)
    print(f"model loaded and warmed in {time.perf_counter() - run_started:.1f} s (model dtype {core.dtype})",
          flush=True)

    # -- 1. per-token cost ---------------------------------------------------------
    def arm_stats() -> dict:
        return {arm: {"seconds": 0.0, "tokens": 0, "requests": 0, "grammar_s": 0.0, "finish": Counter()}
                for arm in arms}

    def record(stats: dict, arm: str, outs, elapsed: float, grammar_s: float) -> None:
        s = stats[arm]
        s["seconds"] += elapsed
        s["grammar_s"] += grammar_s
        for out in outs:
            completion = out.outputs[0]
            s["tokens"] += len(completion.token_ids)
            s["requests"] += 1
            s["finish"][completion.finish_reason] += 1
            if arm != "unconstrained" and completion.finish_reason == "stop":
                json.loads(completion.text)  # a completed grammar parses

    def summarize(stats: dict) -> dict:
        out = {}
        for arm, s in stats.items():
            out[arm] = {"ms_per_token": 1000 * s["seconds"] / s["tokens"], "tokens": s["tokens"],
                        "requests": s["requests"], "seconds": s["seconds"], "grammar_manager_s": s["grammar_s"],
                        "finish_reasons": dict(s["finish"])}
        base = out["unconstrained"]["ms_per_token"]
        for backend in BACKENDS:
            out[backend]["ratio"] = out[backend]["ms_per_token"] / base
            out[backend]["meets_goal_1_25"] = out[backend]["ratio"] <= 1.25
        return out

    def run_arm(stats: dict, arm: str, batch: list[list[int]]) -> None:
        grammar_before = timer.seconds
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params(arm))
        elapsed = time.perf_counter() - start
        record(stats, arm, outs, elapsed, timer.seconds - grammar_before)

    stats1 = arm_stats()
    for i, prompt in enumerate(prompts):
        for k in range(len(arms)):
            run_arm(stats1, arms[(i + k) % len(arms)], [prompt])
    batch1 = summarize(stats1)
    for arm in arms:
        b = batch1[arm]
        extra = f"; x{b['ratio']:.3f}" if arm != "unconstrained" else ""
        print(f"batch 1, {arm}: {b['ms_per_token']:.2f} ms/token ({b['tokens']} tokens in {b['requests']} requests, "
              f"finish {b['finish_reasons']}, grammar manager {b['grammar_manager_s']:.2f} s){extra}", flush=True)

    many = (prompts * (args.batch // len(prompts) + 1))[: args.batch]
    stats32 = arm_stats()
    for r in range(args.rounds):
        for k in range(len(arms)):
            run_arm(stats32, arms[(r + k) % len(arms)], many)
    batch32 = summarize(stats32)
    for arm in arms:
        b = batch32[arm]
        extra = f"; x{b['ratio']:.3f}" if arm != "unconstrained" else ""
        print(f"batch {args.batch}, {arm}: {b['ms_per_token']:.2f} ms/token ({b['tokens']} tokens in "
              f"{b['requests']} requests, finish {b['finish_reasons']}, grammar manager "
              f"{b['grammar_manager_s']:.2f} s){extra}", flush=True)

    # -- 2. compile time of a 50-property schema ------------------------------------
    schemas = {"plain": fifty_property_schema(ranges=False), "ranges": fifty_property_schema(ranges=True)}
    compile_results: dict[str, dict] = {}
    for name in BACKENDS:
        backend = manager._backends[name]  # made by the warm-up, on the manager's context
        started = time.perf_counter()
        type(backend)(manager.context)  # a second instance: its set-up (vocabulary already decoded)
        backend_init_s = time.perf_counter() - started
        result: dict = {"backend_init_s": backend_init_s, "cold_compile_s": {}}
        for variant, schema in schemas.items():
            times = []
            try:
                for _ in range(args.compile_repeats):
                    fresh = Constraint.json_schema(json.loads(json.dumps(schema)))
                    started = time.perf_counter()
                    backend.compile(fresh)
                    times.append(time.perf_counter() - started)
                    if times[-1] > 20:  # one is enough at this size
                        break
            except UnsupportedFeatureError as exc:
                result["cold_compile_s"][variant] = {"refused": str(exc)}
                print(f"{name}, 50 properties ({variant}): refused: {exc}", flush=True)
                continue
            result["cold_compile_s"][variant] = {"min": min(times), "median": statistics.median(times),
                                                 "runs": times}
            print(f"{name}, 50 properties ({variant}): cold compile {min(times) * 1000:.1f} ms min, "
                  f"{statistics.median(times) * 1000:.1f} ms median of {len(times)}", flush=True)

        variant = "ranges" if name == "xgrammar" else "plain"
        schema_constraint = Constraint.json_schema(schemas[variant])
        one = [prompts[0]]
        engine: dict = {"schema": variant}
        for label, p in (
            ("unconstrained", SamplingParams(temperature=0, max_tokens=1)),
            ("first", SamplingParams(temperature=0, max_tokens=1, constraint=schema_constraint, grammar_backend=name)),
            ("cache_hit", SamplingParams(temperature=0, max_tokens=1, constraint=schema_constraint,
                                         grammar_backend=name)),
        ):
            counters = (manager.compile_time_s, manager.num_compiles, manager.num_cache_hits)
            started = time.perf_counter()
            out = llm.generate(prompt_token_ids=one, sampling_params=p)[0].outputs[0]
            elapsed = time.perf_counter() - started
            if out.finish_reason == "error":
                raise RuntimeError(f"{name}: {out.error}")
            engine[label] = {
                "request_s": elapsed,
                "compile_time_s": manager.compile_time_s - counters[0],
                "compiles": manager.num_compiles - counters[1],
                "cache_hits": manager.num_cache_hits - counters[2],
            }
        result["engine"] = engine
        compile_results[name] = result
        print(f"{name}, 50 properties ({variant}) through the engine (1-token request): first "
              f"{engine['first']['request_s'] * 1000:.1f} ms (compile {engine['first']['compile_time_s'] * 1000:.1f} ms, "
              f"{engine['first']['compiles']} compile), cache hit {engine['cache_hit']['request_s'] * 1000:.1f} ms "
              f"({engine['cache_hit']['cache_hits']} hit, {engine['cache_hit']['compiles']} compiles), unconstrained "
              f"{engine['unconstrained']['request_s'] * 1000:.1f} ms", flush=True)

    result = {
        "machine": machine_info(), "torch": torch.__version__, "dtype": args.dtype,
        "model_dtype": str(core.dtype), "model": str(model_dir), "max_tokens": args.max_tokens,
        "decode_schema": DECODE_SCHEMA, "greedy": True, "ignore_eos": True,
        "batch1": {"requests_per_arm": len(prompts), **batch1},
        "batch": {"size": args.batch, "rounds": args.rounds, **batch32},
        "compile_50_properties": compile_results,
        "compile_schema_kinds": "per 10 properties: bounded string, integer (ranges: minimum/maximum), 4-value enum, "
                                "boolean, number, bounded string array, nested object (bounded string, integer, "
                                "boolean), date string, integer array, pattern string; all required",
        "wall_s": time.perf_counter() - run_started,
    }
    print(f"machine: {result['machine']['cpu_model']}; flags {' '.join(f for f, on in result['machine']['flags'].items() if on)}; "
          f"model dtype {result['model_dtype']}; total {result['wall_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
