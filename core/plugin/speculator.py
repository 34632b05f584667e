"""Speculative decoding: the speculator plugin contract. Its configuration is
`ember.config.SpeculativeConfig`; the engine-side driver that asks a speculator for
draft tokens each step and learns from what the target model accepted is
`ember.engine.speculative.SpeculativeDecoder`.

A speculator proposes up to ``k`` tokens to follow each decoding request's last
token. The engine computes them as ``k`` extra query positions of the next step
(``ember.sched.step``'s draft slot) and the model runner verifies them: for a greedy
request it keeps the longest prefix the target's argmax agrees with, plus the
target's next token; for a sampled one it runs rejection sampling — draft ``d`` at a
position is kept with probability ``min(1, p(d) / q(d))`` (``p`` the target's
distribution there, after every processor; ``q`` the one the speculator drew ``d``
from), and the first rejected position draws from the normalised residual
``max(0, p - q)`` — so every emitted token is distributed exactly as without
speculation. A speculator that proposes deterministically (n-gram lookup, argmax
heads) has a point mass for ``q``: ``d`` is kept with probability ``p(d)``, which the
runner does by drawing from ``p`` and comparing.

Rejected positions leave nothing behind: the scheduler counts only accepted
positions as computed (their KV slots are overwritten by the next step and never
hashed into the prefix cache), and logits processors and grammar matchers advance
by emitted tokens only.

Plugins register speculators through the ``ember_register_speculators`` hook:

    class MySpeculator(BaseSpeculator):
        name = "mine"
        def propose(self, requests): ...

    @hookimpl
    def ember_register_speculators(registry):
        registry.register("mine", MySpeculator)

``ember.testing.check_speculator`` checks one against this contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ember.config import SpeculativeConfig  # noqa: F401  (its home before ember.config; plugins import it from here)


@dataclass(slots=True)
class SpecRequest:
    """A decoding request a speculator may propose for. The token lists are the
    engine's own: read them, never change them."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    max_drafts: int  # propose at most this many
    temperature: float  # the request's sampling temperature (0: greedy)
    # the target model's hidden state at the request's last token, (hidden,), when
    # the speculator asks for it (uses_hidden_states) and it is known, else None
    hidden: torch.Tensor | None = None
    # the request's seed: a speculator that samples draws the draft for output token
    # i from a generator of its own seeded with ember.worker.sampler.position_seed(seed, i,
    # stream) (a stream number of its own, 3 and up), so that seeded requests stay
    # reproducible whatever else shares their steps
    seed: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one request, and, for tokens that were sampled, the
    distributions they were drawn from: ``probs[j]`` is ``q`` over the vocabulary at
    draft position ``j`` (float32, sums to 1). None: each draft is a point mass (a
    deterministic proposal)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class SpeculatorContext:
    """What a speculator may use, given once at construction."""

    config: SpeculativeConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # the target's model directory, its transformers config, dtype and backend (a
    # draft model runs on the same backend), its loaded model (heads read its hidden
    # states and share its LM head) and the model-architecture registry
    model_dir: Any = None
    hf_config: Any = None
    dtype: torch.dtype | None = None
    backend: Any = None
    target_model: Any = None
    architectures: Any = None
    tokenizer: Any = None


class BaseSpeculator(ABC):
    """Proposes draft tokens for a batch of decoding requests.

    Invariants: ``propose`` returns at most ``request.max_drafts`` tokens per
    request, each a token id in ``[0, vocab_size)``; a request it has nothing for
    gets an empty proposal (no cost: the step computes its one token); it is called
    once per step, from the engine's thread, never concurrently. ``observe`` and
    ``release`` let a stateful speculator (a draft model's KV cache) follow the
    requests."""

    name: ClassVar[str]
    #: whether ``SpecRequest.hidden`` must be filled (EAGLE/Medusa heads)
    uses_hidden_states: ClassVar[bool] = False
    #: whether ``observe_hidden`` must be called with the hidden state of every
    #: position the target computes (EAGLE: its draft layer attends over them all)
    uses_all_hidden_states: ClassVar[bool] = False

    def __init__(self, context: SpeculatorContext) -> None:
        self.context = context

    @abstractmethod
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """After a step verified ``num_proposed`` of this request's drafts, of which the
        first ``num_accepted`` were accepted (its token lists already hold them)."""

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """With ``uses_all_hidden_states``, after every step: the target's hidden states
        ``(n, hidden)`` (after its final norm) at positions ``start ... start + n - 1`` of
        the request, the rows whose input tokens stay (a prefill chunk, a decode's last
        token and its accepted drafts; never a rejected draft's). A request recomputed
        after preemption sends positions again."""

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop what is kept for it."""
