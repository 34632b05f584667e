"""LoRA products for a flat batch whose tokens belong to different adapters (or none).

``add_lora(y, x, slots, updates)`` adds ``scale * B (A x)`` of each token's adapter to the
base output ``y``: tokens are grouped by adapter slot (one sort, as Punica's SGMV and
vLLM's LoRA layers group them) and each slot that has tokens runs two small matrix
products on its rows; tokens of slot -1 (the base model) are untouched. This is the
CPU form; the engine integration (slots per request, a slot table per step) builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember.weights.peft import LoRAModule


def add_lora(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
             updates: Sequence[LoRAModule | None]) -> torch.Tensor:
    """``y`` (T, out) += for each token t with ``slots[t] = s >= 0``: ``updates[s].scale *
    B_s (A_s x_t)`` (computed in float32, added in y's dtype); ``x`` (T, in). In place;
    returns ``y``. ValueError for a slot without an update or shapes that do not fit."""
    if slots.shape != (x.shape[0],) or y.shape[0] != x.shape[0]:
        raise ValueError(f"add_lora: {x.shape[0]} tokens, slots {tuple(slots.shape)}, output {tuple(y.shape)}")
    order = torch.argsort(slots, stable=True)
    sorted_slots = slots[order]
    counts = torch.bincount(sorted_slots + 1, minlength=len(updates) + 1).tolist()  # slot -1 first
    start = counts[0]  # the base model's tokens
    for slot, count in enumerate(counts[1:]):
        if count == 0:
            continue
        update = updates[slot] if slot < len(updates) else None
        if update is None:
            raise ValueError(f"add_lora: {count} token(s) name slot {slot}, which holds no LoRA update")
        rows = order[start : start + count]
        start += count
        a, b = update.a, update.b
        if a.shape[1] != x.shape[1] or b.shape[0] != y.shape[1]:
            raise ValueError(f"add_lora: slot {slot}'s A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                             f"x {tuple(x.shape)} -> y {tuple(y.shape)}")
        delta = (x[rows].float() @ a.T) @ b.T * update.scale
        y.index_add_(0, rows, delta.to(y.dtype))
    return y
