"""Parallel sampling: one request, several sequences (`n`, `best_of`).

A request with ``params.num_samples == k > 1`` becomes k child requests with the
same prompt (the engine core, `ember.engine.core`). The first child is scheduled at
once; the others join only after it has computed its prompt, so that with prefix
caching they take the prompt's full KV blocks by reference count instead of
computing them again (only the prompt's last, partial block is computed per child —
at most ``block_size`` tokens, no copy). Child ``i`` samples with ``seed + i`` when
the request has a seed.

The output processor reports a group as one request: every output of a child becomes a
`RequestOutput` of the parent id whose ``outputs`` hold all children's
completions so far (ordered by index) and whose ``index`` says which completion
this step's ``new_token_ids`` / ``new_text`` belong to; ``finished`` is set once,
when the last child finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return replace(params, n=1, best_of=None, seed=seed)


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


@dataclass
class SampleGroup:
    parent_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # choose the n best of best_of when the group finishes (cumulative outputs only:
    # delta outputs hold pieces, nothing to rank)
    rank_at_end: bool = True
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0

    @property
    def num_samples(self) -> int:
        return self.params.num_samples

    @property
    def is_finished(self) -> bool:
        return self.num_finished == self.num_samples

    def child_ids(self) -> list[str]:
        return [child_id(self.parent_id, i) for i in range(self.num_samples)]

    def merge(self, index: int, out: RequestOutput) -> RequestOutput:
        """Fold one child's output into the parent's view."""
        completion = replace(out.outputs[0], index=index)
        self.completions[index] = completion
        if out.finished:
            self.num_finished += 1
        outputs = [self.completions[i] for i in sorted(self.completions)]
        candidates = None
        params = self.params
        if self.is_finished and self.rank_at_end and params.best_of is not None and params.best_of > params.n:
            # the one place best_of is decided: the n best first, the others kept in order
            ranked = best_completions(outputs, len(outputs), by=params.best_of_ranking)
            outputs = [replace(c, index=i) for i, c in enumerate(ranked[: params.n])]
            candidates = [replace(c, index=params.n + i) for i, c in enumerate(ranked[params.n :])]
        return RequestOutput(
            request_id=self.parent_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            candidates=candidates,
            finished=self.is_finished,
            new_token_ids=out.new_token_ids,
            new_text=out.new_text,
            prompt_logprobs=out.prompt_logprobs,
            index=index,
            metrics=out.metrics,
        )


def best_completions(outputs: list[CompletionOutput], n: int, by: str = "cumulative") -> list[CompletionOutput]:
    """The n best of best_of candidates: by cumulative logprob (vLLM) or mean logprob (TGI)."""

    def score(c: CompletionOutput) -> float:
        total = c.cumulative_logprob
        return total / max(1, len(c.token_ids)) if by == "mean" else total

    return sorted(outputs, key=score, reverse=True)[:n]
