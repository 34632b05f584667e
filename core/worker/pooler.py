"""Pooling in the model runner: a pooling request's prompt becomes one vector.

A pooling request (``SamplingParams.pooling``, resolved by the engine core to a
concrete `ember.pooling_params.PoolingParams`) is prefilled like any prompt, in chunks
beside generating requests, and samples nothing. :class:`Pooler` reads its rows of each
step's final hidden states (after the model's final norm, before the LM head:
``BaseCausalLM.forward``'s output) and, on the step that computes its last prompt
token, hands back its vector:

* ``last``: the last prompt token's row; ``cls``: the first prompt token's row (kept
  from the chunk that computed position 0);
* ``mean``: a float32 running sum over every chunk, divided by the prompt's length at
  the end, so chunked prefill gives the same mean as one pass (the scheduler gives such
  requests no prefix-cache blocks: every position is computed here);
* ``logits``: the LM head at the last prompt token, only the requested token ids.

Then ``dimensions`` keeps the first components, and ``normalize`` divides by the L2
norm (in that order: a truncated Matryoshka embedding is normalised again). The vector
leaves as a list of Python floats (float32 values, exactly): a plain value that pickles
by value when the engine core runs in its own process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.pooling_params import PoolingParams


class Pooler:
    """Per-request running state of pooling requests across prefill chunks."""

    def __init__(self) -> None:
        self.active: set[str] = set()  # pooling requests in the runner's batch (none: no work per step)
        self._sums: dict[str, torch.Tensor] = {}  # mean: float32 sum of the rows so far
        self._first: dict[str, torch.Tensor] = {}  # cls: the first position's row

    def add(self, request_id: str, params: PoolingParams | None) -> None:
        if params is not None:
            self.active.add(request_id)

    def remove(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted: a preempted one recomputes from position 0)."""
        self.active.discard(request_id)
        self._sums.pop(request_id, None)
        self._first.pop(request_id, None)

    def pool(self, model, hidden: torch.Tensor, requests, query_lens: list[int]) -> dict[str, list[float]] | None:
        """Advance the pooling requests among ``requests`` (each with ``query_lens[i]``
        rows of ``hidden``, ``(num_tokens, hidden_size)``, from its ``num_computed_tokens``)
        and return the vectors of those whose prompt this step completed (None: none did)."""
        done: dict[str, list[float]] = {}
        first = 0
        for request, num_rows in zip(requests, query_lens):
            params = request.params.pooling if request.request_id in self.active else None
            if params is not None:
                vector = self._advance(model, request, params, hidden[first : first + num_rows])
                if vector is not None:
                    done[request.request_id] = vector
            first += num_rows
        return done or None

    def _advance(self, model, request, params: PoolingParams, rows: torch.Tensor) -> list[float] | None:
        rid, start, kind = request.request_id, request.num_computed_tokens, params.pooling_type
        if kind == "mean":
            total = rows.float().sum(dim=0)
            if start:  # later chunks add to the first ones' sum
                total += self._sums[rid]
            self._sums[rid] = total
        elif kind == "cls" and start == 0:
            self._first[rid] = rows[0].float().clone()
        if start + rows.shape[0] < request.num_prompt_tokens:
            return None  # more chunks to come
        if kind == "mean":
            vector = self._sums.pop(rid) / request.num_prompt_tokens
        elif kind == "cls":
            vector = self._first.pop(rid)
        elif kind == "logits":
            logits = model.compute_logits(rows[-1:])[0]
            return logits[torch.tensor(params.logit_token_ids, device=logits.device)].float().cpu().tolist()
        else:
            vector = rows[-1].float()
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if params.normalize:
            vector = F.normalize(vector, p=2.0, dim=0)
        return vector.cpu().tolist()
