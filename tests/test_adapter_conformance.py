"""ember.testing.check_adapter_kind: Ember's LoRA passes it, and so does a second kind from
outside Ember (examples/ember-ia3, PEFT's IA3, imported from its folder), whose greedy
tokens equal transformers + peft on the same IA3 adapters (fp32); broken kinds fail it
naming the broken rule; the IA3 reader refuses what it does not run."""

import copy
import json
import sys
from pathlib import Path

import peft  # in the test extras
import pytest
import torch

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.models.lora import LoRAKind
from ember.plugin import create_plugin_manager
from ember.plugin.adapter import AdapterError
from ember.testing import check_adapter_kind
from ember.testing.tiny_models import make_tiny_model
from ember.weights.peft import LoRAModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "ember-ia3"))
import ember_ia3  # noqa: E402 - the example plugin, from its folder (not installed)

NEW_TOKENS = 12


def test_lora_kind_conforms(tmp_path):
    check_adapter_kind(LoRAKind, tmp_path)


def test_ia3_example_conforms(tmp_path):
    check_adapter_kind(ember_ia3.IA3Kind, tmp_path)


# -- IA3 against peft --------------------------------------------------------------------------------------------
# (name, target_modules, feedforward_modules): every projection, inputs scaled of fused ones (k_proj: with
# Qwen2's bias; up_proj) and of a plain one (down_proj); a regular expression for both, a fused gate_proj's input
IA3_ADAPTERS = [
    ("ia3-list", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["k_proj", "up_proj", "down_proj"]),
    ("ia3-regex", r".*\.(v_proj|gate_proj|o_proj)", r".*\.gate_proj"),
]


def save_ia3(hf_model, path, targets, feedforward, seed):
    """A peft IA3 adapter with random vectors (``init_ia3_weights=False``: N(0, 1), not ones), saved at ``path``."""
    config = peft.IA3Config(target_modules=targets, feedforward_modules=feedforward, init_ia3_weights=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config).eval()
    model.save_pretrained(path)
    return model


def peft_greedy(model, prompt):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_kind", ["llama", "qwen2"])
def test_ia3_gives_transformers_plus_peft_greedy_tokens(tmp_path, model_kind):
    hf_model = make_tiny_model(model_kind, tmp_path / "base", seed=1)
    oracles = {name: save_ia3(hf_model, tmp_path / name, targets, ff, seed=20 + i)
               for i, (name, targets, ff) in enumerate(IA3_ADAPTERS)}
    # the plugin module itself, as its entry point would load it (its EMBER_PLUGIN_API checked)
    engine = LLMEngine(EngineConfig(
        model=str(tmp_path / "base"), dtype="float32", block_size=4, num_kv_blocks=128, max_loras=2,
        lora_modules={name: str(tmp_path / name) for name in oracles},
    ), create_plugin_manager(extra_plugins=[("ia3", ember_ia3)]))
    assert {e.kind for e in engine.adapters.entries.values()} == {"ia3"}
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (4, 11, 23)]
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [(f"{name}-{i}", p, name) for name in [*oracles, None] for i, p in enumerate(prompts)]
    for request_id, prompt, adapter in requests:  # one batch: both adapters and the base side by side
        engine.add_request(None, sampling, prompt_token_ids=prompt, request_id=request_id, adapter=adapter)
    got = {}
    while engine.has_unfinished_requests():
        got.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
    changed = 0
    for name, model in oracles.items():
        for i, prompt in enumerate(prompts):
            want = peft_greedy(model, prompt)
            assert got[f"{name}-{i}"] == want, (name, i)
            changed += want != got[f"None-{i}"]
    for i, prompt in enumerate(prompts):
        assert got[f"None-{i}"] == peft_greedy(hf_model, prompt)
    assert changed >= len(prompts), "the IA3 adapters should change most outputs"


@pytest.mark.parametrize("change, problem", [
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"feedforward_modules": None}, "no feedforward_modules"),
    ({"feedforward_modules": ["k_proj"]}, "make it"),  # both vectors then disagree with it
    ({"peft_type": "LORA"}, "is not IA3"),
])
def test_ia3_refuses_what_it_does_not_run(tmp_path, change, problem):
    kind = ember_ia3.IA3Kind()
    modules = {"model.layers.0.self_attn.k_proj": (64, 32), "model.layers.0.mlp.down_proj": (128, 64)}
    kind.write_example(tmp_path, modules, rank=8, seed=0)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert kind.read("ok", tmp_path, config).updates.keys() == modules.keys()
    with pytest.raises(AdapterError, match=problem):
        kind.read("bad", tmp_path, {**config, **change})


# -- broken kinds fail the kit, naming the rule --------------------------------------------------------------------
class NoTypes(LoRAKind):
    name = "no_types"
    peft_types = ()


class LowerCaseTypes(LoRAKind):
    name = "lower_case"
    peft_types = ("lora",)


class SwappedFactors(LoRAKind):
    """in/out features right, but ``low_rank()`` gives (B^T, A^T): wrong shapes."""

    name = "swapped"

    def read(self, name, path, config, *, max_rank=None):
        weights = super().read(name, path, config, max_rank=max_rank)
        for module, update in weights.updates.items():
            weights.updates[module] = SwappedModule(update.a, update.b, update.scale)
        return weights


class SwappedModule(LoRAModule):
    def low_rank(self):
        return self.b.T.contiguous(), self.a.T.contiguous()


class IgnoresMaxRank(LoRAKind):
    name = "ignores_max_rank"

    def read(self, name, path, config, *, max_rank=None):
        return super().read(name, path, config, max_rank=None)


class WeakExample(LoRAKind):
    """An example whose B is zero: it changes nothing."""

    name = "weak"

    def write_example(self, path, modules, *, rank, seed):
        from safetensors.torch import load_file, save_file

        super().write_example(path, modules, rank=rank, seed=seed)
        file = str(path / "adapter_model.safetensors")
        save_file({k: v * 0 if ".lora_B." in k else v for k, v in load_file(file).items()}, file)


@pytest.mark.parametrize("kind, rule", [
    (NoTypes, "peft_types must be a non-empty tuple"),
    (LowerCaseTypes, "upper-case"),
    (SwappedFactors, r"low_rank\(\) gives A"),
    (IgnoresMaxRank, "accepted rank 8 with max_rank 7"),
    (WeakExample, "changes no prompt"),
])
def test_a_broken_kind_fails_naming_the_rule(tmp_path, kind, rule):
    with pytest.raises(AssertionError, match=rule):
        check_adapter_kind(kind, tmp_path)
