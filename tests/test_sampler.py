"""The batched sampler (ember.worker.sampler): a mixed batch (greedy, sampled, penalties,
seeded rows) equals a per-row reference built of transformers' processors; seeded
rows draw the same tokens whatever their batch and position; several rows of one
request (speculative decoding) draw in row order; an operation no row uses does not
run; the backend's greedy op; generators freed with their request. On a GPU too,
when there is one."""

from __future__ import annotations

import math
from collections import Counter
from typing import ClassVar

import pytest
import torch
from transformers.generation import logits_process as hf

from ember import SamplingParams
from ember.plugin.logits_processor import ORDER_ADJUST, BaseLogitsProcessor, LogitsProcessorContext, SamplingRow
from ember.plugins.logits.typical import TypicalP
from ember.worker import sampler as sampler_module
from ember.worker.logits_pipeline import LogitsPipeline
from ember.worker.sampler import Sampler, position_seed

VOCAB = 64
EOS = (1,)
CONTEXT = LogitsProcessorContext(vocab_size=VOCAB, eos_token_ids=EOS)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPS = ("_logit_bias", "_repetition_penalty", "_frequency_presence_penalty", "_bad_words", "_min_tokens",
       "_temperature", "_top_k", "_top_p", "_min_p")

MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.4, logit_bias={3: 2.0, 9: -1.5}),
    SamplingParams(temperature=0.7, top_k=8),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, frequency_penalty=0.6, presence_penalty=0.3),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=0.8, seed=11,
                   bad_words_token_ids=[[5], [2, 6]], min_tokens=6, stop_token_ids=[7], max_tokens=10),
    SamplingParams(),
    SamplingParams(temperature=0, bad_words_token_ids=[[4, 4, 8]], min_tokens=3, ignore_eos=True,
                   stop_token_ids=[12], top_k=3),  # greedy: top_k ignored
    SamplingParams(temperature=0.8, typical_p=0.6, seed=5, logit_bias={1: 4.0}),
]


def make_rows(params: list[SamplingParams], seed: int = 0) -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, p in enumerate(params):
        prompt = torch.randint(0, 16, (3 + i,), generator=gen).tolist()
        output = torch.randint(0, 16, (i,), generator=gen).tolist()
        rows.append(SamplingRow(f"r{i}", p, prompt, output, EOS))
    if len(rows) > 6:
        rows[6].output_token_ids[-2:] = [4, 4]  # row 6's bad word's prefix ends its context
    return rows


def create_sampler(seed: int | None = None, **kwargs) -> Sampler:
    return Sampler(VOCAB, seed, pipeline=LogitsPipeline([TypicalP(CONTEXT)]), **kwargs)


