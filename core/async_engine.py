"""The engine loop beside an asyncio event loop.

`AsyncLLMEngine` owns one `LLMEngine` and runs its steps in a dedicated thread,
so the event loop (HTTP) never waits on a forward pass. Requests are validated in
the caller's thread (pure checks: tokenization, lengths, parameters), then handed
to the engine thread through a command queue; outputs come back through one
asyncio queue per request. A failing step fails the requests it held, never the
loop: the engine keeps serving the next requests.

It is the `EngineClient` the API uses. Every read of the `LLMEngine`'s attributes
happens in this module (``model_info``, ``stats``, the tokenizer methods), so an
engine that changes its insides updates this one place.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property

from ember.engine import LLMEngine
from ember.engine_client import EngineClient, EngineDeadError, EngineStats, ModelInfo, RequestAbortedError
from ember.logits_processor import BaseLogitsProcessor
from ember.outputs import RequestOutput
from ember.request import check_priority
from ember.sampling_params import SamplingParams
from ember.stats import StepStats
from ember.tokenizer import apply_chat_template, max_chars_per_token

logger = logging.getLogger(__name__)


__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestAbortedError"]


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class _RequestStream:
    """Outputs of one request, pushed from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and the id counter
        self._next_id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None
        self.num_steps = 0
        # called in the engine thread after every step that computed tokens; must be quick
        self._step_listeners: list[Callable[[StepStats], None]] = []

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    # -- requests -------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._next_id += 1
            return f"{prefix}-{self._next_id}"

    def validate(self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None) -> list[int]:
        """Tokenize and check a request without queueing it; ValueError names the problem."""
        return self.engine.validate_request(prompt, params, prompt_token_ids)

    async def generate(
        self,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Validate, queue and stream one request's outputs (the last has ``finished``).
        ``priority``: lower is scheduled first (see `LLMEngine.add_request`).

        Leaving the iterator early (client gone, task cancelled) aborts the request,
        which frees its KV blocks at the engine's next step.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        check_priority(priority)
        ids = self.validate(prompt, params, prompt_token_ids)
        request_id = request_id or self.new_request_id()
        stream = _RequestStream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._commands.put(_Add(request_id, prompt, ids, params, priority))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    def abort_all(self, reason: str) -> int:
        """End every request in flight with `RequestAbortedError(reason)` (its caller sees
        the error, never a silent end) and free its blocks; return how many there were."""
        with self._lock:
            request_ids = list(self._streams)
            streams = list(self._streams.values())
        for request_id, stream in zip(request_ids, streams):
            stream.put(RequestAbortedError(reason))
            self.abort(request_id)
        return len(request_ids)

    @property
    def num_requests(self) -> int:
        """Requests queued or running (those whose caller still waits for outputs)."""
        return len(self._streams)

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener(stats)`` in the engine thread after each step that computed
        tokens. A listener that raises is logged, never stops the loop."""
        self._step_listeners.append(listener)

    # -- the tokenizer (called from any thread: the engine thread never changes it) --------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_with_offsets(self, text: str, keep_last: int) -> tuple[int, list[int], list[tuple[int, int]]]:
        # A fast tokenizer's encoding gives just the offsets asked for (a list of 2 M
        # offsets would hold the GIL for a second).
        tokenizer = self.engine.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            encoding = backend.encode_batch([text], add_special_tokens=True)[0]  # releases the GIL
            num_tokens = len(encoding)
            start = max(0, num_tokens - keep_last)
            offsets = [encoding.token_to_chars(i) or (0, 0) for i in range(start, num_tokens)]  # None: a special token
            return num_tokens, encoding.ids[start:], offsets
        encoding = tokenizer(text, return_offsets_mapping=True)
        ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        start = max(0, len(ids) - keep_last)
        return len(ids), ids[start:], offsets[start:]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return apply_chat_template(self.engine.tokenizer, messages)

    # -- facts and counts ---------------------------------------------------------------
    @cached_property
    def model_info(self) -> ModelInfo:
        engine = self.engine
        kv, scheduler_config = engine.kv_manager, engine.scheduler.config
        return ModelInfo(
            model=engine.config.model,
            model_dir=str(engine.model_dir),
            vocab_size=engine.hf_config.vocab_size,
            max_model_len=engine.max_model_len,
            eos_token_ids=tuple(engine.eos_token_ids),
            special_token_ids=frozenset(engine.tokenizer.all_special_ids),
            max_chars_per_token=max_chars_per_token(engine.tokenizer),
            dtype=str(engine.dtype).removeprefix("torch."),
            backend_name=engine.backend.name,
            backend_description=engine.backend.describe(),
            num_threads=engine.num_threads,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            is_chunked_prefill=scheduler_config.enable_chunked_prefill,
            is_prefix_caching=kv.enable_prefix_caching,
            block_size=kv.block_size,
            num_kv_blocks=kv.num_blocks,
        )

    def stats(self) -> EngineStats:
        scheduler, kv = self.engine.scheduler, self.engine.kv_manager
        counts = scheduler.stats()
        return EngineStats(
            num_running=counts.num_running,
            num_waiting=counts.num_waiting,
            num_free_blocks=counts.num_free_blocks,
            num_total_blocks=counts.num_total_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_prefix_queries=kv.num_prefix_queries,
            num_prefix_hits=kv.num_prefix_hits,
        )

    def logits_processor(self, name: str) -> BaseLogitsProcessor:
        for processor in self.engine.logits_pipeline.processors:
            if processor.name == name:
                return processor
        raise LookupError(f"the logits processor {name!r} is not loaded")

    @property
    def plugin_manager(self):
        return self.engine.plugin_manager

    # -- the engine thread ------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                self._step()
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            logger.exception("engine loop died")
            self._dead_error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            stream = self._streams.get(command.request_id)
            if stream is None:  # the client left before the request reached the engine
                continue
            try:
                self.engine.add_request(
                    command.prompt, command.params, prompt_token_ids=command.prompt_token_ids,
                    request_id=command.request_id, priority=command.priority,
                )
            except ValueError as exc:
                stream.put(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            self.num_steps += 1
        except Exception as exc:
            # Fail the requests in flight, keep the loop alive for the next ones.
            logger.exception("engine step failed; aborting the %d request(s) in flight", len(self._streams))
            self.engine.abort_all()
            self._fail_all(RuntimeError(f"engine step failed: {exc!r}"))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        stats = self.engine.last_step_stats
        if stats is not None and stats.kind != "empty":
            for listener in self._step_listeners:
                try:
                    listener(stats)
                except Exception:
                    logger.exception("step listener %r failed", listener)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(exc)
