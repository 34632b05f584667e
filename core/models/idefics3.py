"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``,
``SmolVLMForConditionalGeneration``): a SigLIP tower over square tiles (the processor
splits an image into a grid of tiles plus a global one), pixel shuffle (``scale_factor``
squared patches into one token) and a linear connector, a Llama decoder. An image's run
in the prompt marks each tile (``<fake_token_around_image><row_r_col_c>``) around its
``<image>`` tokens, as the family's processor writes it.

Registered as a built-in plugin through Ember's own `ember` entry point.
"""

from __future__ import annotations

from collections.abc import Iterable
import torch

from ember.models.layers import Linear
from ember.models.llama import LlamaForCausalLM
from ember.models.vision import VisionTransformer
from ember.models.vision_language import SupportsImages
from ember.multimodal.config import multimodal_config
from ember.multimodal.spec import MultiModalSpec
from ember.plugin import hookimpl

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


class Idefics3Spec(MultiModalSpec):
    processor_kwargs = {"return_row_col_info": True}

    def __init__(self, cfg) -> None:
        vision = cfg.vision_config
        self.image_token_id = int(cfg.image_token_id)
        self.prompt_text = "<image>"
        self.seq_len = (vision.image_size // vision.patch_size) ** 2 // cfg.scale_factor ** 2

    def expand(self, data: dict[str, torch.Tensor]) -> str:
        rows, cols = int(data["rows"].flatten()[0]), int(data["cols"].flatten()[0])
        tile = self.prompt_text * self.seq_len
        whole = f"{FAKE}{GLOBAL}{tile}{FAKE}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{whole}"


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``(tiles, seq, dim)`` patches of square tiles -> ``(tiles, seq / scale**2, dim * scale**2)``,
    as transformers' Idefics3 connector orders them."""
    tiles, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(tiles, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // (scale * scale), dim * scale * scale)


class Idefics3ForConditionalGeneration(SupportsImages, LlamaForCausalLM):
    supports_parallel = False
    decoder_prefixes = ("model.", "model.text_model.")

    def __init__(self, hf_config, attention, compute_dtype, dtype=None, device=None, parallel=None) -> None:
        cfg = multimodal_config(hf_config)
        if cfg is None:
            raise ValueError(f"{ARCHITECTURES[0]} needs the checkpoint's whole config (vision_config)")
        if parallel is not None:
            raise ValueError("Idefics3 / SmolVLM do not run under tensor or pipeline parallelism yet")
        super().__init__(hf_config, attention, compute_dtype, dtype=dtype, device=device)
        dtype = dtype or compute_dtype
        self.scale_factor = int(cfg.scale_factor)
        self.vision_model = VisionTransformer(cfg.vision_config, dtype, compute_dtype, device)
        self.connector = Linear(cfg.vision_config.hidden_size * self.scale_factor ** 2, [hf_config.hidden_size], False,
                                dtype, compute_dtype, device)

    @classmethod
    def multimodal_spec(cls, hf_config) -> Idefics3Spec:
        return Idefics3Spec(multimodal_config(hf_config))

    def encode_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        for data in items:
            mask = data.get("pixel_attention_mask")
            if mask is not None and not bool(mask.all()):
                raise ValueError("padded image tiles are not supported (the family's processors give full tiles "
                                 "for one image)")
        tiles = torch.cat([data["pixel_values"].flatten(0, 1) for data in items])  # (tiles, 3, S, S), all items
        shuffled = pixel_shuffle(self.vision_model(tiles.to(self.connector.weight.device)), self.scale_factor)
        rows = self.connector(shuffled.reshape(-1, shuffled.shape[-1])).view(len(tiles), -1, self.connector.output_sizes[0])
        counts = [int(data["pixel_values"].shape[1]) for data in items]
        return [part.reshape(-1, part.shape[-1]) for part in rows.split(counts)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_name(name), tensor) for name, tensor in weights)

    def load_extra_weight(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        keys = self.load_tower_tensor("vision_model", name, tensor)
        if keys is not None:
            return keys
        if name in ("model.connector.modality_projection.proj.weight", "model.connector.weight"):
            self.connector.load_part(0, "weight", tensor)
            return ["connector.weight"]
        return None


def _name(name: str) -> str:
    """transformers' names -> the Llama family's (``model.text_model.*`` is the decoder)."""
    for old, new in (("model.text_model.", "model."), ("text_model.", "model."), ("vision_model.", "model.vision_model."),
                     ("connector.", "model.connector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


@hookimpl
def ember_register_model_architectures(registry) -> None:
    for name in ARCHITECTURES:
        registry.register(name, Idefics3ForConditionalGeneration)
