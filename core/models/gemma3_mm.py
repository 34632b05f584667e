"""Gemma 3 with images (``Gemma3ForConditionalGeneration``, from 4B up): a SigLIP tower over
one square image (896 pixels: 4,096 patches), average-pooled to ``mm_tokens_per_image``
(256) rows, a Gemma RMSNorm and a linear map into the decoder, Ember's Gemma 3 decoder.
An image stands in the prompt as ``\\n\\n<start_of_image>`` + 256 ``<image_soft_token>`` +
``<end_of_image>\\n\\n`` (pan-and-scan crops each add one such run after a sentence), and
the soft tokens of one run attend to each other both ways: the attention must support
bidirectional spans and the scheduler computes each run within one step.

Registered as a built-in plugin through Ember's own `ember` entry point.
"""

from __future__ import annotations

from collections.abc import Iterable
import torch
import torch.nn.functional as F
from torch import nn

from ember.models.gemma import GemmaForCausalLM
from ember.models.layers import Linear
from ember.models.vision import VisionTransformer
from ember.models.vision_language import SupportsImages
from ember.multimodal.config import multimodal_config
from ember.multimodal.spec import MultiModalSpec
from ember.plugin import hookimpl
from ember.plugin.backend import require_attention_features

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


class Gemma3Spec(MultiModalSpec):
    bidirectional = True

    def __init__(self, cfg) -> None:
        self.image_token_id = int(cfg.boi_token_id)  # the chat template's image part: <start_of_image>
        self.embed_token_id = int(cfg.image_token_id)
        self.prompt_text = BOI
        self.sequence = f"\n\n{BOI}{SOFT * int(cfg.mm_tokens_per_image)}{EOI}\n\n"

    def expand(self, data: dict[str, torch.Tensor]) -> str:
        crops = int(data["num_crops"].flatten()[0]) if "num_crops" in data else 0
        if not crops:
            return self.sequence
        return (f"Here is the original image {self.sequence} and here are some crops to help you see better "
                + " ".join([self.sequence] * crops))


class Gemma3ForConditionalGeneration(SupportsImages, GemmaForCausalLM):
    decoder_prefixes = ("model.", "model.language_model.", "language_model.model.")
    bidirectional_images = True

    def __init__(self, hf_config, attention, compute_dtype, dtype=None, device=None, parallel=None) -> None:
        cfg = multimodal_config(hf_config)
        if cfg is None:
            raise ValueError("Gemma3ForConditionalGeneration needs the checkpoint's whole config (vision_config)")
        require_attention_features(attention, "Gemma3ForConditionalGeneration", bidirectional=True)
        super().__init__(hf_config, attention, compute_dtype, dtype=dtype, device=device, parallel=parallel)
        dtype = dtype or compute_dtype
        vision = cfg.vision_config
        self.vision_tower = VisionTransformer(vision, dtype, compute_dtype, device)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.pool = self.patches_per_side // int(int(cfg.mm_tokens_per_image) ** 0.5)
        self.norm_eps = vision.layer_norm_eps
        # (1 + w) of transformers' Gemma RMSNorm, stored as 1 + w (as the decoder's norms)
        self.soft_emb_norm = nn.Parameter(torch.ones(vision.hidden_size, dtype=dtype, device=device),
                                          requires_grad=False)
        self.projection = Linear(vision.hidden_size, [hf_config.hidden_size], False, dtype, compute_dtype, device)

    @classmethod
    def multimodal_spec(cls, hf_config) -> Gemma3Spec:
        return Gemma3Spec(multimodal_config(hf_config))

    def encode_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = torch.cat([data["pixel_values"] for data in items])  # every item's image, then its crops
        x = self.vision_tower(pixels.to(self.projection.weight.device))  # (images, patches, hidden)
        side = self.patches_per_side
        pooled = F.avg_pool2d(x.transpose(1, 2).reshape(len(x), -1, side, side), self.pool, self.pool)
        pooled = pooled.flatten(2).transpose(1, 2).float()  # (images, tokens, hidden)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.soft_emb_norm.float()
        rows = self.projection(normed.to(x.dtype).reshape(-1, x.shape[-1])).view(len(x), -1, self.projection.output_sizes[0])
        counts = [int(data["pixel_values"].shape[0]) for data in items]
        return [part.reshape(-1, part.shape[-1]) for part in rows.split(counts)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_name(name), tensor) for name, tensor in weights)

    def is_gemma_norm(self, name: str) -> bool:
        return super().is_gemma_norm(name) and "vision_tower." not in name  # SigLIP's are LayerNorms

    def load_extra_weight(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        keys = self.load_tower_tensor("vision_tower", name, tensor)
        if keys is not None:
            return keys
        if name == "model.multi_modal_projector.mm_input_projection_weight":  # (vision, text): stored transposed
            self.projection.load_part(0, "weight", tensor.t().contiguous())
            return ["projection.weight"]
        if name == "model.multi_modal_projector.mm_soft_emb_norm.weight":  # GemmaForCausalLM added the 1
            self.soft_emb_norm.data.copy_(tensor)
            return ["soft_emb_norm"]
        return None


def _name(name: str) -> str:
    for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


@hookimpl
def ember_register_model_architectures(registry) -> None:
    registry.register("Gemma3ForConditionalGeneration", Gemma3ForConditionalGeneration)
