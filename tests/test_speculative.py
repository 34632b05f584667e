"""Speculative decoding (ember.plugin.speculator, ember.plugins.speculative): the config,
the n-gram speculator, exactness against decoding without speculation, the output
distribution under sampling, and the engine's step-aside rules.

Exactness is checked in batch-invariant mode (the CPU backend's option batch_invariant, the CPU
backend computing every token's numbers independently of what shares its step):
there a speculator can change outputs only through a wrong verification, not
through kernels whose summation order follows the number of rows in a product."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import SpeculativeConfig
from ember.engine.speculative import SpeculativeDecoder
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext
from ember.plugins.speculative.ngram import NgramSpeculator

# every proposal verified (no pauses, no cost-aware choice: tests/test_spec_cost.py has that),
# so the verification itself is exercised on the tiny models' rarely accepted drafts
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": None,
         "min_acceptance_rate": 0.0, "cost_aware": False}


# -- config -------------------------------------------------------------------------------------

def test_the_config_takes_vllms_keys_as_a_mapping_or_json_and_names_what_is_wrong():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 5, 4)
    assert SpeculativeConfig.parse(config.to_dict()) == config and SpeculativeConfig.parse(None) is None
    for bad, message in [
        ('{"method": "ngram", "num_tokens": 3}', "unknown key\\(s\\) 'num_tokens'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min \\(5\\) exceeds prompt_lookup_max"),
        ("[1]", "must be a JSON object"),
        ("{", "not valid JSON"),
        ('{"min_acceptance_rate": 2}', "min_acceptance_rate must lie in \\[0, 1\\]"),
        ('{"draft_length_schedule": "fast"}', "draft_length_schedule must be one of constant, heuristic, got 'fast'"),
        ('{"num_speculative_tokens": 5, "max_speculative_tokens": 3}',
         "max_speculative_tokens must be an integer of at least num_speculative_tokens \\(5\\), got 3"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)


def test_an_unknown_method_is_refused_at_start(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown speculative method 'eagle3'; registered: .*ngram"):
        LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=256, speculative_config={"method": "eagle3"})


# -- the n-gram speculator ----------------------------------------------------------------------

def _ngram(**config) -> NgramSpeculator:
    return NgramSpeculator(SpeculatorContext(SpeculativeConfig(**{**NGRAM, **config}), 1000, ()))


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    spec = _ngram()
    prompt = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 6, 2, 3]
    # suffix [2, 3] (n=2) last occurred before at 6..7, followed by 7, 8, 5, 6
    [proposal] = spec.propose([SpecRequest("a", prompt, [], 4, 0.0)])
    assert proposal.token_ids == [7, 8, 5, 6] and proposal.probs is None
    # the output extends the index incrementally: [3, 7] now occurred at 7..8
    [proposal] = spec.propose([SpecRequest("a", prompt, [7], 2, 0.0)])
    assert proposal.token_ids == [8, 5]
    assert spec.propose([SpecRequest("b", [4, 5, 6], [], 3, 0.0)])[0].token_ids == []  # nothing repeats
    spec.release("a")
    assert "a" not in spec._indexes


def test_ngram_prefers_longer_matches_and_rebuilds_for_a_new_prompt():
    spec = _ngram(prompt_lookup_min=1)
    tokens = [5, 1, 2, 5, 9, 1, 2]  # n=3 [5,1,2]? no; n=2 [1,2] at 1..2 -> 5, 9
    assert spec.propose([SpecRequest("a", tokens, [], 2, 0.0)])[0].token_ids == [5, 9]
    assert spec.propose([SpecRequest("a", [7, 7], [], 2, 0.0)])[0].token_ids == [7]  # same id, new prompt


# -- exactness ----------------------------------------------------------------------------------

# prompts that repeat themselves, so that n-gram lookup proposes (and is often right)
REPEATING = [
    [(i % 7) + 10 for i in range(40)],
    [20, 21, 22, 23, 24, 25] * 5 + [20, 21],
    list(range(60, 90)) + list(range(60, 75)),
    [5, 6, 7] * 3,
]


@pytest.fixture
def batch_invariant(monkeypatch):
    """Every CPU backend the test builds in batch-invariant mode, as the option
    ``backend_options={"batch_invariant": "1"}`` sets it on one engine."""
    from ember.hardware.cpu import CPUBackend

    monkeypatch.setattr(CPUBackend, "batch_invariant", property(lambda self: True))


def _outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("kind,schedule", [("llama", "constant"), ("mistral", "constant"), ("qwen2", "constant"),
                                           ("llama", "heuristic")])
def test_greedy_outputs_with_ngram_equal_those_without(kind, schedule, tmp_path, batch_invariant):
    """With prefix caching, chunked prefill (a 16-token step budget) and preemption (a
    KV cache too small for every request at once)."""
    model_dir = tmp_path / kind
    make_tiny_model(kind, model_dir, seed=3)
    engine_args = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
                       enable_prefix_caching=True, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = REPEATING + [REPEATING[0][:20]]  # a shared prefix: a prefix-cache hit
    plain = LLM(str(model_dir), **engine_args)
    expected = _outputs(plain, prompts, params)
    spec = LLM(str(model_dir), speculative_config={**NGRAM, "draft_length_schedule": schedule}, **engine_args)
    assert _outputs(spec, prompts, params) == expected
    stats = spec.engine.core.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.kv_manager.num_prefix_hits > 0
    kv = spec.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks  # rejected positions held no block


def test_seeded_sampled_tokens_with_ngram_equal_those_without(tiny_llama_dir, batch_invariant):
    """A seeded request's draws for output token i are keyed by (seed, i): verifying
    a deterministic draft draws the target's token there exactly as a plain decode
    does, so n-gram speculation leaves seeded sampled outputs as they are, whatever
    the steps' shapes (chunked prefill, preemption, prefix hits)."""
    engine_args = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
                       enable_prefix_caching=True, max_model_len=256)
    params = [SamplingParams(temperature=t, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True)
              for s, t in zip(range(5), (1.0, 0.3, 0.2, 0.1, 0.2))]
    prompts = REPEATING + [REPEATING[0][:20]]
    expected = _outputs(LLM(str(tiny_llama_dir), **engine_args), prompts, params)
    spec = LLM(str(tiny_llama_dir), speculative_config=NGRAM, **engine_args)
    assert _outputs(spec, prompts, params) == expected
    stats = spec.engine.core.speculator.stats
    assert stats.num_accepted_tokens > 0, stats


