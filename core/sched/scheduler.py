"""Iteration-level (continuous batching) scheduler: plain Python over plain data.

Requests are `ember.sched.request.Request`: plain, mutable, per-request hot data that
never crosses to the model runner (ember.sched.step carries values).

Each step, every running request is given the tokens it has not computed yet
(one, for a request that is decoding), then waiting requests join first come,
first served within a priority level (lower `priority` first), while the step's
token budget, the running-request cap and the KV pool allow. The contract with
the model runner is two plain values (ember.sched.step): `SchedulerOutput` (what to
compute: new requests in full, then per-step deltas) and `ModelRunnerOutput` (what
was sampled), so this module is tested with hand-built outputs and no model, and a
runner may live in another process.

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
import math
import time
from dataclasses import dataclass
from functools import partial

from ember.config import SchedulerConfig
from ember.sched.encoder_cache import EncoderCacheManager
from ember.sched.encoder_planner import EncoderPlanner
from ember.sched.kv_cache_manager import KVCacheManager
from ember.sched.request import Request, RequestStatus, check_priority, check_request_fits
from ember.sched.step import CachedRequest, ModelRunnerOutput, NewRequest, SchedulerOutput, StepStats

__all__ = [  # the request types are imported from here too
    "ModelRunnerOutput", "Request", "RequestStatus", "RequestUpdate", "Scheduler", "SchedulerOutput", "SchedulerStats",
    "check_priority", "check_request_fits", "record_step",
]


@dataclass(slots=True)
class ScheduledItem:
    """Engine-side record of one request's share of a step (for stats; never sent to the runner)."""

    request: Request
    num_tokens: int
    start_position: int
    is_prefill: bool


