"""The transformers fallback (``--model-impl``, ember.models.transformers_impl) against
transformers itself, fp32 on CPU, on tiny random models of architectures Ember has no
native code for (OLMo 2, Granite with its multipliers, Cohere with its logit scale and
tied embeddings, Cohere 2 with sliding-window layers): greedy tokens equal to
`generate`, logits and logprobs within 1e-4, through continuous batching, the prefix
cache, chunked prefill and preemption. ``--model-impl transformers`` on a tiny Llama
agrees with the native Llama; what cannot run is refused by name."""

import json
import shutil

import pytest
import torch
import transformers
from tiny_models import VOCAB_SIZE, byte_tokenizer, make_tiny_model

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.models.transformers_impl import TransformersCausalLM
from ember.plugin.backend import AttentionBatch, SequenceSlice

ATOL = 1e-4  # logits and logprobs, absolute
PROMPT_LENGTHS = [1, 3, 7, 12, 20, 33, 5, 40]
JOIN_AT_STEP = [0, 0, 1, 2, 3, 5, 8, 13]
NEW_TOKENS = 24

# kind -> (config class, architecture, config overrides beyond the common tiny ones)
TINY = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        logits_scaling=2.0, attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5, tie_word_embeddings=True)),
    # sliding-window layers (window 8) between full ones: the CPU attention's window
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5)),
}


def make_tiny(kind: str, path, seed: int = 1, **overrides):
    """A tiny random model of ``kind`` (TINY) saved as transformers saves it (safetensors,
    config.json, a byte tokenizer); returns the transformers model (fp32, eval)."""
    config_name, arch, extra = TINY[kind]
    tokenizer = byte_tokenizer()
    params = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB_SIZE, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    params.update(extra)
    params.update(overrides)
    config = getattr(transformers, config_name)(**params)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None  # ignore_eos: transformers generates with no EOS id
    return model


def engine_for(path, **kwargs) -> LLMEngine:
    kwargs = {"dtype": "float32", "num_kv_blocks": 96, "block_size": 4, **kwargs}
    return LLMEngine(EngineConfig(model=str(path), **kwargs))


def reference(hf_model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for ``prompt`` alone, and each one's logprob."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def prompts(n_lengths=PROMPT_LENGTHS, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in n_lengths]


def run_to_end(engine: LLMEngine, batch: list[tuple[int, list[int]]], params: SamplingParams, prefix: str):
    """Add ``(join step, prompt)`` requests at their steps; each one's CompletionOutput by index."""
    results, step = {}, 0
    while len(results) < len(batch):
        for i, (join, prompt) in enumerate(batch):
            if join == step:
                engine.add_request(None, params, prompt_token_ids=prompt, request_id=f"{prefix}{i}")
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[len(prefix):])] = out.outputs[0]
        step += 1
    return [results[i] for i in range(len(batch))]


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = make_tiny(request.param, path)
    return request.param, path, hf_model, engine_for(path)


def test_auto_runs_the_fallback_for_architectures_without_native_code(tiny):
    kind, path, _, engine = tiny
    assert isinstance(engine.model, TransformersCausalLM)
    assert engine.model.hf_model.config._attn_implementation == "ember_paged"
    with pytest.raises(ValueError, match=rf"model architecture \['{TINY[kind][1]}'\] is not supported"):
        engine_for(path, model_impl="ember")


def test_staggered_continuous_batch_matches_transformers(tiny):
    kind, _, hf_model, engine = tiny
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = run_to_end(engine, list(zip(JOIN_AT_STEP, prompts())), params, "b")
    for i, (prompt, out) in enumerate(zip(prompts(), outputs)):
        tokens, logprobs = reference(hf_model, prompt, NEW_TOKENS)
        assert out.token_ids == tokens, f"{kind}: prompt {i} (length {len(prompt)}) diverged"
        assert out.token_logprobs == pytest.approx(logprobs, abs=ATOL), f"{kind}: prompt {i} logprobs"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_last_position_logits_through_the_paged_cache_match_transformers(tiny):
    """Prefill all but the last token into the paged cache, decode the last from it."""
    kind, _, hf_model, engine = tiny
    kv, runner = engine.kv_manager, engine.runner
    for prompt in prompts()[1:]:
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1]
        assert kv.allocate_slots("probe", len(prompt)) is not None
        table = kv.get_block_table("probe")
        try:
            with torch.inference_mode():
                for start, chunk in ((0, prompt[:-1]), (len(prompt) - 1, prompt[-1:])):
                    batch = AttentionBatch.from_slices([SequenceSlice(len(chunk), start, table)], kv.block_size,
                                                       runner.device)
                    hidden = engine.model(torch.tensor(chunk, device=runner.device),
                                          torch.arange(start, start + len(chunk), device=runner.device),
                                          runner.kv_caches, runner.attention.prepare(batch))
                ours = engine.model.compute_logits(hidden[-1:])[0].cpu()
        finally:
            kv.free("probe")
        diff = (ours - ref).abs().max().item()
        assert diff <= ATOL, f"{kind}: max |logit diff| {diff:.2e} for a prompt of {len(prompt)} tokens"


