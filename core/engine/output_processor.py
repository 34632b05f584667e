"""The output processor: the one place engine-core outputs become caller outputs.

The engine core reports, per request and step, only what is new
(:class:`EngineCoreOutput`: token ids, their logprobs, a finish reason). Here, at the
boundary between the core and its callers, each request gets its incremental
detokenization, stop strings, logprob dictionaries and — for ``n``/``best_of`` —
its group's aggregation, once. A stop string found here ends the request in the
core (the caller aborts the ids :meth:`OutputProcessor.process` returns).

``RequestOutput`` comes in two kinds (``OutputKind``): ``CUMULATIVE`` (``outputs``
hold everything so far, plus this step's ``new_text``/``new_token_ids``: the
offline API's shape) and ``DELTA`` (``outputs`` hold only this step's tokens,
logprobs and text; the final output carries the finish reason): a stream of n
tokens then costs O(n), not O(n²).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.engine.client import EngineStats
from ember.engine.parallel_sampling import SampleGroup, child_params
from ember.logprobs import Logprob, PositionLogprobs, to_logprob_dict
from ember.outputs import CompletionOutput, OutputKind, RequestMetrics, RequestOutput
from ember.sampling_params import SamplingParams
from ember.sched.step import StepStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase



class IncrementalDetokenizer:
    """Streams text for one request's output ids.

    Decodes a sliding window (prefix_offset .. end) and emits only what extends
    the window's previous decode, holding back a trailing U+FFFD (an incomplete
    multi-byte character) until the next token completes it, so the emitted
    pieces concatenate to the decode of all output ids.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        # A fast tokenizer's Rust decoder directly: what its Python `decode` calls,
        # without the wrapper's per-call work (two decodes a token add up). Only when
        # the wrapper would not change the text afterwards (no space clean-up).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
            self._backend = backend
            self._decode = self._decode_backend

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_backend(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they complete (may be empty)."""
        delta = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                piece = new_text[len(prefix_text) :]
                delta.append(piece)
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        text = "".join(delta)
        self.text += text
        return text

    def flush(self) -> str:
        """At the end of a request: emit whatever was held back."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        piece = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += piece
        return piece


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did to one request: only what is new (a plain value)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[PositionLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    metrics: RequestMetrics | None = None
    # with finish reason "error": what went wrong for this request alone (its grammar)
    error: str | None = None
    # a pooling request's vector (float32 values), on its final output (ember.worker.pooler)
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    """One engine-core step: what is new per changed request, the step's figures and the counts after it."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step_stats: StepStats | None = None
    stats: EngineStats | None = None


def find_stop_string(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """Earliest occurrence at or after ``start`` of any of ``stops`` in ``text``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


@dataclass
class _State:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    kind: OutputKind
    text: str = ""  # the output text so far, cut at a stop string
    num_emitted_chars: int = 0  # how much of `text` was sent already
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])
    stop_string: str | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    detokenize_time: float = 0.0


