"""LoRA adapters (issue 32) combined with the engine's other features, on a tiny random
fp32 Llama with random peft adapters: n-gram speculative decoding, grammar-guided JSON,
int8 base weights, parallel sampling with prefix caching, preemption; and the
combinations refused at start (tensor parallelism, the transformers fallback), each
named in the error."""

from __future__ import annotations

import copy
import json

import jsonschema
import peft  # in the test extras
import pytest
import torch
from tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.constraint import Constraint
from ember.plugins.quantizers.weight_only import quantize_int8

NEW_TOKENS = 12
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, targets, B scale): both change every greedy output of the tests, and leave
# them repetitive enough for n-gram drafts to be accepted (rank 16 on every projection with
# B scaled up, or rsLoRA's larger scale, had almost no draft accepted)
ADAPTERS = [
    ("a8", 8, ["q_proj", "v_proj", "o_proj", "down_proj"], 4.0),
    ("a16", 16, ALL_MODULES, 1.0),
]


def save_adapter(hf_model, path, rank, targets, seed, b_scale):
    """A peft LoRA with random A and B (``init_lora_weights=False``, B times ``b_scale``),
    saved at ``path``; returns the peft model."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                module.lora_B["default"].weight.mul_(b_scale)
    model.save_pretrained(path)
    return model.eval()


def peft_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root: base/ and one directory per adapter, the HF base model, {name: peft model})."""
    root = tmp_path_factory.mktemp("lora-combinations")
    # initializer_range 0.1 (not the tiny models' 0.3): greedy outputs that repeat
    # themselves often enough for n-gram drafts to be accepted
    hf_model = make_tiny_model("llama", root / "base", seed=5, max_position_embeddings=256,
                               initializer_range=0.1).eval()
    oracles = {name: save_adapter(hf_model, root / name, rank, targets, 20 + i, b_scale)
               for i, (name, rank, targets, b_scale) in enumerate(ADAPTERS)}
    return root, hf_model, oracles


def lora_llm(root, **kwargs) -> LLM:
    """An offline engine on the tiny base serving every adapter of `ADAPTERS`."""
    engine_args = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_loras=2, max_lora_rank=16,
                       lora_modules={name: str(root / name) for name, *_ in ADAPTERS})
    engine_args.update(kwargs)
    return LLM(str(root / "base"), **engine_args)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture
def batch_invariant(monkeypatch):
    """Every CPU backend the test builds in batch-invariant mode (as tests/test_speculative.py):
    speculation can then change outputs only through a wrong verification."""
    from ember.hardware.cpu import CPUBackend

    monkeypatch.setattr(CPUBackend, "batch_invariant", property(lambda self: True))


# -- speculative decoding ---------------------------------------------------------------------

# prompts that repeat themselves, so that n-gram lookup proposes (and is often right)
REPEATING = [
    [(i % 7) + 10 for i in range(40)],
    [20, 21, 22, 23, 24, 25] * 5 + [20, 21],
    list(range(60, 90)) + list(range(60, 75)),
    [5, 6, 7] * 3,
    [40, 41, 42, 43] * 6,
    [100, 101, 102] * 8,
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": None,
         "min_acceptance_rate": 0.0, "cost_aware": False}  # every step drafts: the verification is what is checked


