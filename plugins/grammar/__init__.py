"""Built-in grammar backends: ``outlines`` (outlines-core, the default) and ``xgrammar``,
each its own plugin (``grammar_outlines``, ``grammar_xgrammar``) so that either can be
disabled or missing without the other. The contract is `ember.plugin.grammar`; docs/grammar.md
says what each backend supports and refuses."""
