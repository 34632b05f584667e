"""The engine: what callers hold, and the loop that turns requests into outputs.

Module map:
    llm               LLM: the offline API (generate, chat, stream, beam search)
    llm_engine        LLMEngine: input processor + engine core + output processor in the caller's thread
    async_engine      AsyncLLMEngine: the EngineClient the HTTP server uses; the core in a thread or a process
    client            EngineClient (the narrow interface the API uses), ModelInfo, EngineStats
    core              EngineCore: plugins, backend, model, KV sizing, scheduler, runner; one step at a time
    core_process      EngineCoreProcess: the engine core in its own process over a pipe
    input_processor   validation once, in the caller's thread or process (tokenize, fit, sampling params)
    output_processor  step outputs -> RequestOutput: detokenization, stop strings, logprobs, n/best_of
    parallel_sampling n / best_of: child requests of one prompt
    beam_search       BeamSearchParams and the beam search over LLMEngine
    grammar_manager   grammar compiles off the step, waiting requests, one matcher per constrained request
    grammar_workers   grammar compiles in worker processes (priority, limits, killed at the timeout)
    grammar_guard     per constrained request: the closing budget, the repetition bound, reasoning before the grammar
    speculative       SpeculativeDecoder: asks the speculator for drafts and learns from what was accepted
    tool_calls        tools on a chat: checks, forced calls through a grammar, the chat template
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

# `from ember.engine import LLMEngine` (this package was the LLMEngine module): imported
# on first use, so that importing one module of the package pulls in no other.
_EXPORTS = {"LLMEngine": "ember.engine.llm_engine", "LLM": "ember.engine.llm"}

if TYPE_CHECKING:
    from ember.engine.llm import LLM
    from ember.engine.llm_engine import LLMEngine

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
