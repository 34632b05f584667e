"""n parallel samples and best_of: children share the prompt's KV blocks."""

import pytest

from ember import LLM, SamplingParams

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-n")
    make_tiny_model("llama", path, seed=5, max_position_embeddings=256)
    return LLM(model=str(path), dtype="float32", num_kv_blocks=128, block_size=4)


PROMPT = list(range(20, 60))  # 40 tokens: 9 full blocks cacheable (the last token is recomputed)


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    kv = engine.kv_manager
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=3, ignore_eos=True)
    rid = engine.add_request(None, params, prompt_token_ids=PROMPT)
    peak_used, peak_running = 0, 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            if out.finished:
                final = out
        peak_used = max(peak_used, kv.num_blocks - kv.num_free_blocks)
        peak_running = max(peak_running, len(engine.scheduler.running))
    assert peak_running == 4
    # alone, one child needs ceil(48 / 4) = 12 blocks; 4 unshared children would need 48.
    # Shared: the 9 full prompt blocks once, plus each child's own 3 blocks.
    assert peak_used == 9 + 4 * 3
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1, "different seeds should differ"
    assert kv.num_free_blocks == kv.num_blocks


def test_children_are_reproducible_and_match_single_requests(llm):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=100, ignore_eos=True)
    group = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    singles = [
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=1.0, max_tokens=6, seed=100 + i, ignore_eos=True))[0]
        for i in range(3)
    ]
    assert [c.token_ids for c in group.outputs] == [s.outputs[0].token_ids for s in singles]


def test_best_of_keeps_the_highest_cumulative_logprob(llm):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, best_of=5, seed=9, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
    all5 = llm.generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=1.0, max_tokens=6, n=5, seed=9, ignore_eos=True)
    )[0].outputs
    best = sorted(all5, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]


def test_abort_a_group_frees_everything(llm):
    engine = llm.engine
    rid = engine.add_request(None, SamplingParams(max_tokens=50, n=3, ignore_eos=True), prompt_token_ids=PROMPT)
    engine.step()
    engine.step()
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, "n must be an integer in"),
    ({"n": 17}, "n must be an integer in"),
    ({"n": 3, "best_of": 2}, "best_of must be an integer in"),
])
def test_bad_n_and_best_of(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_abort_all_drops_groups_with_pending_siblings(llm):
    engine = llm.engine
    engine.add_request(None, SamplingParams(max_tokens=20, n=4, ignore_eos=True), prompt_token_ids=PROMPT)
    engine.add_request(None, SamplingParams(max_tokens=20, ignore_eos=True), prompt_token_ids=PROMPT[:7])
    assert engine.has_unfinished_requests()
    engine.abort_all()  # before the first step: three siblings still pending
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_best_of_is_chosen_once_by_the_engine_with_the_requests_ranking(llm):
    """The final output holds the n chosen (best first) and the other candidates; each
    completion reports the seed that reproduces it alone. TGI ranks by mean logprob."""
    params = SamplingParams(temperature=1.0, max_tokens=6, n=1, best_of=4, seed=30, ignore_eos=True,
                            best_of_ranking="mean")
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert len(out.outputs) == 1 and len(out.candidates) == 3

    def mean(c):
        return c.cumulative_logprob / len(c.token_ids)

    assert all(mean(out.outputs[0]) >= mean(c) for c in out.candidates)
    assert [mean(c) for c in out.candidates] == sorted((mean(c) for c in out.candidates), reverse=True)
    assert sorted(c.seed for c in out.outputs + out.candidates) == [30, 31, 32, 33]
    for c in out.outputs + out.candidates:
        alone = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
            temperature=1.0, max_tokens=6, seed=c.seed, ignore_eos=True))[0].outputs[0]
        assert alone.token_ids == c.token_ids
    with pytest.raises(ValueError, match="best_of_ranking"):
        SamplingParams(best_of_ranking="median")
