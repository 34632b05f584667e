"""Conformance checks a plugin author runs against their own implementation.

    from ember.testing import check_backend, check_logits_processor
    check_backend(MyBackend)   # AssertionError naming the first broken rule
    check_logits_processor(MyProcessor, [SamplingParams(extra={"my_processor": 1})])
    check_grammar_backend(MyGrammarBackend)
    check_tool_parser(MyToolParser)
    check_reasoning_parser(MyReasoningParser)
    check_quantizer(MyQuantizer(config), tensors_of_one_linear, backend=MyBackend())
    check_speculator(MySpeculator, tmp_path)
    check_adapter_kind(MyAdapterKind, tmp_path)
"""

from ember.testing.adapter_conformance import check_adapter_kind
from ember.testing.backend_conformance import (
    check_attention, check_backend, check_backend_basics, check_end_to_end, check_graph_attention,
)
from ember.testing.grammar_conformance import check_grammar_backend
from ember.testing.logits_processor_conformance import check_logits_processor
from ember.testing.quantizer_conformance import (
    check_quantized_linear_op, check_quantized_weight, check_quantizer,
)
from ember.testing.reasoning_parser_conformance import check_reasoning_parser
from ember.testing.speculator_conformance import check_speculator
from ember.testing.tool_parser_conformance import check_tool_parser

__all__ = [
    "check_adapter_kind", "check_attention", "check_backend", "check_backend_basics", "check_end_to_end",
    "check_grammar_backend", "check_graph_attention", "check_logits_processor", "check_quantized_linear_op",
    "check_quantized_weight", "check_quantizer", "check_reasoning_parser", "check_speculator", "check_tool_parser",
]
