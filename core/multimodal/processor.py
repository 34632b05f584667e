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

    def process(self, prompt_token_ids: list[int] | None, images: list, where: str | None = None, *,
                text: str | None = None, add_special_tokens: bool = False
                ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """The prompt with each image's placeholder expanded, and one item per image (in
        prompt order). Given ``text``, the placeholders (``spec.prompt_text``) are expanded
        in the text and the whole is tokenized once, as the family's own processor does
        (a run's edge may merge with the text beside it: Gemma 3's newlines); else the
        runs are spliced into ``prompt_token_ids`` at the placeholder token. MediaError when
        the placeholders and the images disagree in number, or past the per-prompt limit."""
        self.limits.check_count("image", len(images), where)
        spec = self.spec
        found = text.count(spec.prompt_text) if text is not None else prompt_token_ids.count(spec.image_token_id)
        if found != len(images):
            raise MediaError(f"the prompt has {found} image placeholder(s) ({spec.prompt_text!r}, token id "
                             f"{spec.image_token_id}) but {len(images)} image(s) were given", where)
        datas = [self.process_image(image) for image in images]
        runs = [spec.expand(data) for data in datas]
        run_ids = [self.tokenizer.encode(run, add_special_tokens=False) for run in runs]
        if text is not None:
            pieces = text.split(spec.prompt_text)
            ids = self.tokenizer.encode(pieces[0] + "".join(r + p for r, p in zip(runs, pieces[1:])),
                                        add_special_tokens=add_special_tokens)
        else:
            ids, last = [], 0
            for slot, tokens in zip([i for i, t in enumerate(prompt_token_ids) if t == spec.image_token_id], run_ids):
                ids += prompt_token_ids[last:slot] + tokens
                last = slot + 1
            ids += prompt_token_ids[last:]
        return ids, self._locate(ids, datas, [tokens.count(self.embed_token_id) for tokens in run_ids], where)

    @property
    def embed_token_id(self) -> int:
        return self.spec.image_token_id if self.spec.embed_token_id is None else self.spec.embed_token_id

    def _locate(self, ids: list[int], datas: list[dict], counts: list[int], where: str | None
                ) -> tuple[MultiModalItem, ...]:
        """Each image's item: its rows are the next ``counts[k]`` positions holding the
        embedding token; its run spans its first to its last (markers between them keep
        their own embeddings: the item's mask)."""
        embed = self.embed_token_id
        positions = [i for i, t in enumerate(ids) if t == embed]
        if len(positions) != sum(counts):
            raise MediaError(f"the prompt holds {len(positions)} image-token positions (token id {embed}) where its "
                             f"{len(counts)} image(s) take {sum(counts)}: image tokens cannot be sent as text", where)
        items, first = [], 0
        for data, count in zip(datas, counts):
            start, end = positions[first], positions[first + count - 1] + 1
            mask = torch.tensor(ids[start:end]) == embed
            items.append(MultiModalItem("image", content_hash(self._model_key, "image", data), start, end - start,
                                        data, None if bool(mask.all()) else mask))
            first += count
        return tuple(items)