# -- the distribution under sampling --------------------------------------------------------------

class SampledDrafts(BaseSpeculator):
    """Drafts drawn from a fixed random distribution q (a bad draft model on purpose:
    the verification must give the target's distribution whatever q is)."""

    name = "sampled-test"

    def __init__(self, vocab: int, k: int, seed: int = 0) -> None:
        super().__init__(SpeculatorContext(SpeculativeConfig(self.name, k), vocab, ()))
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, generator=gen) * 2
        logits[:40] += 4  # put q's mass near the target's (tokens below 40 are common here)
        self.q = logits.softmax(-1)
        self.gen = gen
        self.k = k

    def propose(self, requests):
        out = []
        for r in requests:
            ids = torch.multinomial(self.q, self.k, replacement=True, generator=self.gen).tolist()
            out.append(Proposal(ids, self.q.expand(self.k, -1).clone()))
        return out

    def decoder(self) -> SpeculativeDecoder:
        return SpeculativeDecoder(self, SpeculativeConfig(self.name, self.k, disable_by_batch_size=None,
                                                          min_acceptance_rate=0.0))


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity over the categories (rare ones pooled
    so that every expected count is at least 5); returns the p-value."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    total = len(a) + len(b)
    keys = [key for key in set(ca) | set(cb) if (ca[key] + cb[key]) * min(len(a), len(b)) / total >= 5]
    rows = [[ca[key] for key in keys], [cb[key] for key in keys]]
    rest = [len(a) - sum(rows[0]), len(b) - sum(rows[1])]
    if min(rest) > 0:
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))  # chi2 sf


