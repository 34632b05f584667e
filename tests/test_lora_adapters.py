"""PEFT LoRA adapters (issue 32): read as peft saves them, checked, and their products over
a batch mixing adapters (slots of one ``Linear``, runs of tokens) equal peft's LoRA layers.
The engine's use of them: tests/test_lora_engine.py."""

import json

import peft  # in the test extras
import pytest
import torch
from tiny_models import make_tiny_model

from ember.models.layers import Linear
from ember.models.lora import attach_adapters
from ember.plugin.adapter import AdapterWeights
from ember.weights.peft import AdapterError, read_lora_adapter


def _adapter(tmp_path, hf_model, name, *, r=8, alpha=16, targets=("q_proj", "v_proj"), seed=0, **extra):
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_model, config, adapter_name=name)
    model.save_pretrained(tmp_path / name, selected_adapters=[name])
    return model, tmp_path / name / name if (tmp_path / name / name).is_dir() else tmp_path / name


@pytest.fixture
def base(tmp_path):
    return make_tiny_model("llama", tmp_path / "base", seed=1)


@pytest.mark.parametrize("r, extra", [(8, {}), (16, {"use_rslora": True}), (4, {"rank_pattern": {"v_proj": 2},
                                                                                  "alpha_pattern": {"v_proj": 5}})])
def test_the_adapter_reads_as_peft_computes_it(tmp_path, base, r, extra):
    model, path = _adapter(tmp_path, base, "a1", r=r, **extra)
    adapter = read_lora_adapter("a1", path)
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    module = adapter.updates["model.layers.1.self_attn.v_proj"]
    assert torch.equal(module.a, layer.lora_A["a1"].weight) and torch.equal(module.b, layer.lora_B["a1"].weight)
    assert module.scale == pytest.approx(layer.scaling["a1"])
    assert set(adapter.updates) == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    x = torch.randn(5, base.config.hidden_size)
    with torch.no_grad():
        want = layer(x)
        got = module.apply(x, layer.base_layer(x), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_mixing_adapters_and_the_base_gives_each_token_its_own(tmp_path, base):
    updates = []
    for i, r in enumerate((8, 16, 4)):
        _, path = _adapter(tmp_path, make_tiny_model("llama", tmp_path / f"b{i}", seed=1), f"x{i}", r=r, seed=i)
        updates.append(read_lora_adapter(f"x{i}", path).updates["model.layers.0.self_attn.q_proj"])
    weight = base.model.layers[0].self_attn.q_proj.weight.detach()
    linear = Linear(weight.shape[1], [weight.shape[0]], False, torch.float32, torch.float32)
    linear.weight.data.copy_(weight)

    class OneLinear:  # what attach_adapters asks of a model: its linears by checkpoint name
        def linear_parts(self):
            return {"model.layers.0.self_attn.q_proj": (linear, 0)}

    adapters = attach_adapters(OneLinear(), 3, 16, torch.float32)
    for slot, update in enumerate(updates):
        adapters.load(slot, AdapterWeights(f"x{slot}", "lora", "", {"model.layers.0.self_attn.q_proj": update}))
    x = torch.randn(9, weight.shape[1])
    slots = [2, -1, 0, 0, 1, 1, -1, 2, 0]
    runs = [(2, 0, 1), (0, 2, 4), (1, 4, 6), (2, 7, 8), (0, 8, 9)]
    adapters.set_step(runs, 9)
    got = linear(x)
    for t in range(9):
        alone = x[t : t + 1] @ weight.T
        if slots[t] >= 0:
            u = updates[slots[t]]
            alone = alone + (x[t : t + 1] @ u.a.T) @ u.b.T * u.scale
        torch.testing.assert_close(got[t : t + 1], alone, rtol=1e-5, atol=1e-6)
    adapters.set_step([], 0)
    torch.testing.assert_close(linear(x), x @ weight.T)
    with pytest.raises(AdapterError, match="rank 16, above max_lora_rank 8"):
        attach_adapters(OneLinear(), 1, 8, torch.float32).load(0, AdapterWeights("x1", "lora", "", {
            "model.layers.0.self_attn.q_proj": updates[1]}))


def test_what_ember_does_not_run_is_refused_by_name(tmp_path, base):
    _, path = _adapter(tmp_path, base, "d", use_dora=True)
    with pytest.raises(AdapterError, match="'d'.*DoRA"):
        read_lora_adapter("d", path)
    _, path = _adapter(tmp_path, make_tiny_model("llama", tmp_path / "b2", seed=1), "big", r=64)
    with pytest.raises(AdapterError, match="rank 64, above max_lora_rank 16"):
        read_lora_adapter("big", path, max_rank=16)
    with pytest.raises(AdapterError, match="no such directory"):
        read_lora_adapter("gone", tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="adapter_model.safetensors is damaged"):
        read_lora_adapter("broken", tmp_path / "broken")
    (tmp_path / "broken" / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_lora_adapter("broken", tmp_path / "broken")
