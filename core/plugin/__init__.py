"""Ember's plugin system, and every contract a third party may implement.

One pluggy PluginManager loads the `ember` entry-point group; hooks fill one typed
registry per kind. Module map:
    hookspecs          every hook a plugin can implement (their docstrings are the docs); RouteContext
    manager            create_plugin_manager: discovery, required vs discovered, blocking, rollback
    registry           Registry, Registries: one per kind, with the owner of each name
    api_version        API_VERSION and the range a plugin declares (EMBER_PLUGIN_API)
    backend            hardware backends: BaseBackend, BaseAttention, AttentionBatch, graph capture
    backend_options    BackendOptions: a backend's typed, documented tuning knobs
    quantizer          BaseQuantizer, QuantizedWeight, QuantizedLinearOp
    quantized_weights  the portable packed forms (integer grids, NF4, FP8)
    speculator         BaseSpeculator, SpecRequest, Proposal, SpeculatorContext
    grammar            BaseGrammarBackend, its compiled grammars and matchers (constraints: ember.constraint)
    grammar_vocab      a tokenizer's tokens as bytes, for grammar backends
    tool_parser        BaseToolParser
    reasoning_parser   BaseReasoningParser: reasoning (<think>) kept apart from the answer
    logits_processor   BaseLogitsProcessor, SamplingRow, LogitsProcessorContext
    adapter            BaseAdapterKind, AdapterUpdate, AdapterWeights: adapters served beside the model (LoRA)
Model architectures follow ``ember.models.base``; ``ember.testing`` checks each kind.
"""

from ember.plugin.api_version import API_VERSION
from ember.plugin.hookspecs import hookimpl, hookspec
from ember.plugin.manager import PluginInfo, PluginLoadError, create_plugin_manager, get_registries
from ember.plugin.registry import Registries, Registry

__all__ = [
    "API_VERSION",
    "hookimpl",
    "hookspec",
    "PluginInfo",
    "PluginLoadError",
    "Registries",
    "Registry",
    "create_plugin_manager",
    "get_registries",
]