def test_rejection_sampling_keeps_the_targets_distribution(tiny_llama_dir, batch_invariant):
    """Temperature 1.0, 3000 seeded requests of 3 tokens each with and without drafts
    from a q far from the target's p: for each of the first 3 positions, and for the
    pair of the first two tokens, a chi-square test of homogeneity over the tokens
    must not reject at p < 0.001 (a correct implementation fails one of these four
    tests by chance with probability under 0.4%; a verification that kept drafts
    with probability q/p instead, or always, fails them all by far)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=8192, max_num_seqs=256)
    prompt = [[30, 31, 32, 33]]
    n = 3000
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    without = _outputs(llm, prompt * n, params)
    speculator = SampledDrafts(llm.engine.model_info.vocab_size, k=3)
    llm.engine.core.speculator = speculator.decoder()
    try:
        params = [SamplingParams(temperature=1.0, seed=10_000 + s, max_tokens=3, ignore_eos=True) for s in range(n)]
        with_spec = _outputs(llm, prompt * n, params)
    finally:
        llm.engine.core.speculator = None
    for position in range(3):
        p = _chi_square_p([t[position] for t in without], [t[position] for t in with_spec])
        assert p > 1e-3, (position, p)
    p = _chi_square_p([tuple(t[:2]) for t in without], [tuple(t[:2]) for t in with_spec])
    assert p > 1e-3, ("pair", p)


def test_seeded_sampling_with_sampled_drafts_is_reproducible(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=1024)
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm.engine.core.speculator = SampledDrafts(llm.engine.model_info.vocab_size, k=3, seed=1).decoder()
        runs.append(_outputs(llm, [[40, 41, 42]], params))
    llm.engine.core.speculator = None
    assert runs[0] == runs[1] and len(runs[0][0]) == 12


# -- stepping aside -------------------------------------------------------------------------------

class Constant(BaseSpeculator):
    name = "constant"

    def propose(self, requests):
        return [Proposal([1, 2, 3][: r.max_drafts]) for r in requests]


def _decoder(**config) -> SpeculativeDecoder:
    config = SpeculativeConfig("constant", 3, **config)
    return SpeculativeDecoder(Constant(SpeculatorContext(config, 100, ())), config)


def _requests(n):
    return [SpecRequest(f"r{i}", [1], [], 5, 0.0) for i in range(n)]


def test_speculation_steps_aside_for_large_batches_and_poorly_accepted_requests():
    decoder = _decoder(disable_by_batch_size=4, min_acceptance_rate=0.5, acceptance_window=3, backoff_steps=2)
    assert set(decoder.propose(_requests(3), 3)) == {"r0", "r1", "r2"}
    assert decoder.propose(_requests(4), 4) == {}  # batch large enough: no drafts
    decoder.propose(_requests(2), 2)
    decoder.observe("r0", 3, 0)  # nothing accepted: r0 pauses for 2 steps
    decoder.observe("r1", 3, 3)
    assert set(decoder.propose(_requests(2), 2)) == {"r1"}
    assert set(decoder.propose(_requests(2), 2)) == {"r1"}
    assert set(decoder.propose(_requests(2), 2)) == {"r0", "r1"}  # and tries again
    stats = decoder.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_emitted_tokens) == (6, 3, 5)
    assert stats.acceptance_rate == 0.5 and stats.mean_accepted_length == 2.5
    assert stats.accepted_by_position == [1, 1, 1]
    assert json.loads(json.dumps(stats.to_dict()))["acceptance_rate"] == 0.5


def test_the_heuristic_schedule_grows_drafts_while_all_are_accepted_and_shrinks_them_on_a_miss():
    class Long(Constant):
        def propose(self, requests):
            return [Proposal(list(range(1, 1 + r.max_drafts))) for r in requests]

    config = SpeculativeConfig("constant", 3, draft_length_schedule="heuristic", max_speculative_tokens=8,
                               disable_by_batch_size=None, min_acceptance_rate=0.0)
    decoder = SpeculativeDecoder(Long(SpeculatorContext(config, 100, ())), config)
    offered = []
    for accepted_all in (True, True, True, False, False, True, False, False, False, False):
        [proposal] = decoder.propose([SpecRequest("r0", [1], [], 20, 0.0)], 1).values()
        k = len(proposal.token_ids)
        offered.append(k)
        decoder.observe("r0", k, k if accepted_all else 0)
    assert offered == [3, 5, 7, 8, 7, 6, 8, 7, 6, 5]  # +2 on all accepted (capped at 8), -1 on a miss
    assert len(decoder.stats.accepted_by_position) == 8
    # a proposal shorter than its offer (the lookup ran out, or the request's own
    # limit) leaves the length alone
    decoder.release("r0")
    decoder.propose(_requests(1), 1)
    decoder.observe("r0", 2, 2)
    assert decoder._state["r0"].num_drafts == 3


def test_a_speculator_breaking_the_contract_is_named():
    class Bad(Constant):
        name = "bad"

        def propose(self, requests):
            return [Proposal([10_000])]

    config = SpeculativeConfig("bad", 3, disable_by_batch_size=None)
    decoder = SpeculativeDecoder(Bad(SpeculatorContext(config, 100, ())), config)
    with pytest.raises(RuntimeError, match=r"speculator 'bad' proposed a token outside \[0, 100\)"):
        decoder.propose(_requests(1), 1)
    with pytest.raises(RuntimeError, match="returned 1 proposals for 2 requests"):
        decoder.propose(_requests(2), 2)


def test_serve_flags_speculate_and_speculative_config(capsys):
    import argparse

    from ember.api.commands import _speculative_config
    from ember.api.settings import ServerSettings, engine_config_kwargs

    def args(speculate=None, config=None):
        return argparse.Namespace(speculate=speculate, speculative_config=config)

    assert _speculative_config(args(3)) == SpeculativeConfig("ngram", 3)  # TGI's --speculate 3
    config = _speculative_config(args(config='{"method": "ngram", "num_speculative_tokens": 6}'))
    assert config.num_speculative_tokens == 6 and _speculative_config(args()) is None
    with pytest.raises(ValueError, match="give --speculate or --speculative-config, not both"):
        _speculative_config(args(2, "{}"))
    with pytest.raises(ValueError, match="--speculate must be a positive number"):
        _speculative_config(args(0))
    assert engine_config_kwargs(ServerSettings(speculative_config=config))["speculative_config"] == config


def test_speculation_figures_reach_info_and_metrics(tiny_llama_dir):
    import httpx
    from server_utils import running_server

    spec = {**NGRAM, "method": "ngram"}
    with running_server(tiny_llama_dir, engine={"speculative_config": spec}, engine_mode="process") as (url, _app):
        prompt = "abc abc abc abc abc abc abc abc"
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "do_sample": False}}
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200
        info = httpx.get(f"{url}/info", timeout=10).json()["speculation"]
        assert info["method"] == "ngram" and info["num_draft_tokens"] >= info["num_accepted_tokens"] >= 0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'ember_spec_decode_num_draft_tokens_total{{method="ngram"}} {float(info["num_draft_tokens"])}' in metrics
    assert 'ember_spec_decode_acceptance_rate{method="ngram"}' in metrics
    assert f'ember_spec_decode_mean_drafts_per_decode{{method="ngram"}} {info["mean_drafts_per_decode"]}' in metrics
    assert 'ember_spec_decode_draft_step_fraction{method="ngram"}' in metrics


# -- the draft model ------------------------------------------------------------------------------

def test_a_draft_model_identical_to_the_target_has_every_greedy_draft_accepted(tiny_llama_dir, batch_invariant):
    """The target as its own draft (same weights, same numbers in batch-invariant
    mode): every draft is the target's own next token."""
    engine_args = dict(dtype="float32", num_kv_tokens=2048, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[40, 41, 42], list(range(50, 80)), [7] * 5]
    expected = _outputs(LLM(str(tiny_llama_dir), **engine_args), prompts, params)
    # every proposal verified: the counts below are the schedule's, not the step timings'
    config = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 4,
              "disable_by_batch_size": None, "cost_aware": False}
    llm = LLM(str(tiny_llama_dir), speculative_config=config, **engine_args)
    assert _outputs(llm, prompts, params) == expected
    stats = llm.engine.core.speculator.stats
    assert stats.num_draft_tokens > 20 and stats.acceptance_rate == 1.0, stats
    # the heuristic schedule: every step accepted all, so drafts grew 4 -> 6 -> 8 (the cap)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _outputs(LLM(str(tiny_llama_dir), **engine_args), prompts, params)
    config.update(draft_length_schedule="heuristic", max_speculative_tokens=8)
    llm = LLM(str(tiny_llama_dir), speculative_config=config, **engine_args)
    assert _outputs(llm, prompts, params) == expected
    stats = llm.engine.core.speculator.stats
    assert stats.acceptance_rate == 1.0 and stats.accepted_by_position[7] > 0, stats
    # 39 tokens after the first: 5 + 7 + 9 + 9 + 9 in 5 steps, where 4 drafts a step take 8
    assert stats.num_proposals == 5 * len(prompts), stats


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_outputs_with_a_different_draft_model_equal_those_without(kind, tmp_path, batch_invariant):
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_tiny_model(kind, target, seed=1)
    make_tiny_model(kind, draft, seed=2, num_hidden_layers=1)
    engine_args = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = _outputs(LLM(str(target), **engine_args), REPEATING, params)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": None,
              "min_acceptance_rate": 0.0}
    llm = LLM(str(target), speculative_config=config, **engine_args)
    assert _outputs(llm, REPEATING, params) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.core.speculator.stats.num_draft_tokens > 0


