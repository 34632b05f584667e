"""How often the native GGUF path answers as the float model: first-token and greedy-sequence
agreement of SmolLM2's Q4_1 model, served natively, with the float32 model (the same GGUF
dequantized), for each setting of the CPU backend's option ``gguf_activations``, and the
batch-1 decode speed of each.

    python benchmarks/quant_agreement.py [--settings int8 auto] [--max-tokens 16] [--json out.json]

Prompts: benchmarks/data/agreement_prompts.json (chat, one user message each; ``tune``
may be looked at while choosing numerics, ``heldout`` never is). Every prompt as if sent
alone (a short prompt's products take the integer kernels; ``greedy_alone``) for the
first token and ``--max-tokens`` greedy tokens; then all of a split at once (one prefill
step of thousands of rows: products of more than 256 rows run as ``gguf_prefill`` says)
for the first token. Decode: one chat prompt, ``--decode-tokens`` greedy tokens
(``ignore_eos``), the settings taking turns, each one's best of ``--rounds``; the ratio
old/new is of the same run. Prints lscpu's model name and AVX-512/AMX flags with the
figures: the machine is shared, so take the speeds as rough.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "data" / "agreement_prompts.json"
README_PROMPT = "What is the capital of France?"


def cpu_info() -> dict:
    """lscpu's model name and the flags that choose the kernels (avx2, avx512*, amx*)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        out = ""
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model_name": fields.get("Model name", "?").strip(), "cores": os.cpu_count(),
            "flags": sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx")))}


def load_prompts(path: Path = PROMPTS) -> dict[str, list[str]]:
    data = json.loads(path.read_text())
    return {"tune": data["tune"], "heldout": data["heldout"]}


def chats(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def first_tokens(llm, prompts: list[str]) -> list[int]:
    """The greedy first token of each chat prompt, all in one batch."""
    from ember import SamplingParams

    outs = llm.chat(chats(prompts), SamplingParams(temperature=0.0, max_tokens=1))
    return [o.outputs[0].token_ids[0] for o in outs]


def greedy_alone(llm, prompts: list[str], max_tokens: int, step_tokens: int = 256) -> list[list[int]]:
    """Greedy tokens of each chat prompt as if sent alone: in small groups whose prompts
    add up to at most ``step_tokens`` tokens, so that every product has at most 256 rows
    and takes the integer kernels, whose rows are each their own whatever shares the call
    (docs/quantization.md): the numbers of a lone request, in a few calls."""
    from ember import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokenizer = llm.get_tokenizer()
    groups, size = [[]], 0
    for p in prompts:
        n = len(tokenizer.apply_chat_template(chats([p])[0], add_generation_prompt=True, tokenize=True))
        if groups[-1] and size + n > step_tokens:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += n
    return [list(o.outputs[0].token_ids) for group in groups for o in llm.chat(chats(group), params)]


def decode_speed(llm, tokens: int) -> float:
    """Batch-1 decode tokens/s after the prompt (time to the first token taken off)."""
    from ember import SamplingParams

    conversation = chats(["Write a long story about a lighthouse keeper."])
    llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
    start = time.perf_counter()
    llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    return tokens / max(time.perf_counter() - start - first, 1e-9)


def run_model(llm, splits: dict[str, list[str]], max_tokens: int) -> dict:
    every = [README_PROMPT] + splits["tune"] + splits["heldout"]
    alone = greedy_alone(llm, every, max_tokens)
    batched = {name: first_tokens(llm, prompts) for name, prompts in splits.items()}
    n_tune = len(splits["tune"])
    return {"readme": alone[0], "alone": {"tune": alone[1 : 1 + n_tune], "heldout": alone[1 + n_tune :]},
            "batched": batched}


def agreement(native: dict, reference: dict) -> dict:
    out = {"readme_same_tokens": native["readme"] == reference["readme"],
           "readme_same_first_token": native["readme"][:1] == reference["readme"][:1]}
    for split in ("tune", "heldout"):
        a, b = native["alone"][split], reference["alone"][split]
        out[split] = {
            "num_prompts": len(a),
            "first_token_alone": sum(x[:1] == y[:1] for x, y in zip(a, b)) / len(a),
            "sequence_alone": sum(x == y for x, y in zip(a, b)) / len(a),
            "first_token_batched": sum(x == y for x, y in zip(native["batched"][split],
                                                             reference["batched"][split])) / len(a),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["int8", "auto"],
                        help="gguf_activations values to compare (the first is 'old' in the ratio)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                        help="another CPU backend option for the native runs (e.g. quant_isa=avx2)")
    parser.add_argument("--json", default="benchmarks/results/quant_agreement.json")
    args = parser.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.backend_option)

    from ember import LLM

    splits = load_prompts()
    started = time.perf_counter()
    os.environ["EMBER_GGUF_NATIVE"] = "0"  # the GGUF's float32 conversion: the float model
    llm = LLM(dtype="float32")
    reference = run_model(llm, splits, args.max_tokens)
    text = llm.get_tokenizer().decode(reference["readme"])
    llm.close()
    os.environ.pop("EMBER_GGUF_NATIVE")
    result = {"cpu": cpu_info(), "backend_options": extra, "max_tokens": args.max_tokens,
              "float_readme_answer": text, "settings": {}}
    llms = {}
    for setting in args.settings:
        llms[setting] = LLM(backend_options={**extra, "gguf_activations": setting})
        native = run_model(llms[setting], splits, args.max_tokens)
        result["settings"][setting] = {
            "readme_answer": llms[setting].get_tokenizer().decode(native["readme"]),
            **agreement(native, reference), "decode_tok_s": []}
    for _ in range(args.rounds):  # the settings take turns
        for setting in args.settings:
            result["settings"][setting]["decode_tok_s"].append(round(decode_speed(llms[setting], args.decode_tokens), 1))
    for llm in llms.values():
        llm.close()
    for r in result["settings"].values():
        r["decode_best_tok_s"] = max(r["decode_tok_s"])
    old, new = args.settings[0], args.settings[-1]
    result["decode_ratio_old_over_new"] = round(result["settings"][old]["decode_best_tok_s"]
                                                / result["settings"][new]["decode_best_tok_s"], 3)
    result["seconds"] = round(time.perf_counter() - started, 1)

    cpu = result["cpu"]
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores; flags {' '.join(cpu['flags'])}")
    print(f"float model: {text!r}")
    for setting, r in result["settings"].items():
        print(f"gguf_activations={setting}: README {r['readme_answer']!r} (same tokens: {r['readme_same_tokens']})")
        for split in ("tune", "heldout"):
            s = r[split]
            print(f"  {split:8s} ({s['num_prompts']} prompts): first token alone {s['first_token_alone']:.1%}, "
                  f"batched {s['first_token_batched']:.1%}; {args.max_tokens} greedy tokens alone "
                  f"{s['sequence_alone']:.1%}")
        print(f"  batch-1 decode: {r['decode_best_tok_s']} tok/s (rounds {r['decode_tok_s']})")
    print(f"decode ratio {old}/{new}: {result['decode_ratio_old_over_new']}  ({result['seconds']} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
