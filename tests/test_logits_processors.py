"""Logits processing: each of core's controls (ember.worker.sampler) and the ``typical_p``
plugin against transformers' processor or warper (or hand-computed values) on random
logits with different parameters per row; the pipeline's bands, greedy skipping and
per-request state as requests join and leave; seeded sampling independent of batch
mates and, by a chi-square test, faithful to the processed distribution; discovery
through entry points; the example plugin's ``ban_digits`` switched on per request;
transformers' `generate` on a tiny model. tests/test_sampler.py has the batched
sampler's own tests (mixed batches, skipped operations, generators)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.generation import logits_process as hf

import ember
from ember import SamplingParams
from ember.plugin import create_plugin_manager
from ember.plugin.logits_processor import BaseLogitsProcessor, LogitsProcessorContext, SamplingRow
from ember.plugins.logits.typical import TypicalP
from ember.testing import check_logits_processor
from ember.worker.logits_pipeline import LogitsPipeline
from ember.worker.sampler import Sampler

VOCAB = 64
EOS = (1,)
CONTEXT = LogitsProcessorContext(vocab_size=VOCAB, eos_token_ids=EOS)
NEG_INF = float("-inf")


def random_logits(num_rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_rows(params: list[SamplingParams], seed: int = 0) -> list[SamplingRow]:
    """Rows with prompts and outputs of different lengths (repeats included)."""
    rows = []
    for i, p in enumerate(params):
        prompt = random_ids(2 + 3 * i, seed * 100 + i)
        output = random_ids(i, seed * 100 + 50 + i) + prompt[:1]
        rows.append(SamplingRow(f"r{i}", p, prompt, output, EOS))
    return rows


def create_sampler(context: LogitsProcessorContext = CONTEXT, seed: int | None = None) -> Sampler:
    """Core's sampler with the built-in typical_p plugin, as the engine builds it."""
    return Sampler(context.vocab_size, seed, pipeline=LogitsPipeline([TypicalP(context)]))


def process(logits: torch.Tensor, rows: list[SamplingRow], sampler: Sampler | None = None) -> torch.Tensor:
    """The processed logits (without drawing) of a fresh sampler, or of ``sampler``."""
    sampler = sampler or create_sampler()
    for row in rows:
        sampler.validate(row.params)
    return sampler.process(logits.clone(), rows)


