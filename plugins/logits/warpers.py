"""Temperature and the truncations (top-k, top-p, min-p, typical-p), which only
sampled requests use (`SamplingParams.logits_processor_names`). All but typical-p are
argmax-invariant: typical-p may drop the most likely token. Each matches its transformers warper row by row
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, ``TypicalLogitsWarper`` with ``min_tokens_to_keep=1``), with
a different parameter per row."""

from __future__ import annotations

import torch

from ember.logits_processor import ORDER_TEMPERATURE, ORDER_TRUNCATE, BaseLogitsProcessor, SamplingRow
from ember.plugin import Registry, hookimpl

NEG_INF = float("-inf")


def _column(values: list[float], like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One parameter per row as a ``(num_rows, 1)`` tensor. Thresholds computed in
    Python (double) are rounded to float32 once, as transformers' scalars are."""
    return torch.tensor(values, dtype=dtype, device=like.device).to(like.dtype)[:, None]


class Temperature(BaseLogitsProcessor):
    """``logits / temperature`` (rows with temperature 0 are greedy and never come here)."""

    name = "temperature"
    order = ORDER_TEMPERATURE
    is_argmax_invariant = True

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return logits.div_(_column([r.params.temperature for r in rows], logits))


class TopK(BaseLogitsProcessor):
    """Keep the ``top_k`` largest logits of each row (ties with the k-th all kept)."""

    name = "top_k"
    order = ORDER_TRUNCATE
    is_argmax_invariant = True

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        ks = torch.tensor([min(r.params.top_k, vocab) for r in rows], dtype=torch.int64, device=logits.device)
        top = logits.topk(int(ks.max()), dim=-1).values  # descending
        kth = top.gather(1, (ks - 1)[:, None])
        return logits.masked_fill_(logits < kth, NEG_INF)


class TopP(BaseLogitsProcessor):
    """Nucleus: keep the most likely tokens whose mass reaches ``top_p`` (at least one)."""

    name = "top_p"
    order = ORDER_TRUNCATE + 10
    is_argmax_invariant = True

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= _column([1.0 - r.params.top_p for r in rows], logits, torch.float64)
        remove[:, -1] = False  # the most likely token always stays
        return logits.masked_fill_(remove.scatter(1, order, remove), NEG_INF)


class MinP(BaseLogitsProcessor):
    """Drop tokens whose probability is below ``min_p`` times the top token's."""

    name = "min_p"
    order = ORDER_TRUNCATE + 20
    is_argmax_invariant = True

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        threshold = _column([r.params.min_p for r in rows], logits) * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        return logits.masked_fill_(remove, NEG_INF)


class TypicalP(BaseLogitsProcessor):
    """Locally typical sampling (Meister et al., 2022): keep the tokens whose
    surprisal is closest to the entropy, until their mass reaches ``typical_p``."""

    name = "typical_p"
    order = ORDER_TRUNCATE + 30
    is_argmax_invariant = False  # the most likely token may be the least typical

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        normalized = logits.log_softmax(dim=-1)
        p = normalized.exp()
        entropy = -(normalized * p).nansum(-1, keepdim=True)
        shifted = (-normalized - entropy).abs()
        sorted_shifted, order = shifted.sort(dim=-1)
        cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < _column([r.params.typical_p for r in rows], logits)).sum(dim=1)
        last.clamp_(max=sorted_shifted.shape[-1] - 1)
        remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
        remove[:, :1] = False  # the most typical token always stays
        return logits.masked_fill_(remove.scatter(1, order, remove), NEG_INF)


PROCESSORS = (Temperature, TopK, TopP, MinP, TypicalP)


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    for cls in PROCESSORS:
        registry.register(cls.name, cls)
