"""Built-in speculators (docs/speculative.md), each a plugin in the ``ember``
entry-point group: ``ngram`` (prompt lookup), ``draft_model`` (a smaller model with
the target's tokenizer), ``medusa`` (heads on the target's hidden state), ``eagle`` (an
EAGLE-1 draft layer) and ``suffix`` (suffix decoding: suffix trees over the request's
tokens and earlier responses)."""
