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


# Normalizers that never make text shorter, and how many code points the composing
# ones merge into one at most (NFC: a letter with two combining marks, Hangul L+V+T).
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 3, "NFKC": 3}


def max_chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """An upper bound on the characters of text behind one token, or None if this
    tokenizer has none (a text of more than ``n * bound`` characters cannot encode to
    ``n`` tokens or fewer: a cheap length check before tokenizing).

    A token's vocabulary string is at least as long as the text it covers, for
    byte-level BPE (one character per byte) and for BPE/Unigram with byte fallback
    (an unknown character becomes byte tokens); a normalizer may shrink text first
    (`_NORMALIZER_SHRINK`). There is no bound where one unknown token can swallow any
    run of text (fused ``<unk>``, WordPiece/WordLevel) or a normalizer can delete
    characters (strip, strip accents), nor for slow (Python) tokenizers.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    pre_tokenizers = _components(spec.get("pre_tokenizer"), "pretokenizers")
    is_byte_level = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
    if model.get("type") not in ("BPE", "Unigram") or not (is_byte_level or model.get("byte_fallback")):
        return None
    factor = 1
    for normalizer in _components(spec.get("normalizer"), "normalizers"):
        kind = normalizer.get("type")
        if kind == "Replace":  # a literal pattern replaced by content at least as long keeps the length
            pattern = (normalizer.get("pattern") or {}).get("String")
            if pattern is None or len(normalizer.get("content", "")) < len(pattern):
                return None
        elif kind in _NORMALIZER_SHRINK:
            factor *= _NORMALIZER_SHRINK[kind]
        else:
            return None
    longest = max((len(text) for text in tokenizer.get_vocab()), default=1)
    return max(1, longest) * factor


def _components(spec: dict | None, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer spec as the list of its parts (a Sequence's members)."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [part for member in spec.get(key, []) for part in _components(member, key)]
    return [spec]


def eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may be a list) and the tokenizer."""
    ids: list[int] = []
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        from ember.model_loader import read_json_object

        value = read_json_object(gen_path).get("eos_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            ids.append(value)
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            ids.extend(value)
        elif value is not None:
            raise ValueError(f"{str(gen_path)!r}: eos_token_id must be a token id or a list of them, got {value!r}")
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
        # A fast tokenizer's Rust decoder directly: what its Python `decode` calls,
        # without the wrapper's per-call work (two decodes a token add up). Only when
        # the wrapper would not change the text afterwards (no space clean-up).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
            self._backend = backend
            self._decode = self._decode_backend

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_backend(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
