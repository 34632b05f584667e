"""Logprobs of generated tokens (with top-N alternatives) and of prompt tokens, against
transformers' log-softmax on a tiny random Llama in fp32.

Tolerance: ATOL on logprobs of magnitude ~1-10 (the same order as test_exactness's
logits tolerance; the paged KV cache and the flat batch change summation order only).
"""

import math

import pytest
import torch
from tiny_models import make_tiny_model

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.logprobs import MAX_LOGPROBS

ATOL = 1e-4
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-logprobs")
    hf_model = make_tiny_model("llama", path, seed=3)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4))
    return hf_model, engine


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    ids = [engine.add_request(None, p, prompt_token_ids=prompt) for prompt, p in zip(prompts, params)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 5, 17)]


def test_greedy_logprobs_and_top_n_match_transformers(tiny):
    hf_model, engine = tiny
    all_prompts = prompts(hf_model.config.vocab_size)
    # a batch mixing requests that ask with one that does not
    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
    ]
    outs = run(engine, all_prompts, params)
    assert outs[1].outputs[0].logprobs is None
    for prompt, p, out in zip(all_prompts, params, outs):
        completion = out.outputs[0]
        reference = hf_log_softmax(hf_model, prompt + completion.token_ids)
        for k, token_id in enumerate(completion.token_ids):
            row = reference[len(prompt) - 1 + k]
            assert token_id == int(row.argmax())
            assert completion.token_logprobs[k] == pytest.approx(float(row[token_id]), abs=ATOL)
            if p.logprobs is None:
                continue
            entry = completion.logprobs[k]
            ids = list(entry)
            assert ids[0] == token_id and entry[token_id].rank == 1
            assert entry[token_id].logprob == pytest.approx(float(row[token_id]), abs=ATOL)
            top_values, top_ids = row.topk(p.logprobs)
            alternatives = sorted(entry.items(), key=lambda kv: kv[1].rank)
            assert len(entry) == max(p.logprobs, 1)  # the chosen token is among the top
            assert [t for t, _ in alternatives][: p.logprobs] == top_ids.tolist()
            got = [lp.logprob for _, lp in alternatives][: p.logprobs]
            assert got == sorted(got, reverse=True)
            assert got == pytest.approx(top_values.tolist(), abs=ATOL)
            assert entry[token_id].decoded_token == engine.tokenizer.decode([token_id])


def test_prompt_logprobs_match_transformers_shifted(tiny):
    hf_model, engine = tiny
    all_prompts = prompts(hf_model.config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3) for _ in all_prompts]
    outs = run(engine, all_prompts, params)
    for prompt, out in zip(all_prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        reference = hf_log_softmax(hf_model, prompt)
        for p in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[p], reference[p - 1]
            token_id = prompt[p]
            assert list(entry)[0] == token_id
            assert entry[token_id].logprob == pytest.approx(float(row[token_id]), abs=ATOL)
            assert entry[token_id].rank == int((row > row[token_id]).sum()) + 1
            top_values, top_ids = row.topk(3)
            ranked = sorted(((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3))
            assert [t for _, t in ranked] == top_ids.tolist()
            assert [entry[t].logprob for _, t in ranked] == pytest.approx(top_values.tolist(), abs=ATOL)


def test_sampled_logprobs_are_of_the_processed_distribution(tiny):
    """Top-k 3 at temperature 0.7: the alternatives are the kept 3, renormalized; the
    tokens top-k removed (logprob -inf) never appear."""
    hf_model, engine = tiny
    prompt = prompts(hf_model.config.vocab_size)[1]
    params = SamplingParams(temperature=0.7, top_k=3, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=10)
    completion = run(engine, [prompt], [params])[0].outputs[0]
    reference = hf_log_softmax(hf_model, prompt + completion.token_ids)
    for k, token_id in enumerate(completion.token_ids):
        entry = completion.logprobs[k]
        assert len(entry) == 3 and all(math.isfinite(lp.logprob) for lp in entry.values())
        assert sum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-5)
        logits = (reference[len(prompt) - 1 + k] / 0.7)
        kept = logits.topk(3)
        assert sorted(entry) == sorted(kept.indices.tolist())
        expected = kept.values.log_softmax(dim=-1)
        assert entry[token_id].logprob == pytest.approx(completion.token_logprobs[k], abs=1e-6)
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in by_rank] == pytest.approx(expected.tolist(), abs=ATOL)


def test_requests_without_logprobs_cost_nothing_extra(tiny, monkeypatch):
    """No top-N, rank or prompt-row logits are computed unless a request asks."""
    hf_model, engine = tiny

    def refuse(*args, **kwargs):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr("ember.worker.model_runner.compute_position_logprobs", refuse)
    params = [SamplingParams(max_tokens=3), SamplingParams(temperature=0, max_tokens=3)]
    outs = run(engine, prompts(hf_model.config.vocab_size)[:2], params)
    for out in outs:
        assert out.outputs[0].logprobs is None and out.prompt_logprobs is None
        assert len(out.outputs[0].token_logprobs) == len(out.outputs[0].token_ids)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 2.0, True, "3"])
def test_bad_logprobs_values_name_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("value", [0, 1, MAX_LOGPROBS])
def test_logprobs_range_edges_are_accepted(value):
    assert SamplingParams(logprobs=value, prompt_logprobs=value).logprobs == value
