"""Megatron-style tensor-parallel layers (Shoeybi et al., 2019) for one rank's shard.

* :class:`ColumnParallelLinear` keeps a slice of the output rows of every part of a
  fused projection (qkv: this rank's query heads and its KV heads; gate/up: its
  slice of the intermediate size). Its output is this rank's part only: no
  communication.
* :class:`RowParallelLinear` keeps the matching slice of the input columns
  (o_proj, down_proj): each rank's product is a partial sum, all-reduced over the
  tensor-parallel group; the bias is added once, after the sum.
* :class:`VocabParallelEmbedding` keeps rows ``[start, stop)`` of the vocabulary:
  a token outside them looks up zeros, and the all-reduce sums the one rank that
  has it. The LM head (tied to it, or a column-parallel ``lm_head``) computes this
  rank's vocabulary slice of the logits; :func:`gather_logits` all-gathers them and,
  with pipeline stages, broadcasts them from the last stage so every rank samples
  the same logits.

The checkpoint is read shard by shard: :func:`checkpoint_slice` says, for a tensor
name, which rows or columns this rank keeps, from the modules the model built, so
the loader reads only those bytes (``safe_open(...).get_slice``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ember.models.layers import Linear
from ember.models.parallel.state import ParallelContext


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One rank's attention heads: query heads ``[q_start, q_start + num_heads)``,
    KV heads ``[kv_start, kv_start + num_kv_heads)`` of the full model."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """This rank's heads. A KV head and the query heads that share it (its group) stay
    together, so each rank's attention is ordinary grouped-query attention:

    * at least as many KV heads as ranks: whole groups per rank, as even as they
      divide (SmolLM2's 3 groups over 2 ranks: 2 and 1; a rank may hold one group more);
    * fewer KV heads than ranks: each group's query heads split evenly over
      ``tp_size / num_kv_heads`` ranks, each keeping a copy of the group's KV head.

    ValueError when neither fits (a group cannot be split evenly)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        kv_start = tp_rank * base + min(tp_rank, extra)
        kv = base + (1 if tp_rank < extra else 0)
        return HeadShard(kv_start * group, kv * group, kv_start, kv)
    ranks_per_kv = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % ranks_per_kv:
        raise ValueError(
            f"tensor_parallel_size {tp_size} cannot split the model's {num_heads} attention heads "
            f"({num_kv_heads} KV heads): with fewer KV heads than ranks, each KV head's {group} query heads must "
            "divide evenly over the ranks sharing it"
        )
    q = group // ranks_per_kv
    return HeadShard(tp_rank * q, q, tp_rank // ranks_per_kv, 1)


def even_range(size: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide the model's {what} ({size})")
    part = size // tp_size
    return tp_rank * part, (tp_rank + 1) * part


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a vocabulary split in ``ceil(vocab / tp)`` pieces (the
    last may be shorter)."""
    per = -(-vocab_size // tp_size)
    start = min(vocab_size, tp_rank * per)
    return start, min(vocab_size, start + per)


class ColumnParallelLinear(Linear):
    """A ``Linear`` holding rows ``shards[i]`` (``(start, stop)`` in the full tensor) of
    each part ``i`` of a (fused) projection; ``output_sizes`` are the local parts."""

    def __init__(self, in_features: int, shards: list[tuple[int, int]], bias: bool, dtype, compute_dtype,
                 device=None) -> None:
        super().__init__(in_features, [stop - start for start, stop in shards], bias, dtype, compute_dtype, device)
        self.shards = list(shards)


class RowParallelLinear(Linear):
    """A ``Linear`` holding input columns ``in_range`` of the full weight; the partial
    products are all-reduced over ``group``, then the (replicated) bias is added."""

    def __init__(self, in_range: tuple[int, int], out_features: int, bias: bool, dtype, compute_dtype,
                 device=None, group=None) -> None:
        super().__init__(in_range[1] - in_range[0], [out_features], bias, dtype, compute_dtype, device)
        self.in_range = in_range
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w.dtype != self.compute_dtype:
            w = w.to(self.compute_dtype)
            b = b.to(self.compute_dtype) if b is not None else None
        out = self.linear_op(x, w)
        dist.all_reduce(out, group=self.group)
        return out if b is None else out + b


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab_range`` of the embedding; ``forward`` sums the ranks' lookups."""

    def __init__(self, vocab_range: tuple[int, int], hidden_size: int, dtype, device=None, group=None) -> None:
        super().__init__()
        self.vocab_range = vocab_range
        self.group = group
        num = vocab_range[1] - vocab_range[0]
        self.weight = nn.Parameter(torch.empty(num, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.vocab_range
        outside = (input_ids < start) | (input_ids >= stop)
        local = (input_ids - start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


def gather_logits(ctx: ParallelContext, local: torch.Tensor | None, num_rows: int, vocab_size: int,
                  device) -> torch.Tensor:
    """Full float32 logits ``(num_rows, vocab_size)`` on every rank: the last stage's
    ranks all-gather their vocabulary slices (``local``, padded to equal widths), then
    the last stage broadcasts them along each pipeline group. ``local`` is None on
    the other stages."""
    logits = None
    if ctx.is_last_stage:
        logits = local
        if ctx.tp_size > 1:
            per = -(-vocab_size // ctx.tp_size)
            if local.shape[1] < per:
                local = F.pad(local, (0, per - local.shape[1]))
            parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
            logits = torch.cat(parts, dim=1)[:, :vocab_size]
    if ctx.pp_size > 1:
        if logits is None:
            logits = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        logits = logits.contiguous()
        dist.broadcast(logits, src=ctx.pp_ranks[-1], group=ctx.pp_group)
    return logits


# -- reading a checkpoint shard by shard ------------------------------------------
@dataclass(frozen=True, slots=True)
class WeightSlice:
    """Keep ``[start, stop)`` along ``dim`` of a checkpoint tensor (``dim`` None: all of it)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0


FULL = WeightSlice()


def checkpoint_slice(model, name: str) -> WeightSlice | None:
    """What this rank reads of checkpoint tensor ``name`` for a Llama-family ``model``
    built for it: None when it keeps none of it (another stage's layers, a tied
    ``lm_head``), else the rows or columns its modules hold."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        return None if model.lm_head is None else _module_slice(model.lm_head, 0, "weight")
    if name == "model.embed_tokens.weight":
        return None if model.embed_tokens is None else _module_slice(model.embed_tokens, 0, "weight")
    if name == "model.norm.weight":
        return FULL if model.norm is not None else None
    match = model._LAYER_RE.match(name)
    if match is None:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and layer.isdigit() and not model.holds_layer(int(layer)):
            return None
        return FULL  # norms of a layer, or a name load_weights will refuse
    index, block, proj, kind = match.groups()
    if not model.holds_layer(int(index)):
        return None
    fused = model._FUSED.get(proj)
    module = getattr(getattr(model.layers[int(index)], block), fused[0] if fused else proj, None)
    return _module_slice(module, fused[1] if fused else 0, kind)


def _module_slice(module, part: int, kind: str) -> WeightSlice:
    if isinstance(module, ColumnParallelLinear):
        start, stop = module.shards[part]
        return WeightSlice(0, start, stop)
    if isinstance(module, RowParallelLinear):
        return WeightSlice(1, *module.in_range) if kind == "weight" else FULL
    if isinstance(module, VocabParallelEmbedding):
        return WeightSlice(0, *module.vocab_range)
    return FULL


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights (parameters) this rank holds: its share of the model."""
    return sum(t.numel() * t.element_size() for t in model.parameters())