@dataclass(slots=True)
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
    """``encoder_cache`` (a model that takes images): what the runner holds of images'
    encoder outputs; `ember.sched.encoder_planner` decides what each step encodes (at
    most ``max_num_batched_tokens`` embeddings) and stops a chunk before an image
    neither encoded nor encodable."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 encoder_cache: EncoderCacheManager | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.encoder_cache = encoder_cache
        self.images = None if encoder_cache is None else EncoderPlanner(encoder_cache, config.max_num_batched_tokens)
        self.waiting: list[Request] = []  # sorted by (priority, arrival_index)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # each step's (request, tokens, start, is_prefill), for stats
        self.last_scheduled: list[ScheduledItem] = []
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------
    def check_request_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never be scheduled."""
        check_request_fits(
            request.num_prompt_tokens, request.sampling_params.max_tokens, max_model_len=self.config.max_model_len,
            chunked_prefill=self.config.enable_chunked_prefill,
            max_num_batched_tokens=self.config.max_num_batched_tokens, num_kv_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size, pooling=request.sampling_params.pooling is not None,
        )
        if request.mm_items:
            if self.images is None:
                raise ValueError("this model takes no images")
            self.images.check(request)

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

    def _preempt(self, request: Request, scheduled: dict[str, int]) -> int:
        """Free the request's blocks and queue it to be recomputed. Returns the step
        tokens given back (it may already have been scheduled this step)."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        if request.mm_items:
            self.images.drop(request, scheduled, self.requests)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.draft_token_ids = []
        self.num_preemptions += 1
        if request.num_blocks_in_runner >= 0:
            self._preempted_ids.add(request.request_id)
            request.num_blocks_in_runner = -1
        bisect.insort(self.waiting, request, key=_queue_order)
        return scheduled.pop(request.request_id, 0)

    # -- the step ------------------------------------------------------------
    def _chunk(self, num_new: int, budget: int, start: int = 0, weigh: bool = False) -> tuple[int, int]:
        """Tokens to compute this step and the budget they take: all, or (chunked
        prefill) what the budget allows. ``weigh`` (requests are decoding beside it):
        a token at position p takes 1 + p / prefill_context_scale (SchedulerConfig)."""
        scale = self.config.prefill_context_scale
        if not weigh or scale is None or num_new <= 1:
            if num_new <= budget:
                return num_new, num_new
            return (budget, budget) if self.config.enable_chunked_prefill else (0, 0)
        # c tokens from `start` take about c * (1 + (start + c / 2) / scale)
        a = 1 + start / scale
        fits = int(((a * a + 2 * budget / scale) ** 0.5 - a) * scale)
        num = min(num_new, fits)
        if num < num_new and not self.config.enable_chunked_prefill:
            return 0, 0
        return num, min(budget, math.ceil(num * (a + num / (2 * scale))))

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Draft tokens of a decoding request that fit this step: the budget, the
        context and max_tokens (a draft past the last token it may emit is wasted)."""
        if not request.draft_token_ids:
            return 0
        room = min(
            budget - 1,
            self.config.max_model_len - request.num_tokens,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
        )
        num = max(0, min(len(request.draft_token_ids), room))
        del request.draft_token_ids[num:]
        return num

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[str, int] = {}  # request id -> tokens, in scheduling order
        preempted_for_blocks = False
        if self.images is not None:
            self.images.start_step()

        # Decodes first, then prompts (or preempted requests) being computed in chunks:
        # a long prompt never holds back the tokens of requests already generating.
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_tokens - 1]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        weigh = bool(decoding)  # streams are waiting for this step: long chunks shrink
        # with no stream waiting, prompts take the (larger) prefill-only budget
        budget = self.config.max_num_batched_tokens
        if not decoding and self.config.prefill_step_tokens is not None:
            budget = self.config.prefill_step_tokens
        for request in decoding + prefilling:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new, cost = self._chunk(
                request.num_tokens - request.num_computed_tokens, budget, request.num_computed_tokens, weigh
            )
            start = request.num_computed_tokens
            if request.mm_items:
                num_new, cost, to_encode = self.images.fit_chunk(
                    request, start, num_new, cost, partial(self._chunk, budget=budget, start=start, weigh=weigh))
            if num_new <= 0:
                continue
            if num_new == 1:
                num_new += self._num_drafts(request, budget)
                cost = num_new
            else:
                request.draft_token_ids = []
            while self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new) is None:
                victim = self._victim()
                preempted_for_blocks = True
                budget += self._preempt(victim, scheduled)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            if request.mm_items:
                self.images.commit(request, start, num_new, to_encode)
            scheduled[request.request_id] = num_new
            budget -= cost

        # New (or preempted) requests join while nothing had to be preempted for
        # blocks this step: a pool that just ran short admits no one.
        # With adapters, at most max_loras of them run at once: a request of another
        # adapter waits (the ones behind it may go ahead) until a slot frees.
        max_loras = self.config.max_loras
        adapters = {r.adapter_id for r in self.running if r.adapter_id} if max_loras else None
        index = 0
        while index < len(self.waiting) and not preempted_for_blocks:
            request = self.waiting[index]
            if adapters is not None and request.adapter_id and request.adapter_id not in adapters \
                    and len(adapters) >= max_loras:
                index += 1
                continue
            victim = self._victim()
            outranks = victim is not None and victim.priority > request.priority
            if len(self.running) >= self.config.max_num_seqs:
                if not outranks:
                    break
                budget += self._preempt(victim, scheduled)
                continue
            cached = self._cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new, cost = self._chunk(request.num_tokens - num_cached_tokens, budget, num_cached_tokens, weigh)
            if request.mm_items:
                num_new, cost, to_encode = self.images.fit_chunk(request, num_cached_tokens, num_new, cost, partial(
                    self._chunk, budget=budget, start=num_cached_tokens, weigh=weigh))
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
            request.draft_token_ids = []
            if request.mm_items:
                self.images.commit(request, num_cached_tokens, num_new, to_encode)
            self.waiting.pop(index)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if adapters is not None and request.adapter_id:
                adapters.add(request.adapter_id)
            scheduled[request.request_id] = num_new
            budget -= cost
        if max_loras and len(scheduled) > 1:
            scheduled = self._group_by_adapter(scheduled)
        return self._make_output(scheduled)

    def _group_by_adapter(self, scheduled: dict[str, int]) -> dict[str, int]:
        """The step's requests grouped by adapter (decodes still first), so that each
        adapter's tokens form few runs of the flat batch (the runner's products per run)."""
        requests = self.requests
        order = sorted(scheduled, key=lambda rid: (scheduled[rid] > 1, requests[rid].adapter_id))
        return {rid: scheduled[rid] for rid in order}

    def _make_output(self, scheduled: dict[str, int]) -> SchedulerOutput:
        """The step as a value: requests new to the runner in full, the others as deltas."""
        new: list[NewRequest] = []
        cached: list[CachedRequest] = []
        sampling: list[str] = []
        drafts: dict[str, list[int]] = {}
        items: list[ScheduledItem] = []
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            table = self.kv.get_block_table(request_id)
            if request.num_blocks_in_runner < 0:
                new.append(NewRequest(
                    request_id, request.prompt_token_ids, list(request.output_token_ids), request.sampling_params,
                    request.eos_token_ids, list(table), start, request.adapter_id, request.mm_items,
                ))
            else:
                cached.append(CachedRequest(request_id, table[request.num_blocks_in_runner :], start))
            request.num_blocks_in_runner = len(table)
            num_drafts = len(request.draft_token_ids)
            if num_drafts:
                drafts[request_id] = list(request.draft_token_ids)
            if start + num_new - num_drafts == request.num_tokens and request.sampling_params.pooling is None:
                sampling.append(request_id)  # (a pooling request's last chunk is pooled, not sampled)
            # prompt tokens, or several tokens at once (a preempted request recomputing)
            is_prefill = start < request.num_prompt_tokens or num_new - num_drafts > 1
            items.append(ScheduledItem(request, num_new, start, is_prefill))
        self.last_scheduled = items
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        preempted, self._preempted_ids = frozenset(self._preempted_ids), set()
        return SchedulerOutput(
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            sampling_request_ids=frozenset(sampling),
            draft_token_ids=drafts,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            encoder_inputs=self.images.encode if self.images is not None else {},
            freed_encoder_hashes=self.encoder_cache.take_freed() if self.encoder_cache is not None else [],
        )

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks covering the prefix of the request's tokens: its prompt, and
        for a preempted request the tokens it generated too. None for a request that
        still needs prompt logprobs (those need the prompt's logits, computed) or a
        mean / CLS pooling request (the hidden states of every prompt position)."""
        if not self.kv.enable_prefix_caching:
            return []
        num_top = getattr(request.sampling_params, "prompt_logprobs", None)
        if num_top is not None and len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
            return []
        pooling = request.sampling_params.pooling
        if pooling is not None and pooling.needs_every_position:  # mean / CLS read every hidden state
            return []
        return self.kv.find_cached_prefix(request.all_token_ids if request.output_token_ids else request.prompt_token_ids,
                                          request.adapter_id, request.mm_items)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance computed counts (by the accepted draft tokens only), append sampled
        tokens, finish stopped requests."""
        updates: list[RequestUpdate] = []
        none = [[] for _ in runner_output.sampled_token_ids]
        logprobs = runner_output.sampled_logprobs or none
        top = runner_output.sampled_top_logprobs or none
        prompt_lps = runner_output.prompt_logprobs or none
        accepted = runner_output.num_accepted or [0] * len(none)
        num_scheduled = scheduler_output.num_scheduled_tokens
        for request_id, sampled, sampled_lp, sampled_top, prompt_lp, num_accepted in zip(
            runner_output.request_ids, runner_output.sampled_token_ids, logprobs, top, prompt_lps, accepted
        ):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:  # aborted while the step ran
                continue
            start = request.num_computed_tokens
            num_drafts = len(scheduler_output.draft_token_ids.get(request_id, ()))
            # rejected drafts are not computed: their slots are overwritten next step
            request.num_computed_tokens += num_scheduled[request_id] - num_drafts + num_accepted
            request.draft_token_ids = []
            if prompt_lp:
                # a preempted request recomputes prompt positions it already has
                # logprobs for: keep the first ones (entry p is at position p)
                have = len(request.prompt_logprobs) - start
                request.prompt_logprobs.extend(prompt_lp[max(0, have):])
            new_ids: list[int] = []
            status = None
            for k, token_id in enumerate(sampled):
                request.output_token_ids.append(token_id)
                request.output_logprobs.append(sampled_lp[k] if k < len(sampled_lp) else float("nan"))
                if k < len(sampled_top):
                    request.output_top_logprobs.append(sampled_top[k])
                new_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            if request.sampling_params.pooling is not None and request.num_computed_tokens >= request.num_prompt_tokens:
                request.pooled = runner_output.pooled[request_id]  # its prompt is computed: its vector is ready
                status = RequestStatus.FINISHED_STOPPED
            num_known = min(request.num_computed_tokens, request.num_tokens)  # a stop may cut accepted drafts
            if self.kv.has_uncached_full_blocks(request_id, num_known):
                # all_token_ids copies the sequence: only when a block just filled up
                self.kv.cache_full_blocks(request_id, request.all_token_ids, num_known, request.adapter_id,
                                          request.mm_items)
            if request.mm_items and start < request.num_prompt_tokens:  # images whose runs are now computed
                self.images.computed(request, start)
            if self.kv.sliding_window is not None:  # every layer slides: blocks behind the window go back
                self.kv.release_out_of_window(request_id, num_known)
            if status is not None:
                self._finish(request, status)
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
        if request.mm_items:
            self.images.drop(request, None, self.requests)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)


