"""Ember's built-in logits processors, three plugins registered through Ember's own
`ember` entry points (pyproject.toml), exactly as a third party registers theirs:

- ``logits_masks`` (:mod:`.masks`): logit_bias, bad_words, min_tokens;
- ``logits_penalties`` (:mod:`.penalties`): repetition_penalty, frequency_presence_penalty;
- ``logits_warpers`` (:mod:`.warpers`): temperature, top_k, top_p, min_p, typical_p.

The contract they implement is :class:`ember.logits_processor.BaseLogitsProcessor`.
"""
