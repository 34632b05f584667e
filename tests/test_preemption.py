"""Preemption by recompute and priorities on tiny random Llama, Qwen3 and Phi-3 models: a KV pool far too
small for the batch gives the same tokens (greedy, seeded, logprobs, prompt
logprobs) as an ample one, and priorities order the work."""

import pytest

from ember import LLM, SamplingParams

from tiny_models import make_tiny_model

BLOCK = 4
# 10 prompts of 3..39 tokens, each with 20 new tokens: the largest needs 59 tokens
# (15 blocks); all of them at once need about 115 blocks.
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + 4 * i)] for i in range(10)]


@pytest.fixture(scope="module", params=["llama", "qwen3", "phi3", "gemma3"])
def model_dir(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-preempt")
    make_tiny_model(request.param, path, seed=11, max_position_embeddings=128)
    return str(path)


def run(model_dir, num_blocks, params, prefix_caching=True, chunked=True, **kwargs):
    llm = LLM(
        model=model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=num_blocks,
        enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
        max_num_batched_tokens=64 if chunked else None, **kwargs,
    )
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_count == 0 for block in kv.pool.blocks)
    return outputs, llm.engine.scheduler.num_preemptions


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_outputs_are_identical_under_a_pool_small_enough_to_preempt(model_dir, prefix_caching, chunked):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ample, ample_preemptions = run(model_dir, 256, params, prefix_caching, chunked)
    small, preemptions = run(model_dir, 16, params, prefix_caching, chunked)
    assert ample_preemptions == 0
    assert preemptions >= 5, preemptions  # it happened, many times
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in ample]
    assert all(len(o.outputs[0].token_ids) == 20 for o in small)


def test_seeded_sampling_logprobs_and_prompt_logprobs_survive_preemption(model_dir):
    params = [
        SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=20, ignore_eos=True, logprobs=3,
                       prompt_logprobs=2 if i % 3 == 0 else None)
        for i in range(len(PROMPTS))
    ]
    ample, _ = run(model_dir, 256, params)
    small, preemptions = run(model_dir, 16, params)
    assert preemptions >= 5
    for a, s, prompt in zip(ample, small, PROMPTS):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
        assert s.outputs[0].logprobs is not None and len(s.outputs[0].logprobs) == 20
        for la, ls in zip(a.outputs[0].logprobs, s.outputs[0].logprobs):
            assert la.keys() == ls.keys()
            for token in la:
                assert ls[token].logprob == pytest.approx(la[token].logprob, abs=1e-4)
        if a.prompt_logprobs is not None:
            # one entry per prompt position (the first has none): recomputing the
            # prompt after a preemption must not add the same positions twice
            assert len(s.prompt_logprobs) == len(a.prompt_logprobs) == len(prompt)
            for pa, ps in zip(a.prompt_logprobs[1:], s.prompt_logprobs[1:]):
                assert pa.keys() == ps.keys()


def test_priorities_decide_who_runs_first_offline(model_dir):
    llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, priority in [("late-low", 3), ("mid", 1), ("low", 3), ("high", -2)]:
        engine.add_request(None, params, prompt_token_ids=PROMPTS[0], request_id=rid, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "late-low", "low"]
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request(None, params, prompt_token_ids=PROMPTS[0], priority="urgent")
    with pytest.raises(ValueError, match="2 priorities"):
        llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, priority=[0, 1])
    outs = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, priority=[2, 0, 1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]


def test_a_request_larger_than_the_pool_is_refused_not_retried(model_dir):
    llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"needs 12 KV blocks .* the whole KV cache has 8"):
        llm.generate(prompt_token_ids=[PROMPTS[9][:28]], sampling_params=SamplingParams(max_tokens=20))
    assert not llm.engine.has_unfinished_requests()
