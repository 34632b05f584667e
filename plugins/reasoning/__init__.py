"""Built-in reasoning parsers (the contract is `ember.plugin.reasoning_parser`):
``deepseek_r1`` and ``qwen3``, the ``<think>...</think>`` syntax, in one plugin
(``reasoning_think``)."""