def test_ngram_speculation_under_adapters_gives_the_tokens_without_it(tiny, batch_invariant):
    """One batch mixing both adapters and the base, with a 16-token step budget (chunked
    prefill) and prefix caching: greedy tokens with n-gram drafts (3 a step) equal those
    without, which equal transformers + peft; drafts were proposed and accepted (the
    engine's stats)."""
    root, hf_model, oracles = tiny
    adapters = ["a8", "a16", None, "a16", "a8", None]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine_args = dict(max_num_batched_tokens=16, enable_prefix_caching=True, max_model_len=128)
    plain = token_ids(lora_llm(root, **engine_args).generate(prompt_token_ids=REPEATING, sampling_params=params,
                                                             lora_request=adapters))
    spec = lora_llm(root, speculative_config=NGRAM, **engine_args)
    got = token_ids(spec.generate(prompt_token_ids=REPEATING, sampling_params=params, lora_request=adapters))
    assert got == plain
    models = {None: hf_model, **oracles}
    for prompt, adapter, tokens in zip(REPEATING, adapters, got):
        assert tokens == peft_greedy(models[adapter], prompt, 32), adapter
    stats = spec.engine.core.stats().speculation
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0, stats
    # drafts were accepted for adapter requests too: each of those alone
    for adapter in ("a8", "a16"):
        alone = lora_llm(root, speculative_config=NGRAM, **engine_args)
        indices = [i for i, a in enumerate(adapters) if a == adapter]
        out = alone.generate(prompt_token_ids=[REPEATING[i] for i in indices], sampling_params=params,
                             lora_request=adapter)
        assert token_ids(out) == [got[i] for i in indices]
        assert alone.engine.core.stats().speculation["num_accepted_tokens"] > 0, adapter


# -- grammar-guided JSON ----------------------------------------------------------------------

# Strings by ASCII patterns: xgrammar lets a byte-level vocabulary spell overlong UTF-8
# (E0 followed by 80..9F) inside a JSON string, which decodes to U+FFFD characters and can
# break a maxLength (seen on this model without any adapter; not a LoRA matter)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "adult": {"type": "boolean"},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["name", "adult", "tags"],
}  # a finite language: every output completes within max_tokens (as in tests/test_grammar.py)
JSON_PROMPTS = ["Tell me about", "hello", "x", "The answer is", "{", "A list:"]


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("backend", ["outlines", "xgrammar"])
def test_json_schema_constrained_requests_under_adapters(tiny, backend):
    """Greedy requests under a JSON-schema constraint, each adapter and the base side by
    side in one batch: every output is valid per the schema and ends by the grammar; the
    same requests run again, one adapter's at a time, give the same texts; and the
    adapters' texts differ from the base's (the adapter applied under the mask)."""
    root, _, _ = tiny
    llm = lora_llm(root)
    params = SamplingParams(temperature=0, max_tokens=120, constraint=Constraint.json_schema(PERSON),
                            grammar_backend=backend)
    names = ["a8", "a16", None]
    prompts = [p for p in JSON_PROMPTS for _ in names]
    adapters = names * len(JSON_PROMPTS)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=adapters)]
    for prompt, adapter, out in zip(prompts, adapters, outs):
        assert out.finish_reason == "stop" and _valid(out.text), (adapter, prompt, out.text, out.error)
    texts = {(p, a): o.text for p, a, o in zip(prompts, adapters, outs)}
    for adapter in names:
        again = llm.generate(JSON_PROMPTS, params, lora_request=adapter)
        assert [o.outputs[0].text for o in again] == [texts[p, adapter] for p in JSON_PROMPTS], adapter
    for adapter in ("a8", "a16"):
        changed = sum(texts[p, adapter] != texts[p, None] for p in JSON_PROMPTS)
        assert changed >= len(JSON_PROMPTS) // 2, (adapter, changed)


# -- quantized base weights -------------------------------------------------------------------

