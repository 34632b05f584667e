"""Ember vs transformers on tiny random Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 models, fp32
on CPU (the Gemmas with a sliding window of 6 keys, Gemma 2 with its soft-caps).

Eight prompts of different lengths join one continuous batch at staggered steps;
each must produce exactly the 32 greedy tokens transformers' `generate` gives for
that prompt alone. Last-position logits, computed through the paged KV cache
(prefill, then one decode step reading the cache), must agree within LOGITS_ATOL.
"""

import pytest
import torch
from tiny_models import make_tiny_model

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.plugin.backend import AttentionBatch, SequenceSlice

LOGITS_ATOL = 1e-4  # absolute, on logits of magnitude ~1-10
PROMPT_LENGTHS = [1, 3, 7, 12, 20, 33, 5, 64]
JOIN_AT_STEP = [0, 0, 1, 2, 3, 5, 8, 13]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(f"tiny-{kind}")
    hf_model = make_tiny_model(kind, path, seed=1)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=96, block_size=4))
    return kind, hf_model, engine


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_staggered_continuous_batch_matches_transformers_greedy(tiny):
    kind, hf_model, engine = tiny
    all_prompts = prompts(hf_model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results: dict[str, list[int]] = {}
    ids: list[str] = []
    step = 0
    max_batch = 0
    while len(results) < len(all_prompts):
        for i, join in enumerate(JOIN_AT_STEP):
            if join == step:
                ids.append(engine.add_request(None, params, prompt_token_ids=all_prompts[i], request_id=f"p{i}"))
        outputs = engine.step()
        max_batch = max(max_batch, len(engine.scheduler.running) + sum(o.finished for o in outputs))
        for out in outputs:
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert max_batch >= 6, "requests should overlap in one running batch"
    # ignore_eos means "do not stop at EOS", not "never pick EOS": transformers'
    # equivalent is generating with no EOS id (min_new_tokens would mask it).
    hf_model.generation_config.eos_token_id = None
    for i, prompt in enumerate(all_prompts):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(prompt):].tolist()
        assert len(ref) == NEW_TOKENS
        assert results[f"p{i}"] == ref, f"{kind}: prompt {i} (length {len(prompt)}) diverged"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def _ember_last_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Prefill tokens[:-1] into the paged cache, then decode tokens[-1] from it."""
    kv, runner = engine.kv_manager, engine.runner
    assert kv.allocate_slots("probe", len(tokens)) is not None
    table = kv.get_block_table("probe")
    try:
        with torch.inference_mode():
            for start, chunk in ((0, tokens[:-1]), (len(tokens) - 1, tokens[-1:])):
                md = runner.attention.prepare(
                    AttentionBatch.from_slices([SequenceSlice(len(chunk), start, table)], kv.block_size, torch.device("cpu"))
                )
                hidden = engine.model(
                    torch.tensor(chunk), torch.arange(start, start + len(chunk)), runner.kv_caches, md
                )
            return engine.model.compute_logits(hidden[-1:])[0]
    finally:
        kv.free("probe")


def test_last_position_logits_match_transformers(tiny):
    kind, hf_model, engine = tiny
    for prompt in prompts(hf_model.config.vocab_size)[1:]:
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1]
        ours = _ember_last_logits(engine, prompt)
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_ATOL, f"{kind}: max |logit diff| {diff:.2e} for a prompt of {len(prompt)} tokens"


def test_shared_prefixes_through_the_prefix_cache_match_transformers(tiny):
    """Prompts sharing a long prefix reuse its cached KV blocks (prefill then reads
    them as context) and still give transformers' greedy tokens."""
    kind, hf_model, engine = tiny
    assert engine.kv_manager.enable_prefix_caching
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, hf_model.config.vocab_size, (37,), generator=gen).tolist()
    tails = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (1, 2, 5, 9)]
    prompts = [system + t for t in tails] + [system + tails[2]]  # an exact repeat too
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hits_before = engine.kv_manager.num_prefix_hits
    results = {}
    for i, prompt in enumerate(prompts):  # one by one: each later prompt finds the cache filled
        engine.add_request(None, params, prompt_token_ids=prompt, request_id=f"s{i}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
    assert engine.kv_manager.num_prefix_hits - hits_before >= 4 * 36  # 9 blocks of 4 per later prompt
    hf_model.generation_config.eos_token_id = None
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert results[f"s{i}"] == ref, f"{kind}: prompt {i} diverged with a prefix-cache hit"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_chunked_prefill_matches_transformers(tiny):
    """A 16-token step budget splits the longer prompts across steps while the others
    decode; every prompt still gets transformers' greedy tokens."""
    kind, hf_model, engine = tiny
    chunked = LLMEngine(EngineConfig(model=str(engine.model_dir), dtype="float32", num_kv_blocks=96, block_size=4,
                                     max_num_batched_tokens=16, enable_prefix_caching=False))
    all_prompts = prompts(hf_model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results, step, max_chunks = {}, 0, 0
    while len(results) < len(all_prompts):
        for i, join in enumerate(JOIN_AT_STEP):
            if join == step:
                chunked.add_request(None, params, prompt_token_ids=all_prompts[i], request_id=f"c{i}")
        sched_out = chunked.scheduler.schedule()
        assert sched_out.total_num_scheduled_tokens <= 16
        max_chunks = max(max_chunks, sum(
            1 for s in chunked.scheduler.last_scheduled
            if s.is_prefill and s.request.request_id not in sched_out.sampling_request_ids
        ))
        runner_out = chunked.runner.execute(sched_out)
        for update in chunked.scheduler.update_from_output(sched_out, runner_out):
            if update.request.is_finished:
                results[update.request.request_id] = list(update.request.output_token_ids)
        step += 1
    assert max_chunks >= 1, "some prompt should have been split"
    hf_model.generation_config.eos_token_id = None
    for i, prompt in enumerate(all_prompts):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert results[f"c{i}"] == ref, f"{kind}: prompt {i} (length {len(prompt)}) diverged under chunked prefill"
