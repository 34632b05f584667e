"""Loading a model's tokenizer, and what Ember needs to know of it (EOS ids, the
longest token in characters). Chat templates are the input processor's
(`ember.engine.input_processor.apply_chat_template`); the incremental detokenizer is the
output processor's (`ember.engine.output_processor.IncrementalDetokenizer`)."""

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


def encode_with_offsets(tokenizer: PreTrainedTokenizerBase, text: str,
                        keep_last: int) -> tuple[int, list[int], list[tuple[int, int]]]:
    """The number of tokens of ``text``, and the ids and (start, stop) character offsets
    of its last ``keep_last`` tokens ((0, 0) for a special token). A fast tokenizer's
    encoding gives just the offsets asked for (a list of 2 M offsets would hold the GIL
    for a second)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoding = backend.encode_batch([text], add_special_tokens=True)[0]  # releases the GIL
        num_tokens = len(encoding)
        start = max(0, num_tokens - keep_last)
        offsets = [encoding.token_to_chars(i) or (0, 0) for i in range(start, num_tokens)]  # None: a special token
        return num_tokens, encoding.ids[start:], offsets
    encoding = tokenizer(text, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    start = max(0, len(ids) - keep_last)
    return len(ids), ids[start:], offsets[start:]


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
        from ember.models.loader import read_json_object

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
