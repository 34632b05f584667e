"""Sparse MoE (Mixtral, Qwen3-MoE) and Phi-3's LongRoPE / partial rotary against transformers.

The exactness and preemption checks are test_exactness's and test_preemption's own test
functions, run here over this file's fixtures (tiny random models of 4 experts, 2 per
token; a Phi-3 with LongRoPE whose prompts stay below original_max_position_embeddings;
a Phi-3 rotating half of each head): greedy tokens equal to transformers' in a
staggered continuous batch, through the prefix cache and in chunked prefill, logits
within 1e-4 in float32, the same tokens under a pool small enough to preempt. Then the
grouped experts (no expert without tokens runs, float or quantized), their grouped_mm
form, both checkpoint layouts, GGUF files dequantized and kept quantized, and the refusals.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_exactness import (
    _ember_last_logits,
    test_chunked_prefill_matches_transformers,  # noqa: F401 (collected here, over this file's `tiny`)
    test_last_position_logits_match_transformers,  # noqa: F401
    test_shared_prefixes_through_the_prefix_cache_match_transformers,  # noqa: F401
    test_staggered_continuous_batch_matches_transformers_greedy,  # noqa: F401
)
from test_preemption import (
    test_greedy_outputs_are_identical_under_a_pool_small_enough_to_preempt,  # noqa: F401 (over `model_dir`)
)
from tiny_models import make_tiny_model

from ember import EngineConfig
from ember.engine.llm_engine import LLMEngine
from ember.models.moe import MoeLlamaForCausalLM, MoeSpec, SparseMoeBlock, StackedExperts, is_sparse_layer

# Phi-3 LongRoPE: short factors that differ per dim (so a wrong choice shows), an
# original length of 128 that every exactness prompt stays below, a context of 512
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.15 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 128}
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "phi3_longrope": ("phi3", dict(rope_parameters=LONGROPE, max_position_embeddings=512,
                                   original_max_position_embeddings=128)),
    "phi3_partial_rotary": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5})),
}


def _make(variant: str, path, seed: int, **extra):
    kind, overrides = VARIANTS[variant]
    return make_tiny_model(kind, path, seed=seed, **{**overrides, **extra})


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = _make(request.param, path, seed=1)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=96, block_size=4))
    return request.param, hf_model, engine


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "phi3_longrope"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-preempt")
    extra = {} if request.param == "phi3_longrope" else {"max_position_embeddings": 128}
    _make(request.param, path, seed=11, **extra)
    return str(path)


# -- the grouped experts --------------------------------------------------------------

def _experts(num_experts=4, top_k=2, hidden=16, inter=8, seed=0) -> StackedExperts:
    spec = MoeSpec(num_experts, top_k, inter, renormalize=True, float32_weights=True)
    experts = StackedExperts(spec, hidden, torch.float32, torch.float32, None)
    gen = torch.Generator().manual_seed(seed)
    experts.w13.data.copy_(torch.randn(experts.w13.shape, generator=gen))
    experts.w2.data.copy_(torch.randn(experts.w2.shape, generator=gen))
    return experts


def _dense_reference(experts: StackedExperts, x, ids, weights):
    """Every expert on every token, weighted by its routing weight (zero where not routed)."""
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        w = (weights * (ids == e)).sum(-1, keepdim=True)
        out += experts.run_expert(e, x) * w
    return out


def _quantize_experts(experts: StackedExperts) -> StackedExperts:
    """The experts as Linear modules holding their weights in Q8_0, run by the CPU backend's GGUF op."""
    import gguf

    from ember.hardware.cpu_gguf import GGUFLinearOp
    from ember.plugins.quantizers.gguf import GGUFWeight

    w13, w2, inter = experts.w13.data.clone(), experts.w2.data.clone(), experts.inter
    experts.create_linears()
    op = GGUFLinearOp()
    for e in range(experts.num_experts):
        for proj, weight in (("w1", w13[e, :inter]), ("w3", w13[e, inter:]), ("w2", w2[e])):
            data = torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0))
            linear, part = experts.expert_linear(e, proj)
            linear.load_part(part, "weight", GGUFWeight([("Q8_0", data)], weight.shape[1]))
        for linear in (experts.linears[e].gate_up_proj, experts.linears[e].down_proj):
            linear.set_quantized_op(op)
    return experts


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
def test_grouped_experts_run_only_the_experts_that_got_tokens_once_each(monkeypatch, quantized):
    hidden = 32 if quantized else 16  # Q8_0 rows are blocks of 32
    experts = _experts(num_experts=8, top_k=2, hidden=hidden, inter=hidden)
    if quantized:
        experts = _quantize_experts(experts)
        assert experts.w13 is None and all(m.gate_up_proj.qweights is not None for m in experts.linears)
    x = torch.randn(6, hidden)
    # experts 1, 3 and 6 get tokens; the other five none
    ids = torch.tensor([[1, 3], [3, 1], [6, 1], [1, 6], [3, 6], [6, 3]])
    weights = torch.softmax(torch.randn(6, 2), -1)
    calls = []
    original = StackedExperts.run_expert

    def counting(self, expert, rows):
        calls.append((expert, rows.shape[0]))
        return original(self, expert, rows)

    monkeypatch.setattr(StackedExperts, "run_expert", counting)
    out = experts.forward(x, ids, weights, grouped_mm=None if quantized else False)
    assert calls == [(1, 4), (3, 4), (6, 4)]  # in expert order, each on exactly its rows
    torch.testing.assert_close(out, _dense_reference(experts, x, ids, weights), rtol=1e-5, atol=1e-5)


