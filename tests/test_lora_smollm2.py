"""A LoRA adapter fine-tuned on the real default model with peft in the suite itself
(tests/lora_smollm2.py): the files peft saves, Ember's reader on them, and the learned
behaviour under transformers + peft (the oracle a served adapter is held to)."""

import json
import time

import pytest
from lora_smollm2 import (
    DEFAULT_TARGET_MODULES,
    HELD_OUT_PROMPTS,
    TASK_PROMPTS,
    peft_greedy,
    shows_learned_format,
    train_lora,
)

from ember.weights.peft import read_lora_adapter

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
TRAINING_BUDGET_S = 240  # 20-35 s on one thread of a shared 2-core machine; generous for a loaded CI one


@pytest.fixture(scope="module")
def trained(smollm2_dir, tmp_path_factory):
    """(adapter directory, training seconds): trained once for the module."""
    start = time.perf_counter()
    adapter = train_lora(smollm2_dir, tmp_path_factory.mktemp("lora-smollm2") / "fmt")
    seconds = time.perf_counter() - start
    print(f"\nLoRA training on SmolLM2-135M: {seconds:.1f} s")
    return adapter, seconds


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _texts(tokenizer, outs):
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in outs]


def test_training_is_short(trained):
    assert trained[1] < TRAINING_BUDGET_S, f"LoRA training took {trained[1]:.0f} s"


def test_saved_adapter_reads_as_trained(trained, smollm2_dir):
    adapter_dir, _ = trained
    assert (adapter_dir / "adapter_config.json").is_file()
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16, False)

    layers = json.loads((smollm2_dir / "config.json").read_text())["num_hidden_layers"]
    assert layers == 30
    adapter = read_lora_adapter("fmt", adapter_dir)
    expected = {
        f"model.layers.{i}.{'self_attn' if m.endswith(('q_proj', 'v_proj', 'o_proj')) else 'mlp'}.{m}"
        for i in range(layers)
        for m in DEFAULT_TARGET_MODULES
    }
    assert set(adapter.updates) == expected
    assert {m.rank for m in adapter.updates.values()} == {8}
    assert {m.scale for m in adapter.updates.values()} == {2.0}
    # trained: every B moved off peft's zero initialisation
    assert all(m.b.abs().max() > 0 for m in adapter.updates.values())


def test_adapter_shows_the_learned_format_and_the_base_does_not(trained, smollm2_dir, tokenizer):
    adapter_dir, _ = trained
    tuned = _texts(tokenizer, peft_greedy(smollm2_dir, adapter_dir, HELD_OUT_PROMPTS, NEW_TOKENS))
    base = _texts(tokenizer, peft_greedy(smollm2_dir, None, HELD_OUT_PROMPTS + TASK_PROMPTS, NEW_TOKENS))
    print("\nwith the adapter:", tuned, "\nbase:", base[:len(HELD_OUT_PROMPTS)])
    assert [p for p, t in zip(HELD_OUT_PROMPTS, tuned) if not shows_learned_format(t)] == []
    assert [t for t in base if shows_learned_format(t)] == []