def reference(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row processed by transformers' processors (and OpenAI's penalties by hand)."""
    p = row.params
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids], device=logits.device)
    scores = logits[None].clone()
    if p.logit_bias:
        scores = hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    counts = torch.zeros(VOCAB, device=logits.device)
    for t in row.output_token_ids:
        counts[t] += 1
    scores = scores - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0))
    if p.bad_words_token_ids:
        scores = hf.NoBadWordsLogitsProcessor([list(w) for w in p.bad_words_token_ids])(ids, scores)
    if p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(EOS))
        prompt_len = len(row.prompt_token_ids)
        scores = hf.MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, banned)(ids, scores)
    if not p.is_greedy:
        warpers = [hf.TemperatureLogitsWarper(p.temperature)]
        warpers += [hf.TopKLogitsWarper(p.top_k)] if p.top_k > 0 else []
        warpers += [hf.TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
        warpers += [hf.MinPLogitsWarper(p.min_p)] if p.min_p > 0 else []
        warpers += [hf.TypicalLogitsWarper(p.typical_p)] if p.typical_p < 1 else []
        for warper in warpers:
            scores = warper(ids, scores)
    return scores[0]


def inverse_cdf(processed: torch.Tensor, gen: torch.Generator) -> int:
    """The token whose span of the cumulative distribution holds one uniform draw."""
    u = float(torch.rand(1, dtype=torch.float64, generator=gen, device=processed.device))
    cumulative = 0.0
    probs = processed.softmax(-1).double().cpu().tolist()
    total = sum(probs)
    for token, p in enumerate(probs):
        cumulative += p
        if u * total < cumulative:
            return token
    return max(t for t, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_equals_the_per_row_reference(device, seed):
    rows = make_rows(MIXED, seed)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)).mul_(3).to(device)
    out = create_sampler()(logits.clone(), rows)
    assert out.processed.shape == (len(rows), VOCAB) and out.processed.dtype == torch.float32
    for i, row in enumerate(rows):
        theirs = reference(logits[i], row)
        assert torch.equal(out.processed[i].isfinite(), theirs.isfinite()), i
        kept = theirs.isfinite()
        torch.testing.assert_close(out.processed[i][kept], theirs[kept], rtol=0, atol=1e-6)
        assert theirs[out.token_ids[i]].isfinite(), f"row {i} drew a token its distribution bans"
        log_p = theirs.log_softmax(-1)[out.token_ids[i]]
        assert out.logprobs[i] == pytest.approx(float(log_p), abs=1e-5)
        if row.params.is_greedy:
            assert out.token_ids[i] == int(theirs.argmax()), i
        elif row.params.seed is not None:  # its own generator, seeded by the request and the position
            gen = torch.Generator(device=device).manual_seed(position_seed(row.params.seed, row.num_output_tokens))
            assert out.token_ids[i] == inverse_cdf(out.processed[i], gen), i
    # the rows without a control are untouched by their mates'
    assert torch.equal(out.processed[0], logits[0]) and torch.equal(out.processed[5], logits[5])


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_draw_the_same_tokens_alone_and_in_any_batch(device):
    targets = [SamplingParams(seed=3, temperature=1.1, top_p=0.9), SamplingParams(seed=4, min_p=0.02)]
    mates = [SamplingParams(), SamplingParams(temperature=0, repetition_penalty=1.3),
             SamplingParams(seed=99, temperature=0.5, top_k=5)]

    def run(order: list[int], sampler_seed: int | None, num_steps: int = 8) -> dict[str, list[int]]:
        """``order``: positions of targets (0, 1) and mates (2, 3, 4) in the batch."""
        sampler = create_sampler(sampler_seed)
        params = targets + mates
        rows = [SamplingRow(f"q{k}", params[k], [1, 2], [], EOS) for k in order]
        for step in range(num_steps):
            logits = torch.stack([
                torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * step + int(r.request_id[1:])))
                for r in rows
            ]).to(device)
            for row, token in zip(rows, sampler(logits, rows).token_ids):
                row.output_token_ids.append(token)
        return {r.request_id: r.output_token_ids for r in rows if r.request_id in ("q0", "q1")}

    alone = {**run([0], None), **run([1], 5)}
    assert run([2, 0, 3, 1, 4], 7) == alone
    assert run([1, 4, 0], None) == alone
    assert len(set(alone["q0"])) > 2  # it really sampled


def test_draws_follow_the_distribution_and_never_take_a_banned_token():
    """20,000 unseeded rows of one distribution (tiny, zero and large probabilities):
    the frequencies of the five likely tokens pass a chi-square test at a fixed engine
    seed (the bound is the 0.9999 quantile for 4 degrees of freedom: a correct draw
    fails it one seed in 10,000), the 1-in-10,000 token is drawn about twice, and a
    banned token never."""
    logits = torch.full((VOCAB,), float("-inf"))
    wanted = {3: 0.4, 4: 0.25, 9: 0.2, 10: 0.1, 11: 0.0499, 40: 0.0001}
    for token, p in wanted.items():
        logits[token] = math.log(p)
    rows = 20_000
    out = create_sampler(seed=1234)(logits.expand(rows, VOCAB).clone(),
                                    [SamplingRow(f"r{i}", SamplingParams(temperature=1.0), [1], [], EOS)
                                     for i in range(rows)])
    counts = Counter(out.token_ids)
    assert set(counts) <= set(wanted), f"drew banned tokens: {set(counts) - set(wanted)}"
    total = sum(wanted.values())
    chi2 = sum((counts.get(t, 0) - rows * p / total) ** 2 / (rows * p / total) for t, p in wanted.items() if p > 0.01)
    assert chi2 < 23.5, (chi2, counts)
    assert counts[40] < 12  # expected 2: P(12 or more) is about 1e-6


def test_rows_of_one_request_draw_from_its_generator_in_row_order():
    """Speculative decoding verifies several positions of a request in one step: each
    row draws once from the request's generator, in row order, as consecutive steps do."""
    params = SamplingParams(seed=21, temperature=0.8, frequency_penalty=0.5)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    outputs = [[], [7], [7, 8]]  # the positions' own outputs
    together = create_sampler()(logits.clone(), [SamplingRow("spec", params, [1], o, EOS) for o in outputs])
    one_by_one = create_sampler()
    for i, output in enumerate(outputs):
        single = one_by_one(logits[i : i + 1].clone(), [SamplingRow("spec", params, [1], output, EOS)])
        assert single.token_ids[0] == together.token_ids[i]
        assert torch.equal(single.processed[0], together.processed[i])
    for token in (7, 8):  # each row's penalty counts its own output
        assert float(together.processed[2, token]) == pytest.approx(float(logits[2, token] - 0.5) / 0.8, rel=1e-6)


