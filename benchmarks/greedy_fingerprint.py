"""Greedy tokens of SmolLM2 as one md5 per path: the check that a refactoring changed
no output. Runs 16 prompts (plain and chat) greedily through the offline `LLM` on the
float32 model (the GGUF's float conversion) and on the default native Q4_1 path, and
prints, per path, the md5 of the token lists (and writes them as JSON).

    python benchmarks/greedy_fingerprint.py [--max-tokens 32] [--json out.json]

Compare two commits by running it on each: equal md5s mean equal tokens, prompt by prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "import numpy as np\n\n# multiply two matrices\n",
    "Water boils at",
    "The quick brown fox",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
    "SELECT name FROM users WHERE",
    "The square root of 144 is",
    "To make a cup of tea, first",
]
CHATS = [
    "What is the capital of Italy?",
    "Write a one-line Python function that reverses a string.",
    "Name three planets.",
    "Say hello in Spanish.",
]


def run(path: str, max_tokens: int) -> dict:
    from ember import LLM, SamplingParams

    if path == "float32":
        os.environ["EMBER_GGUF_NATIVE"] = "0"  # the GGUF's float conversion
        llm = LLM(dtype="float32")
    else:
        os.environ.pop("EMBER_GGUF_NATIVE", None)
        llm = LLM()  # the default: native Q4_1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    tokens += [list(o.outputs[0].token_ids) for o in llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)]
    llm.close()
    return {"md5": hashlib.md5(json.dumps(tokens).encode()).hexdigest(), "num_prompts": len(tokens),
            "num_tokens": sum(map(len, tokens))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--paths", nargs="+", default=["float32", "q4_1"], choices=["float32", "q4_1"])
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    result = {path: run(path, args.max_tokens) for path in args.paths}
    for path, r in result.items():
        print(f"{path}: md5 {r['md5']} ({r['num_prompts']} prompts, {r['num_tokens']} tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