def test_sampling_with_a_draft_model_sends_its_distributions_and_is_reproducible(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_tiny_model("llama", target, seed=8)
    make_tiny_model("llama", draft, seed=9, num_hidden_layers=1)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": None,
              "min_acceptance_rate": 0.0}
    llm = LLM(str(target), dtype="float32", num_kv_tokens=1024, speculative_config=config)
    [proposal] = llm.engine.core.speculator.speculator.propose([SpecRequest("x", [40, 41, 42], [], 3, 0.8)])
    assert len(proposal.token_ids) == 3 and proposal.probs.shape == (3, llm.engine.model_info.vocab_size)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True)
    assert _outputs(llm, [[40, 41, 42]], params) == _outputs(llm, [[40, 41, 42]], params)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    vocab_file = json.loads((other / "tokenizer.json").read_text())
    vocab = vocab_file["model"]["vocab"]
    first = next(iter(vocab))
    vocab["renamed-token"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(vocab_file))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=256,
            speculative_config={"method": "draft_model", "model": str(other)})
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=256, speculative_config={"method": "draft_model"})


def test_a_full_draft_pool_evicts_other_requests_state_and_outputs_stay_exact(tmp_path, monkeypatch, batch_invariant):
    from ember.plugins.speculative import draft_model

    monkeypatch.setattr(draft_model, "DRAFT_KV_TOKENS", 128)  # 8 blocks: less than the batch needs
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_tiny_model("llama", target, seed=1)
    make_tiny_model("llama", draft, seed=2, num_hidden_layers=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine_args = dict(dtype="float32", num_kv_tokens=4096, block_size=16)
    expected = _outputs(LLM(str(target), **engine_args), REPEATING, params)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": None,
              "min_acceptance_rate": 0.0}
    llm = LLM(str(target), speculative_config=config, **engine_args)
    assert _outputs(llm, REPEATING, params) == expected
    assert llm.engine.core.speculator.stats.num_draft_tokens > 0


