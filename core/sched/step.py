"""The step contract: what crosses from the scheduler to the model runner and back.

Both directions are plain values (ints, strings, lists, frozen `SamplingParams` and
CPU tensors), never live engine objects, so a runner can live in another process
(tensor parallelism, a separate engine process): `pickle` round-trips them
(tests/test_step_contract.py checks that no engine object travels). The per-step
values are slotted dataclasses, not frozen ones (a frozen dataclass's ``__init__``
sets each field through ``object.__setattr__``, several times slower on the step's
path): treat them as read-only once built.

A request is described in full once, when it joins the runner's batch
(:class:`NewRequest`); afterwards each step carries only deltas
(:class:`CachedRequest`: new block ids and how many tokens are computed). The runner
keeps its own copy of every request's tokens and appends what it samples; a request
that is preempted leaves the runner's batch and comes back as a `NewRequest` holding
the tokens it had generated.

Three slots serve what is built on this step:

* **draft tokens** (speculative decoding): ``draft_token_ids[id]`` are ``k`` proposed
  tokens that follow the request's last token. They are computed as ``k`` extra query
  positions of the same step (``num_scheduled_tokens[id]`` counts them); the runner
  accepts the longest prefix the target model agrees with and samples one more
  token, and returns them all with ``num_accepted``. The scheduler then counts only
  the accepted positions as computed: rejected positions' KV slots lie past the
  request's computed tokens, are never hashed into the prefix cache, and are
  overwritten by the next step.
* **encoder inputs** (images): ``encoder_inputs[id]`` lists the request's images the
  runner encodes this step, before the forward pass; every image a step's tokens
  overlap is either among them or already in the runner's encoder cache (the
  scheduler cuts a chunk before an image that is neither).
* **allowed-token masks** (grammar-guided decoding): ``allowed_token_masks[id]`` is a
  bool tensor ``(positions, vocab)``, one row per position the request samples at
  this step (``1 + len(draft_token_ids[id])``); the runner sets the logits of tokens
  not allowed to ``-inf`` before any processor or the sampler sees them.

What a step reports to observers (metrics, tracing), without depending on them:
`StepStats` describes one engine step (``time.perf_counter()`` seconds; the
scheduler's `record_step` makes it). A request's own timeline,
`ember.outputs.RequestMetrics`, rides on each scheduler `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.logprobs import PositionLogprobs
from ember.multimodal.inputs import MultiModalItem
from ember.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request joining the runner's batch (first scheduled, or back from preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    # tokens it generated before a preemption (empty for a new request)
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int  # already in the KV cache (a prefix-cache hit)
    adapter_id: int = 0  # the adapter it runs under (0: the base model)
    # its images with their processor tensors (sent once: the runner keeps them while it runs)
    mm_items: tuple[MultiModalItem, ...] = ()


@dataclass(slots=True)
class CachedRequest:
    """A request already in the runner's batch: what changed since its last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step. ``num_scheduled_tokens`` lists every scheduled request in batch
    order (the order of the runner's flat batch and of its output)."""

    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests that sample a token at the end of this step (the others compute a
    # chunk of their prompt only).
    sampling_request_ids: frozenset[str] = frozenset()
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # for drafts a speculator sampled: the distribution each was drawn from, (k, vocab)
    # float32 (ember.plugin.speculator.Proposal.probs); absent for deterministic drafts
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    allowed_token_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    # Left the runner's batch since the last step: finished or aborted (the runner
    # drops their state for good) and preempted (they come back as NewRequest).
    finished_request_ids: frozenset[str] = frozenset()
    preempted_request_ids: frozenset[str] = frozenset()
    # Images (ember.sched.encoder_cache): request id -> indices of its ``mm_items`` the
    # runner encodes this step (each distinct content hash once), and the hashes whose
    # encoder outputs it drops first (evicted)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    freed_encoder_hashes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request, in ``SchedulerOutput.num_scheduled_tokens`` order."""

    request_ids: list[str]
    # accepted draft tokens, then the sampled one; empty for a prompt chunk
    sampled_token_ids: list[list[int]]
    # log-probability of each sampled token (same shape); empty lists when unknown
    sampled_logprobs: list[list[float]] | None = None
    # Only for requests whose params ask (empty lists for the others; None when no
    # request of the step asks): each sampled token's rank and alternatives (same
    # shape as sampled_token_ids), and the prompt positions this step computed (the
    # logprob of prompt token p + 1 at row p).
    sampled_top_logprobs: list[list[PositionLogprobs]] | None = None
    prompt_logprobs: list[list[PositionLogprobs]] | None = None
    # how many of the request's draft tokens were accepted (0 without drafts)
    num_accepted: list[int] | None = None
    # pooling requests (SamplingParams.pooling) whose prompt this step completed: their
    # vector (float32 values as Python floats, ember.worker.pooler); None when the step completed none
    pooled: dict[str, list[float]] | None = None


@dataclass(slots=True)
class StepStats:
    """One engine step: how long schedule + forward + sample took, and what it computed."""

    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    # ``prefill``, ``decode`` or ``mixed`` (a step holding both); ``empty`` if neither
    kind: str
