"""The example plugin's hooks: an architecture name and a logits processor.

1. Checkpoints converted with the first Hugging Face Llama scripts carry
   ``"architectures": ["LLaMAForCausalLM"]`` in config.json. Their weights and config
   fields are those of ``LlamaForCausalLM`` (vLLM maps both names to one class), so
   registering the old name for Ember's own model class is all it takes.
2. ``ban_digits`` (see ban_digits.py), a logits processor a request switches on with
   ``extra={"ban_digits": true}``.

Keep this module cheap to import: Ember imports it whenever it builds its plugin
manager (``ember plugins`` included).
"""

from __future__ import annotations

from ember.models.llama import LlamaForCausalLM
from ember.plugin import Registry, hookimpl
from ember_legacy_llama.ban_digits import BanDigits

# the Ember plugin API versions this plugin was written for (docs/plugins.md); Ember
# refuses to load it under a version outside the range
EMBER_PLUGIN_API = ">=1.0,<2"

LEGACY_ARCHITECTURES = ("LLaMAForCausalLM",)


@hookimpl
def ember_register_model_architectures(registry: Registry) -> None:
    for name in LEGACY_ARCHITECTURES:
        registry.register(name, LlamaForCausalLM)


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    registry.register(BanDigits.name, BanDigits)
