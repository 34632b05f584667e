"""Built-in tool-call parsers (the contract is `ember.plugin.tool_parser`): ``hermes``
(``<tool_call>`` JSON: Qwen2.5, Hermes, SmolLM2 and other ChatML templates) and
``llama3_json`` (Llama 3.1/3.2's JSON calls), each its own plugin
(``tool_parser_hermes``, ``tool_parser_llama3_json``)."""
