"""``medusa``: Medusa heads (Cai et al., 2024) on the target's last hidden state.

Head ``i`` is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` followed by a
projection to the vocabulary; from the hidden state at position ``t`` (the one
whose logits gave the request's last token, ``t + 1``) it predicts the token at
``t + 2 + i``. The drafts are the heads' argmaxes (top-1, no tree), deterministic
proposals that the target verifies by agreement, exact under greedy and sampling.

Checkpoints in the layout FasterDecoding/Medusa publishes: a directory with
``config.json`` (``medusa_num_heads``, ``medusa_num_layers``) and
``medusa_lm_head.safetensors`` (or ``.pt``) holding an ``nn.Sequential`` per head:
``{i}.{j}.linear.weight`` / ``.bias`` for the blocks ``j < num_layers`` and
``{i}.{num_layers}.weight`` for the projection."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.plugin import hookimpl
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext

logger = logging.getLogger(__name__)


def load_medusa_heads(path: Path) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(num_heads, num_layers, tensors) of a Medusa checkpoint directory; ValueError
    naming what is missing."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"Medusa heads at {path}: no config.json")
    config = json.loads(config_file.read_text())
    num_heads = config.get("medusa_num_heads")
    num_layers = config.get("medusa_num_layers", 1)
    if not isinstance(num_heads, int) or num_heads < 1 or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"Medusa heads at {path}: config.json needs medusa_num_heads >= 1 and medusa_num_layers >= 0, "
                         f"got {num_heads!r} and {num_layers!r}")
    if (path / "medusa_lm_head.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(path / "medusa_lm_head.safetensors"))
    elif (path / "medusa_lm_head.pt").is_file():
        tensors = torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"Medusa heads at {path}: no medusa_lm_head.safetensors or medusa_lm_head.pt")
    expected = {f"{i}.{j}.linear.{p}" for i in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")}
    expected |= {f"{i}.{num_layers}.weight" for i in range(num_heads)}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"Medusa heads at {path}: missing tensors {missing[:4]}, unexpected {unexpected[:4]}")
    return num_heads, num_layers, tensors


class MedusaSpeculator(BaseSpeculator):
    name = "medusa"
    uses_hidden_states = True

    def __init__(self, context: SpeculatorContext) -> None:
        super().__init__(context)
        if not context.config.model:
            raise ValueError("speculative method 'medusa' needs 'model': the directory of the Medusa heads")
        path = Path(context.config.model)
        num_heads, num_layers, tensors = load_medusa_heads(path)
        hidden = context.hf_config.hidden_size
        device = context.backend.device
        dtype = context.backend.compute_dtype(context.dtype)
        self.heads: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        for i in range(num_heads):
            blocks = [(tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"]) for j in range(num_layers)]
            out = tensors[f"{i}.{num_layers}.weight"]
            for w, _ in blocks:
                if tuple(w.shape) != (hidden, hidden):
                    raise ValueError(f"Medusa head {i}: a block of shape {tuple(w.shape)}, the target's hidden size is "
                                     f"{hidden}")
            if out.shape[1] != hidden or out.shape[0] > context.vocab_size:
                raise ValueError(f"Medusa head {i}: projection of shape {tuple(out.shape)} for hidden size {hidden} and "
                                 f"a vocabulary of {context.vocab_size}")
            self.heads.append((
                [(w.to(device, dtype), b.to(device, dtype)) for w, b in blocks], out.to(device, dtype),
            ))
        logger.info("medusa: %d heads of %d blocks from %s", num_heads, num_layers, path)

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        rows = [i for i, r in enumerate(requests) if r.hidden is not None]
        proposals = [Proposal([]) for _ in requests]
        if not rows:
            return proposals
        k = min(len(self.heads), max(requests[i].max_drafts for i in rows))
        _, out = self.heads[0]
        h = torch.stack([requests[i].hidden for i in rows]).to(out.dtype)
        columns = []
        for blocks, projection in self.heads[:k]:
            x = h
            for w, b in blocks:
                x = x + F.silu(F.linear(x, w, b))
            columns.append(F.linear(x, projection).argmax(dim=-1))
        drafts = torch.stack(columns, dim=1).tolist()  # (rows, k)
        for i, ids in zip(rows, drafts):
            proposals[i] = Proposal(ids[: requests[i].max_drafts])
        return proposals


@hookimpl
def ember_register_speculators(registry) -> None:
    registry.register("medusa", MedusaSpeculator)
