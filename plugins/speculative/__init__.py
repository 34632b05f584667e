"""Built-in speculators (docs/speculative.md), each a plugin in the ``ember``
entry-point group: ``ngram`` (prompt lookup) and ``draft_model`` (a smaller model with
the target's tokenizer)."""
