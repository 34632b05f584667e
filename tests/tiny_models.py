"""The tests' tiny models come from ember.testing (third parties build them too)."""

import json
import shutil
from pathlib import Path

from ember.testing.tiny_models import ARCH, CHAT_TEMPLATE, VOCAB_SIZE, byte_tokenizer, make_tiny_model

__all__ = ["ARCH", "CHAT_TEMPLATE", "VOCAB_SIZE", "byte_tokenizer", "make_tiny_model", "with_context"]


def with_context(model_dir: Path, out: Path, max_position_embeddings: int) -> Path:
    """A copy of ``model_dir`` whose config allows ``max_position_embeddings`` tokens: the
    tiny Llama's 256 hold no tool prompt (several hundred byte tokens) nor a long answer;
    its random weights do not mind."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_position_embeddings}))
    return out
