"""GGUF tensor names to Hugging Face names, and undoing llama.cpp's rotary permutation.

Pure functions on names and tensors; `gguf_loader` drives them.
"""

from __future__ import annotations

import re

import torch

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}

# Tensors llama.cpp stores that have no Hugging Face parameter: `rope_freqs`
# holds Llama 3 rope scaling factors, which transformers takes from the config.
IGNORED_TENSORS = frozenset({"rope_freqs.weight"})

_LAYER_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")
_TOP_NAME = re.compile(r"(?P<part>\w+)\.(?P<kind>weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """Map a Llama-family GGUF tensor name to its Hugging Face parameter name.

    `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`,
    `token_embd.weight` -> `model.embed_tokens.weight`. Raises `ValueError`
    naming the tensor if it has no known counterpart.
    """
    if m := _LAYER_NAME.fullmatch(gguf_name):
        if (hf_part := _PER_LAYER.get(m["part"])) is not None:
            return f"model.layers.{int(m['layer'])}.{hf_part}.{m['kind']}"
    elif m := _TOP_NAME.fullmatch(gguf_name):
        if (hf_part := _TOP_LEVEL.get(m["part"])) is not None:
            return f"{hf_part}.{m['kind']}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face Llama-family name")


def rotary_heads(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """Heads over which llama.cpp permuted this tensor for its rope layout, or None if it did not.

    llama.cpp's Llama converter permutes the rows of q (over `num_heads`) and
    k (over `num_kv_heads`), weights and biases alike.
    """
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return num_kv_heads
    return None


def unpermute_rotary(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's rotary permutation of a q or k projection.

    llama.cpp regroups each head's rows from (two halves of `head_dim / 2`)
    to (`head_dim / 2` interleaved pairs): it reshapes rows as
    `(heads, 2, head_dim // 2)` and swaps the last two axes. This reshapes as
    `(heads, head_dim // 2, 2)` and swaps them back. `tensor` is
    `(heads * head_dim, in_features)` or `(heads * head_dim,)`; the result has
    the same shape.
    """
    num_rows = tensor.shape[0]
    if num_heads <= 0 or num_rows % (2 * num_heads) != 0:
        raise ValueError(
            f"Cannot undo the rotary permutation of a tensor with {num_rows} rows over {num_heads} heads: "
            "rows must be a multiple of 2 * heads"
        )
    half_head_dim = num_rows // num_heads // 2
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, half_head_dim, 2, *rest).transpose(1, 2).reshape(tensor.shape).contiguous()