class OutputProcessor:
    """Per-request output state on the callers' side of the engine core. Not
    thread-safe: one thread adds requests and processes outputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        self._groups: dict[str, SampleGroup] = {}  # parallel sampling, by parent id
        self._child_to_group: dict[str, tuple[str, int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._groups

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Track a request; one with ``params.num_samples > 1`` is a group whose
        children (``child_id(request_id, i)`` in the core) report as one output."""
        if params.num_samples == 1:
            self._add_state(request_id, prompt, prompt_token_ids, params, kind)
            return
        group = SampleGroup(request_id, prompt, prompt_token_ids, params, rank_at_end=kind is OutputKind.CUMULATIVE)
        self._groups[request_id] = group
        for index, cid in enumerate(group.child_ids()):
            self._child_to_group[cid] = (request_id, index)
            self._add_state(cid, prompt, prompt_token_ids, child_params(params, index), kind)

    def _add_state(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        kind: OutputKind,
    ) -> None:
        self._states[request_id] = _State(
            request_id, prompt, prompt_token_ids, params,
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens), kind,
        )

    def abort(self, request_id: str) -> list[str]:
        """Forget a request (or group); returns the core request ids it had."""
        group = self._groups.pop(request_id, None)
        ids = group.child_ids() if group is not None else [request_id]
        for rid in ids:
            self._states.pop(rid, None)
            self._child_to_group.pop(rid, None)
        return ids

    def caller_id(self, request_id: str) -> str:
        """The id the caller knows: a parallel-sampling child's parent, else the id."""
        link = self._child_to_group.get(request_id)
        return link[0] if link is not None else request_id

    def abort_all(self) -> None:
        self._states.clear()
        self._groups.clear()
        self._child_to_group.clear()

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Caller outputs for one step's core outputs, and the core request ids to
        finish because a stop string appeared in their text."""
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for core_out in outputs:
            state = self._states.get(core_out.request_id)
            if state is None:
                continue  # aborted, or already ended by a stop string
            if core_out.finished and state.finish_reason is None:
                state.finish_reason = core_out.finish_reason
                state.stop_token_id = core_out.stop_token_id
                state.error = core_out.error
            if not core_out.new_token_ids and state.finish_reason is None and not core_out.new_prompt_logprobs:
                continue
            started = time.perf_counter()
            new_text = self._update_text(state, core_out.new_token_ids)
            state.detokenize_time += time.perf_counter() - started
            if core_out.metrics is not None:  # the core's copy, for this output only
                core_out.metrics.detokenize_time = state.detokenize_time
            if state.stop_string is not None and core_out.finish_reason is None:
                stopped.append(state.request_id)
            finished = state.finish_reason is not None
            new_ids = core_out.new_token_ids
            state.token_ids.extend(new_ids)
            state.token_logprobs.extend(core_out.new_logprobs)
            new_logprobs = None
            if state.params.logprobs is not None:
                new_logprobs = [to_logprob_dict(e, self._decode_token) for e in core_out.new_top_logprobs]
                state.logprobs.extend(new_logprobs)
            new_prompt_logprobs = None
            if state.params.prompt_logprobs is not None:
                new_prompt_logprobs = [to_logprob_dict(e, self._decode_token) for e in core_out.new_prompt_logprobs]
                state.prompt_logprobs.extend(new_prompt_logprobs)
            if finished:
                del self._states[state.request_id]
            out = self._make_output(state, core_out, new_ids, new_text, new_logprobs, new_prompt_logprobs, finished)
            if self._groups:
                out = self._to_parent(out)
            results.append(out)
        return results, stopped

    def _make_output(
        self, state: _State, core_out: EngineCoreOutput, new_ids: list[int], new_text: str,
        new_logprobs: list | None, new_prompt_logprobs: list | None, finished: bool,
    ) -> RequestOutput:
        stop_reason = state.stop_string if state.stop_string is not None else state.stop_token_id
        if state.kind is OutputKind.DELTA:
            completion = CompletionOutput(
                0, new_text, list(new_ids), state.finish_reason, stop_reason, list(core_out.new_logprobs), new_logprobs,
                state.params.seed, state.error,
            )
            prompt_logprobs = new_prompt_logprobs
        else:
            completion = CompletionOutput(
                0, state.text, list(state.token_ids), state.finish_reason, stop_reason, list(state.token_logprobs),
                list(state.logprobs) if state.params.logprobs is not None else None, state.params.seed, state.error,
            )
            prompt_logprobs = list(state.prompt_logprobs) if state.params.prompt_logprobs is not None else None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            new_token_ids=list(new_ids),
            new_text=new_text,
            prompt_logprobs=prompt_logprobs,
            metrics=core_out.metrics,
            pooled=core_out.pooled,
        )

    def _update_text(self, state: _State, new_token_ids: list[int]) -> str:
        """Detokenize, apply stop strings, and return the text that is safe to send.

        While a request runs, the last ``len(longest stop) - 1`` characters are held
        back (they may begin a stop string), so streamed pieces always concatenate to
        the final text.
        """
        params = state.params
        detok = state.detokenizer
        checked = len(state.text)
        if new_token_ids:
            detok.add_tokens(new_token_ids)
        if state.finish_reason is not None:
            detok.flush()
        state.text = detok.text if state.stop_string is None else state.text
        if params.stop and state.stop_string is None:
            longest = max(len(s) for s in params.stop)
            hit = find_stop_string(state.text, params.stop, max(0, checked - longest + 1))
            if hit is not None:
                index, stop = hit
                state.text = state.text[: index + len(stop) if params.include_stop_str_in_output else index]
                state.stop_string = stop
                state.finish_reason = "stop"
        safe = len(state.text)
        if params.stop and state.finish_reason is None:
            safe = max(state.num_emitted_chars, safe - (max(len(s) for s in params.stop) - 1))
        piece = state.text[state.num_emitted_chars : safe]
        state.num_emitted_chars = safe
        return piece

    def _to_parent(self, out: RequestOutput) -> RequestOutput:
        """A child's output, as an output of its group (parallel sampling)."""
        link = self._child_to_group.get(out.request_id)
        if link is None:
            return out
        parent_id, index = link
        group = self._groups[parent_id]
        merged = group.merge(index, out)
        if group.is_finished:
            del self._groups[parent_id]
            for cid in group.child_ids():
                self._child_to_group.pop(cid, None)
        return merged

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

