"""The contract of a model that takes images beside its tokens.

A vision-language architecture is a `BaseCausalLM` (its decoder runs in the flat batch
over the paged KV cache like any other) that also implements:

* ``multimodal_spec(hf_config)`` (classmethod): how its prompts hold images
  (`ember.multimodal.spec.MultiModalSpec`), read outside the engine;
* ``encode_images(items)``: each image's encoder output, the rows its placeholder
  positions take, in the decoder's hidden size and compute dtype;
* ``embed(input_ids)``: token embeddings; the runner writes the image rows over the
  placeholder positions of this result and passes it to
* ``forward(..., inputs_embeds=...)``: the decoder over given input embeddings.

The runner (``ember.worker.encoder_runner``) calls the encoder only for images the
scheduler planned (an encoder cache holds each distinct image's rows once) and
never for a decode-only step.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ember.multimodal.spec import MultiModalSpec


class SupportsImages:
    """Mixin of the vision-language contract (see the module docstring)."""

    supports_images = True
    # how checkpoints and adapters (peft) name the decoder's layers ("model.language_model.layers.0...")
    decoder_prefixes: tuple[str, ...] = ("model.",)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The decoder over ``inputs_embeds`` when the runner passes them (image rows in
        place), else over the tokens' embeddings."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        hidden, residual = self.run_layers(positions, hidden, None, kv_caches, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def load_tower_tensor(self, tower: str, name: str, tensor: torch.Tensor) -> list[str] | None:
        """A checkpoint tensor of the vision tower held as attribute ``tower`` (named
        ``model.<tower>.*``): loaded, and the keys it filled; None for another tensor."""
        prefix = f"model.{tower}."
        if not name.startswith(prefix):
            return None
        return [f"{tower}.{key}" for key in getattr(self, tower).load_tensor(name[len(prefix):], tensor)]

    def linear_parts(self):
        """The decoder's linears under each of the family's names for them (LoRA adapters
        trained on the whole model name them so), and the head; the vision tower's and
        projector's are not offered (an adapter that targets them is refused by name)."""
        parts = super().linear_parts()
        out = {"lm_head": parts["lm_head"]} if "lm_head" in parts else {}
        for name, value in parts.items():
            if name.startswith("model.layers."):
                out.update((prefix + name[len("model."):], value) for prefix in self.decoder_prefixes)
        return out

    @classmethod
    @abstractmethod
    def multimodal_spec(cls, hf_config) -> MultiModalSpec: ...

    @abstractmethod
    def encode_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One ``(num_embeds, hidden_size)`` tensor per item (its processor tensors,
        batch dimension 1), in the compute dtype; ``num_embeds`` as the spec's
        ``expand`` counted for it."""


def multimodal_spec_of(model_cls, hf_config) -> MultiModalSpec | None:
    """The spec of a model class for this config, None for a model that takes no images."""
    if not getattr(model_cls, "supports_images", False):
        return None
    return model_cls.multimodal_spec(hf_config)


def create_multimodal_processor(model_dir, hf_config, architectures, limits=None, model_impl: str = "auto",
                                tokenizer=None):
    """The media processor of the model in ``model_dir`` (None for a model that takes no
    images): its image processor, its spec, ``limits`` (`ember.multimodal.limits.MediaLimits`),
    ``tokenizer`` (the model's, loaded when not given)."""
    from ember.models.loader import get_model_class
    from ember.models.tokenizer import load_tokenizer
    from ember.multimodal.processor import MultiModalProcessor

    spec = multimodal_spec_of(get_model_class(hf_config, architectures, model_impl), hf_config)
    return None if spec is None else MultiModalProcessor(model_dir, spec, tokenizer or load_tokenizer(model_dir), limits)
