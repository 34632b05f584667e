"""Locally typical sampling (``typical_p``), the one standard control core leaves to a
plugin (``ember.sampling_params.PLUGIN_FIELDS``): it matches transformers'
``TypicalLogitsWarper`` (``min_tokens_to_keep=1``) row by row, with a different
``typical_p`` per row. Disable the ``logits_typical`` plugin and requests that set
``typical_p`` are refused by name; nothing else changes."""

from __future__ import annotations

import torch

from ember.plugin import Registry, hookimpl
from ember.plugin.logits_processor import ORDER_TRUNCATE, BaseLogitsProcessor, SamplingRow
from ember.sampling_params import SamplingParams

NEG_INF = float("-inf")


class TypicalP(BaseLogitsProcessor):
    """Keep the tokens whose surprisal is closest to the entropy, until their mass
    reaches ``typical_p`` (Meister et al., 2022). Sampled requests only, after core's
    top-k, top-p and min-p."""

    name = "typical_p"
    params_fields = ("typical_p",)
    order = ORDER_TRUNCATE + 30
    is_argmax_invariant = False  # the most likely token may be the least typical

    @classmethod
    def is_enabled(cls, params: SamplingParams) -> bool:
        # greedy requests ignore it, as transformers' `generate` applies warpers only when sampling
        return not params.is_greedy and params.typical_p < 1.0

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        normalized = logits.log_softmax(dim=-1)
        p = normalized.exp()
        entropy = -(normalized * p).nansum(-1, keepdim=True)
        shifted = (-normalized - entropy).abs()
        sorted_shifted, order = shifted.sort(dim=-1)
        cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        typical_p = torch.tensor([r.params.typical_p for r in rows], dtype=torch.float32, device=logits.device)
        last = (cumulative < typical_p.to(logits.dtype)[:, None]).sum(dim=1)
        last.clamp_(max=sorted_shifted.shape[-1] - 1)
        remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
        remove[:, :1] = False  # the most typical token always stays
        return logits.masked_fill_(remove.scatter(1, order, remove), NEG_INF)


PROCESSORS = (TypicalP,)


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    for cls in PROCESSORS:
        registry.register(cls.name, cls)