def test_grouped_mm_form_gives_the_loops_numbers():
    """The form used off a CPU (no copy of the counts to the host, so a device graph can
    record it), checked here on CPU tensors: empty experts included."""
    experts = _experts(num_experts=6, top_k=2, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 16, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])  # experts 4, 5 get none
    weights = torch.softmax(torch.randn(9, 2, generator=gen), -1)
    loop = experts.forward(x, ids, weights, grouped_mm=False)
    grouped = experts.forward(x, ids, weights, grouped_mm=True)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def test_router_renormalises_mixtral_always_and_qwen3_moe_per_norm_topk_prob():
    x = torch.randn(5, 16)
    for renormalize in (True, False):
        block = SparseMoeBlock(MoeSpec(4, 2, 8, renormalize, float32_weights=False), 16, torch.float32,
                               torch.float32, None)
        block.gate.weight.data.normal_()
        ids, weights = block.route(x)
        probs = torch.softmax(x @ block.gate.weight.T, -1)
        top = probs.topk(2, -1)
        assert torch.equal(ids, top.indices)
        expected = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
        torch.testing.assert_close(weights, expected)


def test_qwen3_moe_sparse_and_dense_layers_follow_the_config(tmp_path):
    hf = make_tiny_model("qwen3_moe", tmp_path, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in engine.model.layers]
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert ours == theirs == [False, True, False, False]
    assert [is_sparse_layer(hf.config, i) for i in range(4)] == ours
    prompt = list(range(3, 30))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (_ember_last_logits(engine, prompt) - ref).abs().max().item() <= 1e-4


# -- checkpoint layouts and refusals ---------------------------------------------------

def _stack_experts(path) -> None:
    """Rewrite a per-expert checkpoint in transformers 5's stacked form (experts.gate_up_proj, experts.down_proj)."""
    state = load_file(str(path / "model.safetensors"))
    out, experts = {}, {}
    for name, tensor in state.items():
        parts = name.split(".")
        if "experts" in parts:
            at = parts.index("experts")
            layer, expert, proj = ".".join(parts[:at]), int(parts[at + 1]), parts[at + 2]
            experts.setdefault(layer.replace("block_sparse_moe", "mlp"), {})[(expert, proj)] = tensor
        else:
            out[name.replace("block_sparse_moe", "mlp")] = tensor
    for layer, tensors in experts.items():
        n = 1 + max(e for e, _ in tensors)
        gate, up, down = ("w1", "w3", "w2") if (0, "w1") in tensors else ("gate_proj", "up_proj", "down_proj")
        out[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[(e, gate)], tensors[(e, up)]]) for e in range(n)])
        out[f"{layer}.experts.down_proj"] = torch.stack([tensors[(e, down)] for e in range(n)])
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_stacked_expert_tensors_load_as_the_per_expert_ones(tmp_path, kind):
    hf = make_tiny_model(kind, tmp_path, seed=2)
    _stack_experts(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))
    prompt = list(range(5, 25))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (_ember_last_logits(engine, prompt) - ref).abs().max().item() <= 1e-4


