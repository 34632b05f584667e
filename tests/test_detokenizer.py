"""Streamed text pieces concatenate exactly to the full decode, multi-byte characters included."""

import pytest
from tiny_models import byte_tokenizer

from ember.engine.output_processor import IncrementalDetokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧 mid-sentence",
    "中文字符测试，日本語のテキスト、한국어",
    "mixed: café — naïve 🚀 漢字 end",
    "\n\ttabs and  double  spaces\n",
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pieces_concatenate_to_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters split
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for i in range(0, len(ids), chunk):
        piece = detok.add_tokens(ids[i : i + chunk])
        assert "\ufffd" not in piece, "an incomplete character was emitted"
        pieces.append(piece)
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert detok.text == text


def test_incomplete_character_is_held_back_until_complete(tok):
    ids = tok.encode("🙂")
    detok = IncrementalDetokenizer(tok)
    assert [detok.add_tokens([i]) for i in ids] == ["", "", "", "🙂"]


def test_flush_emits_a_truncated_character(tok):
    ids = tok.encode("ok🙂")[:-1]  # generation stopped mid-character
    detok = IncrementalDetokenizer(tok)
    text = detok.add_tokens(ids) + detok.flush()
    assert text == tok.decode(ids)


def test_special_tokens_are_skipped_by_default(tok):
    ids = tok.encode("hi") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(ids) + detok.flush() == "hi"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert keep.add_tokens(ids) + keep.flush() == "hi</s>"
