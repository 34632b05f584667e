"""Speculative decoding: the speculator plugin contract, its configuration, and the
engine-side driver that asks a speculator for draft tokens each step and learns
from what the target model accepted.

A speculator proposes up to ``k`` tokens to follow each decoding request's last
token. The engine computes them as ``k`` extra query positions of the next step
(``ember.step``'s draft slot) and the model runner verifies them: for a greedy
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

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates, in vLLM's terms (``--speculative-config`` takes
    these keys as JSON; TGI's ``--speculate N`` is ``{"method": "ngram",
    "num_speculative_tokens": N}``).

    ``disable_by_batch_size``: no speculation in a step where at least this many
    requests run (verifying drafts costs compute a large batch no longer has to
    spare); None never steps aside. ``min_acceptance_rate``: a request whose recent
    drafts were accepted less often than this (an exponential average over
    ``acceptance_window`` proposals) stops being offered drafts for
    ``backoff_steps`` steps, then tries again; 0 keeps offering.

    ``draft_length_schedule``: ``constant`` offers every request
    ``num_speculative_tokens`` drafts a step (vLLM); ``heuristic`` (Hugging Face's
    ``num_assistant_tokens_schedule``) starts each request there and adapts it: two
    more after a step that accepted all its drafts, one fewer (not under 1) after one
    that did not, up to ``max_speculative_tokens`` (default three times
    ``num_speculative_tokens``). Long copied runs then verify many drafts a step,
    where a step costs little more than a plain decode (a CPU at batch 1), while free
    text shrinks back to few."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    # ngram (prompt lookup): the longest and shortest suffix matched against the
    # request's tokens, longest first
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft_model, eagle, medusa: the draft model's or the heads' directory
    model: str | None = None
    disable_by_batch_size: int | None = 8
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 16
    backoff_steps: int = 16
    draft_length_schedule: str = "constant"
    max_speculative_tokens: int | None = None

    SCHEDULES: ClassVar[tuple[str, ...]] = ("constant", "heuristic")

    @property
    def max_drafts(self) -> int:
        """The most drafts a request is ever offered in one step."""
        if self.draft_length_schedule == "constant":
            return self.num_speculative_tokens
        return self.max_speculative_tokens or 3 * self.num_speculative_tokens

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative method must be a speculator's name, got {self.method!r}")
        positive = {"num_speculative_tokens": self.num_speculative_tokens, "prompt_lookup_max": self.prompt_lookup_max,
                    "prompt_lookup_min": self.prompt_lookup_min, "acceptance_window": self.acceptance_window,
                    "backoff_steps": self.backoff_steps}
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative config: {name} must be a positive integer, got {value!r}")
        if self.draft_length_schedule not in self.SCHEDULES:
            raise ValueError(f"speculative config: draft_length_schedule must be one of {', '.join(self.SCHEDULES)}, "
                             f"got {self.draft_length_schedule!r}")
        most = self.max_speculative_tokens
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < self.num_speculative_tokens):
            raise ValueError(f"speculative config: max_speculative_tokens must be an integer of at least "
                             f"num_speculative_tokens ({self.num_speculative_tokens}), got {most!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        size = self.disable_by_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"speculative config: disable_by_batch_size must be a positive integer or null, got {size!r}")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"speculative config: min_acceptance_rate must lie in [0, 1], got {rate!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a mapping of its fields, or their JSON; None stays None.
        An unknown key is a ValueError naming it."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    # i from a generator of its own seeded with ember.sampler.position_seed(seed, i,
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


@dataclass
class SpeculationStats:
    """Counts since start-up (vLLM's spec_decode metrics)."""

    method: str
    num_steps: int = 0  # steps that verified at least one draft
    num_proposals: int = 0  # (request, step) pairs with drafts
    num_draft_tokens: int = 0  # proposed and verified
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted plus the bonus token of each proposal
    accepted_by_position: list[int] = field(default_factory=list)  # accepted at draft position j

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification of a request's drafts (1 + accepted)."""
        return self.num_emitted_tokens / self.num_proposals if self.num_proposals else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method, "num_steps": self.num_steps, "num_proposals": self.num_proposals,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens, "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_by_position": list(self.accepted_by_position),
        }


@dataclass(slots=True)
class _RequestState:
    rate: float = 1.0  # exponential average of the acceptance rate of its drafts
    skip_until: int = 0  # the step from which it is offered drafts again
    num_drafts: int = 0  # drafts offered per step under the heuristic schedule (0: not yet set)


