"""Tiny random vision-language models, saved the way Hugging Face saves them (config,
safetensors, tokenizer, image processor), for the tests and the conformance checks.

The tokenizer is `ember.testing.tiny_models.byte_tokenizer` plus the family's image
token; the image processor is the family's own, configured for small images so that
an image is a few dozen tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from ember.testing.tiny_models import VOCAB_SIZE, byte_tokenizer

IMAGE_TOKEN = "<image>"


def _tokenizer_with(*tokens: str):
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


def _text_config(tokenizer, overrides: dict, **family) -> dict:
    """The tiny decoder every family here shares (`ember.testing.tiny_models`' sizes), with
    the family's settings, then the caller's."""
    return {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=512, initializer_range=0.3,
                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False), **family, **overrides}


def _widen(model, parts: tuple[str, ...]) -> None:
    """Random vision weights at a scale that keeps images' effect on the logits visible."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in parts) and param.dim() > 1:
                param.normal_(0.0, 0.2)


def make_tiny_llava(out_dir: Path, seed: int = 0, image_size: int = 28, patch_size: int = 7,
                    select_strategy: str = "default", feature_layer: int = -2, **text_overrides):
    """LLaVA-1.5's shape: a CLIP vision tower, a two-layer GELU projector and a Llama
    decoder; an image is ``(image_size / patch_size) ** 2`` tokens (16 by default).
    Returns the transformers model (fp32, eval)."""
    import transformers

    out_dir = Path(out_dir)
    tokenizer = _tokenizer_with(IMAGE_TOKEN)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = _text_config(tokenizer, text_overrides)
    vision = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  image_size=image_size, patch_size=patch_size, projection_dim=32, initializer_range=0.3)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision), text_config=transformers.LlamaConfig(**text),
        image_token_id=image_token_id, vision_feature_layer=feature_layer,
        vision_feature_select_strategy=select_strategy, projector_hidden_act="gelu",
        image_seq_length=(image_size // patch_size) ** 2,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _widen(model, ("vision_tower", "multi_modal_projector"))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return model


SMOLVLM_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                  *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


def make_tiny_smolvlm(out_dir: Path, seed: int = 0, tile: int = 32, patch_size: int = 8, scale_factor: int = 2,
                      longest_edge: int = 64, arch: str = "smolvlm", **text_overrides):
    """SmolVLM's shape (Idefics3's with ``arch="idefics3"``): a SigLIP tower over square tiles
    of ``tile`` pixels, pixel shuffle by ``scale_factor`` and a linear connector, a Llama
    decoder. Images are resized to at most ``longest_edge`` and split into a grid of tiles
    plus a global tile; each tile is ``(tile / patch_size / scale_factor) ** 2`` tokens (4
    by default). Returns the transformers model (fp32, eval)."""
    import transformers

    out_dir = Path(out_dir)
    tokenizer = _tokenizer_with(*SMOLVLM_TOKENS)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = _text_config(tokenizer, text_overrides)
    vision = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  image_size=tile, patch_size=patch_size, initializer_range=0.3)
    names = {"smolvlm": ("SmolVLMConfig", "SmolVLMVisionConfig", "SmolVLMForConditionalGeneration",
                         "SmolVLMImageProcessorPil", "smolvlm"),
             "idefics3": ("Idefics3Config", "Idefics3VisionConfig", "Idefics3ForConditionalGeneration",
                          "Idefics3ImageProcessorPil", "idefics3")}
    config_name, vision_name, arch_name, processor_name, module = names[arch]
    config = getattr(transformers, config_name)(
        vision_config=getattr(transformers, vision_name)(**vision).to_dict(),
        text_config=transformers.LlamaConfig(**text).to_dict(),
        image_token_id=image_token_id, scale_factor=scale_factor,
    )
    config.architectures = [arch_name]
    torch.manual_seed(seed)
    model = getattr(transformers, arch_name)(config).eval()
    _widen(model, ("vision_model", "connector"))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    import importlib

    processors = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
    getattr(processors, processor_name)(size={"longest_edge": longest_edge},
                                        max_image_size={"longest_edge": tile}).save_pretrained(out_dir)
    return model


GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def make_tiny_gemma3_vlm(out_dir: Path, seed: int = 0, image_size: int = 28, patch_size: int = 7,
                         tokens_per_image: int = 4, **text_overrides):
    """Gemma 3's vision-language shape: a SigLIP tower over one ``image_size`` image, average
    pooling to ``tokens_per_image`` rows, a Gemma 3 decoder (sliding and global layers, a
    window of 6 keys so that prompts slide). Returns the transformers model (fp32, eval)."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from ember.testing.tiny_models import GEMMA_DEFAULTS

    out_dir = Path(out_dir)
    tokenizer = _tokenizer_with(*GEMMA3_TOKENS)
    boi, eoi, soft = (tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS)
    # (a narrower init than the other tiny models': Gemma's at 0.3 repeats one token whatever it sees)
    text = _text_config(tokenizer, text_overrides, initializer_range=0.05, tie_word_embeddings=True,
                        **GEMMA_DEFAULTS["gemma3"])
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=image_size, patch_size=patch_size),
        mm_tokens_per_image=tokens_per_image, boi_token_id=boi, eoi_token_id=eoi, image_token_id=soft,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _widen(model, ("vision_tower", "multi_modal_projector"))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return model
