"""The module names of Ember 0.1's flat core, kept importable after core/ got rooms by
duty (docs/architecture.md): ``import ember.scheduler`` gives the module object that
``ember.sched.scheduler`` is (same classes, so ``isinstance`` and registries agree), with a
DeprecationWarning naming the new place. docs/plugins.md says how long they stay.
(``ember.engine`` needs no alias: the package of that name still exports ``LLMEngine``.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name -> where the module lives now
MOVED = {
    "ember.async_engine": "ember.engine.async_engine",
    "ember.engine_client": "ember.engine.client",
    "ember.engine_core": "ember.engine.core",
    "ember.input_processor": "ember.engine.input_processor",
    "ember.output_processor": "ember.engine.output_processor",
    "ember.llm": "ember.engine.llm",
    "ember.parallel_sampling": "ember.engine.parallel_sampling",
    "ember.beam_search": "ember.engine.beam_search",
    "ember.grammar_manager": "ember.engine.grammar_manager",
    "ember.tool_calls": "ember.engine.tool_calls",
    "ember.scheduler": "ember.sched.scheduler",
    "ember.kv_cache_manager": "ember.sched.kv_cache_manager",
    "ember.step": "ember.sched.step",
    "ember.model_runner": "ember.worker.model_runner",
    "ember.sampler": "ember.worker.sampler",
    "ember.graphs": "ember.worker.graphs",
    "ember.kv_sizing": "ember.worker.kv_sizing",
    "ember.logits_processor": "ember.plugin.logits_processor",
    "ember.backend": "ember.plugin.backend",
    "ember.quantization": "ember.plugin.quantizer",
    "ember.quantized_weights": "ember.plugin.quantized_weights",
    "ember.speculative": "ember.plugin.speculator",
    "ember.grammar": "ember.plugin.grammar",
    "ember.grammar_vocab": "ember.plugin.grammar_vocab",
    "ember.tool_parser": "ember.plugin.tool_parser",
    "ember.model_loader": "ember.models.loader",
    "ember.tokenizer": "ember.models.tokenizer",
    "ember.parallel.state": "ember.models.parallel.state",
    "ember.parallel.layers": "ember.models.parallel.layers",
    "ember.parallel.model": "ember.models.parallel.model",
    "ember.parallel.pipeline": "ember.models.parallel.pipeline",
    "ember.parallel.loader": "ember.models.parallel.loader",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new_name}; the old name is an alias (docs/plugins.md)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new_name)

    def exec_module(self, module) -> None:
        """The module ran when it was imported under its new name."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers only for the names in `MOVED`."""

    def find_spec(self, fullname, path=None, target=None):
        new_name = MOVED.get(fullname)
        return None if new_name is None else importlib.util.spec_from_loader(fullname, _AliasLoader(new_name))


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
