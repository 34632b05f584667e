"""ember.testing.check_speculator: Ember's own speculators pass it (n-gram, a draft
model, Medusa heads, an EAGLE head, each on a tiny random Llama), and speculators
that break a rule of the contract fail it with that rule named."""

from __future__ import annotations

import pytest
from test_speculative import _medusa_heads
from test_speculative_eagle import write_eagle_head
from tiny_models import make_tiny_model

from ember.plugin.speculator import BaseSpeculator, Proposal
from ember.plugins.speculative.draft_model import DraftModelSpeculator
from ember.plugins.speculative.eagle import EagleSpeculator
from ember.plugins.speculative.medusa import MedusaSpeculator
from ember.plugins.speculative.ngram import NgramSpeculator
from ember.testing import check_speculator


def test_ngram_conforms(tmp_path):
    check_speculator(NgramSpeculator, tmp_path, config={"prompt_lookup_max": 3})


def test_a_draft_model_conforms(tmp_path):
    make_tiny_model("llama", tmp_path / "draft", seed=11, num_hidden_layers=1)
    check_speculator(DraftModelSpeculator, tmp_path, config={"model": str(tmp_path / "draft")})


def test_medusa_heads_conform(tmp_path):
    target = tmp_path / "target"
    hf = make_tiny_model("llama", target, seed=3)
    _medusa_heads(tmp_path / "heads", hf.config.hidden_size, hf.config.vocab_size)
    # random heads may never be right, but they always propose
    check_speculator(MedusaSpeculator, tmp_path, model_dir=target,
                     config={"model": str(tmp_path / "heads"), "num_speculative_tokens": 3})


def test_an_eagle_head_conforms(tmp_path):
    target = tmp_path / "target"
    hf = make_tiny_model("llama", target, seed=3)
    write_eagle_head(tmp_path / "eagle", hf)
    check_speculator(EagleSpeculator, tmp_path, model_dir=target,
                     config={"model": str(tmp_path / "eagle"), "num_speculative_tokens": 3})


class _TooMany(BaseSpeculator):
    name = "too-many"

    def propose(self, requests):
        return [Proposal([7] * (r.max_drafts + 1)) for r in requests]


class _Meddling(BaseSpeculator):
    name = "meddling"

    def propose(self, requests):
        for r in requests:
            r.output_token_ids.append(7)
        return [Proposal([]) for _ in requests]


class _Silent(BaseSpeculator):
    name = "silent"

    def propose(self, requests):
        return [Proposal([]) for _ in requests]


@pytest.mark.parametrize("cls,message", [
    (_TooMany, r"5 drafts offered 4 \(max_drafts\)"),
    (_Meddling, "changed the request's token lists"),
    (_Silent, "proposed no draft"),
])
def test_a_speculator_breaking_a_rule_fails_with_the_rule_named(cls, message, tmp_path):
    with pytest.raises(AssertionError, match=message):
        check_speculator(cls, tmp_path, num_tokens=8)


def test_what_is_not_a_speculator_is_named(tmp_path):
    with pytest.raises(AssertionError, match="is not a BaseSpeculator"):
        check_speculator(object, tmp_path)