def record_step(scheduled: list[ScheduledItem], updates: list[RequestUpdate], started_at: float) -> StepStats:
    """Stamp the requests of one step (first scheduled, tokens, finished) and describe the step.

    ``started_at`` is the ``time.perf_counter()`` taken before the step was scheduled.
    """
    duration = time.perf_counter() - started_at
    now = time.time()
    num_prefill_tokens = num_decode_tokens = num_prefill = num_decode = 0
    for item in scheduled:
        metrics = item.request.metrics
        if metrics.first_scheduled_time is None:
            # the step began `duration` ago; the request was scheduled then
            metrics.first_scheduled_time = now - duration
            metrics.num_cached_tokens = item.start_position if item.is_prefill else 0
        if item.is_prefill:
            num_prefill_tokens += item.num_tokens
            num_prefill += 1
        else:
            num_decode_tokens += item.num_tokens
            num_decode += 1
    for update in updates:
        metrics = update.request.metrics
        if update.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        if update.request.is_finished and metrics.finished_time is None:
            metrics.finished_time = now
    kind = ("mixed" if num_decode_tokens else "prefill") if num_prefill_tokens else ("decode" if num_decode_tokens else "empty")
    return StepStats(duration, num_prefill_tokens, num_decode_tokens, num_prefill, num_decode, kind)
