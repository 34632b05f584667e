"""Ember's built-in logits-processor plugin, registered through Ember's own `ember`
entry points (pyproject.toml), exactly as a third party registers theirs:

- ``logits_typical`` (:mod:`.typical`): ``typical_p``.

The other standard controls (temperature, top-k, top-p, min-p, penalties,
logit_bias, bad words, min_tokens) are core's own (:mod:`ember.worker.sampler`). The
contract is :class:`ember.plugin.logits_processor.BaseLogitsProcessor`.
"""
