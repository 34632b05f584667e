"""Turn float32 logits of a whole batch into token ids: greedy, temperature, top-k,
top-p, min_tokens, each request with its own generator when it has a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs of one request in the batch."""

    request_id: str
    params: SamplingParams
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]


class Sampler:
    """Stateful only in the per-request generators (seeded requests keep their own
    stream, so a seed gives the same tokens whatever else shares the batch)."""

    def __init__(self, seed: int | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator()
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, row: SamplingRow) -> torch.Generator:
        if row.params.seed is None:
            return self._shared
        gen = self._generators.get(row.request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(row.params.seed)
            self._generators[row.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits``: (len(rows), vocab) float32; one token id per row, and its
        log-probability under the distribution it was drawn from (after temperature,
        top-k and top-p; the raw distribution for greedy rows)."""
        assert logits.shape[0] == len(rows)
        logits = self._apply_min_tokens(logits, rows)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        out = torch.empty(len(rows), dtype=torch.int64)
        logprobs = torch.empty(len(rows), dtype=torch.float32)
        if greedy:
            sub = logits[greedy]
            ids = sub.argmax(dim=-1)
            out[greedy] = ids
            # log p(id) = logit(id) - logsumexp(logits): no full log-softmax per step
            logprobs[greedy] = sub.gather(-1, ids[:, None])[:, 0] - sub.logsumexp(dim=-1)
        if sampled:
            sub = logits[sampled]
            temps = torch.tensor([rows[i].params.temperature for i in sampled], dtype=torch.float32)
            sub = sub / temps[:, None]
            sub = apply_top_k_top_p(
                sub,
                [rows[i].params.top_k for i in sampled],
                [rows[i].params.top_p for i in sampled],
            )
            probs = sub.softmax(dim=-1)
            log_probs = sub.log_softmax(dim=-1)
            for j, i in enumerate(sampled):
                # Exponential race: argmax(p / E), E ~ Exp(1), is a sample from p.
                noise = torch.empty_like(probs[j]).exponential_(generator=self._generator(rows[i]))
                token = (probs[j] / noise).argmax()
                out[i] = token
                logprobs[i] = log_probs[j, token]
        return SamplerOutput(out.tolist(), logprobs.tolist())

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, r in enumerate(rows):
            if r.num_output_tokens < r.params.min_tokens:
                ids = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    ids.update(r.eos_token_ids)
                ids = [t for t in ids if t < logits.shape[1]]
                banned_rows.extend([i] * len(ids))
                banned_ids.extend(ids)
        if banned_rows:
            logits = logits.clone()
            logits[banned_rows, banned_ids] = float("-inf")
        return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) to -inf."""
    vocab = logits.shape[-1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if use_k:
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], dtype=torch.int64)
        kth = sorted_logits.gather(-1, (vocab - ks).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_p:
        ps = torch.tensor(top_p, dtype=torch.float32)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        mask = cumulative <= (1.0 - ps).unsqueeze(1)
        mask[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