def input_ids(row: SamplingRow) -> torch.Tensor:
    return torch.tensor([row.prompt_token_ids + row.output_token_ids])


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Same kept set (the finite entries) and the same values there."""
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    kept = ours.isfinite()
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=0, atol=0)


# -- each control against transformers ------------------------------------------------------

WARPER_CASES = [
    ("temperature", "temperature", [0.3, 0.7, 1.5, 2.0], lambda v: hf.TemperatureLogitsWarper(v)),
    ("top_k", "top_k", [1, 5, 20, VOCAB + 10], lambda v: hf.TopKLogitsWarper(v)),
    ("top_p", "top_p", [0.1, 0.5, 0.9, 0.99], lambda v: hf.TopPLogitsWarper(v)),
    ("min_p", "min_p", [0.02, 0.2, 0.5, 1.0], lambda v: hf.MinPLogitsWarper(v)),
    ("typical_p", "typical_p", [0.2, 0.5, 0.9, 0.95], lambda v: hf.TypicalLogitsWarper(v)),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name, field, values, make_hf", WARPER_CASES, ids=[c[0] for c in WARPER_CASES])
def test_warpers_match_transformers_row_by_row(name, field, values, make_hf, seed):
    rows = make_rows([SamplingParams(**{field: v}) for v in values], seed)
    logits = random_logits(len(rows), seed)
    ours = process(logits, rows)
    for i, (row, value) in enumerate(zip(rows, values)):
        theirs = make_hf(value)(input_ids(row), logits[i : i + 1].clone())[0]
        assert_same(ours[i], theirs)
    if name != "temperature":
        assert (~ours.isfinite()).any(), "the test values should truncate something"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_matches_transformers(seed):
    penalties_per_row = [0.5, 1.2, 2.0, 1.05]
    rows = make_rows([SamplingParams(repetition_penalty=v) for v in penalties_per_row], seed)
    logits = random_logits(len(rows), seed)
    ours = process(logits, rows)
    for i, (row, value) in enumerate(zip(rows, penalties_per_row)):
        theirs = hf.RepetitionPenaltyLogitsProcessor(value)(input_ids(row), logits[i : i + 1].clone())[0]
        assert torch.equal(ours[i], theirs)


def test_repetition_penalty_state_follows_the_output_step_by_step():
    row = SamplingRow("r", SamplingParams(repetition_penalty=1.7), [3, 4, 4], [], EOS)
    sampler = create_sampler()
    for step in range(6):
        logits = random_logits(1, 10 + step)
        ours = sampler.process(logits.clone(), [row])
        theirs = hf.RepetitionPenaltyLogitsProcessor(1.7)(input_ids(row), logits.clone())
        assert torch.equal(ours, theirs), step
        row.output_token_ids.extend([7 + step, 3][: 1 + step % 2])  # one or two tokens a step


@pytest.mark.parametrize("seed", [0, 1])
def test_bad_words_match_transformers(seed):
    words_per_row = [
        [[5], [9, 10]],
        [[7, 8, 9], [11]],
        [[2, 3], [2, 4], [60]],
        [[13, 14, 15, 16]],
    ]
    rows = make_rows([SamplingParams(bad_words_token_ids=w) for w in words_per_row], seed)
    # make the multi-token words' prefixes match the end of some contexts: in the
    # output (row 0), across the prompt/output boundary (row 1), in the prompt (row 3)
    rows[0].output_token_ids.append(9)
    rows[1].prompt_token_ids.append(7)
    rows[1].output_token_ids.clear()
    rows[1].output_token_ids.append(8)
    rows[3].prompt_token_ids.extend([13, 14, 15])
    rows[3].output_token_ids.clear()
    logits = random_logits(len(rows), seed)
    ours = process(logits, rows)
    for i, (row, words) in enumerate(zip(rows, words_per_row)):
        theirs = hf.NoBadWordsLogitsProcessor(words)(input_ids(row), logits[i : i + 1].clone())[0]
        assert_same(ours[i], theirs)
    assert ours[0, 10] == NEG_INF and ours[1, 9] == NEG_INF and ours[3, 16] == NEG_INF
    assert ours[2, 3].isfinite() and ours[2, 4].isfinite()  # row 2's context does not end with 2


def test_min_tokens_matches_transformers():
    cases = [  # (min_tokens, stop_token_ids, ignore_eos, number of output tokens)
        (3, (), False, 1),
        (3, (7,), False, 3),  # reached: nothing banned
        (5, (7, 8), False, 0),
        (4, (9,), True, 2),  # ignore_eos: only the stop token
    ]
    params = [SamplingParams(min_tokens=m, stop_token_ids=s, ignore_eos=e, max_tokens=8) for m, s, e, _ in cases]
    rows = [SamplingRow(f"r{i}", p, [4, 5], list(range(20, 20 + n)), EOS) for i, (p, (*_, n)) in enumerate(zip(params, cases))]
    logits = random_logits(len(rows), 0)
    ours = process(logits, rows)
    for i, (row, (min_tokens, stops, ignore_eos, _)) in enumerate(zip(rows, cases)):
        banned = list(stops) + ([] if ignore_eos else list(EOS))
        theirs = hf.MinNewTokensLengthLogitsProcessor(2, min_tokens, banned)(input_ids(row), logits[i : i + 1].clone())
        assert_same(ours[i], theirs[0])
    assert ours[1].isfinite().all() and ours[3, 1].isfinite() and ours[3, 9] == NEG_INF


# -- hand-computed --------------------------------------------------------------------------


def test_frequency_and_presence_penalty_exact():
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(presence_penalty=2.0),
    ]
    # prompt tokens never count (OpenAI semantics: output tokens only)
    rows = [
        SamplingRow("a", params[0], [3, 3, 3, 4], [3, 3, 5, 3], EOS),
        SamplingRow("b", params[1], [6], [6, 7, 7], EOS),
        SamplingRow("c", params[2], [8, 9], [], EOS),
    ]
    logits = torch.zeros(3, VOCAB)
    ours = process(logits, rows)
    expected = torch.zeros(3, VOCAB)
    expected[0, 3] = -(3 * 0.5 + 0.25)
    expected[0, 5] = -(1 * 0.5 + 0.25)
    expected[1, 6] = 1.0
    expected[1, 7] = 2.0
    assert torch.equal(ours, expected)


def test_frequency_penalty_counts_follow_the_output():
    row = SamplingRow("a", SamplingParams(frequency_penalty=1.0), [1], [], EOS)
    sampler = create_sampler()
    seen = []
    for token in [4, 4, 9, 4]:
        out = sampler.process(torch.zeros(1, VOCAB), [row])
        assert out[0, 4] == -seen.count(4) and out[0, 9] == -seen.count(9)
        row.output_token_ids.append(token)
        seen.append(token)


def test_logit_bias_exact_and_validated():
    params = [SamplingParams(logit_bias={3: 5.0, 10: -100.0}), SamplingParams(logit_bias={3: -2.5, 63: 0.5})]
    rows = make_rows(params)
    logits = random_logits(2, 0)
    ours = process(logits, rows)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 10] += -100.0
    expected[1, 3] += -2.5
    expected[1, 63] += 0.5
    assert torch.equal(ours, expected)
    sampler = create_sampler()
    with pytest.raises(ValueError, match=r"logit_bias token id 64 is outside the vocabulary \[0, 64\)"):
        sampler.validate(SamplingParams(logit_bias={64: 1.0}))
    with pytest.raises(ValueError, match=r"bad_words_token_ids token id 99 is outside the vocabulary"):
        sampler.validate(SamplingParams(bad_words_token_ids=[[1, 99]]))
    with pytest.raises(ValueError, match=r"stop_token_ids token id 64 is outside the vocabulary"):
        sampler.validate(SamplingParams(stop_token_ids=[3, 64]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"typical_p": 1.5}, r"typical_p must be in \(0, 1\], got 1.5"),
        ({"typical_p": 0.0}, r"typical_p must be in \(0, 1\], got 0.0"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0.1"),
        ({"min_p": float("nan")}, r"min_p must be in \[0, 1\], got nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number > 0, got 0.0"),
        ({"repetition_penalty": True}, "repetition_penalty must be a number > 0, got True"),
        ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\], got 2.5"),
        ({"presence_penalty": -3}, r"presence_penalty must be in \[-2, 2\], got -3"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be non-negative integer token ids, got '5'"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative integer token ids, got -1"),
        ({"logit_bias": {5: float("inf")}}, r"logit_bias\[5\] must be a finite number, got inf"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias must be a dict"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must hold non-empty lists"),
        ({"bad_words_token_ids": [[1, -2]]}, r"non-negative token ids, got \[1, -2\]"),
        ({"bad_words_token_ids": [5]}, "bad_words_token_ids must be a list of token-id lists"),
        ({"extra": {"": 1}}, "extra keys must be non-empty logits-processor names"),
        ({"extra": {"top_k": 3}}, r"extra key 'top_k' is a sampling parameter; set SamplingParams.top_k instead"),
        ({"extra": {"typical_p": 0.5}}, "extra key 'typical_p' is a sampling parameter"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0, got nan"),
    ],
)
def test_bad_processor_params_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_plugin_fields_and_processor_names():
    assert SamplingParams().logits_processor_names == () and SamplingParams().plugin_fields_used == ()
    p = SamplingParams(temperature=0.5, top_p=0.9, min_tokens=2, presence_penalty=0.1, extra={"ban_digits": True})
    assert p.logits_processor_names == ("ban_digits",)  # core's controls are no processors
    assert p.plugin_fields_used == ()
    assert SamplingParams(typical_p=0.5).plugin_fields_used == ("typical_p",)
    # typical_p switches its processor on for sampled requests only, as transformers' generate
    assert TypicalP.params_fields == ("typical_p",)
    assert TypicalP.is_enabled(SamplingParams(typical_p=0.5))
    assert not TypicalP.is_enabled(SamplingParams(typical_p=0.5, temperature=0))
    assert not TypicalP.is_enabled(SamplingParams())
    assert SamplingParams(logit_bias={1: 0.0}) == SamplingParams(logit_bias={1: 0.0})


# -- the pipeline ---------------------------------------------------------------------------


class Spy(BaseLogitsProcessor):
    """Records the requests it sees; adds its mark to the logits."""

    calls: list[tuple[str, list[str]]] = []

    def add_request(self, request_id, params, prompt_token_ids):
        self.calls.append((f"add:{self.name}", [request_id]))

    def remove_request(self, request_id):
        self.calls.append((f"remove:{self.name}", [request_id]))

    def apply(self, logits, rows):
        self.calls.append((self.name, [r.request_id for r in rows]))
        return logits.add_(1.0)


def spy(name: str, order: int, invariant: bool) -> type[Spy]:
    return type(f"Spy_{name}", (Spy,), {"name": name, "order": order, "is_argmax_invariant": invariant})


def test_pipeline_order_bands_greedy_skip_and_request_lifecycle():
    Spy.calls = []
    late, early = spy("late_trunc", 300, True), spy("early_adjust", 100, False)
    pipeline = LogitsPipeline([late(CONTEXT), early(CONTEXT)])
    assert pipeline.names == ["early_adjust", "late_trunc"]
    both = {"early_adjust": 1, "late_trunc": 1}
    greedy = SamplingRow("g", SamplingParams(temperature=0, extra=both), [1], [], EOS)
    sampled = SamplingRow("s", SamplingParams(temperature=1.0, extra=both), [1], [], EOS)
    plain = SamplingRow("p", SamplingParams(temperature=0), [1], [], EOS)

    logits = torch.zeros(3, VOCAB)
    out = pipeline.apply(logits, [greedy, sampled, plain])
    assert Spy.calls == [
        ("add:early_adjust", ["g"]),
        ("add:early_adjust", ["s"]), ("add:late_trunc", ["s"]),
        ("early_adjust", ["g", "s"]),  # one call for the rows that use it
        ("late_trunc", ["s"]),  # argmax-invariant: the greedy row skips it
    ]
    assert out[:, 0].tolist() == [1.0, 2.0, 0.0]

    Spy.calls = []  # one band at a time, as the sampler runs them
    pipeline.apply(torch.zeros(2, VOCAB), [greedy, sampled], None, 200)
    assert Spy.calls == [("early_adjust", ["g", "s"])]
    Spy.calls = []
    pipeline.apply(torch.zeros(2, VOCAB), [greedy, sampled], 300, None)
    assert Spy.calls == [("late_trunc", ["s"])]
    Spy.calls = []
    pipeline.apply(torch.zeros(2, VOCAB), [greedy, plain])  # no sampled row: late_trunc is not called at all
    assert Spy.calls == [("early_adjust", ["g"])]
    Spy.calls = []
    pipeline.apply(torch.zeros(1, VOCAB), [plain])
    assert Spy.calls == []
    pipeline.remove_request("s")
    pipeline.remove_request("p")
    assert Spy.calls == [("remove:early_adjust", ["s"]), ("remove:late_trunc", ["s"])]
    assert pipeline.num_active_requests == 1
    pipeline.remove_request("g")
    assert pipeline.num_active_requests == 0


def test_sampler_runs_every_control_in_transformers_order():
    params = SamplingParams(
        logit_bias={5: 2.0, 6: -1.0}, repetition_penalty=1.3, bad_words_token_ids=[[7], [8, 9]], min_tokens=4,
        temperature=0.8, top_k=30, top_p=0.95, min_p=0.01, typical_p=0.98, max_tokens=8,
    )
    row = SamplingRow("r", params, [5, 8, 11], [12, 8], EOS)
    logits = random_logits(1, 3)
    ours = process(logits, [row])
    theirs = hf.LogitsProcessorList([
        hf.SequenceBiasLogitsProcessor([[[5], 2.0], [[6], -1.0]]),
        hf.RepetitionPenaltyLogitsProcessor(1.3),
        hf.NoBadWordsLogitsProcessor([[7], [8, 9]]),
        hf.MinNewTokensLengthLogitsProcessor(3, 4, list(EOS)),
        hf.TemperatureLogitsWarper(0.8),
        hf.TopKLogitsWarper(30),
        hf.TopPLogitsWarper(0.95),
        hf.MinPLogitsWarper(0.01),
        hf.TypicalLogitsWarper(0.98),
    ])(input_ids(row), logits.clone())
    assert_same(ours[0], theirs[0])
    assert ours[0, 1] == ours[0, 7] == ours[0, 9] == NEG_INF


def test_pipeline_refuses_what_it_cannot_serve():
    pipeline = LogitsPipeline([TypicalP(CONTEXT)])
    assert pipeline.served_fields == {"typical_p"}
    pipeline.validate(SamplingParams(typical_p=0.5))
    empty = LogitsPipeline([])
    empty.validate(SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.2))
    with pytest.raises(ValueError, match=r"typical_p=0.5 needs a logits processor plugin that implements 'typical_p', "
                                         r"which is not loaded .*loaded processors: none"):
        empty.validate(SamplingParams(typical_p=0.5))
    with pytest.raises(ValueError, match=r"extra\['nope'\] needs the logits processor 'nope'.*loaded: typical_p"):
        pipeline.validate(SamplingParams(extra={"nope": 1}))
    with pytest.raises(ValueError, match="two logits processors are named 'typical_p'"):
        LogitsPipeline([TypicalP(CONTEXT), TypicalP(CONTEXT)])


def test_requests_joining_and_leaving_keep_their_own_state():
    """A changing batch gives each row what a fresh sampler, fed that request alone, gives."""
    sampler = create_sampler()
    params = {
        "a": SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, temperature=0),
        "b": SamplingParams(presence_penalty=1.0, logit_bias={2: 3.0}, bad_words_token_ids=[[4, 5]], temperature=0),
        "c": SamplingParams(repetition_penalty=0.8, temperature=0.9, typical_p=0.7, seed=4),
    }
    prompts = {"a": [1, 2, 2], "b": [4], "c": [5, 6, 7, 7]}
    # (step, ids in the batch): b joins at 1, a leaves after 2, a comes back (new request, same id) at 4
    schedule = [["a"], ["a", "b"], ["b", "a"], ["b", "c"], ["c", "a", "b"], ["a"]]
    outputs: dict[str, list[int]] = {}
    for step, ids in enumerate(schedule):
        if step == 3:
            sampler.remove_request("a")
            outputs.pop("a")
            prompts["a"] = [9, 9, 3]
        rows = [SamplingRow(i, params[i], prompts[i], outputs.setdefault(i, []), EOS) for i in ids]
        logits = random_logits(len(rows), 100 + step)
        out = sampler.process(logits.clone(), rows)
        for k, row in enumerate(rows):
            fresh_row = SamplingRow(row.request_id, row.params, row.prompt_token_ids, list(row.output_token_ids), EOS)
            assert torch.equal(out[k], process(logits[k : k + 1], [fresh_row])[0]), (step, row.request_id)
        for k, row in enumerate(rows):
            row.output_token_ids.append(int(out[k].argmax()))
    assert sampler.pipeline.num_active_requests == 3
    for request_id in ["a", "b", "c"]:
        sampler.remove_request(request_id)
    assert sampler.pipeline.num_active_requests == 0


def test_typical_p_passes_the_conformance_check():
    check_logits_processor(TypicalP, [SamplingParams(typical_p=p) for p in (0.3, 0.9)])


# -- sampling from the processed distribution ---------------------------------------------------

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                       9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    kept = probs > 0
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def test_seeded_samples_follow_the_processed_distribution():
    context = LogitsProcessorContext(vocab_size=16, eos_token_ids=EOS)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.97, repetition_penalty=1.3, seed=1234, max_tokens=8)
    row = SamplingRow("chi", params, [0, 3, 5], [], EOS)
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(5)) * 1.5
    sampler, num_draws = create_sampler(context), 5000
    probs = sampler.process(logits.clone(), [row])[0].softmax(-1)
    num_kept = int((probs > 0).sum())
    assert 3 <= num_kept <= 10  # the truncations cut something, several tokens remain
    counts = torch.zeros(16)
    for i in range(num_draws):  # a seed's draws at one position are fixed (position_seed): vary the seed
        out = sampler(logits.clone(), [SamplingRow("chi", replace(params, seed=1234 + i), [0, 3, 5], [], EOS)])
        counts[out.token_ids[0]] += 1
    assert torch.equal(out.processed[0].softmax(-1), probs)
    assert counts[probs == 0].sum() == 0, "a truncated token was sampled"
    statistic = chi_square(counts, probs)
    assert statistic < CHI2_CRITICAL_0_001[num_kept - 1], statistic
    # the test has power: the unprocessed distribution is clearly rejected
    raw = logits[0].softmax(-1) * (probs > 0)
    assert chi_square(counts, raw / raw.sum()) > 10 * CHI2_CRITICAL_0_001[num_kept - 1]


def test_seeded_sampling_ignores_batch_mates():
    """The same seeded request, alone or among others that join and leave (greedy,
    unseeded, other seeds, other processors), samples the same tokens."""

    def run(mates_schedule: list[list[SamplingParams]]) -> list[int]:
        sampler = create_sampler()
        target = SamplingParams(seed=7, temperature=0.9, top_k=20, top_p=0.9, frequency_penalty=0.5, max_tokens=32)
        row = SamplingRow("target", target, [1, 2, 3], [], EOS)
        mate_outputs: dict[str, list[int]] = {}
        for step, mates in enumerate(mates_schedule):
            rows = [SamplingRow(f"m{step % 3}-{k}", p, [4, 5], mate_outputs.setdefault(f"m{step % 3}-{k}", []), EOS)
                    for k, p in enumerate(mates)]
            rows.insert(len(rows) // 2, row)
            # logits are a function of the request and step only, as a model's would be
            logits = torch.stack([random_logits(1, hash((r.request_id, step)) % 10_000)[0] for r in rows])
            out = sampler(logits, rows)
            for r, token in zip(rows, out.token_ids):
                r.output_token_ids.append(token)
        return list(row.output_token_ids)

    alone = run([[] for _ in range(12)])
    mates = [SamplingParams(temperature=0), SamplingParams(temperature=1.2, seed=3, min_p=0.1),
             SamplingParams(temperature=0.5, repetition_penalty=1.4), SamplingParams(typical_p=0.5)]
    crowded = run([mates[: step % 5] for step in range(12)])
    assert alone == crowded
    assert len(set(alone)) > 3  # it really sampled


# -- plugins: discovery, the example's ban_digits, the engine ----------------------------------


def test_typical_p_is_discovered_and_disabling_it_breaks_only_typical_p():
    pm = create_plugin_manager()
    registry = pm.registries.logits_processors
    assert registry.get("typical_p") is TypicalP and registry.owner("typical_p") == "logits_typical"
    for name in ("temperature", "top_k", "top_p", "min_p", "logit_bias", "repetition_penalty"):
        assert name not in registry  # core's own: no plugin can take them away
    # disabling the plugin makes the requests that set typical_p fail clearly, and only those
    pm = create_plugin_manager(disabled=["logits_typical"])
    assert "typical_p" not in pm.registries.logits_processors
    sampler = Sampler(VOCAB, pipeline=LogitsPipeline.from_registry(pm.registries.logits_processors, CONTEXT))
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=1)
    sampler.validate(params)
    out = sampler(random_logits(1, 0), [SamplingRow("t", params, [1], [], EOS)])
    assert out.processed.isinf().sum() >= VOCAB - 5  # top-k ran
    with pytest.raises(ValueError, match=r"typical_p=0.5 needs a logits processor plugin .*not loaded"):
        sampler.validate(SamplingParams(typical_p=0.5))


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return ember.LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, block_size=4)


def digit_ids(tokenizer) -> list[int]:
    return [i for i in range(len(tokenizer)) if any(c.isdigit() for c in tokenizer.decode([i]))]


def test_example_ban_digits_is_discovered_and_only_changes_requests_that_ask(tiny_llm):
    from ember_legacy_llama.ban_digits import BanDigits

    pm = create_plugin_manager(required=["legacy_llama"])
    assert pm.registries.logits_processors.get("ban_digits") is BanDigits
    assert pm.registries.logits_processors.owner("ban_digits") == "legacy_llama"
    engine = tiny_llm.engine
    assert "ban_digits" in engine.logits_pipeline.names

    tokenizer = engine.tokenizer
    digits = digit_ids(tokenizer)
    odd = [i for i in digits if any(c in "13579" for c in tokenizer.decode([i]))]
    # push digits to the top, so that without the processor the text is digits
    bias = {i: 30.0 for i in digits}
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias)
    banned = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias, extra={"ban_digits": True})
    odd_banned = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias,
                                extra={"ban_digits": "13579"})
    prompts = ["count: 1 2 3", "hello", "numbers"]
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, plain)]
    together = tiny_llm.generate(prompts * 3, [plain] * 3 + [banned] * 3 + [odd_banned] * 3)
    ids = [o.outputs[0].token_ids for o in together]
    assert ids[:3] == alone  # requests that did not ask are untouched by their batch mates'
    assert all(set(out) <= set(digits) for out in alone)
    for out in ids[3:6]:
        assert out and not set(out) & set(digits)
    for out in ids[6:]:
        assert set(out) <= set(digits) - set(odd) and out
    # finished requests leave the pipeline at the next step (the scheduler hands their ids
    # to the runner then): afterwards only that step's own request is left
    tiny_llm.generate("x", SamplingParams(temperature=0, max_tokens=1))
    assert engine.logits_pipeline.num_active_requests <= 1
    check_logits_processor(
        BanDigits, [SamplingParams(extra={"ban_digits": True}), SamplingParams(extra={"ban_digits": "05"})],
        LogitsProcessorContext(len(tokenizer), EOS, tokenizer),
    )
    with pytest.raises(ValueError, match=r"extra\['ban_digits'\] must be true or a string of digits, got 'x'"):
        tiny_llm.generate("hi", SamplingParams(extra={"ban_digits": "x"}))
    with pytest.raises(ValueError, match=r"extra\['no_such'\] needs the logits processor 'no_such'"):
        tiny_llm.generate("hi", SamplingParams(extra={"no_such": True}))


def test_engine_greedy_with_processors_matches_transformers_generate(tiny_llm, tiny_llama_dir):
    """Penalties, bad words, logit bias and min_tokens through the whole engine give
    transformers' greedy tokens on the same weights."""
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    tokenizer = tiny_llm.engine.tokenizer
    cases = [
        (dict(repetition_penalty=1.6), dict(repetition_penalty=1.6)),
        (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
        (dict(bad_words_token_ids=[[100], [101, 102]], logit_bias={100: 9.0, 50: 4.0}),
         dict(bad_words_ids=[[100], [101, 102]], sequence_bias=[[[100], 9.0], [[50], 4.0]])),
    ]
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    for ours, theirs in cases:
        got = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **ours))
        expected = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, pad_token_id=0,
                                     **theirs)[0, len(ids):].tolist()
        assert got[0].outputs[0].token_ids == expected, ours
    plain = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    penalized = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                         repetition_penalty=1.6))
    assert plain[0].outputs[0].token_ids != penalized[0].outputs[0].token_ids  # the penalty did something