class SpeculativeDecoder:
    """The engine's side: which requests get drafts this step, the speculator's
    proposals for them, and what the step's verification says back."""

    def __init__(self, speculator: BaseSpeculator, config: SpeculativeConfig) -> None:
        self.speculator = speculator
        self.config = config
        self.stats = SpeculationStats(config.method, accepted_by_position=[0] * config.max_drafts)
        self._state: dict[str, _RequestState] = {}
        self._step = 0
        self.last_proposals: dict[str, Proposal] = {}

    @property
    def uses_hidden_states(self) -> bool:
        return self.speculator.uses_hidden_states

    @property
    def uses_all_hidden_states(self) -> bool:
        return self.speculator.uses_all_hidden_states

    def propose(self, requests: list[SpecRequest], num_running: int) -> dict[str, Proposal]:
        """Proposals by request id for the requests offered drafts this step (each
        truncated to its ``max_drafts``); none when ``num_running`` reaches
        ``disable_by_batch_size``."""
        self._step += 1
        self.last_proposals = {}
        limit = self.config.disable_by_batch_size
        if not requests or (limit is not None and num_running >= limit):
            return self.last_proposals
        offered = []
        for request in requests:
            state = self._state.get(request.request_id)
            if state is not None and state.skip_until > self._step:
                continue
            offer = state.num_drafts if state is not None and state.num_drafts else self.config.num_speculative_tokens
            request.max_drafts = min(request.max_drafts, offer)
            if request.max_drafts > 0:
                offered.append(request)
        if not offered:
            return self.last_proposals
        proposals = self.speculator.propose(offered)
        if len(proposals) != len(offered):
            raise RuntimeError(
                f"speculator {self.speculator.name!r} returned {len(proposals)} proposals for {len(offered)} requests"
            )
        vocab = self.speculator.context.vocab_size
        for request, proposal in zip(offered, proposals):
            ids = proposal.token_ids[: request.max_drafts]
            if not ids:
                continue
            if any(not 0 <= t < vocab for t in ids):
                raise RuntimeError(f"speculator {self.speculator.name!r} proposed a token outside [0, {vocab}): {ids}")
            probs = proposal.probs
            if probs is not None:
                if probs.dim() != 2 or probs.shape[0] < len(ids) or probs.shape[1] < vocab:
                    raise RuntimeError(
                        f"speculator {self.speculator.name!r}: probs of shape {tuple(probs.shape)} for {len(ids)} "
                        f"drafts over a vocabulary of {vocab}"
                    )
                probs = probs[: len(ids)]
            self.last_proposals[request.request_id] = Proposal(ids, probs)
        return self.last_proposals

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """What the step made of a request's drafts (``num_proposed`` verified)."""
        if not num_proposed:
            return
        stats = self.stats
        stats.num_proposals += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.num_emitted_tokens += num_accepted + 1
        for j in range(num_accepted):
            stats.accepted_by_position[j] += 1
        state = self._state.setdefault(request_id, _RequestState())
        if self.config.draft_length_schedule == "heuristic":
            offered = state.num_drafts or self.config.num_speculative_tokens
            # a proposal shorter than its offer (the lookup ran out) says nothing of the length
            if num_accepted == num_proposed:
                state.num_drafts = min(self.config.max_drafts, offered + 2) if num_proposed == offered else offered
            else:
                state.num_drafts = max(1, offered - 1)
        weight = min(1.0, num_proposed / self.config.acceptance_window)
        state.rate += weight * (num_accepted / num_proposed - state.rate)
        if state.rate < self.config.min_acceptance_rate:
            state.skip_until = self._step + 1 + self.config.backoff_steps
            state.rate = self.config.min_acceptance_rate  # one more chance after the pause
        self.speculator.observe(request_id, num_proposed, num_accepted)

    def step_done(self, any_verified: bool) -> None:
        if any_verified:
            self.stats.num_steps += 1

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        self.speculator.release(request_id)


def create_speculator(registry, config: SpeculativeConfig, context: SpeculatorContext) -> SpeculativeDecoder:
    """The decoder for ``config.method`` from the ``speculators`` registry."""
    if config.method not in registry.names():
        raise ValueError(
            f"unknown speculative method {config.method!r}; registered: {', '.join(registry.names()) or '(none)'}"
        )
    speculator = registry.get(config.method)(context)
    logger.info("speculative decoding: %s, up to %d draft tokens per step%s", config.method,
                config.num_speculative_tokens,
                f", off from {config.disable_by_batch_size} running requests" if config.disable_by_batch_size else "")
    return SpeculativeDecoder(speculator, config)