# -- Medusa heads ---------------------------------------------------------------------------------

def _medusa_heads(out_dir, hidden: int, vocab: int, num_heads: int = 3, num_layers: int = 1, seed: int = 0):
    """Random heads written as FasterDecoding/Medusa publishes them."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.1
            tensors[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=gen) * 0.1
        tensors[f"{i}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=gen)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "medusa_lm_head.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers}))
    return tensors


def test_medusa_heads_propose_their_argmaxes_from_the_targets_hidden_state(tiny_llama_dir, tmp_path, batch_invariant):
    llm0 = LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=1024)
    hidden, vocab = llm0.engine.core.hf_config.hidden_size, llm0.engine.model_info.vocab_size
    tensors = _medusa_heads(tmp_path / "heads", hidden, vocab)
    config = {"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 3,
              "disable_by_batch_size": None, "min_acceptance_rate": 0.0, "cost_aware": False}  # random heads: verify all
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=1024, speculative_config=config)
    speculator = llm.engine.core.speculator.speculator
    h = torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    [proposal] = speculator.propose([SpecRequest("x", [1], [], 3, 0.0, h)])
    expected = []
    for i in range(3):
        x = h + torch.nn.functional.silu(tensors[f"{i}.0.linear.weight"] @ h + tensors[f"{i}.0.linear.bias"])
        expected.append(int((tensors[f"{i}.1.weight"] @ x).argmax()))
    assert proposal.token_ids == expected
    # in the engine: the runner hands over each request's hidden state; greedy outputs are unchanged
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[40, 41, 42], list(range(50, 80))]
    assert _outputs(llm, prompts, params) == _outputs(llm0, prompts, params)
    assert llm.engine.core.speculator.stats.num_draft_tokens > 0


def test_medusa_checkpoints_that_do_not_fit_are_refused_by_name(tiny_llama_dir, tmp_path):
    _medusa_heads(tmp_path / "wrong", hidden=8, vocab=50)
    for path, message in [(tmp_path / "wrong", "a block of shape \\(8, 8\\), the target's hidden size is"),
                          (tmp_path / "none", "no config.json")]:
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_llama_dir), dtype="float32", num_kv_tokens=256,
                speculative_config={"method": "medusa", "model": str(path)})


def test_ember_bench_reports_the_speculation_of_its_run(tiny_llama_dir, tmp_path, capsys):
    from ember.api.bench.cli import speculation_delta
    from ember.api.cli import main

    out = tmp_path / "offline.json"
    config = json.dumps({**NGRAM})
    status = main(["bench", "offline", "--model", str(tiny_llama_dir), "--dtype", "float32", "--engine-arg",
                   "num_kv_blocks=64", "--engine-arg", f"speculative_config={config}", "--dataset", "random",
                   "--num-prompts", "2", "--max-tokens", "12", "--no-progress", "--result-file", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    spec = json.loads(out.read_text())["speculation"]
    assert spec["method"] == "ngram" and "speculation (ngram):" in printed
    before = {"method": "ngram", "num_steps": 1, "num_proposals": 2, "num_draft_tokens": 8, "num_accepted_tokens": 2,
              "num_emitted_tokens": 4}
    after = {**before, "num_steps": 3, "num_proposals": 4, "num_draft_tokens": 16, "num_accepted_tokens": 8,
             "num_emitted_tokens": 10}
    delta = speculation_delta(before, after)
    assert (delta["acceptance_rate"], delta["mean_accepted_length"], delta["num_steps"]) == (0.75, 3.0, 2)