def _int8_dequantized(hf_model):
    """A copy of the HF model whose decoder linears hold the int8 grid's dequantized
    weights (per output channel, as ``--quantize int8`` stores them; LM head and
    embeddings stay float, as the quantizer leaves them)."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for layer in model.model.layers:
            for module in (*[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
                           *[getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]):
                module.weight.copy_(quantize_int8(module.weight).dequantize(torch.float32))
    return model.eval()


def _peft_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits after each prompt prefix: row i scores token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def test_adapters_on_an_int8_base_stay_near_peft_on_the_dequantized_weights(tiny):
    """``quantize="int8"`` (weight-only, per channel) with float adapters. The reference is
    transformers + peft with the same adapter on the base's dequantized int8 weights; equal
    tokens are not asked, since Ember's int8 op rounds activations (and scales) to bfloat16
    for PyTorch's int8 kernel (ember.hardware.cpu_int_quant). Teacher-forced over three
    prompts, the top-20 prompt logprobs Ember gives at each position are within 0.05 nat of
    the reference's on average and their argmax agrees at 90% of positions or more, while
    each adapter moves those logprobs 10x that far from the base's; greedy outputs under
    each adapter differ from the base's."""
    root, hf_model, _ = tiny
    llm = lora_llm(root, quantize="int8", kv_cache_dtype="float32")
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweights[0].format == "int8"
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(30)] for i in range(3)]
    base_deq = _int8_dequantized(hf_model)
    teacher = SamplingParams(max_tokens=1, prompt_logprobs=20)
    for name, *_ in ADAPTERS:
        oracle = peft.PeftModel.from_pretrained(copy.deepcopy(base_deq), str(root / name)).eval()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=teacher, lora_request=name)
        errors, shifts, agree, positions = [], [], 0, 0
        for out, prompt in zip(outs, prompts):
            want, base = _peft_logprobs(oracle, prompt), _peft_logprobs(base_deq, prompt)
            for pos in range(1, len(prompt)):
                got = out.prompt_logprobs[pos]
                for token, logprob in got.items():
                    errors.append(abs(logprob.logprob - want[pos - 1, token].item()))
                    shifts.append(abs(want[pos - 1, token].item() - base[pos - 1, token].item()))
                agree += max(got, key=lambda t: got[t].logprob) == want[pos - 1].argmax().item()
                positions += 1
        error, shift = sum(errors) / len(errors), sum(shifts) / len(shifts)
        assert error <= 0.05, (name, error)
        assert agree >= 0.9 * positions, (name, agree, positions)
        assert shift >= 10 * error, (name, shift, error)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    base = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    for name, *_ in ADAPTERS:
        got = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=name))
        assert all(g != b for g, b in zip(got, base)), name


# -- parallel sampling and prefix caching -----------------------------------------------------

def test_parallel_samples_share_their_adapter_and_its_cached_prefix(tiny):
    """n=3 seeded samples under an adapter: child i equals a single request with seed
    seed + i under that adapter (tests/test_parallel_sampling.py's rule), not the base's;
    the children shared the prompt's blocks; the group again hits the prefix cache its
    first run filled and gives the same children."""
    root, _, _ = tiny
    llm = lora_llm(root, max_model_len=128)
    engine, kv = llm.engine, llm.engine.kv_manager
    prompt = list(range(20, 60))  # 40 tokens: 9 full blocks of 4 cacheable (the last token is recomputed)
    group_params = SamplingParams(n=3, temperature=1.0, seed=100, max_tokens=8, ignore_eos=True)
    engine.add_request(None, group_params, prompt_token_ids=prompt, request_id="group", adapter="a16")
    peak_used, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        peak_used = max(peak_used, kv.num_blocks - kv.num_free_blocks)
    group = final.outputs
    assert [c.index for c in group] == [0, 1, 2] and len({tuple(c.token_ids) for c in group}) > 1
    # shared: the 9 full prompt blocks once, plus each child's own 3 (12 blocks for 48 tokens alone)
    assert peak_used == 9 + 3 * 3, peak_used
    hits = kv.num_prefix_hits
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=group_params, lora_request="a16")[0].outputs
    assert kv.num_prefix_hits > hits, "the adapter's cached prompt blocks serve the same group again"
    assert [c.token_ids for c in again] == [c.token_ids for c in group]
    for i, child in enumerate(group):
        single = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8, ignore_eos=True)
        alone = llm.generate(prompt_token_ids=[prompt], sampling_params=single, lora_request="a16")[0].outputs[0]
        assert alone.token_ids == child.token_ids, i
    base = llm.generate(prompt_token_ids=[prompt], sampling_params=group_params)[0].outputs
    assert [c.token_ids for c in base] != [c.token_ids for c in group], "the children ran under the adapter"
    assert kv.num_free_blocks == kv.num_blocks


