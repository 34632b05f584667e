"""Speculative decoding on SmolLM2 (issue 17): n-gram prompt lookup against plain
decoding, in one run, on input-grounded tasks (edit a given snippet, quote a given
passage, summarise with quotations), 16 prompts.

1. Batch 1: each prompt alone, greedy, with and without ``ngram``, the two arms
   alternating prompt by prompt (so the machine's noise falls on both); tokens/s of
   each arm over all prompts, their ratio, the acceptance rate and the mean accepted
   length, and how many outputs are identical (outside batch-invariant mode a
   verification's larger products can flip a near-tie; see docs/speculative.md).
2. 32 concurrent requests (the 16 prompts twice, one ``generate`` call), with and
   without speculation: throughput ratio (speculation steps aside from
   ``disable_by_batch_size`` running requests).

    python benchmarks/bench_speculative.py [--dtype auto] [--max-tokens 128] [--out result.json]

Prints the figures with the machine (lscpu model name and flags) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--schedule", choices=("constant", "heuristic"), default="constant",
                        help="draft_length_schedule of the speculative config")
    parser.add_argument("--max-speculative-tokens", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/speculative.json")
    args = parser.parse_args()

    import torch

    from ember import LLM, SamplingParams
    from ember.api.bench.machine import machine_info
    from ember.engine.llm import encode_chat

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4,
            "draft_length_schedule": args.schedule, "max_speculative_tokens": args.max_speculative_tokens}
    plain = LLM(dtype=args.dtype, max_model_len=2048)
    fast = LLM(dtype=args.dtype, max_model_len=2048, speculative_config=spec)
    tokenizer = plain.get_tokenizer()
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}])[1] for t in TASKS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in (plain, fast):  # warm-up
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=8))

    seconds = {"plain": 0.0, "ngram": 0.0}
    tokens = {"plain": 0, "ngram": 0}
    identical = 0
    stats = fast.engine.core.speculator.stats
    before = stats.to_dict()
    for prompt in prompts:
        outs = {}
        for name, llm in (("plain", plain), ("ngram", fast)):
            start = time.perf_counter()
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(out.token_ids)
            outs[name] = out.token_ids
        identical += outs["plain"] == outs["ngram"]
    after = stats.to_dict()
    drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    proposals = after["num_proposals"] - before["num_proposals"]
    emitted = after["num_emitted_tokens"] - before["num_emitted_tokens"]
    batch1 = {
        "plain_tokens_per_s": tokens["plain"] / seconds["plain"],
        "ngram_tokens_per_s": tokens["ngram"] / seconds["ngram"],
        "tokens": tokens, "seconds": seconds, "identical_outputs": identical, "prompts": len(prompts),
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": emitted / proposals if proposals else 0.0,
    }
    batch1["ratio"] = batch1["ngram_tokens_per_s"] / batch1["plain_tokens_per_s"]
    # Where the ratio comes from: each step emits one token plus its accepted drafts, so
    # the ngram arm took tokens - accepted steps (prefills included), `proposals` of them
    # verifications. Were a verification as cheap as a decode step, the ratio would be
    # the step ratio; the time ratio then says what a verification costs, in decode
    # steps (prefill time counted as steps of both arms: a slight underestimate).
    steps = tokens["ngram"] - accepted
    batch1["steps"] = {"plain": tokens["plain"], "ngram": steps, "verifications": proposals,
                       "undrafted": steps - proposals}
    batch1["ratio_if_verification_cost_a_decode_step"] = tokens["plain"] / steps
    batch1["verification_cost_in_decode_steps"] = (
        seconds["ngram"] / seconds["plain"] * tokens["plain"] - (steps - proposals)) / proposals if proposals else None
    print(f"batch 1: {batch1['plain_tokens_per_s']:.1f} -> {batch1['ngram_tokens_per_s']:.1f} tok/s "
          f"(x{batch1['ratio']:.2f}); acceptance {batch1['acceptance_rate']:.2f}, mean accepted length "
          f"{batch1['mean_accepted_length']:.2f}; {identical}/{len(prompts)} outputs identical", flush=True)
    print(f"  steps: {steps} against {tokens['plain']} ({proposals} verifications, {steps - proposals} with nothing "
          f"to draft): x{batch1['ratio_if_verification_cost_a_decode_step']:.2f} if a verification cost a decode "
          f"step; it cost {batch1['verification_cost_in_decode_steps'] or 0:.2f}", flush=True)

    many = (prompts * (args.concurrency // len(prompts) + 1))[: args.concurrency]
    concurrent = {}
    for name, llm in (("plain", plain), ("ngram", fast), ("plain_again", plain)):
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=many, sampling_params=params)
        elapsed = time.perf_counter() - start
        concurrent[name] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    base = (concurrent["plain"] + concurrent["plain_again"]) / 2
    concurrent["ratio"] = concurrent["ngram"] / base
    print(f"{args.concurrency} concurrent: {base:.1f} -> {concurrent['ngram']:.1f} tok/s (x{concurrent['ratio']:.3f}; "
          f"plain measured before and after)", flush=True)

    result = {"machine": machine_info(), "torch": torch.__version__, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "speculative_config": spec, "batch1": batch1, "concurrent": {"requests": args.concurrency, **concurrent},
              "speculator_stats": stats.to_dict()}
    print(f"machine: {result['machine']['cpu_model']}; flags {' '.join(f for f, on in result['machine']['flags'].items() if on)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
