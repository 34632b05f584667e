"""Speculative decoding on SmolLM2 (issues 17 and 36): n-gram prompt lookup against
plain decoding, in one run, on input-grounded tasks (edit a given snippet, quote a
given passage, summarise with quotations; 16 prompts) and on open prompts with
nothing to copy (8 prompts).

1. Batch 1: each prompt alone, greedy, in three arms alternating prompt by prompt (so
   the machine's noise falls on all): plain, ``ngram`` cost-aware (the default: drafts
   only where the measured step costs and the acceptance say they pay;
   docs/speculative.md) and ``ngram_fixed`` (``cost_aware: false``, the old schedule:
   every proposal verified). Per prompt set: tokens/s of each arm, the ratios to plain,
   the acceptance rate, mean accepted length, the cost-aware arm's mean drafts per
   decode step and fraction of steps with drafts, and how many outputs are identical
   (outside batch-invariant mode a verification's larger products can flip a near-tie).
2. 32 concurrent requests (the grounded prompts twice, one ``generate`` call), with and
   without speculation: throughput ratio (speculation steps aside from
   ``disable_by_batch_size`` running requests).

    python benchmarks/bench_speculative.py [--dtype auto|float32|bfloat16] [--max-tokens 128] [--out result.json]

Prints the figures with the machine (lscpu model name and flags) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CODE = '''def load_config(path):
    """Read a JSON config file and return it as a dict."""
    with open(path) as handle:
        data = json.load(handle)
    if "name" not in data:
        raise KeyError("config has no name")
    return data
'''
CODE2 = '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

    def reset(self):
        self.count = 0
'''
PASSAGE = ("The lighthouse at Point Reyes was built in 1870 to warn ships away from the headland, one of the "
           "foggiest places on the Pacific coast. Its first-order Fresnel lens, made in France, has 1,032 pieces "
           "of glass and could be seen 24 miles out to sea. Keepers climbed 308 steps each day to wind the clockwork "
           "that turned the lens. The light was automated in 1975, and the old lens still turns for visitors on "
           "special occasions.")
PASSAGE2 = ("Honeybees communicate the location of flowers through the waggle dance. A forager returning to the hive "
            "walks in a figure-eight pattern, waggling her body during the straight run. The angle of that run "
            "relative to vertical tells the other bees the direction of the food relative to the sun, and the "
            "duration of the waggle tells them the distance. Karl von Frisch decoded this language and shared the "
            "1973 Nobel Prize for it.")

TASKS = [
    f"Rename the function load_config to read_config in this code and return the whole code:\n{CODE}",
    f"Add a docstring to the method increment in this code and return the whole code:\n{CODE2}",
    f"Change the error message 'config has no name' to 'missing name' and return the whole code:\n{CODE}",
    f"Rename the attribute count to total everywhere in this code and return the whole code:\n{CODE2}",
    f"Replace json.load with json.loads(handle.read()) in this code and return the whole code:\n{CODE}",
    f"Add a method decrement to this class, like increment, and return the whole class:\n{CODE2}",
    f"Rewrite this code with the variable data renamed to config, and return the whole code:\n{CODE}",
    f"Copy this code exactly, then add a comment line at the top saying '# counter utilities':\n{CODE2}",
    f"Read the passage and answer by quoting the sentence that says how many steps the keepers climbed.\n\n{PASSAGE}",
    f"Quote the passage's sentence about the Fresnel lens, word for word.\n\n{PASSAGE}",
    f"Read the passage and answer by quoting the sentence that explains what the angle of the run means.\n\n{PASSAGE2}",
    f"Quote, word for word, the passage's sentences about Karl von Frisch and the waggle dance.\n\n{PASSAGE2}",
    f"Summarise this passage in two sentences, quoting its exact words where you can.\n\n{PASSAGE}",
    f"Summarise this passage, quoting the sentence about distance exactly.\n\n{PASSAGE2}",
    f"Repeat the passage below exactly, then say in one sentence what it is about.\n\n{PASSAGE}",
    f"Repeat the passage below exactly, then give it a title.\n\n{PASSAGE2}",
]


OPEN = [
    "Write a short poem about autumn rain in a quiet town.",
    "Explain in a few sentences why the sky is blue.",
    "Give three tips for staying focused while studying.",
    "Tell a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise? Answer briefly.",
    "Describe your ideal weekend in a paragraph.",
    "Why do cats purr? Give a short answer.",
    "Suggest a name for a bakery and explain the choice.",
]


def _spec_counts(stats) -> dict:
    d = stats.to_dict()
    return {k: d[k] for k in ("num_draft_tokens", "num_accepted_tokens", "num_proposals", "num_emitted_tokens",
                              "num_steps", "num_decode_steps", "num_decode_request_steps", "num_probe_steps")}


def batch1(arms: dict, prompts: list, params) -> dict:
    """Each prompt alone through every arm in turn; tokens/s per arm and each
    speculative arm's figures over the run."""
    seconds = dict.fromkeys(arms, 0.0)
    tokens = dict.fromkeys(arms, 0)
    identical = dict.fromkeys(arms, 0)
    spec = {name: llm.engine.core.speculator.stats for name, llm in arms.items() if llm.engine.core.speculator}
    before = {name: _spec_counts(stats) for name, stats in spec.items()}
    for prompt in prompts:
        outs = {}
        for name, llm in arms.items():
            start = time.perf_counter()
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(out.token_ids)
            outs[name] = out.token_ids
        for name in arms:
            identical[name] += outs[name] == outs["plain"]
    result = {"prompts": len(prompts), "tokens": tokens, "seconds": seconds}
    for name in arms:
        result[name] = {"tokens_per_s": tokens[name] / seconds[name],
                        "ratio": tokens[name] / seconds[name] / (tokens["plain"] / seconds["plain"]),
                        "identical_outputs": identical[name]}
    for name, stats in spec.items():
        after = _spec_counts(stats)
        d = {k: after[k] - before[name][k] for k in after}
        drafts, proposals = d["num_draft_tokens"], d["num_proposals"]
        result[name].update(
            acceptance_rate=d["num_accepted_tokens"] / drafts if drafts else 0.0,
            mean_accepted_length=d["num_emitted_tokens"] / proposals if proposals else 0.0,
            mean_drafts_per_decode=drafts / d["num_decode_request_steps"] if d["num_decode_request_steps"] else 0.0,
            draft_step_fraction=d["num_steps"] / d["num_decode_steps"] if d["num_decode_steps"] else 0.0,
            probe_steps=d["num_probe_steps"], verifications=proposals, draft_tokens=drafts,
            steps=tokens[name] - d["num_accepted_tokens"])
    return result


