"""Log-probabilities beyond the chosen token's: the top-N alternatives at each
generated position (`SamplingParams.logprobs`) and the prompt's own tokens
(`SamplingParams.prompt_logprobs`).

Which distribution (docs/sampling.md, "Logprobs"): a generated token's logprobs are
of the distribution it was drawn from, the logits after the request's processors
(temperature, truncation, penalties; for greedy requests only the processors that
change the argmax, so plain greedy gives the model's raw log-softmax). Tokens a
truncation removed have logprob -inf and are left out of the top-N. Prompt logprobs
are of the model's raw log-softmax: no processor ran at a prompt position.

Only rows of requests that ask are touched: one logsumexp, one top-k and one
comparison per such row, never a full log-softmax over the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One position of one request: the token there and the top alternatives.

    `rank` is 1 for the most likely token. `top_token_ids`/`top_logprobs` are sorted
    by descending logprob, at most the number asked for, without -inf entries.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Logprob:
    """What callers see (vLLM's shape): one token's logprob, rank and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def compute_position_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[PositionLogprobs]:
    """``logits``: ``(len(token_ids), vocab)`` float32; row ``i`` is the distribution
    ``token_ids[i]`` came from; ``num_top[i] >= 0`` alternatives are kept for it."""
    assert logits.shape[0] == len(token_ids) == len(num_top)
    if not token_ids:
        return []
    logits = logits.float()
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    log_z = logits.logsumexp(dim=-1)
    chosen = logits.gather(-1, ids[:, None])[:, 0]
    ranks = (logits > chosen[:, None]).sum(dim=-1) + 1
    k = min(max(num_top), logits.shape[-1])
    top_values, top_ids = logits.topk(k, dim=-1) if k else (logits[:, :0], ids[:, None][:, :0])
    top_lp = (top_values - log_z[:, None]).tolist()
    top_ids_list = top_ids.tolist()
    chosen_lp = (chosen - log_z).tolist()
    ranks_list = ranks.tolist()
    out = []
    for i, token_id in enumerate(token_ids):
        n = num_top[i]
        lps = [lp for lp in top_lp[i][:n] if lp != -math.inf]
        out.append(
            PositionLogprobs(token_id, chosen_lp[i], ranks_list[i], tuple(top_ids_list[i][: len(lps)]), tuple(lps))
        )
    return out


def to_logprob_dict(entry: PositionLogprobs, decode) -> dict[int, Logprob]:
    """vLLM's per-position shape: the chosen token first, then the alternatives in
    rank order (the chosen token appears once, with its own rank)."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
        if token_id not in out:
            out[token_id] = Logprob(logprob, rank, decode(token_id))
    return out
