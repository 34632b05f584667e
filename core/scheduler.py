"""Iteration-level (continuous batching) scheduler: plain Python over plain data.

Each step, every running request is given the tokens it has not computed yet
(one, for a request that is decoding), then waiting requests join first come,
first served while the step's token budget, the running-request cap and the KV
pool allow. The contract with the model runner is two dataclasses:
`SchedulerOutput` (what to compute) and `ModelRunnerOutput` (what was sampled),
so this module is tested with hand-built outputs and no model.

Until preemption exists (a later issue), a request is admitted only if the pool
can hold its worst case (prompt + max_tokens, capped at the context length) on
top of what running requests have reserved, so a running request never stalls
for lack of blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.config import SchedulerConfig
from ember.kv_cache_manager import KVCacheManager
from ember.logprobs import PositionLogprobs
from ember.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions `start_position ...`."""

    request: Request
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    is_prefill: bool
    needs_sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step; the runner
    # drops any per-request state it keeps for them.
    finished_request_ids: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per scheduled request (same order as `SchedulerOutput.scheduled`): sampled ids."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    # log-probability of each sampled token (same shape); empty lists when unknown
    sampled_logprobs: list[list[float]] | None = None
    # Only for requests whose params ask (empty lists otherwise): each sampled token's
    # rank and alternatives (same shape as sampled_token_ids), and the prompt
    # positions this step computed (the logprob of prompt token p + 1 at row p).
    sampled_top_logprobs: list[list[PositionLogprobs]] | None = None
    prompt_logprobs: list[list[PositionLogprobs]] | None = None


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()

    # -- admission ---------------------------------------------------------
    def max_tokens_of(self, request: Request) -> int:
        """Worst-case token count of a request: what its KV reservation covers."""
        return min(
            request.num_prompt_tokens + request.sampling_params.max_tokens,
            self.config.max_model_len,
        )

    def check_request_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never be scheduled."""
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context "
                f"(max_model_len) is {self.config.max_model_len}, which leaves no room "
                "for a generated token"
            )
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens})"
            )
        needed = self.kv.num_blocks_for(self.max_tokens_of(request))
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks (prompt {request.num_prompt_tokens} + "
                f"max_tokens {request.sampling_params.max_tokens} tokens) but the whole "
                f"KV cache has {self.kv.num_blocks}"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_request_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
        )

    def _reserved_blocks(self) -> int:
        """Blocks running requests may still claim to reach their worst case."""
        return sum(
            self.kv.num_new_blocks_needed(r.request_id, self.max_tokens_of(r))
            for r in self.running
        )

    # -- the step ------------------------------------------------------------
    def _chunk(self, num_new: int, budget: int) -> int:
        """Tokens to compute this step: all, or (chunked prefill) what the budget allows."""
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill else 0

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        # Decodes first, then prompts still being prefilled in chunks: a long prompt
        # never holds back the tokens of requests that are already generating.
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for request in decoding + prefilling:
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            allocated = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
            assert allocated is not None, "admission reserved this request's blocks"
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new

        free_after_reservations = self.kv.num_free_blocks - self._reserved_blocks()
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self._cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens - num_cached_tokens, budget)
            if num_new <= 0:
                break
            # worst case minus what the cache already holds, plus the cached blocks
            # that sit in the free queue (taking them uses up free blocks)
            needed = (
                self.kv.num_blocks_for(self.max_tokens_of(request)) - len(cached) + self.kv.count_free_among(cached)
            )
            if needed > free_after_reservations:
                break
            allocated = self.kv.allocate_slots(
                request.request_id, request.num_computed_tokens + num_cached_tokens + num_new, cached_blocks=cached
            )
            assert allocated is not None
            if self.kv.enable_prefix_caching:
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached_tokens)
            request.num_computed_tokens += num_cached_tokens
            free_after_reservations -= needed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new

        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=finished,
        )

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks covering the prompt's prefix (none for a request that asks for
        prompt logprobs: those need the prompt's logits, computed)."""
        if not self.kv.enable_prefix_caching or request.num_computed_tokens:
            return []
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return []
        return self.kv.find_cached_prefix(request.prompt_token_ids)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        return ScheduledRequest(
            request=request,
            token_ids=token_ids,
            start_position=start,
            block_table=list(self.kv.get_block_table(request.request_id)),
            is_prefill=start < request.num_prompt_tokens,
            needs_sample=start + num_new == request.num_tokens,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish stopped requests."""
        updates: list[RequestUpdate] = []
        none = [[] for _ in runner_output.sampled_token_ids]
        logprobs = runner_output.sampled_logprobs or none
        top = runner_output.sampled_top_logprobs or none
        prompt_lps = runner_output.prompt_logprobs or none
        for item, sampled, sampled_lp, sampled_top, prompt_lp in zip(
            scheduler_output.scheduled, runner_output.sampled_token_ids, logprobs, top, prompt_lps
        ):
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += item.num_tokens
            if self.kv.has_uncached_full_blocks(request.request_id, request.num_computed_tokens):
                # all_token_ids copies the sequence: only when a block just filled up
                self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
            request.prompt_logprobs.extend(prompt_lp)
            new_ids: list[int] = []
            for k, token_id in enumerate(sampled):
                request.output_token_ids.append(token_id)
                request.output_logprobs.append(sampled_lp[k] if k < len(sampled_lp) else float("nan"))
                if k < len(sampled_top):
                    request.output_top_logprobs.append(sampled_top[k])
                new_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    break
            updates.append(RequestUpdate(request, new_ids))
        return updates

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        was_waiting = request.status == RequestStatus.WAITING
        request.status = status
        if was_waiting:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
