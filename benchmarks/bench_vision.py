"""Image+text requests on a realistic-shape random-weight vision-language model (issue 44):
Ember against transformers on the same weights, offline, in one run.

The model has SmolVLM-256M-Instruct's shapes (SigLIP 768 x 12 layers over 512-pixel tiles,
pixel shuffle by 4, a 576-wide 30-layer Llama decoder, 49,280 tokens) with random
weights: the FLOPs are real, the words are not. Each request is a short question about
its own image (random pixels), greedy, ``--max-tokens`` tokens.

1. Offline throughput: the same ``--requests`` requests through ``ember.LLM.generate``
   (one continuous batch) and through transformers' ``generate`` (one padded batch),
   alternating ``--rounds`` times; images/s and output tokens/s of each, and the ratio.
2. The encoder cache: the same requests again in Ember (every image already encoded):
   encoder seconds (0 for hits) and the wall time against the first pass.
3. Time to first token of one request alone: a new image, then the same image again
   (an encoder-cache hit; its prompt's blocks are in the prefix cache too), then the
   same image under a new question (encoder hit, text recomputed).

    python benchmarks/bench_vision.py [--requests 8] [--max-tokens 32] [--longest-edge 512]
        [--split] [--rounds 2] [--dtype float32] [--out result.json] [--plot-dir DIR]

Prints the figures with the machine (lscpu model name and flags) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # run from a checkout too

SMOLVLM_256M_TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49280, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOLVLM_256M_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16)
QUESTIONS = ["What is in this picture?", "Describe the colours you see.", "Is there a person here?",
             "Write a caption for this image.", "How many objects are there?", "What is the weather like?",
             "Which room is this?", "Read any text in the image."]


def build_model(out_dir: Path, longest_edge: int, split: bool) -> None:
    """SmolVLM-256M's shapes, random weights (initializer_range 0.02), saved with its processor."""
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from ember.testing.tiny_vlms import SMOLVLM_TOKENS, _tokenizer_with

    tokenizer = _tokenizer_with(*SMOLVLM_TOKENS)
    text = dict(SMOLVLM_256M_TEXT, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    config = transformers.SmolVLMConfig(vision_config=SMOLVLM_256M_VISION, text_config=text, scale_factor=4,
                                        image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    config.architectures = ["SmolVLMForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.SmolVLMForConditionalGeneration(config).eval().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    SmolVLMImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": 512},
                             do_image_splitting=split).save_pretrained(out_dir)


def images(count: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(count)]


def ember_run(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from ember import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_run(model, processor, ids_list, pictures, max_tokens: int) -> tuple[float, int]:
    """One padded batch (left padding) through transformers' generate."""
    width = max(len(ids) for ids in ids_list)
    pad = processor.tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in ids_list])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in ids_list])
    pixels = processor.image_processor(images=[[p] for p in pictures], return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad, **pixels)
    return time.perf_counter() - start, int((out.shape[1] - width) * len(ids_list))


class EncoderClock:
    """Seconds spent in the model's image encoder (wraps `encode_images`)."""

    def __init__(self, model) -> None:
        self.seconds, self.calls, inner = 0.0, 0, model.encode_images

        def timed(items):
            start = time.perf_counter()
            try:
                return inner(items)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += len(items)
        model.encode_images = timed


