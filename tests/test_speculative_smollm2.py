"""Speculative decoding on the real default model (SmolLM2-135M-Instruct): greedy
outputs with n-gram drafts equal those without, token for token, in batch-invariant
mode (the CPU backend's option batch_invariant: every token's numbers independent of what shares its
step, so that only the verification itself could change an output), with drafts
accepted along the way."""

import pytest

from ember import LLM, SamplingParams
from ember.engine.llm import encode_chat

pytestmark = pytest.mark.slow

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height
'''
TASKS = [
    f"Rename the function area to rectangle_area and return the whole code:\n{CODE}",
    "Quote the first sentence of this passage exactly: The river rises in the hills. It runs to the sea.",
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
]


def test_ngram_on_smollm2_gives_the_greedy_tokens_without_speculation(smollm2_dir, monkeypatch):
    args = dict(dtype="bfloat16", max_model_len=512, num_kv_tokens=2048, max_num_batched_tokens=64,
                backend_options={"batch_invariant": "1"})
    plain = LLM(str(smollm2_dir), **args)
    prompts = [encode_chat(plain.get_tokenizer(), [{"role": "user", "content": t}])[1] for t in TASKS]
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    del plain
    config = {"method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": None, "min_acceptance_rate": 0,
              "cost_aware": False}  # every step drafts: identity and acceptance, not whether drafting pays, are checked
    spec = LLM(str(smollm2_dir), speculative_config=config, **args)
    got = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == expected
    stats = spec.engine.core.speculator.stats
    assert stats.num_accepted_tokens > 10, stats
