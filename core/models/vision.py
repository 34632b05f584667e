"""Vision encoders of vision-language models: the ViT family (CLIP, SigLIP) over one
image at a time, with Ember's `Linear` (the backend's matrix product) and PyTorch's
scaled-dot-product attention (bidirectional: every patch sees every patch).

An image's patches are a 2-D ``(num_patches, hidden)`` tensor through the layers, as
a decoder's flat batch is, so the backend's linear ops serve both."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.layers import Linear


def activation(name: str):
    """The activations vision towers name in their configs."""
    table = {
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
        "silu": F.silu,
    }
    if name not in table:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {', '.join(table)})")
    return table[name]


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class VisionAttention(nn.Module):
    def __init__(self, cfg, dtype, compute_dtype, device) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = Linear(hidden, [hidden] * 3, True, dtype, compute_dtype, device)
        self.out_proj = Linear(hidden, [hidden], True, dtype, compute_dtype, device)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        """``x``: ``(num_images * n, hidden)``, each image's ``n`` patches attending to each other."""
        total = x.shape[0]
        q, k, v = self.qkv_proj(x).view(num_images, total // num_images, 3, self.num_heads, self.head_dim) \
            .permute(2, 0, 3, 1, 4)
        # 4-D (images, heads, n, head_dim): PyTorch's CPU flash kernel (3-D inputs take the math path)
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5
        return self.out_proj(out.transpose(1, 2).reshape(total, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg, dtype, compute_dtype, device) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, [cfg.intermediate_size], True, dtype, compute_dtype, device)
        self.fc2 = Linear(cfg.intermediate_size, [cfg.hidden_size], True, dtype, compute_dtype, device)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg, dtype, compute_dtype, device) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device)
        self.self_attn = VisionAttention(cfg, dtype, compute_dtype, device)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device)
        self.mlp = VisionMLP(cfg, dtype, compute_dtype, device)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), num_images)
        return x + self.mlp(self.layer_norm2(x))


# CLIP's tower, and SigLIP's with the towers built on it (Idefics3's and SmolVLM's take
# SigLIP's shape; their variable-resolution position ids equal SigLIP's on full tiles)
VISION_TOWERS = ("clip_vision_model", "siglip_vision_model", "idefics3_vision", "smolvlm_vision")


class VisionTransformer(nn.Module):
    """CLIP's vision model (``clip_vision_model``: a class token, a layer norm before the
    layers) or SigLIP's (``siglip_vision_model`` and the towers on it: no class token,
    patch bias, a layer norm after). ``forward`` returns the hidden states after layer ``num_layers_used``
    (transformers' ``hidden_states[num_layers_used]``; 0: the embeddings), so a
    projector that reads an inner layer (LLaVA's -2) never computes the layers after it."""

    def __init__(self, cfg, dtype, compute_dtype, device, num_layers_used: int | None = None) -> None:
        super().__init__()
        kind = cfg.model_type
        if kind not in VISION_TOWERS:
            raise ValueError(f"vision tower {kind!r} is not supported (supported: {', '.join(VISION_TOWERS)})")
        self.is_clip = kind == "clip_vision_model"
        self.compute_dtype = compute_dtype
        self.patch_size = cfg.patch_size
        self.image_size = cfg.image_size
        hidden = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, hidden, cfg.patch_size, cfg.patch_size,
                                         bias=not self.is_clip, dtype=dtype, device=device)
        self.patch_embedding.requires_grad_(False)
        num_positions = (cfg.image_size // cfg.patch_size) ** 2 + (1 if self.is_clip else 0)
        self.position_embedding = nn.Parameter(torch.empty(num_positions, hidden, dtype=dtype, device=device),
                                               requires_grad=False)
        self.class_embedding = (nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False)
                                if self.is_clip else None)
        self.pre_layrnorm = LayerNorm(hidden, cfg.layer_norm_eps, dtype, device) if self.is_clip else None
        total = cfg.num_hidden_layers
        used = total if num_layers_used is None else num_layers_used
        if not 0 <= used <= total:
            raise ValueError(f"vision feature layer {used} is outside the tower's {total} layers")
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, dtype, compute_dtype, device) for _ in range(used))
        # SigLIP's final norm applies only when the projector reads the last layer
        self.post_layernorm = (LayerNorm(hidden, cfg.layer_norm_eps, dtype, device)
                               if not self.is_clip and used == total else None)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(images, 3, H, W)`` pixels -> ``(images, num_positions, hidden)`` in the compute
        dtype; the images go through each layer together (one product per linear)."""
        weight = self.patch_embedding.weight
        num_images, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"image tensor is {height}x{width}; this vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            patches = torch.cat([self.class_embedding.expand(num_images, 1, -1), patches], dim=1)
        x = (patches + self.position_embedding).to(self.compute_dtype)
        positions = x.shape[1]
        x = x.reshape(num_images * positions, -1)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x, num_images)
        if self.post_layernorm is not None:
            x = self.post_layernorm(x)
        return x.view(num_images, positions, -1)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        """One of the tower's checkpoint tensors under transformers' names (from
        ``embeddings.`` / ``encoder.layers.`` / the norms on); returns the parameter
        names it filled. Layers past ``num_layers_used`` are skipped (never computed)."""
        name = name.removeprefix("vision_model.")
        renames = {"embeddings.class_embedding": "class_embedding",
                   "embeddings.position_embedding.weight": "position_embedding",
                   "embeddings.patch_embedding.weight": "patch_embedding.weight",
                   "embeddings.patch_embedding.bias": "patch_embedding.bias"}
        if name in renames:
            return _copy(self, renames[name], tensor)
        if name.startswith("encoder.layers."):
            index, _, rest = name[len("encoder.layers."):].partition(".")
            if int(index) >= len(self.layers):
                return []
            layer = self.layers[int(index)]
            for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                if rest.startswith(f"self_attn.{proj}."):
                    kind = rest.rsplit(".", 1)[1]
                    layer.self_attn.qkv_proj.load_part(part, kind, tensor)
                    return [f"layers.{index}.self_attn.qkv_proj.{kind}#{part}"]
            return _copy(self, f"layers.{index}.{rest}", tensor)
        if name.startswith(("pre_layrnorm.", "post_layernorm.")):
            if getattr(self, name.split(".")[0]) is None:
                return []  # a norm this use of the tower does not apply
            return _copy(self, name, tensor)
        if name.startswith("head."):
            return []  # SigLIP's pooling head: not read by a vision-language model
        raise ValueError(f"unexpected vision tower tensor {name!r}")


def _copy(module: nn.Module, target: str, tensor: torch.Tensor) -> list[str]:
    param = dict(module.named_parameters()).get(target)
    if param is None:
        raise ValueError(f"unexpected vision tower tensor {target!r}")
    if param.shape != tensor.shape:
        raise ValueError(f"vision tower tensor {target!r} has shape {tuple(tensor.shape)}, "
                         f"model expects {tuple(param.shape)}")
    param.data.copy_(tensor)
    return [target]
