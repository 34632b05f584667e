"""What a model architecture calls to build and run one rank's shard.

The Llama family (``ember.models.llama``) takes ``parallel=`` (a
:class:`ember.models.parallel.state.ParallelContext`) and asks these functions for its
tensor-parallel projections, its stage's part of the model, and its stage-by-stage
forward pass; an architecture without ``supports_parallel`` is refused by the
parallel loader.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ember.models.layers import Linear, RMSNorm
from ember.models.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_range,
    gather_logits,
    shard_heads,
    vocab_range,
)
from ember.models.parallel.pipeline import MicroBatches
from ember.models.parallel.state import ParallelContext

__all__ = ["build_parallel_shard", "gather_logits", "parallel_attention", "parallel_mlp", "pipeline_forward"]


class MissingLayer(nn.Module):
    """A layer another pipeline stage computes: no weights, never called."""

    def forward(self, *args, **kwargs):  # pragma: no cover - a bug if reached
        raise RuntimeError("this layer belongs to another pipeline stage")


def parallel_attention(ctx: ParallelContext, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       qkv_bias: bool, o_bias: bool, dtype, compute_dtype, device):
    """(qkv_proj, o_proj, local heads, local KV heads) of this tensor-parallel rank."""
    heads = shard_heads(num_heads, num_kv_heads, ctx.tp_size, ctx.tp_rank)
    q_start, q_stop = heads.q_start * head_dim, (heads.q_start + heads.num_heads) * head_dim
    kv_start, kv_stop = heads.kv_start * head_dim, (heads.kv_start + heads.num_kv_heads) * head_dim
    q_size = num_heads * head_dim
    kv_size = num_kv_heads * head_dim
    qkv = ColumnParallelLinear(
        hidden_size,
        [(q_start, q_stop), (q_size + kv_start, q_size + kv_stop), (q_size + kv_size + kv_start, q_size + kv_size + kv_stop)],
        qkv_bias, dtype, compute_dtype, device,
    )
    # checkpoint_slice reads q/k/v as separate tensors: their shards count from 0
    qkv.shards = [(q_start, q_stop), (kv_start, kv_stop), (kv_start, kv_stop)]
    o_proj = RowParallelLinear((q_start, q_stop), hidden_size, o_bias, dtype, compute_dtype, device, ctx.tp_group)
    return qkv, o_proj, heads.num_heads, heads.num_kv_heads


def parallel_mlp(ctx: ParallelContext, hidden_size: int, intermediate_size: int, bias: bool, dtype, compute_dtype,
                 device):
    """(gate_up_proj, down_proj) of this tensor-parallel rank: its slice of the intermediate size."""
    part = even_range(intermediate_size, ctx.tp_size, ctx.tp_rank, "intermediate_size")
    gate_up = ColumnParallelLinear(hidden_size, [part, part], bias, dtype, compute_dtype, device)
    down = RowParallelLinear(part, hidden_size, bias, dtype, compute_dtype, device, ctx.tp_group)
    return gate_up, down


def build_parallel_shard(model, cfg, ctx: ParallelContext, make_layer, dtype, compute_dtype, device):
    """(embed_tokens, layers, norm, lm_head) of this rank: the embedding on the first
    stage (and on the last when the LM head is tied to it), this stage's layers
    (``MissingLayer`` elsewhere), the final norm and LM head on the last stage;
    vocabulary-split when tensor-parallel. Absent parts are None."""
    start, end = model.layer_range
    tp = ctx.tp_size > 1
    rows = vocab_range(cfg.vocab_size, ctx.tp_size, ctx.tp_rank)
    if cfg.vocab_size < ctx.tp_size:
        raise ValueError(f"tensor_parallel_size {ctx.tp_size} is more than the vocabulary ({cfg.vocab_size})")
    embed = None
    if ctx.is_first_stage or (ctx.is_last_stage and model.tie_word_embeddings):
        if tp:
            embed = VocabParallelEmbedding(rows, cfg.hidden_size, dtype, device, ctx.tp_group)
        else:
            embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
            embed.weight.requires_grad_(False)
    layers = nn.ModuleList(make_layer() if start <= i < end else MissingLayer() for i in range(cfg.num_hidden_layers))
    norm = lm_head = None
    if ctx.is_last_stage:
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if not model.tie_word_embeddings:
            if tp:
                lm_head = ColumnParallelLinear(cfg.hidden_size, [rows], False, dtype, compute_dtype, device)
            else:
                lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, compute_dtype, device)
    return embed, layers, norm, lm_head


def pipeline_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, metadata) -> torch.Tensor:
    """One stage's part of a forward pass, micro-batch by micro-batch.

    The first stage embeds, every stage runs its layers, each but the last sends the
    hidden state and residual of a micro-batch to the next stage as soon as that
    micro-batch is done (asynchronously), so stage ``s`` computes micro-batch ``m + 1``
    while stage ``s + 1`` computes ``m``. Returns ``(num_tokens, hidden)``: the final
    hidden states on the last stage; on the others a placeholder of that shape (their
    logits arrive by broadcast in ``compute_logits``)."""
    ctx: ParallelContext = model.parallel
    parts = metadata.parts if isinstance(metadata, MicroBatches) else [(0, input_ids.shape[0], metadata)]
    hidden_size = model.config.hidden_size
    device = input_ids.device
    out = torch.empty(input_ids.shape[0], hidden_size, dtype=model.compute_dtype, device=device)
    stage = ctx.pp_rank
    prev_rank = ctx.pp_ranks[stage - 1] if stage > 0 else None
    next_rank = ctx.pp_ranks[stage + 1] if not ctx.is_last_stage else None
    sends = []
    for start, stop, meta in parts:
        if ctx.is_first_stage:
            hidden, residual = model.embed(input_ids[start:stop]), None
        else:
            hidden = torch.empty(stop - start, hidden_size, dtype=model.compute_dtype, device=device)
            residual = torch.empty_like(hidden)
            dist.recv(hidden, src=prev_rank, group=ctx.pp_group)
            dist.recv(residual, src=prev_rank, group=ctx.pp_group)
        hidden, residual = model.run_layers(positions[start:stop], hidden, residual, kv_caches, meta)
        if ctx.is_last_stage:
            out[start:stop], _ = model.norm(hidden, residual)
        else:
            hidden, residual = hidden.contiguous(), residual.contiguous()
            # the tensors stay referenced until their sends complete
            sends.append((dist.isend(hidden, dst=next_rank, group=ctx.pp_group), hidden))
            sends.append((dist.isend(residual, dst=next_rank, group=ctx.pp_group), residual))
    for work, _ in sends:
        work.wait()
    return out
