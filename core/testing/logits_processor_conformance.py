"""Conformance check for logits processors: does a :class:`BaseLogitsProcessor` keep the
contract in :mod:`ember.plugin.logits_processor`? Ember runs it against its built-ins; a third
party runs it against theirs::

    from ember import SamplingParams
    from ember.testing import check_logits_processor

    def test_my_processor_conforms():
        check_logits_processor(MyProcessor, [SamplingParams(extra={"my_proc": 1}), ...])

``params`` are requests that switch the processor on (``cls.is_enabled(params)``: by
default, its name is a key of ``extra``), preferably with different parameters. Raises AssertionError describing
the first broken rule.
"""

from __future__ import annotations

import torch

from ember.plugin.logits_processor import BaseLogitsProcessor, LogitsProcessorContext, SamplingRow
from ember.sampling_params import PLUGIN_FIELDS, SamplingParams

VOCAB_SIZE = 64


def check_logits_processor(
    cls: type[BaseLogitsProcessor],
    params: list[SamplingParams],
    context: LogitsProcessorContext | None = None,
    num_steps: int = 3,
    seed: int = 0,
) -> None:
    """Run ``cls`` over a few steps of a batch of ``params`` and check the rules:
    the class attributes (``params_fields`` only of ``PLUGIN_FIELDS``: core implements
    the rest); ``validate`` accepts them; ``apply`` keeps shape and dtype,
    makes no NaN, leaves every row a finite logit, and changes no argmax when it says
    it is argmax-invariant; a row's result does not depend on its batch mates (nor
    on their order); requests join and leave without disturbing the others."""
    assert isinstance(cls, type) and issubclass(cls, BaseLogitsProcessor), f"{cls!r} is not a BaseLogitsProcessor"
    assert isinstance(getattr(cls, "name", None), str) and cls.name, f"{cls.__name__}.name must be a non-empty str"
    assert isinstance(cls.order, int), f"{cls.__name__}.order must be an int"
    assert isinstance(cls.is_argmax_invariant, bool), f"{cls.__name__}.is_argmax_invariant must be a bool"
    fields = cls.params_fields
    assert isinstance(fields, tuple) and all(isinstance(f, str) for f in fields), (
        f"{cls.__name__}.params_fields must be a tuple of SamplingParams field names"
    )
    assert set(fields) <= set(PLUGIN_FIELDS), (
        f"{cls.__name__}.params_fields {fields} names fields core implements itself; plugins may implement "
        f"{PLUGIN_FIELDS}"
    )
    assert params, "give at least one SamplingParams that switches the processor on"
    context = context or LogitsProcessorContext(vocab_size=VOCAB_SIZE, eos_token_ids=(1,))
    vocab = context.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, p in enumerate(params):
        assert cls.name in p.extra or set(cls.params_fields) & set(p.plugin_fields_used), (
            f"params[{i}] does not name {cls.name!r} (an extra key {cls.name!r} or a field of its params_fields): "
            "the pipeline asks is_enabled only of the processors a request names"
        )
        assert cls.is_enabled(p) is True, f"params[{i}] does not switch {cls.name!r} on (is_enabled)"
        cls(context).validate(p)
        prompt = torch.randint(0, vocab, (3 + i,), generator=gen).tolist()
        rows.append(SamplingRow(f"req-{i}", p, prompt, [], context.eos_token_ids))

    batched, alone = cls(context), {row.request_id: cls(context) for row in rows}
    for row in rows:
        batched.add_request(row.request_id, row.params, row.prompt_token_ids)
        alone[row.request_id].add_request(row.request_id, row.params, row.prompt_token_ids)
    for step in range(num_steps):
        logits = torch.randn(len(rows), vocab, generator=gen) * 4
        out = batched.apply(logits.clone(), rows)
        _check_output(cls, logits, out, step)
        if len(rows) > 1:  # reversed order: same rows, other positions
            flipped = batched.apply(logits.clone().flip(0), rows[::-1]).flip(0)
            assert torch.equal(_canon(flipped), _canon(out)), f"{cls.name}: a row's result depends on its position"
        for i, row in enumerate(rows):
            single = alone[row.request_id].apply(logits[i : i + 1].clone(), [row])
            assert torch.equal(_canon(single[0]), _canon(out[i])), (
                f"{cls.name}: row {i} (step {step}) differs when its batch mates change"
            )
        for i, row in enumerate(rows):  # the step's tokens join the outputs, as the engine appends them
            row.output_token_ids.append(int(out[i].argmax()))
    for row in rows:
        batched.remove_request(row.request_id)
    # a request id may come back (a new request reusing it): it starts afresh
    row = SamplingRow(rows[0].request_id, rows[0].params, rows[0].prompt_token_ids, [], context.eos_token_ids)
    batched.add_request(row.request_id, row.params, row.prompt_token_ids)
    fresh = cls(context)
    fresh.add_request(row.request_id, row.params, row.prompt_token_ids)
    logits = torch.randn(1, vocab, generator=gen)
    assert torch.equal(_canon(batched.apply(logits.clone(), [row])), _canon(fresh.apply(logits.clone(), [row]))), (
        f"{cls.name}: state of a removed request leaked into a new one with the same id"
    )
    batched.remove_request(row.request_id)


def _check_output(cls: type[BaseLogitsProcessor], logits: torch.Tensor, out: torch.Tensor, step: int) -> None:
    where = f"{cls.name} (step {step})"
    assert isinstance(out, torch.Tensor), f"{where}: apply returned {type(out).__name__}, not a tensor"
    assert out.shape == logits.shape and out.dtype == logits.dtype, (
        f"{where}: apply returned {tuple(out.shape)} {out.dtype}, expected {tuple(logits.shape)} {logits.dtype}"
    )
    assert not out.isnan().any(), f"{where}: apply made NaN logits"
    assert out.isfinite().any(dim=-1).all(), f"{where}: apply left a row without any finite logit"
    if cls.is_argmax_invariant:
        assert torch.equal(out.argmax(-1), logits.argmax(-1)), f"{where}: says argmax-invariant, changed an argmax"


def _canon(t: torch.Tensor) -> torch.Tensor:
    """Compare -inf fills and values alike (NaN never occurs: checked above)."""
    return t.nan_to_num(neginf=-1e30, posinf=1e30)
