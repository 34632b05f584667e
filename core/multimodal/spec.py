"""The contract between a vision-language architecture and Ember's media processing.

A model class that takes images returns a `MultiModalSpec` from its classmethod
``multimodal_spec(hf_config)`` (None, the default of `ember.models.base.BaseCausalLM`:
the model takes no images). The spec is read outside the engine (the server's
request path, the offline `LLM`), so it holds only what the config says: no weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class MultiModalSpec(ABC):
    """How a family's prompts hold images.

    ``image_token_id``: the placeholder token an image stands as in a prompt before
    expansion (one per image, where the image goes). ``prompt_text``: what a chat's
    image part becomes in the templated text (it tokenizes to the placeholder).
    ``processor_kwargs``: keyword arguments for the image processor's call."""

    image_token_id: int
    prompt_text: str
    processor_kwargs: dict = {}
    #: the token whose positions take encoder rows where it is not the placeholder itself
    #: (Gemma 3: ``<start_of_image>`` stands for the image, ``<image_soft_token>`` take rows)
    embed_token_id: int | None = None
    #: whether an image's tokens attend to each other both ways (Gemma 3): the scheduler
    #: never splits such a run across steps, and the attention must support it
    bidirectional: bool = False

    @abstractmethod
    def expand(self, data: dict[str, torch.Tensor]) -> str:
        """The text one processed image (its processor outputs, batch dimension 1)
        stands as in the prompt, in place of its placeholder: the run of image tokens
        and any markers the family puts around and inside it, as the family's own
        Hugging Face processor writes it. Ember tokenizes it; the positions holding
        ``image_token_id`` take the encoder's rows, in order, and the model's encoder
        must give exactly that many for the image
        (`ember.models.vision_language.SupportsImages.encode_images`)."""