def test_a_missing_expert_tensor_is_named(tmp_path):
    make_tiny_model("mixtral", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): layers\.1\.mlp\.experts\.w13#2\.1"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))


def test_expert_tensors_for_a_dense_layer_or_an_unknown_expert_are_refused(tmp_path):
    make_tiny_model("qwen3_moe", tmp_path)  # layer 1 is dense (mlp_only_layers)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.1.mlp.experts.0.up_proj.weight"] = state["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight'.*layer 1 is dense"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))
    del state["model.layers.1.mlp.experts.0.up_proj.weight"]
    state["model.layers.0.mlp.experts.7.up_proj.weight"] = state["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"names expert 7; the model has 4"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))


def test_parallelism_and_quantized_checkpoints_are_refused_by_name(tmp_path):
    from ember.models.parallel.loader import check_parallel_model
    from ember.plugin.registry import Registry

    hf = make_tiny_model("mixtral", tmp_path)
    registry = Registry("architectures")
    registry.register("MixtralForCausalLM", MoeLlamaForCausalLM)
    with pytest.raises(ValueError, match="MoeLlamaForCausalLM does not support tensor or pipeline parallelism"):
        check_parallel_model(hf.config, registry)
    with pytest.raises(ValueError, match=r"MixtralForCausalLM \(sparse MoE\) cannot run with tensor or pipeline"):
        MoeLlamaForCausalLM(hf.config, None, torch.float32, parallel=object())
    model = MoeLlamaForCausalLM(hf.config, None, torch.float32, device=torch.device("meta"))
    with pytest.raises(NotImplementedError, match=r"MixtralForCausalLM \(sparse MoE\) keeps its experts quantized "
                                                  r"only from GGUF files: .* quant_method None"):
        model.linear_parts()
    hf.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(NotImplementedError, match="quant_method 'gptq' are not supported"):
        model.linear_parts()


@pytest.mark.parametrize("field, value, named", [
    ("num_experts_per_tok", 5, "num_experts_per_tok 5 must be in 1..4"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
])
def test_bad_moe_configs_are_refused_naming_the_value(tmp_path, field, value, named):
    make_tiny_model("mixtral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))


# -- LongRoPE and partial rotary ------------------------------------------------------

def test_longrope_tables_are_transformers_short_below_the_original_length_and_long_from_it(tmp_path):
    """transformers picks one factor set per forward (long once its longest position
    passes original_max_position_embeddings); Ember fixes it per position. Each row of
    Ember's tables equals transformers' cos/sin for that position under the set
    transformers uses for a sequence that ends there."""
    hf = _make("phi3_longrope", tmp_path, seed=0)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))
    rotary = engine.model.rotary
    rotary_hf = hf.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    for end in (100, 128, 129, 300, 512):
        positions = torch.arange(end)[None]
        cos, sin = rotary_hf(x, positions)
        tail = slice(end - 1, end)  # the position transformers' choice was made for
        torch.testing.assert_close(rotary.cos_cache[tail], cos[0, tail], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rotary.sin_cache[tail], sin[0, tail], rtol=1e-5, atol=1e-6)
    assert rotary_hf.attention_scaling != 1.0  # the attention factor is in both tables


def test_partial_rotary_outside_phi3_is_refused_by_name(tmp_path):
    make_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 .* model type 'llama'"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=4))


def test_longrope_settings_that_do_not_fit_the_head_are_refused_naming_them():
    """(transformers' config validation refuses them first when they come from config.json)"""
    from ember.models.layers import RotaryEmbedding

    params = {**LONGROPE, "long_factor": [1.0] * 5}
    with pytest.raises(ValueError, match=r"long_factor with 8 values \(rotated dims / 2\), got 5"):
        RotaryEmbedding(16, 512, params)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.3125 of a head of 16 rotates 5"):
        RotaryEmbedding(16, 512, {**LONGROPE, "partial_rotary_factor": 0.3125})


# -- GGUF ----------------------------------------------------------------------------

def _write_moe_gguf(path, model, arch: str, *, stacked: bool = True, qtype=None):
    """`model` as llama.cpp writes it: Mixtral as `llama` with experts (q/k permuted),
    Qwen3-MoE as `qwen3moe`; experts stacked (`ffn_gate_exps`, E x out x in) or, as older
    files did, one tensor per expert (`ffn_gate.E`). ``qtype`` (a gguf quant type): the
    linears' and experts' weights in it, as llama.cpp quantizes (the router, norms and
    token embedding float)."""
    import gguf
    import numpy as np
    from test_weights import add_tiny_tokenizer, gguf_name, llamacpp_permute

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in [("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("head_count", cfg.num_attention_heads), ("head_count_kv", cfg.num_key_value_heads),
                       ("rope_freq_base", cfg.rope_parameters["rope_theta"]), ("layer_norm_rms_eps", cfg.rms_norm_eps),
                       ("expert_count", 4), ("expert_used_count", 2)]:
        getattr(writer, f"add_{add}")(value)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_tiny_tokenizer(writer)
    experts: dict = {}

    def add(name, data, quantize=True):
        data = np.ascontiguousarray(data)
        if qtype is not None and quantize:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)

    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if ".experts." in name:  # transformers 5 holds them stacked: gate_up_proj (E, 2I, H), down_proj (E, H, I)
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                experts[(layer, "gate")], experts[(layer, "up")] = np.split(data, 2, axis=1)
            else:
                experts[(layer, "down")] = data
            continue
        if name.endswith(".mlp.gate.weight") or name.endswith(".block_sparse_moe.gate.weight"):
            writer.add_tensor(f"blk.{name.split('.')[2]}.ffn_gate_inp.weight", data)
            continue
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        add(gguf_name(name), data, quantize=data.ndim == 2 and "embed_tokens" not in name)
    for (layer, proj), data in experts.items():
        if stacked:
            add(f"blk.{layer}.ffn_{proj}_exps.weight", data)
        else:
            for e, one in enumerate(data):
                add(f"blk.{layer}.ffn_{proj}.{e}.weight", one)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind, arch, stacked", [("mixtral", "llama", True), ("mixtral", "llama", False),
                                                 ("qwen3_moe", "qwen3moe", True)])
