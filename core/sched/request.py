"""A request as the engine core and the scheduler see it (`Request`: plain, mutable,
per-request hot data that never crosses to the model runner), its states, and the
admission checks every caller asks the same way (`check_priority`,
`check_request_fits`: pure functions of the engine's figures, so that validation
outside the engine core, in another thread or process, gives the same answer)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ember.logprobs import PositionLogprobs
from ember.multimodal.inputs import MultiModalItem
from ember.outputs import RequestMetrics
from ember.sampling_params import SamplingParams


def check_priority(priority: object) -> int:
    """A request's priority is a plain integer (lower runs first); ValueError names anything else."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
    return priority


def check_request_fits(
    num_prompt_tokens: int, max_tokens: int, *, max_model_len: int, chunked_prefill: bool,
    max_num_batched_tokens: int, num_kv_blocks: int, block_size: int, pooling: bool = False,
) -> None:
    """Raise ValueError naming the limit if a request could never be scheduled: a
    prompt that leaves no room in the context, one larger than a step without chunked
    prefill, or a worst case (prompt + max_tokens, capped at the context) larger than
    the whole KV cache (``pooling``: a request that generates nothing may fill the
    context). A pure function of the engine's figures, so that validation
    outside the engine core (another thread or process) asks the same question."""
    if num_prompt_tokens > max_model_len or (num_prompt_tokens == max_model_len and not pooling):
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens; the model's context "
            f"(max_model_len) is {max_model_len}, which leaves no room for a generated token"
        )
    if not chunked_prefill and num_prompt_tokens > max_num_batched_tokens:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens ({max_num_batched_tokens})"
        )
    needed = -(-min(num_prompt_tokens + (0 if pooling else max_tokens), max_model_len) // block_size)
    if needed > num_kv_blocks:
        raise ValueError(
            f"request needs {needed} KV blocks (prompt {num_prompt_tokens} + max_tokens {max_tokens} tokens) "
            f"but the whole KV cache has {num_kv_blocks}"
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # ended by an error of its own (its grammar); the others go on

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request (the scheduler's and the engine core's state of it).

    `num_computed_tokens` catches up with `num_tokens` (prompt plus output): the
    scheduler schedules the difference, whether that is a whole prompt or one
    decode token, so prefill and decode are one mechanism.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_index: int = 0  # set by the scheduler: FCFS order within a priority level
    priority: int = 0  # lower is scheduled first (and preempted last)
    adapter_id: int = 0  # the adapter it runs under (ember.engine.adapters; 0: the base model)
    # its images, in prompt order (ember.multimodal.inputs): runs of prompt tokens that take encoder rows
    mm_items: tuple[MultiModalItem, ...] = ()
    num_preemptions: int = 0  # times its KV was freed to be recomputed later
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # filled only when sampling_params.logprobs / prompt_logprobs ask; prompt_logprobs
    # starts at the second prompt token (the first has no distribution)
    output_top_logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    # block ids the model runner holds of it (-1: not in the runner's batch), so each
    # step sends only the new ones
    num_blocks_in_runner: int = -1
    # tokens a speculator proposed to verify at the next step (the step contract's slot)
    draft_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs_sent: int = 0  # prompt_logprobs entries reported so far
    status: RequestStatus = RequestStatus.WAITING
    stop_token_id: int | None = None
    stop_string: str | None = None
    # a pooling request's vector (SamplingParams.pooling), set when its prompt is computed
    pooled: object = None
    # when it arrived, was first scheduled, produced tokens, finished (for metrics and traces)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
