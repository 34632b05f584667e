"""Multi-LoRA in the engine (issue 32): greedy tokens under each adapter equal transformers +
peft on the same adapter (fp32, tiny Llama and Qwen2, ranks 8/16/64 on different target
modules), a step mixing adapters and the base gives every request exactly its tokens
alone, adapters wait for a slot instead of failing, the prefix cache never serves a
block across adapters, and adapters load and unload while the engine runs."""

import copy

import peft  # in the test extras
import pytest
import torch
from tiny_models import make_tiny_model

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.plugin.adapter import AdapterError, UnknownAdapterError

NEW_TOKENS = 12
# (name, rank, targets, extra LoraConfig settings)
ADAPTERS = [
    ("r8", 8, ["q_proj", "v_proj"], {}),
    ("r16", 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    ("r64", 64, ["o_proj", "down_proj", "up_proj"], {}),
    ("pat", 8, ["k_proj", "gate_proj"], {"rank_pattern": {"gate_proj": 4}, "alpha_pattern": {"k_proj": 3}}),
]


def save_adapter(hf_model, path, name, rank, targets, seed, **extra):
    """A peft LoRA with random A and B (``init_lora_weights=False``: B is not zero), saved at ``path``."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():  # B scaled up so that the adapter changes greedy tokens
        for module in model.modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                module.lora_B["default"].weight.mul_(4.0)
    model.save_pretrained(path)
    return model


def peft_greedy(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]], **params) -> dict[str, list[int]]:
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    for request_id, prompt, adapter in requests:
        engine.add_request(None, sampling, prompt_token_ids=prompt, request_id=request_id, adapter=adapter)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


def prompts(vocab: int, lengths=(3, 9, 17, 30), seed: int = 11) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"lora-{kind}")
    hf_model = make_tiny_model(kind, root / "base", seed=1)
    oracles = {}
    for index, (name, rank, targets, extra) in enumerate(ADAPTERS):
        oracles[name] = save_adapter(hf_model, root / name, name, rank, targets, seed=10 + index, **extra)
    engine = LLMEngine(EngineConfig(
        model=str(root / "base"), dtype="float32", num_kv_blocks=128, block_size=4, max_loras=4, max_lora_rank=64,
        lora_modules={name: str(root / name) for name, *_ in ADAPTERS},
    ))
    return hf_model, oracles, engine, root


def test_each_adapter_gives_transformers_plus_peft_greedy_tokens(setup):
    hf_model, oracles, engine, _ = setup
    all_prompts = prompts(hf_model.config.vocab_size)
    requests = [(f"{name}-{i}", p, name) for name in oracles for i, p in enumerate(all_prompts)]
    requests += [(f"base-{i}", p, None) for i, p in enumerate(all_prompts)]
    got = run(engine, requests)  # one batch: every adapter and the base side by side
    changed = 0
    for name, model in oracles.items():
        for i, prompt in enumerate(all_prompts):
            want = peft_greedy(model, prompt)
            assert got[f"{name}-{i}"] == want, (name, i)
            changed += want != got[f"base-{i}"]
    for i, prompt in enumerate(all_prompts):
        assert got[f"base-{i}"] == peft_greedy(hf_model, prompt)
    assert changed >= len(oracles) * len(all_prompts) // 2, "the adapters should change most outputs"


def test_a_mixed_batch_gives_each_request_its_tokens_alone(setup):
    hf_model, oracles, engine, _ = setup
    all_prompts = prompts(hf_model.config.vocab_size, (5, 12, 21, 8, 14))
    names = [*oracles, None]
    requests = [(f"m{i}", p, names[i % len(names)]) for i, p in enumerate(all_prompts * 2)]
    together = run(engine, requests)
    for request_id, prompt, adapter in requests:
        assert run(engine, [("alone-" + request_id, prompt, adapter)])["alone-" + request_id] == together[request_id]


def test_more_adapters_than_slots_wait_and_never_fail(setup, tmp_path):
    hf_model, oracles, _, root = setup
    engine = LLMEngine(EngineConfig(
        model=str(root / "base"), dtype="float32", num_kv_blocks=128, block_size=4, max_loras=2, max_lora_rank=64,
        max_cpu_loras=2, lora_modules={name: str(root / name) for name, *_ in ADAPTERS},
    ))
    all_prompts = prompts(hf_model.config.vocab_size, (4, 6, 8))
    requests = [(f"{name}-{i}", p, name) for name in oracles for i, p in enumerate(all_prompts)]
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for request_id, prompt, adapter in requests:
        engine.add_request(None, sampling, prompt_token_ids=prompt, request_id=request_id, adapter=adapter)
    results, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        most = max(most, len({r.adapter_id for r in engine.scheduler.running}))
    assert most == 2 and len(results) == len(requests)
    assert engine.adapters.num_reads > len(ADAPTERS), "adapters beyond max_cpu_loras are read again"
    for name, model in oracles.items():
        for i, prompt in enumerate(all_prompts):
            assert results[f"{name}-{i}"] == peft_greedy(model, prompt)


def test_prefix_cache_blocks_never_cross_adapters(setup):
    hf_model, oracles, engine, _ = setup
    prompt = prompts(hf_model.config.vocab_size, (40,), seed=99)[0]  # shares no block with the other tests'
    kv = engine.kv_manager
    first = run(engine, [("pc-base", prompt, None)])["pc-base"]
    hits = kv.num_prefix_hits
    under = run(engine, [("pc-r8", prompt, "r8")])["pc-r8"]
    assert kv.num_prefix_hits == hits, "a block computed for the base served an adapter"
    again = run(engine, [("pc-r8-again", prompt, "r8")])["pc-r8-again"]
    assert kv.num_prefix_hits > hits, "the adapter's own blocks serve it again"
    assert again == under == peft_greedy(oracles["r8"], prompt) and first == peft_greedy(hf_model, prompt)


def test_load_and_unload_at_run_time(setup):
    hf_model, oracles, engine, root = setup
    prompt = prompts(hf_model.config.vocab_size, (6,))[0]
    entry = engine.add_adapter("late", str(root / "r16"))
    assert entry.adapter_id > 0 and "late" in engine.adapters.names()
    with pytest.raises(AdapterError, match="'late' is already loaded"):
        engine.add_adapter("late", str(root / "r8"))
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(None, sampling, prompt_token_ids=prompt, request_id="running-late", adapter="late")
    engine.step()
    engine.remove_adapter("late")  # the running request finishes; new ones are refused
    with pytest.raises(UnknownAdapterError, match="'late' is not loaded; loaded adapters: r8, r16, r64, pat"):
        engine.add_request(None, sampling, prompt_token_ids=prompt, request_id="refused", adapter="late")
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert results["running-late"] == peft_greedy(oracles["r16"], prompt)
    assert "late" not in engine.adapters.entries  # dropped once its last request ended
    with pytest.raises(UnknownAdapterError, match="'late' is not loaded"):
        engine.remove_adapter("late")
    # the name loaded again with other weights: its own, no stale slot or cached block
    engine.add_adapter("late", str(root / "r8"))
    assert run(engine, [("late-again", prompt, "late")])["late-again"] == peft_greedy(oracles["r8"], prompt)
    engine.remove_adapter("late")


def test_bad_adapters_are_refused_by_name(setup, tmp_path):
    hf_model, _, engine, root = setup
    other = make_tiny_model("llama", tmp_path / "other", seed=2, intermediate_size=96)
    save_adapter(other, tmp_path / "wide", "wide", 8, ["up_proj"], seed=4)
    with pytest.raises(AdapterError, match=r"'wide'.*up_proj' maps 64 -> 96 features but the model's maps 64 -> 128"):
        engine.add_adapter("wide", str(tmp_path / "wide"))
    with pytest.raises(AdapterError, match="'gone'.*not a directory"):
        engine.add_adapter("gone", str(tmp_path / "nowhere"))
    big = copy.deepcopy(hf_model)
    save_adapter(big, tmp_path / "r128", "r128", 128, ["q_proj"], seed=3)
    with pytest.raises(AdapterError, match="rank 128, above max_lora_rank 64"):
        engine.add_adapter("r128", str(tmp_path / "r128"))
    with pytest.raises(AdapterError, match="adapter name must be"):
        engine.add_adapter("two words", str(root / "r8"))
    with pytest.raises(UnknownAdapterError, match="adapter 'nope' is not loaded; loaded adapters: r8, r16, r64, pat"):
        engine.add_request(None, SamplingParams(max_tokens=2), prompt_token_ids=[5, 6], request_id="x",
                           adapter="nope")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_async_engine_loads_serves_and_unloads_adapters(setup, mode):
    """The server's client, with the core in a thread and in its own process: adapters from
    --lora-modules and loaded at run time serve their requests; errors reach the caller."""
    import asyncio

    from ember.engine.async_engine import AsyncLLMEngine

    hf_model, oracles, _, root = setup
    config = EngineConfig(model=str(root / "base"), dtype="float32", num_kv_blocks=128, block_size=4, max_loras=2,
                          max_lora_rank=64, lora_modules={"r8": str(root / "r8")})
    engine = (AsyncLLMEngine.with_engine_process(config) if mode == "process"
              else AsyncLLMEngine(LLMEngine(config)))
    engine.start()
    prompt = prompts(hf_model.config.vocab_size, (7,), seed=5)[0]
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def tokens(adapter):
        final = None
        async for out in engine.generate(None, sampling, prompt_token_ids=prompt, adapter=adapter):
            final = out
        return final.outputs[0].token_ids

    async def main():
        assert set(engine.adapters()) == {"r8"} and engine.model_info.lora.max_loras == 2
        info = engine.load_adapter("r64", str(root / "r64"))
        assert (info.kind, info.rank) == ("lora", 64)
        got = await asyncio.gather(tokens("r8"), tokens("r64"), tokens(None))
        assert got == [peft_greedy(oracles["r8"], prompt), peft_greedy(oracles["r64"], prompt),
                       peft_greedy(hf_model, prompt)]
        with pytest.raises(AdapterError, match="'r64' is already loaded"):
            engine.load_adapter("r64", str(root / "r16"))
        with pytest.raises(AdapterError, match="rank 64, above max_lora_rank 16|not a directory"):
            engine.load_adapter("gone", str(root / "nowhere"))
        engine.unload_adapter("r64")
        with pytest.raises(UnknownAdapterError, match="'r64' is not loaded; loaded adapters: r8"):
            await tokens("r64")
        with pytest.raises(UnknownAdapterError):
            engine.unload_adapter("r64")
        assert await tokens("r8") == got[0]  # the others go on
        engine.load_adapter("r64", str(root / "r16"))  # the name again, other weights
        assert await tokens("r64") == peft_greedy(oracles["r16"], prompt)

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.shutdown()
