"""Images and a prompt's token ids to the engine's input: the model's Hugging Face
image processor turns each image into tensors, Ember expands each placeholder into the
image's run of tokens (`MultiModalSpec.expand`) and names each item by a content hash.

Runs before a request enters the engine (in the server, in a worker thread): never in
the engine's step."""

from __future__ import annotations

import hashlib
import logging
import warnings
from pathlib import Path

import torch

from ember.multimodal.inputs import MultiModalItem
from ember.multimodal.limits import MediaError, MediaLimits
from ember.multimodal.spec import MultiModalSpec

logger = logging.getLogger(__name__)


def load_image_processor(model_dir: Path):
    """The checkpoint's image processor (preprocessor_config.json). transformers 5.x
    prefers torchvision-backed processors; without torchvision it takes the PIL/NumPy
    one of the same family (identical outputs: transformers tests them against each
    other), which is what runs here."""
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers.utils.logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the "falling back to the PIL backend" notice, once per load
        try:
            return AutoImageProcessor.from_pretrained(str(model_dir))
        except Exception as exc:
            raise ValueError(f"could not load the image processor of {str(model_dir)!r}: {exc}") from exc
        finally:
            hf_logging.set_verbosity(level)


def content_hash(model_key: bytes, modality: str, data: dict[str, torch.Tensor]) -> str:
    """sha256 over the model and processor identity, the modality and every processed
    tensor (name, dtype, shape, bytes)."""
    h = hashlib.sha256(model_key)
    h.update(modality.encode())
    for name in sorted(data):
        tensor = data[name].contiguous()
        h.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


class MultiModalProcessor:
    """One per served model, shared by every request (thread-safe: keeps no request state)."""

    def __init__(self, model_dir: Path, spec: MultiModalSpec, tokenizer, limits: MediaLimits | None = None,
                 image_processor=None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.limits = limits or MediaLimits()
        self.image_processor = image_processor or load_image_processor(model_dir)
        options = self.image_processor.to_json_string() if hasattr(self.image_processor, "to_json_string") else ""
        self._model_key = hashlib.sha256(f"{Path(model_dir).resolve()}|{type(spec).__name__}|{options}".encode()).digest()

    def process_image(self, image) -> dict[str, torch.Tensor]:
        """One RGB image to its processor outputs as tensors (batch dimension 1; lists of
        integers, such as a tiling's rows and columns, become integer tensors)."""
        out = self.image_processor(images=[image], return_tensors="pt", **self.spec.processor_kwargs)
        return {k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in out.items()}

    def expand(self, data: dict[str, torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
        """An image's run of tokens (`MultiModalSpec.expand`, tokenized) and which of
        them take encoder rows (None: all)."""
        tokens = self.tokenizer.encode(self.spec.expand(data), add_special_tokens=False)
        mask = torch.tensor(tokens) == self.spec.image_token_id
        return tokens, None if bool(mask.all()) else mask

    def process(self, prompt_token_ids: list[int], images: list, where: str | None = None
                ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """The prompt with each image's placeholder expanded, and one item per image (in
        prompt order). MediaError when the placeholders and the images disagree in
        number, or past the per-prompt limit."""
        self.limits.check_count("image", len(images), where)
        placeholder = self.spec.image_token_id
        slots = [i for i, t in enumerate(prompt_token_ids) if t == placeholder]
        if len(slots) != len(images):
            raise MediaError(
                f"the prompt has {len(slots)} image placeholder(s) (token id {placeholder}, "
                f"{self.spec.prompt_text!r}) but {len(images)} image(s) were given", where,
            )
        out: list[int] = []
        items: list[MultiModalItem] = []
        last = 0
        for slot, image in zip(slots, images):
            data = self.process_image(image)
            tokens, mask = self.expand(data)
            out.extend(prompt_token_ids[last:slot])
            items.append(MultiModalItem("image", content_hash(self._model_key, "image", data), len(out), len(tokens),
                                        data, mask))
            out.extend(tokens)
            last = slot + 1
        out.extend(prompt_token_ids[last:])
        return out, tuple(items)
