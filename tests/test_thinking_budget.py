"""The thinking_budget logits processor: a reasoning model's thinking ends after its
budget of tokens (the end tag forced token by token), then the answer follows; nothing
changes before the budget, after the tag, or for an answer that does not open with the
start tag. Also through /v1/messages' `thinking.budget_tokens` (tests/test_api_anthropic.py)."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from ember.plugin.logits_processor import LogitsProcessorContext, SamplingRow
from ember.plugins.logits.thinking_budget import ThinkingBudget
from ember.testing import check_logits_processor

END = [7, 8, 9]


def _params(**spec) -> SamplingParams:
    return SamplingParams(extra={"thinking_budget": spec})


def test_conforms():
    check_logits_processor(ThinkingBudget, [_params(budget=0, end_token_ids=END), _params(budget=2, end_token_ids=[5]),
                                            _params(budget=1, start_token_ids=[3], end_token_ids=END)])


def _forced(spec: dict, output: list[int]) -> int | None:
    """The token forced after ``output`` (None: the logits are left alone)."""
    import torch

    proc = ThinkingBudget(LogitsProcessorContext(vocab_size=16))
    params = _params(**spec)
    proc.add_request("r", params, [1, 2])
    logits = torch.zeros(1, 16)
    out = proc.apply(logits, [SamplingRow("r", params, [1, 2], output)])
    finite = torch.isfinite(out[0]).nonzero().flatten().tolist()
    return None if len(finite) == 16 else finite[0] if len(finite) == 1 else pytest.fail(f"{finite}")


def test_the_end_tag_is_forced_after_the_budget_token_by_token():
    spec = {"budget": 3, "end_token_ids": END}
    assert _forced(spec, [1, 1]) is None  # under budget
    assert _forced(spec, [1, 1, 1]) == 7
    assert _forced(spec, [1, 1, 1, 7]) == 8  # the tag goes on where it stands
    assert _forced(spec, [1, 1, 1, 7, 8]) == 9
    assert _forced(spec, [1, 1, 1, 7, 8, 9]) is None  # ended: the answer is free
    assert _forced(spec, [7, 8, 9, 1, 1, 1, 1]) is None  # ended early by the model
    assert _forced(spec, [1, 7, 1, 1, 7]) == 8


def test_a_start_tag_counts_from_after_it_and_only_when_the_answer_opens_with_it():
    spec = {"budget": 2, "start_token_ids": [3, 4], "end_token_ids": END}
    assert _forced(spec, [3, 4, 1]) is None
    assert _forced(spec, [3, 4, 1, 1]) == 7
    assert _forced(spec, [1, 1, 1, 1, 1]) is None  # no reasoning section
    assert _forced(spec, [3]) is None


@pytest.mark.parametrize(("spec", "words"), [
    ({"budget": -1, "end_token_ids": END}, "budget must be an integer >= 0"),
    ({"budget": 2}, "needs the end tag"),
    ({"budget": 2, "end_token_ids": [99]}, "end_token_ids must be a non-empty list of token ids below 16"),
    ({"budget": 2, "end": "</think>"}, "needs the model's tokenizer"),
    ({"budget": 2, "end_token_ids": END, "nope": 1}, "unknown keys ['nope']"),
])
def test_bad_parameters_are_named(spec, words):
    with pytest.raises(ValueError) as info:
        ThinkingBudget(LogitsProcessorContext(vocab_size=16)).validate(_params(**spec))
    assert words in str(info.value)


def test_in_the_engine_with_tags_as_text(tiny_llama_dir):
    """A greedy answer of the tiny model is cut after 6 tokens of "reasoning", the end tag
    written, then the answer goes on; the same request without the processor is the
    untouched continuation, identical for the first 6 tokens."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    plain = llm.generate("hello", SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    budget = SamplingParams(max_tokens=24, temperature=0, extra={"thinking_budget": {"budget": 6, "end": "</think>"}})
    cut = llm.generate("hello", budget)[0].outputs[0]
    assert cut.token_ids[:6] == plain.token_ids[:6]
    assert "</think>" not in plain.text and "</think>" in cut.text
    assert cut.text.index("</think>") == len(llm.get_tokenizer().decode(plain.token_ids[:6])), cut.text
    assert len(cut.token_ids) == 24  # the answer goes on after the tag
    with pytest.raises(ValueError, match="thinking_budget.budget"):
        llm.generate("hello", SamplingParams(max_tokens=4, extra={"thinking_budget": {"budget": "x", "end": "</think>"}}))
