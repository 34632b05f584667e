"""Tokenizers, chat templates and the incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ValueError(f"could not load a tokenizer from {model_dir}: {exc}") from exc


def eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may be a list) and the tokenizer."""
    ids: list[int] = []
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class IncrementalDetokenizer:
    """Streams text for one request's output ids.

    Decodes a sliding window (prefix_offset .. end) and emits only what extends
    the window's previous decode, holding back a trailing U+FFFD (an incomplete
    multi-byte character) until the next token completes it, so the emitted
    pieces concatenate to the decode of all output ids.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they complete (may be empty)."""
        delta = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                piece = new_text[len(prefix_text) :]
                delta.append(piece)
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        text = "".join(delta)
        self.text += text
        return text

    def flush(self) -> str:
        """At the end of a request: emit whatever was held back."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        piece = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += piece
        return piece