def test_moe_gguf_converts_and_generates_as_transformers(tmp_path, kind, arch, stacked):
    import transformers
    from test_weights import tiny_vocab

    from ember import LLM, SamplingParams
    from ember.weights.gguf_loader import convert_gguf_to_hf

    model = make_tiny_model(kind, tmp_path / "hf", seed=4, vocab_size=len(tiny_vocab()), rms_norm_eps=1e-6,
                            mlp_only_layers=[])
    src = _write_moe_gguf(tmp_path / f"tiny-{kind}.gguf", model, arch, stacked=stacked)
    out = convert_gguf_to_hf(src, tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["num_experts_per_tok"] == 2
    oracle = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for name, tensor in model.state_dict().items():  # the same weights, whatever the layout
        torch.testing.assert_close(oracle.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    prompt = [5, 17, 42, 7, 99, 3]
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=32, block_size=4)
    ours = llm.generate(prompt_token_ids=[prompt],
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    theirs = oracle.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert list(ours[0].outputs[0].token_ids) == theirs[0, len(prompt):].tolist()


def _greedy(directory, prompt, num_tokens=12):
    from ember import LLM, SamplingParams

    llm = LLM(model=str(directory), dtype="float32", num_kv_blocks=32, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return llm, list(llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("kind, arch, stacked", [("mixtral", "llama", True), ("mixtral", "llama", False),
                                                 ("qwen3_moe", "qwen3moe", True)])
def test_moe_gguf_kept_quantized_holds_each_expert_quantized_and_generates_as_the_float_one(
        tmp_path, kind, arch, stacked):
    """The default native path: each expert's gate/up/down keep their Q8_0 rows (split
    from the stacked tensor by rows), run by the CPU backend's GGUF op, grouped by expert."""
    import gguf
    import torch.nn.functional as F
    from test_weights import tiny_vocab

    from ember.weights import iter_safetensors
    from ember.weights.gguf_loader import convert_gguf_to_hf
    from ember.weights.gguf_quants import QUANT_TYPES

    extra = {"moe_intermediate_size": 64} if kind == "qwen3_moe" else {}  # Q8_0 rows: blocks of 32
    model = make_tiny_model(kind, tmp_path / "hf", seed=4, vocab_size=len(tiny_vocab()), rms_norm_eps=1e-6,
                            mlp_only_layers=[], **extra)
    src = _write_moe_gguf(tmp_path / f"tiny-{kind}.gguf", model, arch, stacked=stacked,
                          qtype=gguf.GGMLQuantizationType.Q8_0)
    native = convert_gguf_to_hf(src, tmp_path / "native", progress=False, keep_quantized=True)
    floats = convert_gguf_to_hf(src, tmp_path / "float", progress=False)
    assert json.loads((native / "config.json").read_text())["quantization_config"] == {
        "quant_method": "gguf", "types": ["Q8_0"]}
    stored, reference = dict(iter_safetensors(native)), dict(iter_safetensors(floats))
    block, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if kind == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    q8_0 = QUANT_TYPES["Q8_0"]
    num_layers = model.config.num_hidden_layers
    for layer in range(num_layers):
        assert stored[f"model.layers.{layer}.{block}.gate.weight"].dtype == torch.float32  # the router
        for expert in range(4):
            for proj in projs:
                name = f"model.layers.{layer}.{block}.experts.{expert}.{proj}"
                assert stored[f"{name}.weight"].dtype == torch.uint8
                assert stored[f"{name}.gguf_type"].tolist() == [q8_0.type_id]
                # this expert's rows: their numbers are the float conversion's, bit for bit
                assert torch.equal(q8_0.dequantize(stored[f"{name}.weight"]), reference[f"{name}.weight"]), name

    prompt = [5, 17, 42, 7, 99, 3]
    llm, tokens = _greedy(native, prompt)
    _, expected = _greedy(floats, prompt)
    agree = sum(a == b for a, b in zip(tokens, expected))
    assert tokens[0] == expected[0] and agree >= len(expected) // 2, (tokens, expected)

    ours = llm.engine.core.runner.model
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, model.config.hidden_size, generator=gen) * 2
    for layer in range(num_layers):
        experts = ours.layers[layer].mlp.experts
        assert experts.w13 is None and len(experts.linears) == 4
        for expert, mlp in enumerate(experts.linears):
            name = f"model.layers.{layer}.{block}.experts.{expert}."
            gate_up = torch.cat([reference[name + projs[0] + ".weight"], reference[name + projs[1] + ".weight"]])
            down = reference[name + projs[2] + ".weight"]
            h = torch.randn(33, down.shape[1], generator=gen)
            for linear, weight, rows in ((mlp.gate_up_proj, gate_up, x), (mlp.down_proj, down, h)):
                assert linear.weight is None and linear.qweights is not None
                for num in (1, 2, 7, 33):  # the op's product on the dequantized weight, within its tolerance
                    got, want = linear.forward(rows[:num]), F.linear(rows[:num], weight)
                    bound = linear.qop.max_relative_error * want.abs().max().item()
                    assert (got - want).abs().max().item() <= bound, (name, num)

