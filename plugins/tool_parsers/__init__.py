"""Built-in tool-call parsers (the contract is `ember.plugin.tool_parser`), each its own
plugin (``tool_parser_<name>``): ``hermes`` (``<tool_call>`` JSON: Qwen2.5, Hermes, SmolLM2
and other ChatML templates), ``llama3_json`` (Llama 3.1/3.2's JSON calls), ``mistral``
(``[TOOL_CALLS]``), ``pythonic`` (Llama 3.2/4's ``[f(k=v)]``), ``granite``
(``<|tool_call|>``) and ``qwen3_coder`` (Qwen3-Coder's XML)."""
