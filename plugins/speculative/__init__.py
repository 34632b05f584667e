"""Built-in speculators (docs/speculative.md), each a plugin in the ``ember``
entry-point group: ``ngram`` (prompt lookup), ``draft_model`` (a smaller model with
the target's tokenizer) and ``medusa`` (heads on the target's hidden state)."""