class Counting(BaseLogitsProcessor):
    name = "counting"
    order = ORDER_ADJUST
    calls: ClassVar[list[list[str]]] = []

    def apply(self, logits, rows):
        self.calls.append([r.request_id for r in rows])
        return logits


def test_an_operation_runs_only_for_the_rows_that_use_it(monkeypatch):
    calls: list[tuple[str, int]] = []
    for name in OPS:
        real = getattr(sampler_module, name)

        def recorder(logits, rows, name=name, real=real):
            calls.append((name, len(rows)))
            return real(logits, rows)

        monkeypatch.setattr(sampler_module, name, recorder)
    sampler = Sampler(VOCAB, pipeline=LogitsPipeline([TypicalP(CONTEXT), Counting(CONTEXT)]))
    Counting.calls = []
    # greedy rows ignore temperature and the truncations; nothing else is set
    greedy = [SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.2, typical_p=0.5, seed=1)] * 3
    out = sampler(torch.randn(3, VOCAB), make_rows(greedy))
    assert calls == [] and Counting.calls == [] and not sampler._shared and not sampler._generators
    assert len(out.token_ids) == 3

    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=0.5), SamplingParams(temperature=0, min_tokens=3),
             SamplingParams(top_k=4, extra={"counting": 1}), SamplingParams(temperature=0.5)]
    sampler(torch.randn(5, VOCAB), make_rows(mixed))
    assert calls == [("_min_tokens", 1), ("_temperature", 2), ("_top_k", 1)]
    assert Counting.calls == [["r3"]]


def test_the_backends_greedy_op_takes_the_greedy_rows():
    seen = []

    def greedy_op(logits):
        seen.append(logits.shape[0])
        return logits.argmax(-1), logits.log_softmax(-1).amax(-1)

    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(temperature=0), SamplingParams()]
    out = Sampler(VOCAB, greedy_op=greedy_op)(logits.clone(), make_rows(params))
    assert seen == [2]
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(logits[2].argmax())


def test_remove_request_frees_its_generator_and_processor_state():
    sampler = create_sampler()
    rows = make_rows([SamplingParams(seed=1, typical_p=0.5), SamplingParams(seed=2), SamplingParams()])
    first = sampler(torch.zeros(3, VOCAB), rows).token_ids
    assert set(sampler._generators) == {"r0", "r1"} and sampler.pipeline.num_active_requests == 3
    for row in rows:
        sampler.remove_request(row.request_id)
    assert not sampler._generators and sampler.pipeline.num_active_requests == 0
    # a request id that comes back starts its seed afresh
    assert sampler(torch.zeros(3, VOCAB), rows).token_ids[:2] == first[:2]


def test_validate_names_token_ids_outside_the_vocabulary_and_missing_plugins():
    sampler = Sampler(VOCAB)  # no typical_p plugin
    sampler.validate(SamplingParams(temperature=0.3, top_k=2, logit_bias={63: 1.0}, stop_token_ids=[0]))
    with pytest.raises(ValueError, match=r"logit_bias token id 70 is outside the vocabulary \[0, 64\)"):
        sampler.validate(SamplingParams(logit_bias={70: 1.0}))
    with pytest.raises(ValueError, match="typical_p=0.3 needs a logits processor plugin .*not loaded"):
        sampler.validate(SamplingParams(typical_p=0.3))


def test_non_finite_logits_are_repaired_before_drawing():
    logits = torch.randn(3, VOCAB)
    logits[0, 5] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    params = [SamplingParams(temperature=0), SamplingParams(seed=0), SamplingParams(seed=1)]
    out = Sampler(VOCAB)(logits, make_rows(params))
    assert out.token_ids[1] == 9 and not any(math.isnan(lp) for lp in out.logprobs)
    assert out.processed[0, 5] == float("-inf") and out.processed[2].eq(0).all()
