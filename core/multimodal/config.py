"""A multimodal checkpoint's config as the engine reads it."""

from __future__ import annotations

import copy


def is_multimodal_config(hf_config) -> bool:
    """A config with a language model and a vision (or audio) part of its own."""
    return getattr(hf_config, "vision_config", None) is not None and hasattr(hf_config, "get_text_config") \
        and hf_config.get_text_config() is not hf_config


def text_view(hf_config):
    """The language model's config, standing for the whole checkpoint: everything the
    engine sizes from a config (context, KV shape, vocabulary, step budgets) reads the
    text model's figures, as for any decoder. It keeps the checkpoint's
    ``architectures`` (the registry finds the multimodal class by them) and dtype, and
    holds the whole config as ``multimodal_config`` (the model class builds its vision
    part from it). A text-only config is returned as it is."""
    if not is_multimodal_config(hf_config):
        return hf_config
    view = copy.deepcopy(hf_config.get_text_config())
    view.architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in ("dtype", "torch_dtype"):
        if getattr(view, name, None) is None and getattr(hf_config, name, None) is not None:
            setattr(view, name, getattr(hf_config, name))
    view.multimodal_config = hf_config
    return view


def multimodal_config(hf_config):
    """The whole multimodal config behind a `text_view` (None for a text-only model)."""
    return getattr(hf_config, "multimodal_config", None)
