"""Gemma 2 and Gemma 3 (text): the Llama family's paged attention and fused projections
with Gemma's differences, each as transformers computes it:

* RMSNorms that scale by ``(1 + w)`` (stored here as ``1 + w``, added at load, so the
  backend's fused norm runs them), four per layer: before and after attention, before
  and after the MLP, the residual added after the post-norms;
* GeGLU (``gelu_pytorch_tanh(gate) * up``), the embedding scaled by ``sqrt(hidden)``,
  scores scaled by ``query_pre_attn_scalar ** -0.5``, tied embeddings;
* interleaved sliding-window and global layers (``layer_types``; the window reaches to
  ``sliding_window`` keys), run by the backend's attention (``window=``);
* Gemma 2: attention-logit and final-logit soft-capping (``tanh`` caps);
* Gemma 3: per-head q/k RMSNorms before RoPE and per-kind RoPE (``rope_parameters`` keyed
  by layer type: a local base of 10,000 and a global one of 1,000,000, the global one
  scaled linearly in the larger models).

Registered as a built-in plugin through Ember's own `ember` entry point. One process
only: tensor and pipeline parallelism are refused by the parallel builder
(``supports_parallel`` is False).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from ember.models.base import layer_sliding_window
from ember.models.layers import (
    Embedding,
    GeluAndMul,
    HeadRMSNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    Scale,
    rope_parameters,
)
from ember.models.llama import LlamaForCausalLM
from ember.plugin import hookimpl
from ember.plugin.backend import BaseAttention, require_attention_features

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QK_NORM_MODEL_TYPES = ("gemma3_text",)
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_kinds(cfg) -> list[str]:
    """Each layer's kind, ``"sliding_attention"`` or ``"full_attention"`` (transformers'
    ``layer_types``; Gemma 2 alternates from a sliding first layer where a config lacks it)."""
    kinds = getattr(cfg, "layer_types", None)
    if kinds:
        return list(kinds)
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)]


def kind_rope_parameters(cfg, kind: str) -> dict:
    """The RoPE settings of layers of ``kind``: Gemma 3 keys them by layer type, Gemma 2
    has one set for all."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if kind in params and isinstance(params[kind], dict):
        per_kind = SimpleNamespace(rope_parameters=dict(params[kind]), model_type=cfg.model_type)
        return rope_parameters(per_kind)
    return rope_parameters(cfg)


class GemmaAttention(nn.Module):
    def __init__(self, cfg, index: int, attention: BaseAttention, rotary: RotaryEmbedding, dtype, compute_dtype,
                 device) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        self.head_dim = _head_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias, dtype, compute_dtype, device)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias, dtype, compute_dtype, device)
        self.sizes = (q_size, kv_size, kv_size)
        self.scale = float(getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.attn = attention
        self.__dict__["rotary"] = rotary  # the model's, shared by every layer of this kind (not a submodule)
        self.q_norm = self.k_norm = None
        if cfg.model_type in QK_NORM_MODEL_TYPES:
            self.q_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        # the keywords of this layer's attention: its window, the score cap
        self.limits: dict = {}
        window = layer_sliding_window(cfg, index)
        if window is not None:
            self.limits["window"] = window
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        if softcap:
            self.limits["softcap"] = float(softcap)

    def forward(self, positions, hidden, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj.forward(hidden).split(self.sizes, dim=-1)
        num_tokens = hidden.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head, in place where the backend fuses it
            q = self.q_norm.forward(q)
            k = self.k_norm.forward(k)
        q, k = self.rotary.forward(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata, self.scale, **self.limits)
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class GemmaMLP(nn.Module):
    def __init__(self, cfg, dtype, compute_dtype, device) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported by Gemma (only "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)})")
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], False, dtype, compute_dtype, device)
        self.down_proj = Linear(inter, [cfg.hidden_size], False, dtype, compute_dtype, device)
        self.act = GeluAndMul()

    def forward(self, x):
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, index, attention, rotary, dtype, compute_dtype, device) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, index, attention, rotary, dtype, compute_dtype, device)
        self.mlp = GemmaMLP(cfg, dtype, compute_dtype, device)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata, rotary=None):
        """``hidden``: the previous layer's post-MLP-normed output, ``residual`` the stream
        before it (None at the first layer): the residual sums ride the fused norms."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, kv_cache, attn_metadata)
        hidden = self.post_attention_layernorm.forward(hidden)
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        hidden = self.mlp.forward(hidden)
        return self.post_feedforward_layernorm.forward(hidden), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text models; what they share with Llama (weight names, fused
    projections, the tied LM head, quantized parts) comes from `LlamaForCausalLM`."""

    supports_parallel = False

    def __init__(self, hf_config, attention: BaseAttention, compute_dtype: torch.dtype,
                 dtype: torch.dtype | None = None, device: torch.device | None = None, parallel=None) -> None:
        nn.Module.__init__(self)
        cfg = hf_config
        if parallel is not None:
            raise ValueError(f"{cfg.architectures or cfg.model_type}: tensor and pipeline parallelism are not "
                             "supported for Gemma models; run them in one process")
        kinds = layer_kinds(cfg)
        if len(kinds) != cfg.num_hidden_layers or set(kinds) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                             f"{cfg.num_hidden_layers} layers, got {kinds}")
        name = (getattr(cfg, "architectures", None) or [cfg.model_type])[0]
        require_attention_features(
            attention, name, window=any(layer_sliding_window(cfg, i) for i in range(len(kinds))),
            softcap=bool(getattr(cfg, "attn_logit_softcapping", None)),
        )
        dtype = dtype or compute_dtype
        self.config = cfg
        self.compute_dtype = compute_dtype
        self.parallel = None
        self.layer_range = (0, cfg.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) or None
        self.embed_scale = Scale(math.sqrt(cfg.hidden_size))
        head_dim = _head_dim(cfg)
        # one rotary table per kind of layer (equal settings share one)
        self.rotaries = nn.ModuleDict()
        by_kind: dict[str, RotaryEmbedding] = {}
        for kind in sorted(set(kinds)):
            params = kind_rope_parameters(cfg, kind)
            same = next((r for k, r in by_kind.items() if kind_rope_parameters(cfg, k) == params), None)
            by_kind[kind] = same or RotaryEmbedding(head_dim, cfg.max_position_embeddings, params, device)
            if same is None:
                self.rotaries[kind] = by_kind[kind]
        self.rotary = by_kind[kinds[0]]
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, i, attention, by_kind[kind], dtype, compute_dtype, device)
            for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (None if self.tie_word_embeddings
                        else Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, compute_dtype, device))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # transformers multiplies in the embedding's dtype by sqrt(hidden) rounded to it
        return self.embed_scale.forward(self.embed_tokens.forward(input_ids)).to(self.compute_dtype)

    def _local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super()._local_logits(hidden_states)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint norms hold ``w`` of ``(1 + w)``: stored here as ``1 + w`` (in float32
        before rounding to the model's dtype), so every norm is a plain RMSNorm."""
        super().load_weights((name, _plus_one(tensor) if self.is_gemma_norm(name) else tensor)
                             for name, tensor in weights)

    def is_gemma_norm(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is a ``(1 + w)`` norm's ``w``."""
        return name.endswith("norm.weight")


def _plus_one(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() + 1.0


@hookimpl
def ember_register_model_architectures(registry) -> None:
    for name in ARCHITECTURES:
        registry.register(name, GemmaForCausalLM)
