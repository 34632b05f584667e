"""GGUF files of the architectures added beside the Llama family, written as llama.cpp
writes them (its tensor names, Phi-3's fused projections, Gemma's norms stored as 1 + w):
converted float and quantized, they generate transformers' greedy tokens on the same
file (transformers reads the GGUF itself: ``from_pretrained(dir, gguf_file=...)``)."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from test_weights import add_tiny_tokenizer, tiny_gguf_writer, tiny_vocab

from ember import LLM, SamplingParams
from ember.weights import convert_gguf_to_hf
from ember.weights.errors import UnsupportedArchitectureError

Q8_0 = gguf.GGMLQuantizationType.Q8_0
PROMPT = [5, 17, 42, 7, 99, 3, 60, 61, 62, 11]
NEW_TOKENS = 12

_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_POST_ATTENTION = {"phi3": "ffn_norm", "gemma3": "post_attention_norm"}
_GEMMA_NORMS = {"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str, arch: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    table = {**_LAYER, "post_attention_layernorm": _POST_ATTENTION[arch], **_GEMMA_NORMS}
    return f"blk.{layer}.{table[part]}.{kind}"


def tiny(arch: str, seed: int = 0):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(tiny_vocab()), max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    if arch == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, tie_word_embeddings=False,
                                                                     pad_token_id=0))
    else:  # both layers slide (transformers' GGUF config: five sliding to one global), window 6
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=6, tie_word_embeddings=True,
            pad_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_gguf(path: Path, model, arch: str, qtype=None) -> Path:
    cfg = model.config
    writer, head_dim = tiny_gguf_writer(path, cfg, arch)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(cfg.sliding_window)
    add_tiny_tokenizer(writer)
    writer.add_pad_token_id(tiny_vocab().index("<|endoftext|>"))  # Phi-3's config default (32000) lies outside
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's w of (1 + w) as 1 + w
        if data.ndim == 2 and qtype is not None:
            writer.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name, arch), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _transformers_tokens(src: Path) -> list[int]:
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                               dtype=torch.float32).eval()
    out = oracle.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _ember_tokens(directory: Path) -> list[int]:
    llm = LLM(model=str(directory), dtype="float32", num_kv_blocks=32, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return list(llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
@pytest.mark.parametrize("qtype", [None, Q8_0], ids=["f32", "q8_0"])
def test_gguf_generates_as_transformers_on_the_same_file(tmp_path, arch, qtype):
    src = write_gguf(tmp_path / f"tiny-{arch}.gguf", tiny(arch), arch, qtype)
    expected = _transformers_tokens(src)
    out = convert_gguf_to_hf(src, tmp_path / "float", progress=False)
    assert _ember_tokens(out) == expected
    if qtype is not None:  # kept quantized: Phi-3's fused rows split into q/k/v and gate/up
        native = convert_gguf_to_hf(src, tmp_path / "native", progress=False, keep_quantized=True)
        from safetensors import safe_open

        with safe_open(str(native / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "model.layers.0.self_attn.k_proj.gguf_type" in names and "model.layers.0.mlp.up_proj.weight" in names
        tokens = _ember_tokens(native)
        agree = sum(a == b for a, b in zip(tokens, expected))
        assert tokens[0] == expected[0] and agree >= NEW_TOKENS // 2, (tokens, expected)


def test_phi3_gguf_with_longrope_is_refused_by_name(tmp_path):
    src = tmp_path / "longrope.gguf"
    writer = gguf.GGUFWriter(str(src), "phi3")
    writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="Phi-3 with LongRoPE"):
        convert_gguf_to_hf(src, tmp_path / "out", progress=False)
