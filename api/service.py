"""What every route shares: the engine client, the limits, admission control, a few
threads that prepare requests off the event loop, and the server's lifecycle.

Tokenizing and chat templating take time that grows with the request (seconds for
a 2 MB prompt), so routes run them with `run_blocking` on the service's own small
thread pool, never on the event loop: /health answers meanwhile. Before that,
`check_chars` refuses a text that cannot fit --max-input-tokens, by its length alone.
`with_watermark` turns a request's ``watermark: true`` into the processor's entry in
its ``extra`` (both TGI and OpenAI routes take it).

`Lifecycle`: readiness, warm-up and draining. The server is *starting* until a
warm-up request (a short prompt, one token) has run through the engine, then
*ready*; ``/health`` answers 503 until then. On SIGTERM (or SIGINT) it *drains*:
``/health`` and every API route answer 503, requests in flight run to their end for
up to the graceful-termination timeout, those still running then are ended with an
error (an error event on a stream, an error body otherwise), and only then does the
server stop listening.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.api.errors import APIError, overloaded, validation_error
from ember.api.observability import GenerationRecord, current
from ember.api.settings import ResolvedLimits
from ember.api.structured_outputs import GRAMMAR_ERROR_TYPE
from ember.engine.client import EngineClient
from ember.errors import EngineDeadError, RequestAbortedError
from ember.grammar_limits import GrammarLimitError
from ember.outputs import OutputKind, RequestOutput
from ember.plugin.adapter import UnknownAdapterError
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.api.lifecycle")  # the name the lifecycle has always logged under

T = TypeVar("T")
NUM_PREPARE_THREADS = 4  # tokenizers release the GIL; a few threads keep one huge prompt from queueing the rest
WARM_UP_PROMPT = "Ember warm-up: the quick brown fox jumps over the lazy dog."
FLUSH_TIMEOUT_S = 5.0  # after aborting, how long the aborted requests get to send their error


@dataclass(frozen=True)
class ServedModel:
    """The model as this server names it (``model_id``: --served-model-name or the model)."""

    model_id: str
    dtype: str
    backend: str
    version: str
    created: int
    reasoning_parser: str | None = None  # --reasoning-parser: its registered name, None when off
    tool_call_parser: str | None = None  # --tool-call-parser: its registered name, None: chosen by the chat template


class GenerationService:
    def __init__(self, client: EngineClient, limits: ResolvedLimits, info: ServedModel) -> None:
        self.client = client
        self.limits = limits
        self.info = info
        self.model_info = client.model_info
        self.num_in_flight = 0
        self.started_at = time.time()
        self.chars_per_token = self.model_info.max_chars_per_token
        # adapter name -> the base model /v1/models names as its parent, where --lora-modules' JSON form named one
        self.adapter_parents: dict[str, str] = {}
        # the served model's images (`ember.api.routes.media.ServerMedia`), set by `create_app`
        self.media: Any = None
        self._executor = ThreadPoolExecutor(NUM_PREPARE_THREADS, thread_name_prefix="ember-prepare")

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a preparation thread (in this request's context), off the event loop."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- adapters (LoRA) ----------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self.model_info.lora is not None

    def served_names(self) -> list[str]:
        """The base model's name, then every loaded adapter's (what /v1/models lists)."""
        return [self.info.model_id, *self.client.adapters()]

    def adapter_for_model(self, model: str) -> str | None:
        """The OpenAI ``model`` field: the served model's name is the base (None), a loaded
        adapter's name that adapter; another name is a 404 listing what is served. With
        adapters off any name is the base (and echoed back), as before adapters existed."""
        if not self.lora_enabled or model == self.info.model_id:
            return None
        if model in self.client.adapters():
            return model
        raise APIError(404, f"The model `{model}` does not exist; served models: "
                       f"{', '.join(self.served_names())} (GET /v1/models lists them)", "model_not_found", "model")

    def adapter_for_id(self, adapter_id: str | None) -> str | None:
        """TGI's ``parameters.adapter_id``: null (or the served model's name) is the base; a
        loaded adapter's name that adapter; another name is a 404 listing the loaded ones."""
        if adapter_id is None or adapter_id == self.info.model_id:
            return None
        if not self.lora_enabled:
            raise APIError(404, f"adapter {adapter_id!r} is not loaded: LoRA adapters are off (start the server "
                           "with --enable-lora or --lora-modules NAME=PATH)", "adapter_not_found", "adapter_id")
        loaded = self.client.adapters()
        if adapter_id in loaded:
            return adapter_id
        raise APIError(404, f"adapter {adapter_id!r} is not loaded; loaded adapters: {', '.join(loaded) or 'none'}",
                       "adapter_not_found", "adapter_id")

    def check_chars(self, text: str, input_name: str, max_tokens: int | None = None) -> None:
        """422 for a text too long to fit ``max_tokens`` (default --max-input-tokens)
        whatever its tokens (see `ember.models.tokenizer.max_chars_per_token`), without
        tokenizing it."""
        max_tokens = self.limits.max_input_tokens if max_tokens is None else max_tokens
        if self.chars_per_token is not None and len(text) > self.chars_per_token * max_tokens:
            raise validation_error(
                f"`{input_name}` must have at most {max_tokens} tokens; its {len(text)} "
                f"characters are more than that many tokens can hold", input_name,
            )

    def acquire(self) -> None:
        """Count a request in flight; past --max-concurrent-requests answer 429 at once.
        Every successful acquire is paired with exactly one `release`."""
        if self.num_in_flight >= self.limits.max_concurrent_requests:
            raise overloaded()
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1

    @contextmanager
    def admit(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks (vocabulary, context, KV capacity) as a 422; a constraint
        over the grammar size limits as the 400 a grammar that failed to compile gets."""
        try:
            self.client.validate(None, params, prompt_ids)
        except GrammarLimitError as exc:
            raise APIError(400, str(exc), GRAMMAR_ERROR_TYPE) from None
        except ValueError as exc:
            raise validation_error(str(exc)) from None

    @property
    def tokenizer(self) -> EngineClient:
        """The tokenizer's operations (``encode``, ``decode``, ``apply_chat_template``)
        are the client's: there is no other tokenizer on this side of the engine."""
        return self.client

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.client.encode(text, add_special_tokens=add_special_tokens)

    def encode_with_offsets(self, text: str, keep_last: int) -> tuple[int, list[int], list[tuple[int, int]]]:
        """See `EngineClient.encode_with_offsets`."""
        return self.client.encode_with_offsets(text, keep_last)

    def check_lengths(self, num_input: int, max_new_tokens: int | None, input_name: str = "inputs") -> int:
        """Apply the TGI limits; return max_new_tokens (defaulting to the room left)."""
        limits = self.limits
        if num_input == 0:
            raise validation_error(f"`{input_name}` is empty: it has no tokens", input_name)
        if num_input > limits.max_input_tokens:
            raise validation_error(
                f"`{input_name}` must have at most {limits.max_input_tokens} tokens. Given: {num_input}", input_name
            )
        if max_new_tokens is None:
            max_new_tokens = limits.max_total_tokens - num_input
        if num_input + max_new_tokens > limits.max_total_tokens:
            raise validation_error(
                f"`{input_name}` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                f"Given: {num_input} `{input_name}` tokens and {max_new_tokens} `max_new_tokens`",
                "max_new_tokens",
            )
        return max_new_tokens

    def check_stop(self, stop: list[str], param: str = "stop") -> None:
        if len(stop) > self.limits.max_stop_sequences:
            raise validation_error(
                f"`{param}` supports at most {self.limits.max_stop_sequences} stop sequences. Given: {len(stop)}", param
            )

    async def generate(
        self, prompt: str | None, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
        output_kind: OutputKind = OutputKind.CUMULATIVE, adapter: str | None = None, mm_items: tuple = (),
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for a request that passed :meth:`validate` (every route
        validates while preparing, so the engine does not again); the current request's
        context records their timings and counts. ``output_kind``: DELTA for streams.
        ``adapter``: a loaded adapter's name (`adapter_for_model` / `adapter_for_id`), None for the base.
        ``mm_items``: the prompt's processed images (`ember.api.routes.media`; ``prompt_ids``
        expanded), passed to the engine only when there are some."""
        record = GenerationRecord(len(prompt_ids), params.num_samples, adapter=adapter)
        ctx = current()
        if ctx is not None:
            ctx.generations.append(record)
        try:
            async for out in self.client.generate(
                prompt, params, prompt_token_ids=prompt_ids, priority=priority, validated=True, output_kind=output_kind,
                **({"adapter": adapter} if adapter is not None else {}), **({"mm_items": mm_items} if mm_items else {}),
            ):
                record.observe(out)
                yield out
        except EngineDeadError as exc:
            record.error_type = "unhealthy"
            raise APIError(503, str(exc), "unhealthy") from None
        except RequestAbortedError as exc:
            record.error_type = "shutting_down"
            raise APIError(503, str(exc), "shutting_down") from None
        except UnknownAdapterError as exc:  # unloaded since the route looked it up
            record.error_type = "adapter_not_found"
            raise APIError(404, str(exc), "adapter_not_found") from None
        except ValueError as exc:
            record.error_type = "validation"
            raise validation_error(str(exc)) from None
        except Exception:
            record.error_type = "generation"
            raise
        finally:
            record.end_time = time.time()

    async def generate_final(
        self, prompt: str | None, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
        adapter: str | None = None, mm_items: tuple = (),
    ) -> RequestOutput:
        last = None
        media = {"mm_items": mm_items} if mm_items else {}
        async for out in self.generate(prompt, prompt_ids, params, priority, adapter=adapter, **media):
            last = out
        assert last is not None and last.finished
        return last

    def token_text(self, token_id: int) -> str:
        return self.client.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.model_info.special_token_ids


def with_watermark(extra: dict | None, is_watermarked: bool | None) -> dict:
    """``extra`` with the watermark processor switched on (TGI's ``watermark: true``);
    its parameters, if ``extra`` already names it, are kept."""
    extra = dict(extra or {})
    if is_watermarked:
        extra.setdefault("watermark", {})
    return extra


# -- readiness, warm-up and draining -----------------------------------------------
class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


class Lifecycle:
    def __init__(self, client: EngineClient, graceful_timeout_s: float) -> None:
        self.client = client
        self.graceful_timeout_s = graceful_timeout_s
        self.phase = Phase.STARTING
        self.warm_up_error: BaseException | None = None
        self.num_active = 0  # API requests being served (counted by the middleware)
        self._drain_task: asyncio.Task | None = None
        self._drain_started = asyncio.Event()

    @property
    def is_ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def is_draining(self) -> bool:
        return self.phase is Phase.DRAINING

    def refusal(self) -> APIError | None:
        """The 503 a new API request gets while draining."""
        if self.is_draining:
            if (dead := self.client.dead_error) is not None:  # say why: the engine stopped (docs/operations.md)
                return APIError(503, f"the engine stopped ({dead}); the server is shutting down and takes no new "
                                "requests", "unhealthy")
            return APIError(503, "the server is shutting down and takes no new requests", "shutting_down")
        return None

    async def wait_drain(self) -> None:
        """Return once draining has begun."""
        await self._drain_started.wait()

    # -- warm-up -------------------------------------------------------------------
    async def warm_up(self) -> None:
        """One forward pass through the engine (prefill and one decode token), then ready."""
        started = time.perf_counter()
        try:
            ids = self.client.encode(WARM_UP_PROMPT)
            ids = ids[: max(1, min(8, self.client.model_info.max_model_len - 2))]
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            async for _ in self.client.generate(None, params, prompt_token_ids=ids, request_id="warm-up"):
                pass
        except Exception as exc:
            self.warm_up_error = exc
            logger.error("warm-up failed; /health stays 503: %r", exc)
            return
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY
        logger.info("warm-up done in %.2f s; ready", time.perf_counter() - started)

    # -- draining ------------------------------------------------------------------
    def begin_drain(self, on_drained: Callable[[], None]) -> None:
        """Stop taking requests, let those in flight end, then call ``on_drained``.
        Called from the event loop's thread; a second call does nothing."""
        if self._drain_task is not None:
            return
        self.phase = Phase.DRAINING
        self._drain_started.set()
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(on_drained))

    async def _drain(self, on_drained: Callable[[], None]) -> None:
        logger.info(
            "shutting down: %d request(s) in flight get up to %.1f s to finish",
            self.num_active, self.graceful_timeout_s,
        )
        try:
            deadline = time.monotonic() + self.graceful_timeout_s
            while self.num_active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.num_active:
                num = self.client.abort_all(
                    f"the server shut down before this request finished (graceful termination timeout "
                    f"{self.graceful_timeout_s:g} s)"
                )
                logger.warning("graceful termination timeout: ended %d request(s) with an error", num)
                deadline = time.monotonic() + FLUSH_TIMEOUT_S
                while self.num_active and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            logger.info("drained; stopping")
        finally:
            on_drained()
