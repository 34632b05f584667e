"""Readiness, warm-up and draining.

The server is *starting* until a warm-up request (a short prompt, one token) has
run through the engine, then *ready*; ``/health`` answers 503 until then. On
SIGTERM (or SIGINT) it *drains*: ``/health`` and every API route answer 503,
requests in flight run to their end for up to the graceful-termination timeout,
those still running then are ended with an error (an error event on a stream, an
error body otherwise), and only then does the server stop listening.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable

from ember.api.errors import APIError
from ember.engine_client import EngineClient
from ember.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARM_UP_PROMPT = "Ember warm-up: the quick brown fox jumps over the lazy dog."
FLUSH_TIMEOUT_S = 5.0  # after aborting, how long the aborted requests get to send their error


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
