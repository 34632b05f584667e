"""The contract every model architecture implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.layers import FusableOp, Linear
from ember.plugin.backend import BaseAttention


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token's KV needs: the runner sizes and allocates the cache from it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


class BaseCausalLM(nn.Module, ABC):
    """A decoder-only model over one flat batch with a paged KV cache.

    Constructed as ``cls(hf_config, attention, compute_dtype)`` on the meta
    device or directly on the target device; weights arrive through
    :meth:`load_weights` using the Hugging Face checkpoint names.

    ``linear_op`` (``F.linear`` by default) is the backend's matrix product, set by
    the loader on the model and on every :class:`ember.models.layers.Linear`; a
    model that multiplies by a weight outside a ``Linear`` (a tied LM head) uses it.
    """

    linear_op = staticmethod(F.linear)

    def matmul_weights(self) -> list[torch.Tensor]:
        """Every weight this model passes to ``linear_op``: those of its ``Linear``
        layers by default; a model that multiplies by another (a tied LM head) adds it."""
        return [m.weight for m in self.modules() if isinstance(m, Linear) and not m.is_quantized]

    def linear_parts(self) -> dict[str, tuple[Linear, int]]:
        """Each linear's checkpoint prefix (``"model.layers.0.self_attn.q_proj"``) ->
        ``(Linear, part index)``: where a quantized checkpoint's tensors of that linear
        go (docs/quantization.md). An architecture that supports quantized weights
        implements it; the default refuses them."""
        raise NotImplementedError(f"{type(self).__name__} does not support quantized weights")

    def embed_from(self, linear: Linear) -> None:
        """Make the token embedding read the rows of ``linear``'s weight (a tied LM head
        kept quantized, ``BaseQuantizer.embedding_source``) instead of a table of its
        own, which is then neither kept nor expected from the checkpoint. An
        architecture that supports it implements it; the default refuses."""
        raise NotImplementedError(f"{type(self).__name__} cannot read its embedding from a linear's weight")

    def set_linear_op(self, op) -> None:
        """Install ``op`` as the matrix product of the model and of every ``Linear``."""
        self.linear_op = op
        for module in self.modules():
            if isinstance(module, Linear):
                module.linear_op = op

    def set_layer_ops(self, ops: dict) -> list[str]:
        """Install the backend's fused ops (``BaseBackend.layer_ops``) on every
        :class:`ember.models.layers.FusableOp` that has one; returns the names used."""
        used = set()
        for module in self.modules():
            if isinstance(module, FusableOp) and ops.get(module.op_name) is not None:
                module.fused = ops[module.op_name]
                used.add(module.op_name)
        return sorted(used)

    @property
    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec: ...

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``(num_tokens,)`` int64. ``kv_caches``: one
        tensor per layer (layout in :mod:`ember.plugin.backend`). Returns hidden states
        ``(num_tokens, hidden_size)`` in the compute dtype."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(num_sampled, hidden_size)`` -> float32 logits ``(num_sampled, vocab_size)``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the model; raise
        ValueError naming any missing or unexpected tensor."""


def layer_sliding_window(hf_config, index: int) -> int | None:
    """The sliding window of layer ``index`` (keys a query reaches, itself included), or
    None for global attention, as transformers reads the config: ``layer_types`` where it
    is given (Gemma 2/3, Qwen2/3: ``"sliding_attention"`` layers slide), else every layer
    slides when ``sliding_window`` is set (Mistral, Phi-3) unless ``use_sliding_window``
    is false (Qwen2)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    kinds = getattr(hf_config, "layer_types", None)
    if kinds:
        return int(window) if kinds[index] == "sliding_attention" else None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def uniform_sliding_window(hf_config) -> int | None:
    """The window when every layer slides with the same one (Mistral-7B-v0.1: the KV
    manager may then release blocks behind it), else None (global layers keep all)."""
    count = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    windows = {layer_sliding_window(hf_config, i) for i in range(count)}
    return windows.pop() if len(windows) == 1 and None not in windows else None
