"""Sliding-window attention end to end: Mistral (every layer slides) and Qwen2
(``use_sliding_window``, its ``layer_types``) with windows shorter than the prompts,
exact against transformers; a window longer than the model's context changes nothing;
the model's context is no longer cut to the window."""

import pytest
import torch
from tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.models.base import layer_sliding_window
from ember.worker.kv_sizing import resolve_max_model_len

PROMPT_LENGTHS = [3, 9, 17, 30]
NEW_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _reference(hf_model, prompt: list[int]) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind, overrides", [
    ("mistral", dict(sliding_window=5)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)),
])
@pytest.mark.parametrize("chunked", [False, True])
def test_windows_shorter_than_the_prompt_match_transformers(tmp_path, kind, overrides, chunked):
    hf_model = make_tiny_model(kind, tmp_path / kind, seed=2, **overrides)
    windows = [layer_sliding_window(hf_model.config, i) for i in range(hf_model.config.num_hidden_layers)]
    assert any(windows), f"{kind}: the config should slide somewhere: {windows}"
    extra = dict(enable_chunked_prefill=True, max_num_batched_tokens=8) if chunked else {}
    llm = LLM(str(tmp_path / kind), dtype="float32", block_size=4, num_kv_blocks=128, enable_prefix_caching=True,
              **extra)
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _reference(hf_model, prompt), f"{kind} {windows}: length {len(prompt)}"
    # the same prompts again: prefix-cache hits inside and past the window
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]


def test_layer_windows_follow_transformers_config_rules():
    from transformers import MistralConfig, Qwen2Config

    assert layer_sliding_window(MistralConfig(sliding_window=None), 0) is None
    assert layer_sliding_window(MistralConfig(sliding_window=4096), 3) == 4096
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=2, num_hidden_layers=4)
    assert [layer_sliding_window(qwen, i) for i in range(4)] == [None, None, 64, 64]
    assert layer_sliding_window(Qwen2Config(use_sliding_window=False, sliding_window=64), 0) is None


def test_the_context_is_not_cut_to_the_window():
    from transformers import MistralConfig

    config = MistralConfig(sliding_window=4096, max_position_embeddings=32768)
    assert resolve_max_model_len(config, None) == 32768
