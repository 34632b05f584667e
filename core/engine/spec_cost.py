"""Cost-aware speculation (docs/speculative.md, "Cost-aware speculation"): what a
decode step costs by the query tokens it computes, learned online from the step
timings; how often each request's drafts are accepted, per draft position; and the
drafts per request that maximise the step's expected tokens per second (none where
a plain step does better). Plain Python on a handful of numbers: a few microseconds
a step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def batch_bucket(batch: int) -> int:
    """Batches of up to 8 each their own; larger ones by the power of two above."""
    return batch if batch <= 8 else 1 << (batch - 1).bit_length()


class _Point:
    """The last ``window`` times of steps of one shape; their lower quartile is the
    estimate: what disturbs a step (the OS preempting it on a shared machine, a
    kernel's first-use compile) only ever adds time, so the low samples are the
    shape's own cost and one slow step is outvoted by the next normal one."""

    __slots__ = ("samples", "seconds")

    def __init__(self, window: int) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.seconds = sorted(self.samples)[(len(self.samples) - 1) // 4]


class StepCostModel:
    """Seconds of a decode step by (batch size bucket, query tokens in the step): the
    lower quartile of the last ``window`` steps per measured shape (_Point), each sample first clipped
    at ``clip`` times what the shape of fewest tokens costs per token (once that has
    3 samples: computing more rows never costs more than proportionally, so a step
    the OS preempted, or a kernel's first-use compile, cannot make a shape look dear
    for long); between measured points the
    line joining them; beyond them the least-squares line through the bucket's
    points (slope at least 0), or, with one point, that point plus ``prior_slope``
    of a plain step per extra token per request, an optimistic guess that makes the
    decoder try drafts and so measure them. A step of fewer tokens is never
    estimated dearer than a measured one of more."""

    def __init__(self, window: int = 9, clip: float = 2.0, prior_slope: float = 0.02) -> None:
        self.window = window
        self.clip = clip
        self.prior_slope = prior_slope
        self._points: dict[int, dict[int, _Point]] = {}

    def observe(self, batch: int, tokens: int, seconds: float) -> float:
        """Learn a step's time; returns it as learned (clipped)."""
        points = self._points.setdefault(batch_bucket(batch), {})
        if points:
            fewest = min(points)
            if len(points[fewest].samples) >= 3:
                seconds = min(seconds, self.clip * points[fewest].seconds * max(1.0, tokens / fewest))
        point = points.get(tokens)
        if point is None:
            point = points[tokens] = _Point(self.window)
        point.add(seconds)
        return seconds

    def measured(self, batch: int, tokens: int) -> bool:
        return tokens in self._points.get(batch_bucket(batch), {})

    def cost(self, batch: int, tokens: int) -> float | None:
        """Estimated seconds of a step computing ``tokens`` query tokens for ``batch``
        decoding requests; None before anything in its bucket was measured."""
        points = self._points.get(batch_bucket(batch))
        if not points:
            return None
        xs = sorted(points)
        dearer = [points[x].seconds for x in xs if x > tokens]
        return min([self._estimate(batch, points, xs, tokens)] + dearer)

    def _estimate(self, batch: int, points: dict[int, _Point], xs: list[int], tokens: int) -> float:
        if tokens in points:
            return points[tokens].seconds
        below = [x for x in xs if x < tokens]
        above = [x for x in xs if x > tokens]
        if below and above:
            lo, hi = below[-1], above[0]
            t = (tokens - lo) / (hi - lo)
            return points[lo].seconds + t * (points[hi].seconds - points[lo].seconds)
        anchor = below[-1] if below else above[0]
        floor = 0.5 * min(p.seconds for p in points.values())  # a line falling below the fewest tokens' cost
        return max(floor, points[anchor].seconds + self.slope(batch) * (tokens - anchor))

    def slope(self, batch: int) -> float:
        """Seconds per extra query token in the bucket of ``batch``."""
        points = self._points[batch_bucket(batch)]
        if len(points) < 2:
            (x, point), = points.items()
            return self.prior_slope * point.seconds / max(1, batch)
        xs = list(points)
        ys = [points[x].seconds for x in xs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """Measured milliseconds by bucket, then query tokens (for /info and the benchmark)."""
        return {str(b): {str(t): round(p.seconds * 1e3, 3) for t, p in sorted(pts.items())}
                for b, pts in sorted(self._points.items())}


@dataclass(slots=True)
class _Counts:
    tried: list[float]
    accepted: list[float]


class AcceptanceModel:
    """The chance draft j is accepted given drafts 1..j-1 were, per request: decayed
    counts (``decay`` per observation, so recent drafts weigh most) of the request's
    own drafts at position j, plus ``weight`` pseudo-drafts at the rate of every
    request's drafts there (which start at ``prior``, with one pseudo-draft)."""

    def __init__(self, max_drafts: int, prior: float = 0.5, decay: float = 0.8, weight: float = 2.0,
                 global_decay: float = 0.99) -> None:
        self.max_drafts = max_drafts
        self.prior = prior
        self.decay = decay
        self.weight = weight
        self.global_decay = global_decay
        self._all = _Counts([0.0] * max_drafts, [0.0] * max_drafts)
        self._requests: dict[str, _Counts] = {}

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        counts = self._requests.get(request_id)
        if counts is None:
            counts = self._requests[request_id] = _Counts([0.0] * self.max_drafts, [0.0] * self.max_drafts)
        for own, decay in ((counts, self.decay), (self._all, self.global_decay)):
            tried = min(num_proposed, num_accepted + 1)  # drafts after the first rejection were never judged
            for j in range(min(tried, self.max_drafts)):
                own.tried[j] = own.tried[j] * decay + 1.0
                own.accepted[j] = own.accepted[j] * decay + (1.0 if j < num_accepted else 0.0)

    def rates(self, request_id: str, k: int) -> list[float]:
        """a_1..a_k for the request's next drafts."""
        counts = self._requests.get(request_id)
        out = []
        for j in range(min(k, self.max_drafts)):
            shared = (self._all.accepted[j] + self.prior) / (self._all.tried[j] + 1.0)
            if counts is None:
                out.append(shared)
            else:
                out.append((counts.accepted[j] + self.weight * shared) / (counts.tried[j] + self.weight))
        return out

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def expected_tokens(rates: list[float], k: int) -> float:
    """E[tokens](k) = 1 + sum_{j<=k} prod_{i<=j} a_i: the bonus token plus each draft
    accepted with all before it."""
    total, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


def choose_drafts(offers: dict[str, int], rates: dict[str, list[float]], batch: int,
                  cost) -> tuple[dict[str, int], float, float]:
    """Drafts per request for a step of ``batch`` decoding requests, each offered up to
    ``offers[id]`` drafts with acceptance ``rates[id]``; ``cost(tokens)``: a step's
    estimated seconds. The greedy rule: every draft (request i, position j) gains
    prod_{l<=j} a_il expected tokens, which falls with j, so taking drafts in order of
    falling gain keeps each request's drafts a prefix; of the n = 0..all first drafts
    in that order, keep the n maximising (batch + gains) / cost(batch + n). Returns the
    drafts per request (0s left out), that rate and the plain step's (tokens/s)."""
    gains = []
    for request_id, k in offers.items():
        run = 1.0
        for j, a in enumerate(rates[request_id][:k]):
            run *= a
            gains.append((-run, j, request_id))
    gains.sort()
    plain = batch / cost(batch)
    best_rate, best_n, total = plain, 0, float(batch)
    for n, (neg_gain, _, _) in enumerate(gains, 1):
        total -= neg_gain
        rate = total / cost(batch + n)
        if rate > best_rate:
            best_rate, best_n = rate, n
    chosen: dict[str, int] = {}
    for _, _, request_id in gains[:best_n]:
        chosen[request_id] = chosen.get(request_id, 0) + 1
    return chosen, best_rate, plain


@dataclass
class ExplorationBudget:
    """When a probe step may verify drafts the cost model turned down (or run plain
    where it never has), so the model keeps learning where it stopped speculating: at
    most one probe in ``interval`` decode steps, and only while the probes' measured
    extra time stays under ``fraction`` of all decode-step time."""

    interval: int = 32
    fraction: float = 0.02
    steps_since: int = 0
    total_s: float = 0.0
    extra_s: float = 0.0
    num_probes: int = field(default=0)

    def due(self) -> bool:
        return self.steps_since >= self.interval and self.extra_s <= self.fraction * self.total_s

    def step(self, seconds: float, probe_extra_s: float | None) -> None:
        """One decode step's time; ``probe_extra_s``: what a probe cost over the chosen step."""
        self.total_s += seconds
        if probe_extra_s is None:
            self.steps_since += 1
        else:
            self.extra_s += max(0.0, probe_extra_s)
            self.steps_since = 0
            self.num_probes += 1
