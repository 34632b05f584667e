"""A hardware backend for Ember, as small as the contract allows.

It runs on the host CPU with PyTorch's own ops, so that it passes
`ember backends check template` anywhere. To port it to a device: change
`is_available`/`unavailable_reason` and `device`, size the KV cache from the device's
memory in `kv_cache_memory_bytes`, and replace `TemplateAttention` with your kernels
(or subclass `ember.hardware.torch_device.TorchDeviceBackend`, which does the memory
accounting for a torch device module and brings Triton attention). The contract is
docs/backends.md of Ember; `ember backends check NAME` checks it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.backend import AttentionBatch, BaseAttention, BaseBackend
from ember.plugin import hookimpl

# the Ember plugin API versions this backend was written for (docs/plugins.md); Ember
# refuses to load it under a version outside the range
EMBER_PLUGIN_API = ">=1.0,<2"


class TemplateAttention(BaseAttention):
    """Paged attention with PyTorch ops: write the step's K/V at their slots, then for
    each request gather its context from the cache and run causal SDPA."""

    def prepare(self, batch: AttentionBatch) -> AttentionBatch:
        return batch  # kernels that need indices or masks build them here, once per step

    def forward(self, q, k, v, kv_cache, batch: AttentionBatch, scale: float) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, batch.slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, batch.slot_mapping, v.to(kv_cache.dtype))
        out = torch.empty_like(q)
        for i, (num_new, start) in enumerate(zip(batch.query_lens, batch.start_positions)):
            rows = slice(int(batch.query_start_loc[i]), int(batch.query_start_loc[i]) + num_new)
            slots = batch.context_slots(i)  # cached tokens, then this step's
            keys = flat[0][slots].transpose(0, 1).to(q.dtype)  # (kv_heads, context, D)
            values = flat[1][slots].transpose(0, 1).to(q.dtype)
            context = start + num_new
            # query j (position start + j) sees positions 0 .. start + j
            mask = torch.ones(num_new, context, dtype=torch.bool, device=q.device).tril(diagonal=start)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                                               enable_gqa=q.shape[1] != num_kv_heads)
            out[rows] = o.transpose(0, 1)
        return out


class TemplateBackend(BaseBackend):
    name = "template"
    priority = -1  # never chosen over the CPU backend unless asked for (--backend template)

    @classmethod
    def is_available(cls) -> bool:
        return True  # a device backend checks its library and device here, never raising

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype | None) -> torch.dtype:
        dtypes = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}
        if requested not in dtypes:
            raise ValueError(f"dtype {requested!r} is not supported by the template backend; choose one of {list(dtypes)}")
        return dtypes[requested]

    def kv_cache_memory_bytes(self, model_bytes: int, activation_bytes: int = 0) -> int:
        return 256 << 20  # a device backend: its free memory, less the activation peak

    def create_attention(self) -> BaseAttention:
        return TemplateAttention()


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("template", TemplateBackend)
