"""Suffix decoding against n-gram prompt lookup and plain decoding on SmolLM2 (issue 36
item 2), in one run, batch 1, greedy.

Prompts: the 16 input-grounded tasks of ``bench_speculative.py`` (edit a given snippet,
quote a given passage; imported, not copied) and agentic-style conversations: multi-turn
tool-calling transcripts where the answer repeats earlier tool arguments and JSON, and
code-edit turns that return a file given earlier in the conversation.

Arms: ``plain``, ``ngram`` (k=5, prompt_lookup_max 4, as bench_speculative.py),
``suffix`` (the request's own tree) and ``suffix_global`` (also the global tree of
earlier responses); each prompt runs on every arm in turn, the order rotating prompt by
prompt (so the machine's noise falls on all of them). Per arm and prompt group: tokens/s,
the ratio to plain and to ngram, the acceptance rate (accepted / drafted tokens), the
mean accepted length (tokens emitted per verification, the target's own included) and
how many outputs equal plain's.

    python benchmarks/bench_suffix.py [--dtype auto] [--max-tokens 128] [--out result.json]

Prints the figures with the machine (lscpu model name and flags, load average) and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculative import CODE, CODE2, TASKS  # noqa: E402  (the same input-grounded prompts)

CALL = '{"name": "search_flights", "arguments": {"origin": "SFO", "destination": "JFK", "date": "2025-03-14", ' \
       '"passengers": 2, "cabin": "economy"}}'
RESULT = '{"flights": [{"id": "UA 1542", "depart": "07:05", "arrive": "15:32", "price": 318}, ' \
         '{"id": "DL 2210", "depart": "09:40", "arrive": "18:01", "price": 296}]}'
BOOK = '{"name": "book_flight", "arguments": {"flight_id": "DL 2210", "passengers": 2, "cabin": "economy"}}'


def _turns(*contents: str) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


AGENTIC = [
    _turns("Find flights from SFO to JFK on 2025-03-14 for 2 passengers in economy. Answer with a tool call in JSON.",
           CALL, f"Tool result:\n{RESULT}\nThe user now asks for the same search on 2025-03-15. Write the new tool "
                 "call, JSON only, with the same fields in the same order."),
    _turns("Find flights from SFO to JFK on 2025-03-14 for 2 passengers in economy. Answer with a tool call in JSON.",
           CALL, f"Tool result:\n{RESULT}\nBook the cheaper flight. Answer with a tool call in JSON.", BOOK,
           'Tool result:\n{"error": "timeout"}\nThe booking timed out. Repeat exactly the same book_flight call.'),
    _turns("You are a travel agent. Search flights with the search_flights tool.", CALL,
           f"Tool result:\n{RESULT}\nList both flights as a JSON array of objects with the keys id, depart, "
           "arrive and price, copying the values from the tool result."),
    _turns(f"Here is my code:\n{CODE}", "Thanks, I have read the code. What should I do with it?",
           "It crashes when the file is missing. Return the whole function with a try/except around the open call "
           "that raises FileNotFoundError with a clear message."),
    _turns(f"Here is a class:\n{CODE2}", "I have read the class.",
           "Add type hints to every method and return the whole class."),
    _turns(f"Review this code:\n{CODE}", "It reads a JSON config and checks for a name key.",
           "Rename data to config and path to config_path, and return the whole function."),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--suffix-max-drafts", type=int, default=16, help="num_speculative_tokens of the suffix arms")
    parser.add_argument("--cost-aware", action="store_true", help="cost_aware on in every speculating arm")
    parser.add_argument("--out", default="benchmarks/results/suffix.json")
    args = parser.parse_args()

    import torch

    from ember import LLM, SamplingParams
    from ember.api.bench.machine import machine_info
    from ember.engine.llm import encode_chat

    # cost_aware off by default: the figures are the speculators' own (with it on, each arm's drafts are cut by
    # the decoder's step-cost model, the same for every speculator)
    common = {"disable_by_batch_size": 8, "cost_aware": args.cost_aware}
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, **common},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.suffix_max_drafts, **common},
        "suffix_global": {"method": "suffix", "num_speculative_tokens": args.suffix_max_drafts,
                          "suffix_decoding_max_cached_requests": 64, **common},
    }
    llms = {"plain": LLM(dtype=args.dtype, max_model_len=2048)}
    for name, spec in specs.items():
        llms[name] = LLM(dtype=args.dtype, max_model_len=2048, speculative_config=spec)
    tokenizer = llms["plain"].get_tokenizer()
    groups = {
        "input_grounded": [encode_chat(tokenizer, [{"role": "user", "content": t}])[1] for t in TASKS],
        "agentic": [encode_chat(tokenizer, turns)[1] for turns in AGENTIC],
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up
        llm.generate(prompt_token_ids=groups["input_grounded"][:1],
                     sampling_params=SamplingParams(temperature=0, max_tokens=8))
    arms = list(llms)
    load_before = os.getloadavg()
    figures: dict[str, dict] = {}
    turn = 0
    for group, prompts in groups.items():
        seconds = dict.fromkeys(arms, 0.0)
        tokens = dict.fromkeys(arms, 0)
        identical = dict.fromkeys(arms, 0)
        before = {a: llms[a].engine.core.speculator.stats.to_dict() for a in specs}
        for prompt in prompts:
            order = arms[turn % len(arms):] + arms[: turn % len(arms)]
            turn += 1
            outs = {}
            for name in order:
                start = time.perf_counter()
                out = llms[name].generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out.token_ids)
                outs[name] = list(out.token_ids)
            for name in arms:
                identical[name] += outs[name] == outs["plain"]
        result = {}
        for name in arms:
            entry = {"tokens_per_s": tokens[name] / seconds[name], "tokens": tokens[name], "seconds": seconds[name],
                     "identical_to_plain": identical[name]}
            if name in specs:
                after = llms[name].engine.core.speculator.stats.to_dict()
                delta = {k: after[k] - before[name][k] for k in
                         ("num_draft_tokens", "num_accepted_tokens", "num_proposals", "num_emitted_tokens")}
                entry["acceptance_rate"] = delta["num_accepted_tokens"] / max(1, delta["num_draft_tokens"])
                entry["mean_accepted_length"] = delta["num_emitted_tokens"] / max(1, delta["num_proposals"])
                entry.update(delta)
            result[name] = entry
        plain = result["plain"]["tokens_per_s"]
        for name in specs:
            result[name]["ratio_to_plain"] = result[name]["tokens_per_s"] / plain
            result[name]["ratio_to_ngram"] = result[name]["tokens_per_s"] / result["ngram"]["tokens_per_s"]
        figures[group] = {"prompts": len(prompts), **result}
        print(f"{group} ({len(prompts)} prompts, batch 1, greedy, max_tokens {args.max_tokens}): plain "
              f"{plain:.1f} tok/s", flush=True)
        for name in specs:
            r = result[name]
            print(f"  {name:14s} {r['tokens_per_s']:6.1f} tok/s  x{r['ratio_to_plain']:.2f} plain  "
                  f"x{r['ratio_to_ngram']:.2f} ngram  acceptance {r['acceptance_rate']:.2f}  mean accepted length "
                  f"{r['mean_accepted_length']:.2f}  drafts {r['num_draft_tokens']}  identical "
                  f"{r['identical_to_plain']}/{len(prompts)}", flush=True)

    machine = machine_info()
    result = {"machine": machine, "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "torch": torch.__version__, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "speculative_configs": {n: llms[n].engine.core.speculator.config.to_dict() for n in specs},
              "figures": figures}
    print(f"machine: {machine['cpu_model']}; flags {' '.join(f for f, on in machine['flags'].items() if on)}; "
          f"load average {load_before[0]:.2f} before, {result['load_average_after'][0]:.2f} after")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({g: {n: {k: round(v, 3) for k, v in r.items() if k in ("tokens_per_s", "ratio_to_plain",
                     "ratio_to_ngram", "acceptance_rate", "mean_accepted_length")} for n, r in f.items()
                          if isinstance(r, dict)} for g, f in figures.items()}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
