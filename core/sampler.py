"""Turn processed float32 logits of a whole batch into token ids: greedy rows take the
argmax, sampled rows draw from the softmax, each request with its own generator when
it has a seed. Temperature, truncation, penalties and bans happen before, in the
:class:`ember.logits_pipeline.LogitsPipeline`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.logits_processor import SamplingRow

__all__ = ["Sampler", "SamplerOutput", "SamplingRow"]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]


class Sampler:
    """Stateful only in the per-request generators (seeded requests keep their own
    stream, so a seed gives the same tokens whatever else shares the batch)."""

    def __init__(self, seed: int | None = None, greedy_op=None) -> None:
        # greedy_op(logits) -> (ids, logprobs): the backend's fused argmax and
        # log-softmax of it (BaseBackend.greedy_op), else PyTorch's
        self.greedy_op = greedy_op
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
        """``logits``: (len(rows), vocab) float32, already processed by the logits
        pipeline. One token id per row, and its log-probability under the distribution
        it was drawn from (the processed one; for greedy rows, the logits after the
        processors that are not argmax-invariant: the raw distribution unless
        penalties, biases or bans apply)."""
        assert logits.shape[0] == len(rows)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        out = torch.empty(len(rows), dtype=torch.int64)
        logprobs = torch.empty(len(rows), dtype=torch.float32)
        if greedy:
            sub = logits[greedy] if len(greedy) < len(rows) else logits
            if self.greedy_op is not None:
                ids, lps = self.greedy_op(sub)
            else:
                ids = sub.argmax(dim=-1)
                # log p(id) = logit(id) - logsumexp(logits): no full log-softmax per step
                lps = sub.gather(-1, ids[:, None])[:, 0] - sub.logsumexp(dim=-1)
            out[greedy] = ids
            logprobs[greedy] = lps
        if sampled:
            sub = logits[sampled] if len(sampled) < len(rows) else logits
            probs = sub.softmax(dim=-1)
            log_z = sub.logsumexp(dim=-1)
            for j, i in enumerate(sampled):
                # Exponential race: argmax(p / E), E ~ Exp(1), is a sample from p. Each
                # row draws from its own generator (or the shared one), one row at a
                # time, so a seeded row's draws never depend on its batch mates.
                noise = torch.empty_like(probs[j]).exponential_(generator=self._generator(rows[i]))
                token = (probs[j] / noise).argmax()
                out[i] = token
                logprobs[i] = sub[j, token] - log_z[j]
        return SamplerOutput(out.tolist(), logprobs.tolist())
