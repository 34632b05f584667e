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
    "ffn_gate_inp": "mlp.gate",  # a sparse MoE block's router (Mixtral, Qwen3-MoE)
}

# A sparse MoE block's experts: stacked 3-D tensors (E, out, in), or one 2-D tensor per
# expert in older files (`blk.N.ffn_gate.E.weight`). Hugging Face names them per expert:
# Mixtral `block_sparse_moe.experts.E.w1/w3/w2`, Qwen3-MoE `mlp.experts.E.gate_proj/up_proj/down_proj`.
_EXPERT_PROJ = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}
_STACKED_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")
_ONE_EXPERT = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)\.(?P<expert>\d+)\.weight")

# Gemma 2/3: four norms a layer, and llama.cpp's ffn_norm is the one before the MLP
_GEMMA_LAYER = {
    **_PER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: llama.cpp keeps the checkpoint's fused projections (ffn_up holds gate and up)
_PHI3_LAYER = {**_PER_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_PER_LAYER_BY_ARCH = {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER, "phi3": _PHI3_LAYER}

# Tensors llama.cpp stores that have no Hugging Face parameter: `rope_freqs`
# holds Llama 3 rope scaling factors, which transformers takes from the config.
IGNORED_TENSORS = frozenset({"rope_freqs.weight"})

_LAYER_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")
_TOP_NAME = re.compile(r"(?P<part>\w+)\.(?P<kind>weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a GGUF tensor name of architecture ``arch`` (``general.architecture``: the
    Llama family's names unless the architecture has its own) to its Hugging Face
    parameter name.

    `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`,
    `token_embd.weight` -> `model.embed_tokens.weight`. Raises `ValueError`
    naming the tensor if it has no known counterpart.
    """
    if m := _LAYER_NAME.fullmatch(gguf_name):
        if (hf_part := _PER_LAYER_BY_ARCH.get(arch, _PER_LAYER).get(m["part"])) is not None:
            return f"model.layers.{int(m['layer'])}.{hf_part}.{m['kind']}"
    elif m := _TOP_NAME.fullmatch(gguf_name):
        if (hf_part := _TOP_LEVEL.get(m["part"])) is not None:
            return f"{hf_part}.{m['kind']}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face Llama-family name")


def expert_tensor_names(gguf_name: str, num_experts: int, mixtral_names: bool) -> list[str] | None:
    """The Hugging Face names of the experts a GGUF tensor holds, in order: one per expert
    of a stacked `ffn_*_exps` tensor, one for an older per-expert tensor; None for any
    other tensor. ``mixtral_names``: Mixtral's (`block_sparse_moe.experts.E.w1`), else
    Qwen3-MoE's (`mlp.experts.E.gate_proj`)."""
    if m := _STACKED_EXPERTS.fullmatch(gguf_name):
        experts = range(num_experts)
    elif m := _ONE_EXPERT.fullmatch(gguf_name):
        experts = [int(m["expert"])]
    else:
        return None
    block = "block_sparse_moe" if mixtral_names else "mlp"
    proj = _EXPERT_PROJ[m["proj"]][0 if mixtral_names else 1]
    return [f"model.layers.{int(m['layer'])}.{block}.experts.{e}.{proj}.weight" for e in experts]


def is_stacked_experts(gguf_name: str) -> bool:
    """Whether a GGUF tensor holds all of a layer's experts stacked (`ffn_*_exps`)."""
    return _STACKED_EXPERTS.fullmatch(gguf_name) is not None


def is_router(gguf_name: str) -> bool:
    """Whether a GGUF tensor is a sparse MoE block's router (`ffn_gate_inp`)."""
    return gguf_name.endswith(".ffn_gate_inp.weight")


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


def fused_parts(hf_name: str, config) -> list[tuple[str, int]] | None:
    """The projections a fused weight's rows hold, in order, as ``(name, rows)``: Phi-3's
    ``qkv_proj`` (q, k, v) and ``gate_up_proj`` (gate, up); None for any other tensor."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if hf_name.endswith(".self_attn.qkv_proj.weight"):
        stem = hf_name.removesuffix("qkv_proj.weight")
        return [(f"{stem}q_proj.weight", heads * head_dim), (f"{stem}k_proj.weight", kv_heads * head_dim),
                (f"{stem}v_proj.weight", kv_heads * head_dim)]
    if hf_name.endswith(".mlp.gate_up_proj.weight"):
        stem = hf_name.removesuffix("gate_up_proj.weight")
        inter = config.intermediate_size
        return [(f"{stem}gate_proj.weight", inter), (f"{stem}up_proj.weight", inter)]
    return None