def first_token_seconds(llm, prompt: dict) -> float:
    from ember import SamplingParams

    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--longest-edge", type=int, default=512, help="images resized to at most this (tiles of 512)")
    parser.add_argument("--split", action="store_true", help="split images into 512-pixel tiles plus a global one")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="Ember's dtype (transformers runs float32)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot-dir", type=Path, default=None)
    args = parser.parse_args()

    import transformers

    from ember import LLM
    from ember.api.bench.machine import machine_info

    workdir = Path(tempfile.mkdtemp(prefix="ember-bench-vision-"))
    build_model(workdir, args.longest_edge, args.split)
    llm = LLM(model=str(workdir), dtype=args.dtype)
    clock = EncoderClock(llm.engine.model)
    hf = transformers.SmolVLMForConditionalGeneration.from_pretrained(workdir, dtype=torch.float32).eval()

    class _Processor:  # the tokenizer and image processor transformers' side uses (SmolVLMProcessor needs num2words)
        tokenizer = llm.get_tokenizer()
        image_processor = llm.engine.multimodal_processor.image_processor

    pictures = images(args.requests)
    prompts = [{"prompt": f"User:<image>{QUESTIONS[i % len(QUESTIONS)]}<end_of_utterance>\nAssistant:",
                "multi_modal_data": {"image": pictures[i]}} for i in range(args.requests)]
    expanded = [llm.engine.process_images(llm.engine.tokenize(p["prompt"]), [p["multi_modal_data"]["image"]])[0]
                for p in prompts]
    tokens_per_image = sum(len(ids) for ids in expanded) / len(expanded)
    # warm-up: both stacks once on one request
    ember_run(llm, [dict(prompts[0], multi_modal_data={"image": images(1, seed=99)[0]})], 2)
    hf_run(hf, _Processor, expanded[:1], pictures[:1], 2)
    rounds = []
    for round_index in range(args.rounds):  # fresh images each round: the encoder cache does not help here
        fresh = images(args.requests, seed=round_index + 1)
        batch = [dict(p, multi_modal_data={"image": fresh[i]}) for i, p in enumerate(prompts)]
        ids = [llm.engine.process_images(llm.engine.tokenize(p["prompt"]), [fresh[i]])[0] for i, p in enumerate(prompts)]
        clock.seconds = 0.0
        e_wall, e_tokens = ember_run(llm, batch, args.max_tokens)
        e_encoder = clock.seconds
        h_wall, h_tokens = hf_run(hf, _Processor, ids, fresh, args.max_tokens)
        clock.seconds = 0.0
        again_wall, _ = ember_run(llm, batch, args.max_tokens)  # every image cached now
        rounds.append({"ember_s": e_wall, "ember_tokens": e_tokens, "ember_encoder_s": e_encoder,
                       "transformers_s": h_wall, "transformers_tokens": h_tokens,
                       "ember_repeat_s": again_wall, "ember_repeat_encoder_s": clock.seconds})
    best = {k: min(r[k] for r in rounds) for k in ("ember_s", "transformers_s", "ember_repeat_s")}
    new_image = dict(prompts[1], multi_modal_data={"image": images(1, seed=1234)[0]})
    ttft = {"new_image_s": first_token_seconds(llm, new_image),
            "same_image_again_s": first_token_seconds(llm, new_image),
            "same_image_new_question_s": first_token_seconds(
                llm, dict(new_image, prompt=new_image["prompt"].replace(QUESTIONS[1], "Tell me everything here.")))}
    result = {
        "machine": machine_info(), "model": "SmolVLM-256M shapes, random weights", "dtype_ember": args.dtype,
        "dtype_transformers": "float32", "transformers": transformers.__version__, "torch": torch.__version__,
        "requests": args.requests, "max_tokens": args.max_tokens, "prompt_tokens_mean": tokens_per_image,
        "split": args.split, "longest_edge": args.longest_edge, "rounds": rounds,
        "ember_images_per_s": args.requests / best["ember_s"],
        "transformers_images_per_s": args.requests / best["transformers_s"],
        "ratio_offline": best["transformers_s"] / best["ember_s"],
        "ember_output_tok_per_s": rounds[0]["ember_tokens"] / best["ember_s"],
        "transformers_output_tok_per_s": rounds[0]["transformers_tokens"] / best["transformers_s"],
        "repeat_over_first": best["ember_repeat_s"] / best["ember_s"],
        "ttft": ttft,
    }
    flags = " ".join(f for f, on in result["machine"]["flags"].items() if on)
    print(f"machine: {result['machine']['cpu_model']}; flags {flags}; cores {result['machine']['usable_cores']}")
    print(f"{args.requests} requests x {args.max_tokens} tokens, {tokens_per_image:.0f} prompt tokens each "
          f"(Ember {args.dtype}, transformers float32)")
    for r in rounds:
        print(f"  Ember {r['ember_s']:.2f} s (encoder {r['ember_encoder_s']:.2f} s) | transformers "
              f"{r['transformers_s']:.2f} s | Ember again, images cached {r['ember_repeat_s']:.2f} s "
              f"(encoder {r['ember_repeat_encoder_s']:.2f} s)")
    print(f"images/s: Ember {result['ember_images_per_s']:.2f}, transformers {result['transformers_images_per_s']:.2f}"
          f" -> x{result['ratio_offline']:.2f}")
    print(f"repeated images: {result['repeat_over_first']:.2f} of the first pass's time")
    print("TTFT alone: new image {new_image_s:.3f} s, same image again {same_image_again_s:.3f} s, "
          "same image new question {same_image_new_question_s:.3f} s".format(**ttft))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.plot_dir:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.bar(["Ember", "transformers"], [result["ember_images_per_s"], result["transformers_images_per_s"]],
                 color=["#d2691e", "#888888"])
        left.set_ylabel("images/s (offline)")
        left.set_title(f"{args.requests} image+text requests, {args.max_tokens} tokens each")
        right.bar(["new image", "same image", "same image,\nnew question"], list(ttft.values()), color="#d2691e")
        right.set_ylabel("time to first token, alone (s)")
        right.set_title("encoder cache and prefix cache")
        fig.tight_layout()
        fig.savefig(args.plot_dir / "vision.png", dpi=120)


if __name__ == "__main__":
    main()
