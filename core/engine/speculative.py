"""The engine's side of speculative decoding (docs/speculative.md): which decoding
requests get drafts each step, the speculator's proposals for them, and what the
step's verification says back (acceptance rates, pauses, the heuristic schedule),
and, cost-aware, how many of each request's drafts are worth verifying this step
(ember.engine.spec_cost). The speculator contract it drives is `ember.plugin.speculator`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ember.config import SpeculativeConfig
from ember.engine.spec_cost import AcceptanceModel, ExplorationBudget, StepCostModel, choose_drafts
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext
from ember.sched.step import SchedulerOutput

logger = logging.getLogger(__name__)


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
    # cost-aware choice (ember.engine.spec_cost): decode-only steps and the decoding
    # requests in them, probe steps, and the step costs learned (ms by batch bucket, tokens)
    cost_aware: bool = False
    num_decode_steps: int = 0
    num_decode_request_steps: int = 0
    num_probe_steps: int = 0
    step_cost_ms: Any = None  # a callable returning the cost model's table

    @property
    def mean_drafts_per_decode(self) -> float:
        """Drafts verified per decoding request per decode-only step (the mean k, 0s included)."""
        return self.num_draft_tokens / self.num_decode_request_steps if self.num_decode_request_steps else 0.0

    @property
    def draft_step_fraction(self) -> float:
        """Fraction of decode-only steps that verified any draft."""
        return min(1.0, self.num_steps / self.num_decode_steps) if self.num_decode_steps else 0.0

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
            "accepted_by_position": list(self.accepted_by_position), "cost_aware": self.cost_aware,
            "num_decode_steps": self.num_decode_steps, "num_decode_request_steps": self.num_decode_request_steps,
            "num_probe_steps": self.num_probe_steps, "mean_drafts_per_decode": self.mean_drafts_per_decode,
            "draft_step_fraction": self.draft_step_fraction,
            "step_cost_ms": self.step_cost_ms() if self.step_cost_ms is not None else {},
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
        self.costs = StepCostModel()
        self.acceptance = AcceptanceModel(config.max_drafts)
        self.explore = ExplorationBudget(config.cost_probe_interval)
        self.stats = SpeculationStats(config.method, accepted_by_position=[0] * config.max_drafts,
                                      cost_aware=config.cost_aware, step_cost_ms=self.costs.to_dict)
        self._state: dict[str, _RequestState] = {}
        self._step = 0
        self.last_proposals: dict[str, Proposal] = {}
        self._ready_at: float | None = None  # when the step's drafts were set: its time runs from here
        self._probe_predicted: float | None = None  # a probe step: the cost of the step it replaced

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
        self.acceptance.observe(request_id, num_proposed, num_accepted)
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

    def propose_for(self, running: list, max_model_len: int, last_hidden: dict | None) -> None:
        """Set the running requests' drafts (``request.draft_token_ids``) from the
        speculator's proposals for those decoding; the scheduler trims them to what
        fits the step (budget, context, max_tokens). ``running``: the scheduler's
        requests; ``last_hidden``: the runner's hidden states by request id."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:  # a batch this large verifies no drafts
            for request in running:
                request.draft_token_ids = []
            self.propose([], len(running))
            return
        hidden = last_hidden if self.uses_hidden_states else None
        candidates = [
            SpecRequest(
                r.request_id, r.prompt_token_ids, r.output_token_ids,
                min(max_model_len - r.num_tokens, r.sampling_params.max_tokens - r.num_output_tokens - 1),
                r.sampling_params.temperature, hidden.get(r.request_id) if hidden else None,
                r.sampling_params.seed,
            )
            for r in running
            if r.num_computed_tokens == r.num_tokens - 1  # decoding
        ]
        proposals = self.propose(candidates, len(running))
        if self.config.cost_aware and proposals and len(candidates) == len(running):
            self._choose(len(candidates), {c.request_id for c in candidates if c.seed is not None})
            proposals = self.last_proposals
        for request in running:
            proposal = proposals.get(request.request_id)
            request.draft_token_ids = list(proposal.token_ids) if proposal is not None else []
        self._ready_at = time.perf_counter()

    def _choose(self, batch: int, seeded: set[str]) -> None:
        """Cut each proposal to the drafts worth verifying in a decode-only step of
        ``batch`` requests (ember.engine.spec_cost.choose_drafts), or, on a probe step
        (ExplorationBudget), keep what the model turned down: every proposal, or none
        where a plain step of this batch was never timed. Before anything of the batch's
        bucket was timed, every proposal is kept. So are the sampled drafts (with
        probs) of a ``seeded`` request: which of them are verified decides its tokens,
        and a choice by step timings would make its output irreproducible."""
        self._probe_predicted = None
        proposals = self.last_proposals
        if self.costs.cost(batch, batch) is None:
            return
        offers = {request_id: len(p.token_ids) for request_id, p in proposals.items()}
        fixed = {request_id: offers.pop(request_id) for request_id in seeded
                 if request_id in offers and proposals[request_id].probs is not None}
        rates = {request_id: self.acceptance.rates(request_id, k) for request_id, k in offers.items()}
        extra = sum(fixed.values())  # the kept drafts' query tokens, in every choice's step
        base = batch + extra
        chosen, _, _ = choose_drafts(offers, rates, batch, lambda tokens: self.costs.cost(batch, tokens + extra))
        if self.explore.due():
            probe = {} if not self.costs.measured(batch, base) else offers
            if probe != chosen:
                self._probe_predicted = self.costs.cost(batch, base + sum(chosen.values()))
                chosen = probe
        chosen.update(fixed)
        self.last_proposals = {
            request_id: Proposal(p.token_ids[: chosen[request_id]], None if p.probs is None else
                                 p.probs[: chosen[request_id]])
            for request_id, p in proposals.items() if chosen.get(request_id)
        }

    def _learn_cost(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """A decode-only step's time (every scheduled request computing its next token
        plus its drafts) teaches the cost model; a step holding a prompt chunk does not."""
        drafts = scheduler_output.draft_token_ids
        sampling = scheduler_output.sampling_request_ids
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled or any(
            request_id not in sampling or n != 1 + len(drafts.get(request_id, ())) for request_id, n in scheduled.items()
        ):
            self._probe_predicted = None
            return
        batch, tokens = len(scheduled), scheduler_output.total_num_scheduled_tokens
        seconds = self.costs.observe(batch, tokens, seconds)
        probe, self._probe_predicted = self._probe_predicted, None
        self.explore.step(seconds, None if probe is None else seconds - probe)
        stats = self.stats
        stats.num_decode_steps += 1
        stats.num_decode_request_steps += batch
        stats.num_probe_steps = self.explore.num_probes

    def with_draft_probs(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The step with the distributions its sampled drafts were drawn from, for the
        runner's rejection sampling (deterministic proposals have none)."""
        proposals = self.last_proposals
        probs = {
            request_id: proposals[request_id].probs[: len(drafts)]
            for request_id, drafts in scheduler_output.draft_token_ids.items()
            if request_id in proposals and proposals[request_id].probs is not None
        }
        return replace(scheduler_output, draft_probs=probs) if probs else scheduler_output

    def observe_step(self, scheduler_output: SchedulerOutput, runner_output, step_hidden) -> None:
        """What the step's verification accepted, per request; ``step_hidden``: the
        runner's ``(request_id, start, hidden)`` of every computed position, for a
        speculator that learns from them."""
        if self._ready_at is not None:
            self._learn_cost(scheduler_output, time.perf_counter() - self._ready_at)
            self._ready_at = None
        for request_id, start, hidden in step_hidden:
            self.speculator.observe_hidden(request_id, start, hidden)
        drafts = scheduler_output.draft_token_ids
        if drafts and runner_output.num_accepted:
            for request_id, accepted in zip(runner_output.request_ids, runner_output.num_accepted):
                proposed = len(drafts.get(request_id, ()))
                if proposed:
                    self.observe(request_id, proposed, accepted)
        self.step_done(bool(drafts))

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        self.acceptance.release(request_id)
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
