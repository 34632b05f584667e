"""The engine's side of grammar-guided decoding: compiles constraints off the step,
holds requests until their grammar is ready, and keeps one matcher per running
constrained request.

* **Compiling** runs in worker processes (`ember.engine.grammar_workers`: lowered
  priority, a memory limit, killed at the timeout) for a backend whose grammars
  serialize (both built-in ones), else on worker threads; never on the step. Compiled
  grammars are cached by (backend, constraint); the manager belongs to one engine, so
  to one tokenizer. A request whose constraint is in the cache, compiled or still
  compiling, shares that work.
* **Waiting**: a constrained request stays here, outside the scheduler, until its
  grammar is compiled; the step goes on for the others. A compile error, or a compile
  past ``compile_timeout_s`` (a worker's: in CPU seconds, or `WALL_FACTOR` times it in
  all; a thread's: since submission) ends only that request, with the message. A worker's compile is then stopped (its process killed) unless another
  request waits for it; a thread's runs on (a thread cannot be stopped).
* **Fallback**: a request that names no backend and whose constraint the default
  backend refuses (a kind it does not compile, a schema keyword it cannot enforce) is
  compiled by the first other registered backend (by name) that accepts it, and the
  switch is logged; a request that names its backend gets that backend's refusal.
* **Matchers** follow each request's output: the engine advances them by the tokens a
  step emitted (accepted drafts and the sampled token) after the scheduler has
  recorded them. A preempted request keeps its output tokens, and its matcher stands
  where they left it, so preemption needs no rollback; rollback undoes only the draft
  positions the masks walked through.
* **Guards**: each matcher is wrapped in a `GuardedMatcher` (ember.engine.grammar_guard):
  the budget that makes outputs close within ``max_tokens``, the repetition bound, and
  reasoning left free before the grammar (`SamplingParams.grammar_after`).
* **Masks**: one packed bitmask for every constrained row of the step, filled by the
  matchers, unpacked to bool rows in one operation.

The counters (`compile_time_s`, `num_compiles`, `num_cache_hits`, `num_compile_errors`,
`num_compile_timeouts`) are for metrics; they only grow.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ember.engine.grammar_guard import GuardedMatcher, GuardSettings, Vocab
from ember.engine.grammar_workers import WALL_FACTOR, CompilePool
from ember.plugin.grammar import (
    BaseCompiledGrammar,
    BaseGrammarBackend,
    Constraint,
    GrammarCompileTimeout,
    GrammarContext,
    GrammarError,
    UnsupportedFeatureError,
)
from ember.plugin.registry import Registry
from ember.sampling_params import SamplingParams
from ember.sched.scheduler import RequestUpdate
from ember.sched.step import SchedulerOutput

logger = logging.getLogger(__name__)

NUM_COMPILE_THREADS = 2
MAX_CACHED_GRAMMARS = 256


@dataclass(slots=True)
class _Waiting:
    item: Any  # what the engine gets back when the grammar is ready (its request)
    future: concurrent.futures.Future
    submitted_at: float
    description: str


class GrammarManager:
    """Not thread-safe, except the counters: one thread (the engine's) calls it."""

    def __init__(
        self, registry: Registry, context: GrammarContext, default_backend: str, compile_timeout_s: float,
        guard: GuardSettings = GuardSettings(), num_workers: int = 1, worker_memory_mb: int = 2048,
        worker_priority: str = "idle",
    ) -> None:
        self.registry = registry
        self.guard = guard
        self._vocab: Vocab | None = None  # built by the first matcher
        self.context = context
        self.default_backend = default_backend
        self.compile_timeout_s = compile_timeout_s
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # started by the first constraint
        self.num_workers = num_workers
        self.worker_memory_mb = worker_memory_mb
        self.worker_priority = worker_priority
        self.pool: CompilePool | None = None  # the worker processes, started by the first constraint
        self._backends: dict[str, BaseGrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, Constraint, bool], concurrent.futures.Future] = OrderedDict()
        # read-only outside: the requests held for their grammar, the running ones' matchers
        # (the engine tests them for emptiness each step without a call)
        self.waiting: dict[str, _Waiting] = {}
        self.matchers: dict[str, GuardedMatcher] = {}
        self._bitmask = torch.zeros((0, context.num_mask_words), dtype=torch.int32)
        self._counter_lock = threading.Lock()
        self.compile_time_s = 0.0
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_compile_errors = 0
        self.num_compile_timeouts = 0

    # -- compiling -------------------------------------------------------------
    def backend_class(self, params: SamplingParams) -> type[BaseGrammarBackend]:
        """The backend a request names (else the engine's default, or the first other
        one that compiles its constraint's kind); ValueError naming an unknown one,
        UnsupportedFeatureError for a constraint kind it does not compile."""
        name = params.grammar_backend or self.default_backend
        if name not in self.registry:
            known = ", ".join(self.registry.names()) or "none"
            raise ValueError(f"unknown grammar backend {name!r}; registered: {known}")
        cls = self.registry.get(name)
        if params.grammar_backend is None and params.constraint.kind not in cls.supported_kinds:
            other = next((c for c in self._fallbacks(cls) if params.constraint.kind in c.supported_kinds), None)
            if other is not None:
                logger.info("grammar backend %r does not compile %s constraints; %r does",
                            cls.name, params.constraint.kind.value, other.name)
                return other
        cls.check_kind(params.constraint)
        return cls

    def _fallbacks(self, cls: type[BaseGrammarBackend]) -> list[type[BaseGrammarBackend]]:
        return [other for name, other in self.registry.items() if name != cls.name]

    def submit(self, request_id: str, params: SamplingParams, item: Any) -> None:
        """Hold ``item`` (the request) until the grammar of ``params.constraint`` is
        compiled; `collect` hands it back. Raises as `backend_class` does."""
        cls = self.backend_class(params)
        fallbacks = self._fallbacks(cls) if params.grammar_backend is None else []
        # a grammar a fallback compiled must not answer a request that named the backend
        key = (cls.name, params.constraint, bool(fallbacks))
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
        elif cls.serializes_grammars and self.num_workers > 0:
            future = self._compile_pool().submit(
                cls.name, params.constraint, tuple(c.name for c in fallbacks), f"{params.constraint.describe()}",
            )
            self._cache[key] = future
        else:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(NUM_COMPILE_THREADS, "ember-grammar")
            future = self._executor.submit(self._compile, cls, params.constraint, fallbacks)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)  # a request waiting on it keeps its future
        description = f"{params.constraint.describe()} (grammar backend {cls.name!r})"
        self.waiting[request_id] = _Waiting(item, future, time.monotonic(), description)

    def _compile_pool(self) -> CompilePool:
        if self.pool is None:
            self.pool = CompilePool(
                dict(self.registry.items()), self.context, self.num_workers, self.compile_timeout_s,
                self.worker_memory_mb, self._load, self._count_compile, self.worker_priority,
            )
        return self.pool

    def _load(self, name: str, data: bytes) -> BaseCompiledGrammar:
        """On a worker's slot thread: a worker's grammar, loaded by this process's instance of its backend."""
        return self._backend(self.registry.get(name)).load_grammar(data)

    def _count_compile(self, seconds: float) -> None:
        with self._counter_lock:
            self.compile_time_s += seconds
            self.num_compiles += 1

    def close(self) -> None:
        """Stop the compile workers (their processes end; idempotent)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _backend(self, cls: type[BaseGrammarBackend]) -> BaseGrammarBackend:
        with self._backend_lock:
            backend = self._backends.get(cls.name)
            if backend is None:
                backend = self._backends[cls.name] = cls(self.context)
        return backend

    def _compile(
        self, cls: type[BaseGrammarBackend], constraint: Constraint, fallbacks: list[type[BaseGrammarBackend]],
    ) -> BaseCompiledGrammar:
        """On a compile thread: with ``cls``, else the first of ``fallbacks`` that does
        not refuse a feature of the constraint (the first refusal is raised if all do)."""
        try:
            return self._compile_with(cls, constraint)
        except UnsupportedFeatureError as refusal:
            for other in fallbacks:
                if constraint.kind not in other.supported_kinds:
                    continue
                try:
                    grammar = self._compile_with(other, constraint)
                except UnsupportedFeatureError:
                    continue
                logger.info("%s; compiled %s with grammar backend %r instead", refusal, constraint.describe(), other.name)
                return grammar
            raise

    def _compile_with(self, cls: type[BaseGrammarBackend], constraint: Constraint) -> BaseCompiledGrammar:
        backend = self._backend(cls)
        started = time.perf_counter()
        try:
            return backend.compile(constraint)
        finally:
            with self._counter_lock:
                self.compile_time_s += time.perf_counter() - started
                self.num_compiles += 1

    def collect(self, wait_s: float = 0.0) -> tuple[list[tuple[Any, BaseCompiledGrammar]], list[tuple[Any, str]]]:
        """The held items whose grammar is ready, with it, and those that failed, with
        the message to give their caller (an invalid or unsupported constraint, a
        compile past the timeout). ``wait_s``: block up to that long for a compile to
        end when none has (the engine has nothing else to do)."""
        if wait_s > 0 and not any(w.future.done() for w in self.waiting.values()):
            concurrent.futures.wait(
                {w.future for w in self.waiting.values()}, timeout=wait_s,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        ready: list[tuple[Any, BaseCompiledGrammar]] = []
        failed: list[tuple[Any, str]] = []
        now = time.monotonic()
        for request_id, waiting in list(self.waiting.items()):
            future = waiting.future
            if future.done():
                del self.waiting[request_id]
                exc = future.exception()
                if exc is None:
                    ready.append((waiting.item, future.result()))
                    continue
                if isinstance(exc, GrammarCompileTimeout):  # stopped in its worker: the machine may have been busy
                    self.num_compile_timeouts += 1
                    self._forget(future)
                    failed.append((waiting.item, str(exc)))
                    continue
                self.num_compile_errors += 1
                if isinstance(exc, GrammarError):
                    failed.append((waiting.item, str(exc)))
                    continue
                # a backend's own failure: not the constraint's fault, so not cached
                logger.error("grammar backend failed to compile %s", waiting.description, exc_info=exc)
                self._forget(future)
                failed.append((waiting.item, f"compiling {waiting.description} failed: {exc!r}"))
            elif now - self._started_at(waiting) > self._wall_timeout(waiting):
                del self.waiting[request_id]
                self.num_compile_timeouts += 1
                self._give_up(future, stop=True)
                failed.append((waiting.item, (
                    f"compiling {waiting.description} took longer than {self.compile_timeout_s:g} s "
                    "(--grammar-compile-timeout, grammar_compile_timeout_s)"
                )))
        return ready, failed

    def _wall_timeout(self, waiting: _Waiting) -> float:
        """A worker's compile is stopped by its CPU time (the pool watches it), or past
        `WALL_FACTOR` times the timeout; a thread's at the timeout."""
        owned = self.pool is not None and self.pool.owns(waiting.future)
        return self.compile_timeout_s * (WALL_FACTOR if owned else 1)

    def _started_at(self, waiting: _Waiting) -> float:
        """When the request's compile began: a worker's, once it left the queue (a
        queued one has not begun); a thread's, at submission."""
        if self.pool is None or not self.pool.owns(waiting.future):
            return waiting.submitted_at
        started = self.pool.started_at(waiting.future)
        return time.monotonic() if started is None else max(started, waiting.submitted_at)

    def _give_up(self, future: concurrent.futures.Future, stop: bool) -> None:
        """No request waits for ``future`` any more: a worker's queued compile is dropped,
        and a running one stopped when ``stop`` (a timeout, not an abort, whose
        constraint may come again)."""
        if self.pool is None or any(w.future is future for w in self.waiting.values()):
            return
        if future.cancel() or stop:
            self.pool.abandon(future)
            self._forget(future)

    def _forget(self, future: concurrent.futures.Future) -> None:
        for key, cached in list(self._cache.items()):
            if cached is future:
                del self._cache[key]

    def waiting_ids(self) -> list[str]:
        return list(self.waiting)

    def discard(self, request_id: str) -> Any | None:
        """Stop holding a request (aborted); its item, or None if it was not held."""
        waiting = self.waiting.pop(request_id, None)
        if waiting is None:
            return None
        self._give_up(waiting.future, stop=False)
        return waiting.item

    # -- matchers --------------------------------------------------------------
    def add_matcher(
        self, request_id: str, grammar: BaseCompiledGrammar, params: SamplingParams | None = None,
        context_left: int | None = None,
    ) -> None:
        """A matcher for a request about to run; ``params`` give its ``max_tokens`` and
        reasoning span, ``context_left`` the tokens its context has room for."""
        if self._vocab is None:
            context = self.context
            self._vocab = Vocab(context.token_bytes, context.eos_token_ids, context.num_mask_words)
        budget = min(params.max_tokens if params is not None else 1 << 30,
                     context_left if context_left is not None else 1 << 30)
        span = params.grammar_after if params is not None else None
        self.matchers[request_id] = GuardedMatcher(grammar.create_matcher(), budget, self.guard, self._vocab, span)

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def advance(self, updates: Iterable[RequestUpdate]) -> tuple[list[str], dict[str, str]]:
        """Advance the matchers of the step's unfinished requests by their new tokens.
        Returns the requests whose grammar is now complete (nothing but EOS may follow:
        they are done) and, by id, a message for each request that emitted a token its
        grammar does not allow (a backend that broke its contract)."""
        finished: list[str] = []
        errors: dict[str, str] = {}
        for update in updates:
            request = update.request
            matcher = self.matchers.get(request.request_id)
            if matcher is None or request.is_finished or not update.new_token_ids:
                continue
            new_ids = update.new_token_ids
            num = matcher.accept_tokens(new_ids)
            if num < len(new_ids):
                errors[request.request_id] = (
                    f"token {new_ids[num]} was sampled where the grammar does not allow it "
                    f"(after {request.num_output_tokens - len(new_ids) + num} tokens)"
                )
            elif matcher.is_finished:
                finished.append(request.request_id)
        return finished, errors

    def masks(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Allowed-token masks (bool ``(positions, vocab_size)``) of the step's sampling
        requests that have a matcher: one row per position, the draft positions masked
        as if the drafts before them were accepted."""
        ids = [rid for rid in scheduler_output.sampling_request_ids if rid in self.matchers]
        if not ids:
            return {}
        drafts = scheduler_output.draft_token_ids
        num_rows = len(ids) + sum(len(drafts.get(rid, ())) for rid in ids)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.zeros((max(num_rows, 2 * self._bitmask.shape[0]), self.context.num_mask_words),
                                        dtype=torch.int32)
        bitmask = self._bitmask
        spans: list[tuple[str, int, int]] = []
        row = 0
        for request_id in ids:
            matcher = self.matchers[request_id]
            draft = drafts.get(request_id, ())
            matcher.fill_bitmask(bitmask, row)
            num_accepted = 0
            for k, token_id in enumerate(draft):
                if matcher.accept_tokens((token_id,)) != 1:
                    # the runner rejects this draft (its logit is -inf), so later rows
                    # are never sampled from; they only need some allowed token
                    bitmask[row + k + 1 : row + len(draft) + 1] = bitmask[row + k]
                    break
                num_accepted += 1
                matcher.fill_bitmask(bitmask, row + k + 1)
            matcher.rollback(num_accepted)
            spans.append((request_id, row, 1 + len(draft)))
            row += 1 + len(draft)
        # bit t % 32 of int32 word t // 32 is token t: the words' little-endian bytes,
        # read bit by bit from the low end, are the tokens in order
        words = bitmask[:num_rows].numpy().astype("<i4", copy=False)
        bits = np.unpackbits(words.view(np.uint8), axis=1, count=self.context.vocab_size, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
        return {request_id: allowed[start : start + n] for request_id, start, n in spans}
