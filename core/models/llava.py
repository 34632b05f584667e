"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP (or SigLIP) vision tower, a
two-layer projector and a decoder of the Llama family. An image is resized and
cropped to the tower's size by its processor; its patches' hidden states at
``vision_feature_layer`` (without the class token under the ``default`` strategy)
go through the projector and stand in the prompt at its ``<image>`` run.

Registered as a built-in plugin through Ember's own `ember` entry point.
"""

from __future__ import annotations

from collections.abc import Iterable
import torch

from ember.models.layers import Linear
from ember.models.llama import LlamaForCausalLM
from ember.models.vision import VisionTransformer, activation
from ember.models.vision_language import SupportsImages
from ember.multimodal.config import multimodal_config
from ember.multimodal.spec import MultiModalSpec
from ember.plugin import hookimpl

LLAMA_TEXT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


class LlavaSpec(MultiModalSpec):
    def __init__(self, cfg) -> None:
        vision = cfg.vision_config
        self.image_token_id = int(cfg.image_token_id)
        self.prompt_text = "<image>"
        self.patch_size = int(vision.patch_size)
        # CLIP's class token is one row more; the "default" strategy drops it
        self.extra = (1 if vision.model_type == "clip_vision_model" else 0) - (
            1 if cfg.vision_feature_select_strategy == "default" else 0)

    def expand(self, data: dict[str, torch.Tensor]) -> str:
        height, width = data["pixel_values"].shape[-2:]
        return self.prompt_text * ((height // self.patch_size) * (width // self.patch_size) + self.extra)


def _feature_layer(cfg) -> int:
    layer = cfg.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"LLaVA with several vision feature layers ({layer}) is not supported yet")
    total = cfg.vision_config.num_hidden_layers
    return layer + total + 1 if layer < 0 else layer  # transformers' hidden_states index


class LlavaForConditionalGeneration(SupportsImages, LlamaForCausalLM):
    supports_parallel = False
    decoder_prefixes = ("model.", "model.language_model.", "language_model.model.")

    def __init__(self, hf_config, attention, compute_dtype, dtype=None, device=None, parallel=None) -> None:
        cfg = multimodal_config(hf_config)
        if cfg is None:
            raise ValueError("LlavaForConditionalGeneration needs the checkpoint's whole config (vision_config)")
        if hf_config.model_type not in LLAMA_TEXT_TYPES:
            raise ValueError(f"LLaVA with a {hf_config.model_type!r} language model is not supported "
                             f"(supported: {', '.join(LLAMA_TEXT_TYPES)})")
        if parallel is not None:
            raise ValueError("LLaVA does not run under tensor or pipeline parallelism yet")
        super().__init__(hf_config, attention, compute_dtype, dtype=dtype, device=device)
        dtype = dtype or compute_dtype
        self.image_token_id = int(cfg.image_token_id)
        self.drop_class_token = cfg.vision_feature_select_strategy == "default"
        if cfg.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {cfg.vision_feature_select_strategy!r} "
                             "is not supported (default, full)")
        self.vision_tower = VisionTransformer(cfg.vision_config, dtype, compute_dtype, device, _feature_layer(cfg))
        bias = getattr(cfg, "multimodal_projector_bias", True)
        hidden = hf_config.hidden_size
        self.projector_1 = Linear(cfg.vision_config.hidden_size, [hidden], bias, dtype, compute_dtype, device)
        self.projector_2 = Linear(hidden, [hidden], bias, dtype, compute_dtype, device)
        self.projector_act = activation(cfg.projector_hidden_act)

    @classmethod
    def multimodal_spec(cls, hf_config) -> LlavaSpec:
        return LlavaSpec(multimodal_config(hf_config))

    def encode_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        device = self.vision_tower.patch_embedding.weight.device
        features = self.vision_tower(torch.cat([data["pixel_values"] for data in items]).to(device))
        if self.drop_class_token and self.vision_tower.is_clip:
            features = features[:, 1:]
        rows = self.projector_2(self.projector_act(self.projector_1(features.reshape(-1, features.shape[-1]))))
        return list(rows.view(len(items), -1, rows.shape[-1]))  # one image per item

    # -- weights: transformers' names, legacy (language_model.model.*) and current (model.language_model.*)
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_text_name(name), tensor) for name, tensor in weights)

    def load_extra_weight(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        keys = self.load_tower_tensor("vision_tower", name, tensor)
        if keys is not None:
            return keys
        if name.startswith("model.multi_modal_projector."):
            layer, _, kind = name[len("model.multi_modal_projector."):].partition(".")
            target = {"linear_1": self.projector_1, "linear_2": self.projector_2}.get(layer)
            if target is None:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            target.load_part(0, kind, tensor)
            return [f"projector_{layer[-1]}.{kind}"]
        return None


def _text_name(name: str) -> str:
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model."), ("language_model.", "model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


@hookimpl
def ember_register_model_architectures(registry) -> None:
    registry.register("LlavaForConditionalGeneration", LlavaForConditionalGeneration)

