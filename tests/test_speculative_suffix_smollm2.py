"""Suffix decoding on the real default model (SmolLM2-135M-Instruct): greedy outputs
with ``suffix`` drafts equal those without, token for token, in batch-invariant mode
(the CPU backend's option batch_invariant), with drafts accepted along the way, on a
code edit and a tool-calling turn that repeats an earlier call's JSON arguments."""

import pytest

from ember import LLM, SamplingParams
from ember.engine.llm import encode_chat

pytestmark = pytest.mark.slow

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height
'''
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TASKS = [
    f"Rename the function area to rectangle_area and return the whole code:\n{CODE}",
    f"Earlier you called this tool:\n{CALL}\nCall it again with the same arguments. Reply with the JSON only.",
]


def test_suffix_on_smollm2_gives_the_greedy_tokens_without_speculation(smollm2_dir):
    args = dict(dtype="float32", max_model_len=512, num_kv_tokens=2048, max_num_batched_tokens=256,
                backend_options={"batch_invariant": "1"})
    plain = LLM(str(smollm2_dir), **args)
    prompts = [encode_chat(plain.get_tokenizer(), [{"role": "user", "content": t}])[1] for t in TASKS]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    del plain
    config = {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": None,
              "min_acceptance_rate": 0, "suffix_decoding_max_cached_requests": 4, "cost_aware": False}
    spec = LLM(str(smollm2_dir), speculative_config=config, **args)
    got = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == expected
    stats = spec.engine.core.speculator.stats
    assert stats.num_accepted_tokens > 10, stats