def _print(label: str, result: dict) -> None:
    plain = result["plain"]["tokens_per_s"]
    parts = [f"plain {plain:.1f}"]
    for name, r in result.items():
        if isinstance(r, dict) and "acceptance_rate" in r:
            parts.append(f"{name} {r['tokens_per_s']:.1f} (x{r['ratio']:.3f}; acceptance {r['acceptance_rate']:.2f}, "
                         f"accepted length {r['mean_accepted_length']:.2f}, mean k {r['mean_drafts_per_decode']:.2f}, "
                         f"drafted steps {r['draft_step_fraction']:.2f}, probes {r['probe_steps']}, "
                         f"{r['identical_outputs']}/{result['prompts']} identical)")
    print(f"{label}, batch 1, tok/s: " + "; ".join(parts), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--schedule", choices=("constant", "heuristic"), default="constant",
                        help="draft_length_schedule of the speculative config")
    parser.add_argument("--max-speculative-tokens", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=32, help="0: skip the concurrent part")
    parser.add_argument("--prompts", type=int, default=None, help="only the first N prompts of each set")
    parser.add_argument("--no-fixed-arm", action="store_true", help="leave out the cost_aware=false arm")
    parser.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a backend option for every arm, e.g. path=fp32 (the path of CPUs without bf16 math)")
    parser.add_argument("--out", default="benchmarks/results/speculative.json")
    args = parser.parse_args()

    import torch

    from ember import LLM, SamplingParams
    from ember.api.bench.machine import machine_info
    from ember.engine.llm import encode_chat

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4,
            "draft_length_schedule": args.schedule, "max_speculative_tokens": args.max_speculative_tokens}
    options = dict(o.split("=", 1) for o in args.backend_option)
    common = {"dtype": args.dtype, "max_model_len": 2048, "backend_options": options}
    arms = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec)}
    if not args.no_fixed_arm:
        arms["ngram_fixed"] = LLM(**common, speculative_config={**spec, "cost_aware": False})
    tokenizer = arms["plain"].get_tokenizer()

    def encode(texts):
        return [encode_chat(tokenizer, [{"role": "user", "content": t}])[1] for t in texts[: args.prompts]]

    grounded, open_prompts = encode(TASKS), encode(OPEN)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # warm-up, verifications included (a kernel's first use of a shape compiles), on prompts
    # of its own: a measured prompt found in the prefix cache would recompute only its
    # tail, in products of other sizes than a cold prompt's (another rounding in bf16)
    warm = encode([f"Copy this code, renaming `count` to `total`:\n\n{CODE2}"])
    for llm in arms.values():
        llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(temperature=0, max_tokens=48))

    results = {}
    for label, prompts in (("grounded", grounded), ("open", open_prompts)):
        results[label] = batch1(arms, prompts, params)
        _print(label, results[label])

    concurrent = {}
    if args.concurrency:
        many = (grounded * (args.concurrency // len(grounded) + 1))[: args.concurrency]
        for name, llm in (("plain", arms["plain"]), ("ngram", arms["ngram"]), ("plain_again", arms["plain"])):
            start = time.perf_counter()
            outs = llm.generate(prompt_token_ids=many, sampling_params=params)
            elapsed = time.perf_counter() - start
            concurrent[name] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        base = (concurrent["plain"] + concurrent["plain_again"]) / 2
        concurrent["ratio"] = concurrent["ngram"] / base
        print(f"{args.concurrency} concurrent: {base:.1f} -> {concurrent['ngram']:.1f} tok/s "
              f"(x{concurrent['ratio']:.3f}; plain measured before and after)", flush=True)

    stats = {name: llm.engine.core.speculator.stats.to_dict() for name, llm in arms.items() if name != "plain"}
    print(f"step costs learned (ms by batch, query tokens): {stats['ngram']['step_cost_ms']}")
    result = {"machine": machine_info(), "torch": torch.__version__, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "load_average": list(os.getloadavg()), "speculative_config": spec, "backend_options": options,
              **results,
              "concurrent": {"requests": args.concurrency, **concurrent}, "speculator_stats": stats}
    flags = " ".join(f for f, on in result["machine"]["flags"].items() if on)
    print(f"machine: {result['machine']['cpu_model']}; flags {flags}")
    print(f"load average at the end: {result['load_average']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
