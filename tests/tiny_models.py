"""The tests' tiny models come from ember.testing (third parties build them too)."""

from ember.testing.tiny_models import ARCH, CHAT_TEMPLATE, VOCAB_SIZE, byte_tokenizer, make_tiny_model

__all__ = ["ARCH", "CHAT_TEMPLATE", "VOCAB_SIZE", "byte_tokenizer", "make_tiny_model"]