def test_shared_prefixes_through_the_prefix_cache_match_transformers(tiny):
    kind, _, hf_model, engine = tiny
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, VOCAB_SIZE, (37,), generator=gen).tolist()
    tails = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (1, 2, 5, 9)]
    all_prompts = [system + t for t in tails] + [system + tails[2]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hits_before = engine.kv_manager.num_prefix_hits
    for i, prompt in enumerate(all_prompts):  # one by one: each later prompt finds the cache filled
        (out,) = run_to_end(engine, [(0, prompt)], params, f"s{i}-")
        tokens, logprobs = reference(hf_model, prompt, 12)
        assert out.token_ids == tokens, f"{kind}: prompt {i} diverged with a prefix-cache hit"
        assert out.token_logprobs == pytest.approx(logprobs, abs=ATOL)
    assert engine.kv_manager.num_prefix_hits - hits_before >= 4 * 36  # 9 blocks of 4 per later prompt


def test_chunked_prefill_matches_transformers(tiny):
    kind, path, hf_model, _ = tiny
    engine = engine_for(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_to_end(engine, list(zip(JOIN_AT_STEP, prompts())), params, "c")
    assert max(PROMPT_LENGTHS) > 2 * 16  # the longest prompts are computed in chunks
    for i, (prompt, out) in enumerate(zip(prompts(), outputs)):
        tokens, logprobs = reference(hf_model, prompt, 10)
        assert out.token_ids == tokens, f"{kind}: prompt {i} (length {len(prompt)}) diverged under chunked prefill"
        assert out.token_logprobs == pytest.approx(logprobs, abs=ATOL)


PREEMPT_PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + 4 * i)] for i in range(10)]


@pytest.mark.parametrize("kind", ["olmo2", "granite", "cohere"])
def test_a_pool_small_enough_to_preempt_gives_the_same_outputs(tmp_path, kind):
    make_tiny(kind, tmp_path, seed=11, max_position_embeddings=128)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)

    def run(num_blocks):
        llm = LLM(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=num_blocks,
                  max_num_batched_tokens=64)
        outputs = llm.generate(prompt_token_ids=PREEMPT_PROMPTS, sampling_params=params)
        kv = llm.engine.kv_manager
        assert kv.num_free_blocks == kv.num_blocks
        return outputs, llm.engine.scheduler.num_preemptions

    ample, none = run(256)
    small, preemptions = run(16)
    assert none == 0 and preemptions >= 5, (none, preemptions)
    for a, s in zip(ample, small):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
        assert s.outputs[0].token_logprobs == pytest.approx(a.outputs[0].token_logprobs, abs=ATOL)


def test_model_impl_transformers_on_llama_agrees_with_native(tmp_path):
    make_tiny_model("llama", tmp_path, seed=3)
    native, fallback = engine_for(tmp_path), engine_for(tmp_path, model_impl="transformers")
    assert not isinstance(native.model, TransformersCausalLM)
    assert isinstance(fallback.model, TransformersCausalLM)
    assert fallback.model.kv_cache_spec == native.model.kv_cache_spec
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = list(zip(JOIN_AT_STEP, prompts()))
    for ours, theirs in zip(run_to_end(fallback, batch, params, "t"), run_to_end(native, batch, params, "n")):
        assert ours.token_ids == theirs.token_ids
        assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=ATOL)


def test_bad_model_impl_and_combinations_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="model_impl must be one of auto, ember, transformers, got 'hf'"):
        EngineConfig(model_impl="hf")
    with pytest.raises(ValueError, match="model_impl 'transformers'.*tensor_parallel_size=2"):
        EngineConfig(model_impl="transformers", tensor_parallel_size=2)
    make_tiny("olmo2", tmp_path)
    with pytest.raises(ValueError, match="transformers fallback \\(Olmo2ForCausalLM\\) does not support quantized "
                                         "weights.*quantizer 'int8'"):
        engine_for(tmp_path, quantize="int8")


def _save_transformers_model(path, config):
    torch.manual_seed(0)
    getattr(transformers, config.architectures[0])(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("config, named", [
    (transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=VOCAB_SIZE,
                              architectures=["BloomForCausalLM"]),
     r"'BloomForCausalLM' does not support transformers' attention interface \(_supports_attention_backend"),
    (transformers.StableLmConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=VOCAB_SIZE, architectures=["StableLmForCausalLM"]),
     r"'StableLmForCausalLM' does not support transformers' attention interface"),
    (transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             vocab_size=VOCAB_SIZE, architectures=["BertForMaskedLM"]),
     r"'BertForMaskedLM' is not a causal language model"),
    (transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8, vocab_size=VOCAB_SIZE,
                           architectures=["T5ForConditionalGeneration"]),
     r"'T5ForConditionalGeneration' is an encoder-decoder model"),
])
def test_architectures_the_fallback_cannot_run_are_refused_by_name(tmp_path_factory, config, named, model_impl):
    path = tmp_path_factory.mktemp(config.architectures[0])
    _save_transformers_model(path, config)
    with pytest.raises(ValueError, match=named) as caught:
        engine_for(path, model_impl=model_impl, max_model_len=64)
    if model_impl == "auto":  # the native registry's refusal first, then the fallback's
        assert f"model architecture ['{config.architectures[0]}'] is not supported" in str(caught.value)


def test_an_architecture_unknown_to_transformers_is_refused_by_name(tmp_path):
    make_tiny_model("llama", tmp_path / "src", seed=0)
    shutil.copytree(tmp_path / "src", tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    config_path.write_text(json.dumps(config))
    for impl, message in [("auto", r"\['NoSuchModelForCausalLM'\] is not supported.*unknown to transformers"),
                          ("transformers", r"'NoSuchModelForCausalLM' is unknown to transformers"),
                          ("ember", r"\['NoSuchModelForCausalLM'\] is not supported; supported architectures")]:
        with pytest.raises(ValueError, match=message):
            engine_for(tmp_path / "m", model_impl=impl)
