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


def test_blocks_behind_a_window_every_layer_has_are_released(tmp_path):
    """Mistral with a window of 5 and blocks of 4: a 40-token prompt plus 24 new tokens
    holds at most window + 2 blocks' worth while it runs, and its outputs stay exact."""
    from ember.models.base import uniform_sliding_window

    hf_model = make_tiny_model("mistral", tmp_path / "m", seed=2, sliding_window=5)
    assert uniform_sliding_window(hf_model.config) == 5
    llm = LLM(str(tmp_path / "m"), dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    engine = llm.engine
    kv = engine.kv_manager
    assert kv.sliding_window == 5
    prompt = _prompts(hf_model.config.vocab_size)[-1] + _prompts(hf_model.config.vocab_size)[1]  # 39 tokens
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(None, params, prompt_token_ids=prompt, request_id="long")
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        if "long" in kv._block_tables:
            held.append(kv.num_allocated_blocks("long") - kv.num_released_blocks("long"))
    assert tokens == _reference(hf_model, prompt)
    assert max(held[1:]) <= 5 // 4 + 3, held  # after the prompt's step: the window's blocks and the next
    assert kv.num_free_blocks == kv.num_blocks


def test_mixed_models_keep_every_block():
    from transformers import Gemma3TextConfig

    from ember.models.base import uniform_sliding_window

    config = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    assert uniform_sliding_window(config) is None


def test_release_drops_each_reference_once_and_keeps_prefixes_findable():
    from ember.sched.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True, sliding_window=6)
    tokens = list(range(100, 120))
    assert kv.allocate_slots("a", 20) is not None and kv.num_free_blocks == 5
    kv.cache_full_blocks("a", tokens, 20)
    assert kv.release_out_of_window("a", 20) == 3  # positions <= 14 unreachable: blocks 0-2 (0..11)
    assert kv.release_out_of_window("a", 20) == 0 and kv.num_free_blocks == 8
    # the next query (position 20) reaches position 15, in block 3; one token later it does not
    assert kv.release_out_of_window("a", 21) == 1 and kv.num_free_blocks == 9
    # a released block keeps its prefix until the pool hands it out
    assert len(kv.find_cached_prefix(tokens[:17])) == 4
    kv.free("a")
    assert kv.num_free_blocks == 10
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_blocks=4, block_size=4, sliding_window=0)
