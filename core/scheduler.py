"""Iteration-level (continuous batching) scheduler: plain Python over plain data.

Each step, every running request is given the tokens it has not computed yet
(one, for a request that is decoding), then waiting requests join first come,
first served within a priority level (lower `priority` first), while the step's
token budget, the running-request cap and the KV pool allow. The contract with
the model runner is two dataclasses: `SchedulerOutput` (what to compute) and
`ModelRunnerOutput` (what was sampled), so this module is tested with hand-built
outputs and no model.

Admission asks only for the blocks of the tokens computed in this step, so the
pool is used by as many requests as it can hold. When a running request needs a
block the pool no longer has, the scheduler *preempts by recompute*: the running
request with the lowest priority, most recently admitted among equals, frees all
its blocks and goes back to the waiting queue in its arrival place (in practice
its front); when admitted again it recomputes its prompt and the tokens it had
generated (a prefix-cache hit where those blocks were not evicted yet) and goes
on sampling where it stopped. A higher-priority waiting request may also preempt
a running request of strictly lower priority. A request whose worst case
(prompt + max_tokens, capped at the context) exceeds the whole pool is refused
at `add_request`, so the oldest running request can always finish: no deadlock.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from ember.config import SchedulerConfig
from ember.kv_cache_manager import KVCacheManager
from ember.logprobs import PositionLogprobs
from ember.request import Request, RequestStatus, check_priority


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
    num_preemptions: int = 0  # since start


def _queue_order(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_index)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: list[Request] = []  # sorted by (priority, arrival_index)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------
    def max_tokens_of(self, request: Request) -> int:
        """Worst-case token count of a request: what must fit the whole pool."""
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
        check_priority(request.priority)
        self.check_request_fits(request)
        request.status = RequestStatus.WAITING
        request.arrival_index = next(self._arrivals)
        bisect.insort(self.waiting, request, key=_queue_order)
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
            num_preemptions=self.num_preemptions,
        )

    # -- preemption ----------------------------------------------------------
    def _victim(self) -> Request | None:
        """The running request to preempt: lowest priority, then most recently admitted."""
        if not self.running:
            return None
        index = max(range(len(self.running)), key=lambda i: (self.running[i].priority, i))
        return self.running[index]

    def _preempt(self, request: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free the request's blocks and queue it to be recomputed. Returns the step
        tokens given back (it may already have been scheduled this step)."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_queue_order)
        item = scheduled.pop(request.request_id, None)
        return item.num_tokens if item is not None else 0

    # -- the step ------------------------------------------------------------
    def _chunk(self, num_new: int, budget: int) -> int:
        """Tokens to compute this step: all, or (chunked prefill) what the budget allows."""
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill else 0

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}  # in scheduling order
        preempted_for_blocks = False

        # Decodes first, then prompts (or preempted requests) being computed in chunks:
        # a long prompt never holds back the tokens of requests already generating.
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_tokens - 1]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        for request in decoding + prefilling:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new) is None:
                victim = self._victim()
                preempted_for_blocks = True
                budget += self._preempt(victim, scheduled)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            scheduled[request.request_id] = self._make_scheduled(request, num_new)
            budget -= num_new

        # New (or preempted) requests join while nothing had to be preempted for
        # blocks this step: a pool that just ran short admits no one.
        while self.waiting and not preempted_for_blocks:
            request = self.waiting[0]
            victim = self._victim()
            outranks = victim is not None and victim.priority > request.priority
            if len(self.running) >= self.config.max_num_seqs:
                if not outranks:
                    break
                budget += self._preempt(victim, scheduled)
                continue
            cached = self._cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = self._chunk(request.num_tokens - num_cached_tokens, budget)
            if num_new <= 0:
                break
            allocated = self.kv.allocate_slots(request.request_id, num_cached_tokens + num_new, cached_blocks=cached)
            if allocated is None:
                if not outranks:
                    break
                budget += self._preempt(victim, scheduled)
                continue
            if self.kv.enable_prefix_caching and not request.num_preemptions:
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached_tokens)
            request.num_computed_tokens = num_cached_tokens
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = self._make_scheduled(request, num_new)
            budget -= num_new

        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=finished,
        )

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks covering the prefix of the request's tokens: its prompt, and
        for a preempted request the tokens it generated too. None for a request that
        still needs prompt logprobs (those need the prompt's logits, computed)."""
        if not self.kv.enable_prefix_caching:
            return []
        num_top = getattr(request.sampling_params, "prompt_logprobs", None)
        if num_top is not None and len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
            return []
        return self.kv.find_cached_prefix(request.all_token_ids if request.output_token_ids else request.prompt_token_ids)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        return ScheduledRequest(
            request=request,
            token_ids=token_ids,
            start_position=start,
            block_table=list(self.kv.get_block_table(request.request_id)),
            # prompt tokens, or several tokens at once (a preempted request recomputing)
            is_prefill=start < request.num_prompt_tokens or num_new > 1,
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
            if prompt_lp:
                # a preempted request recomputes prompt positions it already has
                # logprobs for: keep the first ones (entry p is at position p)
                have = len(request.prompt_logprobs) - item.start_position
                request.prompt_logprobs.extend(prompt_lp[max(0, have):])
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
            self.waiting.remove(request)  # identity: Request compares by id
        else:
            self.running.remove(request)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
