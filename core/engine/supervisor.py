"""Restarting a dead engine-core process in place (`ember serve --restart-engine-on-failure`).

By default an engine core that dies (SIGKILL, a segfault in a kernel, the OOM killer, a
parallel worker lost) stops the server: it drains and exits non-zero, and the
orchestrator starts a new one (vLLM's behaviour). With the flag, `AsyncLLMEngine`'s
reader thread asks `CoreSupervisor.replace` for a fresh core of the same config instead;
the requests the dead core held cannot be resumed (their KV cache died with it) and end
with an error. The restarts are bounded: at most ``max_restarts`` within a sliding
``window_s`` (an hour) — a core that keeps dying (a poisoned request replayed by
clients, a device gone bad) then stops the server as without the flag.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.engine.core_process import EngineCoreProcess

logger = logging.getLogger(__name__)

RESTART_WINDOW_S = 3600.0  # --max-engine-restarts counts the restarts of the last hour


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds."""

    max_restarts: int = 3
    window_s: float = RESTART_WINDOW_S
    restart_times: deque[float] = field(default_factory=deque)  # time.monotonic() of each restart

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-engine-restarts must be >= 0, got {self.max_restarts}")

    def allows_restart(self, now: float) -> bool:
        while self.restart_times and now - self.restart_times[0] >= self.window_s:
            self.restart_times.popleft()
        return len(self.restart_times) < self.max_restarts

    def record(self, now: float) -> None:
        self.restart_times.append(now)


class CoreSupervisor:
    """Starts the replacement of a dead engine-core process, within its `RestartPolicy`."""

    def __init__(self, config: EngineConfig, policy: RestartPolicy) -> None:
        self.config = config
        self.policy = policy
        self.num_restarts = 0  # since start: ember_engine_restarts_total

    def replace(self, dead, cause: BaseException):
        """A new `EngineCoreProcess` for ``dead`` (closed here), or None when the policy
        allows no more restarts. Blocks while the new core loads its model; raises what
        its start raises."""
        dead.close(timeout=5)
        now = time.monotonic()
        if not self.policy.allows_restart(now):
            logger.error("the engine core died (%s); %d restart(s) within the last %.0f s already "
                         "(--max-engine-restarts %d): the server stops", cause, len(self.policy.restart_times),
                         self.policy.window_s, self.policy.max_restarts)
            return None
        self.policy.record(now)
        self.num_restarts += 1
        logger.error("the engine core died (%s); restarting it (restart %d, %d of %d allowed within %.0f s); "
                     "its requests in flight ended with an error", cause, self.num_restarts,
                     len(self.policy.restart_times), self.policy.max_restarts, self.policy.window_s)
        started = time.monotonic()
        process = EngineCoreProcess(self.config)
        process.config = self.config
        logger.info("the engine core restarted in %.1f s; serving again", time.monotonic() - started)
        return process
