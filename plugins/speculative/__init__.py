"""Built-in speculators (docs/speculative.md), each a plugin in the ``ember``
entry-point group: ``ngram`` (prompt lookup)."""
