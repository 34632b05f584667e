"""Cost-aware speculation (ember.engine.spec_cost, the decoder's use of it): the step
cost model learns a linear cost from timings, the choice of drafts per request
follows cost and acceptance, probes stay within their bound, ``cost_aware: false``
keeps the old schedule, and greedy outputs stay those of plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from ember import LLM, SamplingParams
from ember.config import SpeculativeConfig
from ember.engine.spec_cost import (
    AcceptanceModel,
    ExplorationBudget,
    StepCostModel,
    batch_bucket,
    choose_drafts,
    expected_tokens,
)
from ember.engine.speculative import SpeculativeDecoder
from ember.plugin.speculator import BaseSpeculator, Proposal, SpeculatorContext
from ember.sampling_params import SamplingParams as Params
from ember.sched.request import Request, RequestStatus


def test_the_cost_model_learns_a_linear_cost_from_timings():
    model = StepCostModel()
    assert model.cost(1, 1) is None  # nothing measured: no estimate
    for _ in range(30):
        for tokens in (1, 3, 6):
            model.observe(1, tokens, 0.010 + 0.004 * (tokens - 1))
    assert model.cost(1, 1) == pytest.approx(0.010)
    assert model.cost(1, 2) == pytest.approx(0.014)  # between measured points: the line joining them
    assert model.cost(1, 11) == pytest.approx(0.050)  # beyond: the least-squares line
    assert model.slope(1) == pytest.approx(0.004)
    assert model.cost(2, 2) is None  # another batch bucket learns on its own
    model.observe(2, 2, 0.012)
    assert model.cost(2, 4) == pytest.approx(0.012 * (1 + 0.02 * 2 / 2))  # one point: the optimistic prior
    assert batch_bucket(5) == 5 and batch_bucket(9) == 16 and batch_bucket(16) == 16
    assert json.loads(json.dumps(model.to_dict()))["1"]["6"] == pytest.approx(30.0)


def test_slow_steps_do_not_swamp_the_estimate():
    model = StepCostModel()
    for _ in range(10):
        model.observe(1, 1, 0.010)
    model.observe(1, 1, 1.0)  # the OS took the core for a second
    assert model.cost(1, 1) == pytest.approx(0.010)
    for _ in range(3):
        model.observe(1, 6, 0.015)
    assert model.observe(1, 3, 0.5) == pytest.approx(0.060)  # a new shape's first step, slow: clipped at 2x3 rows
    assert model.cost(1, 3) == pytest.approx(0.015)  # and never above a dearer shape
    fresh = StepCostModel()
    for _ in range(3):
        fresh.observe(1, 1, 0.010)
    fresh.observe(1, 6, 0.055)  # a shape's first step compiled its kernels
    fresh.observe(1, 6, 0.015)
    assert fresh.cost(1, 6) == pytest.approx(0.015)  # the next normal step outvotes it
    steep = StepCostModel()
    steep.observe(1, 3, 0.010)
    steep.observe(1, 6, 0.040)
    assert steep.cost(1, 1) == pytest.approx(0.005)  # a line falling below zero: half the cheapest shape


def test_acceptance_is_learned_per_request_and_draft_position():
    model = AcceptanceModel(4)
    assert model.rates("a", 3) == [0.5, 0.5, 0.5]  # the prior
    for _ in range(20):
        model.observe("a", 4, 4)
        model.observe("b", 4, 0)
    a, b = model.rates("a", 4), model.rates("b", 4)
    assert min(a) > 0.75 and b[0] < 0.3
    model.observe("c", 4, 1)  # accepted the first, rejected the second: the rest never judged
    assert expected_tokens([1.0, 1.0], 2) == 3.0 and expected_tokens([0.5, 0.5], 2) == 1.75
    model.release("a")
    assert model.rates("a", 1) != a[:1]  # back to every request's rate


def _cost(plain, per_token):
    return lambda tokens: plain + per_token * (tokens - 1)


def test_no_drafts_when_verification_is_dear_and_acceptance_low():
    chosen, rate, plain = choose_drafts({"r": 5}, {"r": [0.3] * 5}, 1, _cost(0.010, 0.010))
    assert chosen == {} and rate == plain == pytest.approx(100.0)


def test_drafts_when_verification_is_cheap_and_acceptance_high():
    chosen, rate, plain = choose_drafts({"r": 5}, {"r": [0.9] * 5}, 1, _cost(0.010, 0.0005))
    assert chosen == {"r": 5} and rate > 3 * plain
    # dear verification but near-certain acceptance: still worth it
    assert choose_drafts({"r": 5}, {"r": [0.99] * 5}, 1, _cost(0.010, 0.005))[0] == {"r": 5}
    # in a batch the drafts go to the request whose drafts are accepted
    chosen, _, _ = choose_drafts({"good": 4, "bad": 4}, {"good": [0.95] * 4, "bad": [0.05] * 4}, 2,
                                 _cost(0.010, 0.002))
    assert chosen == {"good": 4}


def test_a_costly_first_draft_is_weighed_with_the_cheap_ones_after_it():
    """A cost that jumps at the second row then stays flat (a one-row product is
    memory-bound, more rows compute-bound): one draft alone does not pay, four do."""
    def cost(tokens):
        return 0.010 if tokens == 1 else 0.016
    assert choose_drafts({"r": 4}, {"r": [0.8] * 4}, 1, cost)[0] == {"r": 4}


def test_probes_are_at_most_one_in_the_interval_and_within_the_time_budget():
    budget = ExplorationBudget(interval=4, fraction=0.02)
    probes = 0
    for step in range(400):
        if budget.due():
            probes += 1
            budget.step(0.030, 0.020)  # a probe: 20 ms over the 10 ms step it replaced
        else:
            budget.step(0.010, None)
    assert probes <= 400 // 4
    assert budget.extra_s <= 0.02 * budget.total_s + 0.020  # at most one probe past the budget
    assert probes == budget.num_probes > 0


class Copying(BaseSpeculator):
    """Proposes 1..max_drafts: drafts always available."""

    name = "copying"

    def propose(self, requests):
        return [Proposal(list(range(1, 1 + r.max_drafts))) for r in requests]


def _decoding_request(request_id="r0"):
    request = Request(request_id, [1, 2, 3], Params(temperature=0.0, max_tokens=100))
    request.output_token_ids = [4]
    request.num_computed_tokens = request.num_tokens - 1
    request.status = RequestStatus.RUNNING
    return request


def _decoder(**config):
    config = SpeculativeConfig("copying", 5, disable_by_batch_size=None, min_acceptance_rate=0.0, **config)
    return SpeculativeDecoder(Copying(SpeculatorContext(config, 100, ())), config)


def _teach(decoder, plain, per_token, accepted):
    for tokens in (1, 6):
        for _ in range(5):
            decoder.costs.observe(1, tokens, plain + per_token * (tokens - 1))
    for _ in range(10):
        decoder.observe("r0", 5, accepted)


@pytest.mark.parametrize("cost_aware", [True, False])
def test_the_decoder_drafts_by_cost_and_the_flag_off_keeps_the_old_schedule(cost_aware):
    decoder = _decoder(cost_aware=cost_aware, cost_probe_interval=1000)
    _teach(decoder, 0.010, 0.010, accepted=0)  # verification dear, nothing accepted
    request = _decoding_request()
    decoder.propose_for([request], 1000, None)
    assert request.draft_token_ids == ([] if cost_aware else [1, 2, 3, 4, 5])
    decoder = _decoder(cost_aware=cost_aware, cost_probe_interval=1000)
    _teach(decoder, 0.010, 0.0005, accepted=5)  # cheap and accepted
    decoder.propose_for([request], 1000, None)
    assert request.draft_token_ids == [1, 2, 3, 4, 5]
    assert decoder.stats.to_dict()["cost_aware"] is cost_aware


def test_a_probe_verifies_what_the_model_turned_down_once_per_interval():
    decoder = _decoder(cost_probe_interval=4)
    _teach(decoder, 0.010, 0.010, accepted=0)
    decoder.explore.total_s = 100.0  # time enough in the budget
    drafted = []
    for _ in range(12):
        request = _decoding_request()
        decoder.propose_for([request], 1000, None)
        drafted.append(bool(request.draft_token_ids))
        decoder.explore.step(0.010, 0.0 if decoder._probe_predicted is not None else None)
    assert drafted == [False] * 4 + [True] + [False] * 4 + [True] + [False] * 2


def test_the_config_flag_is_checked():
    assert SpeculativeConfig().cost_aware is True
    with pytest.raises(ValueError, match="cost_aware"):
        SpeculativeConfig(cost_aware="off")
    with pytest.raises(ValueError, match="cost_probe_interval"):
        SpeculativeConfig(cost_probe_interval=0)


@pytest.fixture
def batch_invariant(monkeypatch):
    from ember.hardware.cpu import CPUBackend

    monkeypatch.setattr(CPUBackend, "batch_invariant", property(lambda self: True))


def test_greedy_outputs_with_cost_aware_speculation_equal_those_without(tiny_llama_dir, batch_invariant):
    prompts = [[(i % 7) + 10 for i in range(40)], [20, 21, 22, 23, 24, 25] * 5, list(range(60, 90)) * 2]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine_args = dict(dtype="float32", max_model_len=256)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, **engine_args).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None, "cost_probe_interval": 4}
    llm = LLM(tiny_llama_dir, speculative_config=spec, **engine_args)
    for batch in ([p] for p in prompts):  # batch 1, then all three at once
        assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=params)] == \
            [expected[prompts.index(batch[0])]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == expected
    stats = llm.engine.core.speculator.stats.to_dict()
    assert stats["cost_aware"] and stats["num_decode_steps"] > 0 and stats["step_cost_ms"]["1"]
    assert stats["num_draft_tokens"] > 0 and 0 < stats["draft_step_fraction"] <= 1



@pytest.mark.parametrize("dtype,path", [("float32", "fp32"), ("bfloat16", "fp32"), ("bfloat16", "bf16")])
def test_a_verification_computes_each_row_as_its_plain_step_would(tiny_llama_dir, dtype, path):
    """A float32 model, a bf16 model computed in float32 (the CPU path of CPUs without
    bf16 math) or in bf16 (the bf16 path, its dot-product kernel), with speculation and
    without batch-invariant mode: every product of a lone request's verification (1 + 5
    drafts) takes a few-row kernel (gemv_f32, gemv_bf16, gemv_bf16_dot; small_batch_rows
    auto: 8),
    which gives each row bit for bit what that row gives alone, as a plain decode step
    computes it. oneDNN's GEMM blocks by the number of rows, so when the kernel took
    only 4 rows a verification's tokens could differ in the last bits and a near-tie
    flip a greedy token."""
    from ember.hardware import cpu_kernels
    from ember.hardware.cpu_linear import packing_works

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("native kernels unavailable on this machine (no AVX2/FMA or no C compiler)")
    if path == "bf16" and not (packing_works() and kernels.has_bf16_dot):
        pytest.skip("the bf16 path's dot-product kernel needs a CPU with avx512_bf16")
    engine_args = dict(dtype=dtype, max_model_len=256, backend_options={"path": path})
    # every proposal verified (cost_aware off), at 1 + 5 rows
    spec = {"method": "ngram", "num_speculative_tokens": 5, "cost_aware": False, "disable_by_batch_size": None}
    llm = LLM(tiny_llama_dir, speculative_config=spec, **engine_args)
    core = llm.engine.core
    model = core.runner.model
    assert model.linear_op.max_rows >= 6
    torch.manual_seed(0)
    checked = 0
    compute = core.backend.compute_dtype(core.dtype)
    for weight in model.matmul_weights():
        x = torch.randn(6, weight.shape[1]).to(compute)
        together = model.linear_op(x, weight)
        alone = torch.cat([model.linear_op(x[i : i + 1], weight) for i in range(6)])
        assert torch.equal(together, alone), tuple(weight.shape)
        checked += 1
    assert checked >= 7
    # and end to end: greedy outputs with speculation equal those without
    prompts = [[(i % 7) + 10 for i in range(40)], [20, 21, 22, 23, 24, 25] * 5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(tiny_llama_dir, **engine_args)
    for prompt in prompts:
        want = plain.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
        assert llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids == want
    assert core.speculator.stats.to_dict()["num_draft_tokens"] > 0