# -- refused combinations ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2, "enable_lora": True},
     r"LoRA adapters do not combine with tensor or pipeline parallelism yet: got tensor_parallel_size=2, "
     r"pipeline_parallel_size=1 with LoRA enabled"),
    ({"pipeline_parallel_size": 2, "lora_modules": {"a8": "/x"}},
     r"LoRA adapters do not combine with tensor or pipeline parallelism yet: got tensor_parallel_size=1, "
     r"pipeline_parallel_size=2"),
    ({"model_impl": "transformers", "lora_modules": {"a8": "/x"}},
     r"LoRA adapters do not combine with model_impl 'transformers' \(the transformers fallback\)"),
    ({"model_impl": "transformers", "enable_lora": True}, r"do not combine with model_impl 'transformers'"),
], ids=["tp2-enable-lora", "pp2-lora-modules", "transformers-lora-modules", "transformers-enable-lora"])
def test_unsupported_combinations_are_refused_at_start_naming_them(tiny, kwargs, message):
    root, _, _ = tiny
    if "lora_modules" in kwargs:
        kwargs = {**kwargs, "lora_modules": {"a8": str(root / "a8")}}
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(root / "base"), **kwargs)
    with pytest.raises(ValueError, match=message):  # the offline API: before any model or worker is loaded
        LLM(str(root / "base"), dtype="float32", **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2", "--enable-lora"],
     "LoRA adapters do not combine with tensor or pipeline parallelism yet: got tensor_parallel_size=2"),
    (["--model-impl", "transformers", "--lora-modules", "a8=ROOT/a8"],
     "LoRA adapters do not combine with model_impl 'transformers' (the transformers fallback)"),
], ids=["tp2", "transformers"])
def test_ember_serve_refuses_them_with_exit_2(tiny, monkeypatch, capsys, argv, message):
    """``ember serve`` with the same combinations exits 2 with the message, building no engine."""
    from ember.api.cli import main
    from ember.engine.async_engine import AsyncLLMEngine
    from ember.engine.llm_engine import LLMEngine

    def built(*args, **kwargs):
        raise AssertionError("an engine was built for a refused combination")

    monkeypatch.setattr(LLMEngine, "__init__", built)
    monkeypatch.setattr(AsyncLLMEngine, "with_engine_process", built)
    root = tiny[0]
    argv = [a.replace("ROOT", str(root)) for a in argv]
    assert main(["serve", "--model-id", str(root / "base"), *argv]) == 2
    assert message in capsys.readouterr().err


# -- preemption -------------------------------------------------------------------------------

# 10 prompts of 3..39 tokens, 20 new tokens each (tests/test_preemption.py): all at once
# need about 115 blocks of 4; the small pool holds 16
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + 4 * i)] for i in range(10)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_adapter_requests_resume_with_their_adapter(tiny, prefix_caching):
    """A KV pool far too small for the batch (16 blocks of 4): requests of both adapters
    and the base are preempted (recomputed) many times and each still gets exactly its
    tokens alone on an ample pool, which are transformers + peft's."""
    root, hf_model, oracles = tiny
    adapters = [["a8", "a16", None][i % 3] for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    small = lora_llm(root, num_kv_blocks=16, enable_prefix_caching=prefix_caching, max_num_batched_tokens=64,
                     max_model_len=128)
    got = token_ids(small.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=adapters))
    assert small.engine.scheduler.num_preemptions >= 5, small.engine.scheduler.num_preemptions
    kv = small.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and all(block.ref_count == 0 for block in kv.pool.blocks)
    ample = lora_llm(root, enable_prefix_caching=prefix_caching, max_model_len=128)
    alone = [token_ids(ample.generate(prompt_token_ids=[p], sampling_params=params, lora_request=a))[0]
             for p, a in zip(PROMPTS, adapters)]
    assert ample.engine.scheduler.num_preemptions == 0
    assert got == alone
    models = {None: hf_model, **oracles}
    assert alone == [peft_greedy(models[a], p, 20) for p, a in zip(PROMPTS, adapters)]
