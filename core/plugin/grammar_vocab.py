"""Each token's bytes, as they appear in the decoded text: what a grammar matches.

A grammar backend walks its automaton over bytes, so it needs to know which bytes
each token id adds to the output. Tokenizers store tokens in their own alphabets:

* byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2): each byte is written as one
  printable character (GPT-2's ``bytes_to_unicode`` table), so ``Ġ`` is a space and
  a token may hold half of a multi-byte character;
* SentencePiece (Llama 2, Mistral): ``▁`` is a space, and ``<0x0A>`` tokens are single
  bytes (byte fallback).

Added tokens are stored as their text. Special tokens (and padding ids past the
tokenizer's end, when the model's vocabulary is larger) decode to nothing a grammar
can match: they map to None.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable bytes stand for themselves,
    the others (controls, space, 0x7F-0xA0, 0xAD) for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_types(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"grammar-guided decoding needs a fast (Rust) tokenizer; {type(tokenizer).__name__} is not one"
        )
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {part.get("type") for part in parts}


def decode_token_bytes(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> list[bytes | None]:
    """``vocab_size`` entries: entry ``i`` is the bytes token ``i`` adds to the decoded
    text, None for a special token (EOS included: the grammar handles it apart) and for
    ids the tokenizer does not have. ValueError for a tokenizer whose alphabet is none
    of those above (naming its decoder)."""
    types = _decoder_types(tokenizer)
    added = {i: tok for i, tok in tokenizer.added_tokens_decoder.items()}
    special = set(tokenizer.all_special_ids) | set(eos_token_ids)
    special |= {i for i, tok in added.items() if tok.special}
    table: list[bytes | None] = [None] * vocab_size
    if "ByteLevel" in types:
        to_byte = _unicode_to_byte()

        def to_bytes(token: str) -> bytes:
            return bytes(to_byte[ch] for ch in token)
    elif types & {"Metaspace", "ByteFallback"}:
        def to_bytes(token: str) -> bytes:
            byte = _BYTE_TOKEN.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace("▁", " ").encode()
    else:
        raise ValueError(
            f"cannot tell the bytes of this tokenizer's tokens (decoder {sorted(map(str, types))}); "
            "grammar-guided decoding supports byte-level BPE and SentencePiece tokenizers"
        )
    for token, token_id in tokenizer.get_vocab().items():
        if token_id >= vocab_size or token_id in special:
            continue
        data = added[token_id].content.encode() if token_id in added else to_bytes(token)
        table[token_id] = data or None  # an empty token adds nothing a grammar could follow
    return table
