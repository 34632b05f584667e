"""The pooling path (docs/embeddings.md): a request that asks for a vector is prefilled
like a prompt (chunked, batched with generating requests), generates nothing and ends
with its pooled final hidden state. The oracle is transformers' ``AutoModel`` on the
same weights: bare decoders (``Qwen3Model``, ``LlamaModel``) saved with
``save_pretrained`` load through Ember's Llama family."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from ember import LLM, SamplingParams
from ember.config import EngineConfig, SchedulerConfig
from ember.engine.async_engine import AsyncLLMEngine
from ember.engine.llm_engine import LLMEngine
from ember.models.pooling_config import resolve_pooling_defaults
from ember.pooling_params import PoolingParams
from ember.sched.kv_cache_manager import KVCacheManager
from ember.sched.request import Request
from ember.sched.scheduler import Scheduler
from ember.sched.step import ModelRunnerOutput
from ember.testing.tiny_models import VOCAB_SIZE, byte_tokenizer, make_tiny_model

CHUNK = 8  # max_num_batched_tokens: every long prompt here takes several prefill chunks
LONG = "The quick brown fox jumps over the lazy dog, then sleeps."  # 58 tokens: 8 chunks
PROMPTS = [LONG, "hi", "embeddings of a middle-sized prompt"]


def make_base_model(kind: str, out_dir: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random bare decoder saved as ``AutoModel`` saves it (no LM head, no "model." prefix)."""
    config_class = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[kind]
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                          initializer_range=0.3)
    config.architectures = [{"qwen3": "Qwen3Model", "llama": "LlamaModel"}[kind]]
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config).eval()
    model.save_pretrained(out_dir)
    byte_tokenizer().save_pretrained(out_dir)
    return model


def write_sentence_transformers(model_dir: Path, mode: str, normalize: bool) -> None:
    """modules.json + 1_Pooling/config.json as sentence-transformers writes them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    keys = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    config = {"word_embedding_dimension": 64, **{k: k == keys[mode] for k in keys.values()},
              "pooling_mode_max_tokens": False}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(config))


def reference(model, ids: list[int], kind: str, normalize: bool = True, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    if dimensions is not None:
        vector = vector[:dimensions]
    return F.normalize(vector, dim=0) if normalize else vector


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert F.cosine_similarity(got, want, dim=0) > 0.9999
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def base_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"{request.param}_base")
    hf = make_base_model(request.param, out)
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=CHUNK)
    return hf, llm


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_vectors_match_transformers_single_and_batched(base_model, kind):
    hf, llm = base_model
    tokenizer = llm.get_tokenizer()
    params = PoolingParams(kind, normalize=True)
    assert len(tokenizer.encode(LONG)) > 4 * CHUNK
    single = llm.embed(LONG, params)
    assert_close(single[0].data, reference(hf, tokenizer.encode(LONG), kind))
    batched = llm.embed(PROMPTS, params)
    assert [o.prompt_token_ids for o in batched] == [tokenizer.encode(p) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, batched):
        assert_close(out.data, reference(hf, tokenizer.encode(prompt), kind))
    raw = llm.embed(PROMPTS[2], PoolingParams(kind, normalize=False))[0]
    assert_close(raw.data, reference(hf, tokenizer.encode(PROMPTS[2]), kind, normalize=False))
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks  # nothing left behind


def test_pooling_reuses_the_prefix_cache_only_where_it_can(base_model):
    """Last-token pooling takes cached blocks (their hidden states are not needed);
    mean and CLS must compute every position, so they take none and stay exact."""
    hf, llm = base_model
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(LONG + " again")
    kv = llm.engine.kv_manager
    llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, temperature=0))
    for kind, reuses in (("mean", False), ("cls", False), ("last", True)):
        hits = kv.num_prefix_hits
        out = llm.embed(prompt_token_ids=[ids], pooling_params=PoolingParams(kind))[0]
        assert_close(out.data, reference(hf, ids, kind))
        assert (kv.num_prefix_hits > hits) == reuses, kind


def test_pooling_requests_share_steps_with_generating_ones(base_model):
    """A request generating tokens and pooling requests run in the same steps (mixed
    batches); the generated tokens are those of the request alone."""
    hf, llm = base_model
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate("Once upon a time", greedy)[0].outputs[0].token_ids
    engine: LLMEngine = llm.engine
    gen_id = engine.add_request("Once upon a time", greedy)
    engine.step()
    engine.step()
    pool_ids = {engine.add_request(p, SamplingParams.for_pooling(PoolingParams("mean"))): p for p in PROMPTS}
    finished, kinds = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        kinds.add(engine.last_step_stats.kind)
    assert "mixed" in kinds
    assert finished[gen_id].outputs[0].token_ids == alone
    assert finished[gen_id].pooled is None
    for rid, prompt in pool_ids.items():
        out = finished[rid]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        assert isinstance(out.pooled, list) and all(isinstance(x, float) for x in out.pooled)
        assert_close(torch.tensor(out.pooled), reference(hf, tokenizer.encode(prompt), "mean"))


def test_sentence_transformers_config_chooses_the_pooling(tmp_path):
    hf = make_base_model("qwen3", tmp_path, seed=1)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert resolve_pooling_defaults(tmp_path, config).pooling_type == "last"  # a decoder without one: last, normalised
    assert resolve_pooling_defaults(tmp_path, config).normalize is True
    write_sentence_transformers(tmp_path, "cls", normalize=False)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=CHUNK)
    info = llm.engine.model_info.pooling
    assert (info.pooling_type, info.normalize, info.is_matryoshka) == ("cls", False, False)
    ids = llm.get_tokenizer().encode(LONG)
    assert_close(llm.embed(LONG)[0].data, reference(hf, ids, "cls", normalize=False))
    write_sentence_transformers(tmp_path, "mean", normalize=True)
    defaults = resolve_pooling_defaults(tmp_path, config)
    assert (defaults.pooling_type, defaults.normalize) == ("mean", True)
    # the engine's settings win over the model's config
    defaults = resolve_pooling_defaults(tmp_path, config, EngineConfig(pooling="last", pooling_normalize=False))
    assert (defaults.pooling_type, defaults.normalize) == ("last", False)


def test_dimensions_need_a_matryoshka_model(base_model, tmp_path):
    hf, llm = base_model
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("hello", PoolingParams(dimensions=8))
    llm2 = LLM(model=str(llm.engine.model_dir), dtype="float32", num_kv_blocks=64, block_size=4, matryoshka=True)
    ids = llm2.get_tokenizer().encode(LONG)
    out = llm2.embed(LONG, PoolingParams("last", dimensions=16))[0]
    assert out.data.shape == (16,)
    assert_close(out.data, reference(hf, ids, "last", dimensions=16))  # truncated, then normalised
    with pytest.raises(ValueError, match="dimensions"):
        llm2.embed("hello", PoolingParams(dimensions=65))


def test_logits_pooling_returns_the_requested_next_token_logits(tmp_path):
    """The yes/no reranker's path: the next-token logits at the last prompt position,
    of the given tokens only, with nothing generated."""
    hf = make_tiny_model("llama", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=CHUNK)
    ids = llm.get_tokenizer().encode(LONG)
    out = llm.embed(LONG, PoolingParams("logits", logit_token_ids=(40, 7, 300)))[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1, [40, 7, 300]].float()
    torch.testing.assert_close(out.data, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed(LONG, PoolingParams("logits", logit_token_ids=(VOCAB_SIZE,)))


def test_pooling_params_refuse_bad_values():
    for kwargs, match in (
        (dict(pooling_type="max"), "pooling_type"), (dict(dimensions=0), "dimensions"),
        (dict(normalize="yes"), "normalize"), (dict(pooling_type="logits"), "logit_token_ids"),
        (dict(pooling_type="last", logit_token_ids=(1,)), "logit_token_ids"),
        (dict(pooling_type="logits", logit_token_ids=(-1,)), "logit_token_ids"),
        (dict(pooling_type="logits", logit_token_ids=(1,), normalize=True), "normalize"),
    ):
        with pytest.raises(ValueError, match=match):
            PoolingParams(**kwargs)
    with pytest.raises(ValueError, match="pooling request"):
        SamplingParams(pooling=PoolingParams(), n=2)


def test_a_prompt_may_fill_the_context_when_pooled(base_model):
    hf, llm = base_model
    model_dir = llm.engine.model_dir
    small = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16, block_size=4, max_model_len=16)
    ids = list(range(40, 56))
    assert_close(small.embed(prompt_token_ids=[ids])[0].data, reference(hf, ids, "last"))
    with pytest.raises(ValueError, match="max_model_len"):
        small.embed(prompt_token_ids=[ids + [1]])
    with pytest.raises(ValueError, match="max_model_len"):
        small.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1))


def test_pipeline_parallelism_refuses_pooling(tmp_path):
    make_base_model("llama", tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    defaults = resolve_pooling_defaults(tmp_path, config, EngineConfig(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        defaults.apply(PoolingParams())


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_engine_pools_in_both_engine_modes(base_model, mode):
    hf, llm = base_model
    config = EngineConfig(model=str(llm.engine.model_dir), dtype="float32", num_kv_blocks=128, block_size=4,
                          max_num_batched_tokens=CHUNK)
    engine = (AsyncLLMEngine(LLMEngine(config)) if mode == "thread" else AsyncLLMEngine.with_engine_process(config))
    tokenizer = llm.get_tokenizer()
    assert engine.model_info.pooling.pooling_type == "last"

    async def main():
        engine.start()
        try:
            outs = await asyncio.gather(*(engine.pool(tokenizer.encode(p), PoolingParams("mean")) for p in PROMPTS))
            with pytest.raises(ValueError, match="dimensions"):
                await engine.pool(tokenizer.encode("hi"), PoolingParams(dimensions=4))
            return outs
        finally:
            engine.shutdown()

    for prompt, out in zip(PROMPTS, asyncio.run(main())):
        assert_close(out.data, reference(hf, tokenizer.encode(prompt), "mean"))


def test_a_causal_lm_saved_without_the_model_prefix_loads(tmp_path):
    """Qwen3-Embedding's checkpoint: architecture Qwen3ForCausalLM, a tied head, tensors
    named without "model." (as AutoModel saves them)."""
    from safetensors.torch import load_file, save_file

    hf = make_tiny_model("qwen3", tmp_path, tie_word_embeddings=True)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=CHUNK)
    ids = llm.get_tokenizer().encode(LONG)
    assert_close(llm.embed(LONG, PoolingParams("last"))[0].data, reference(hf.model, ids, "last"))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert llm.generate(LONG, greedy)[0].outputs[0].token_ids == want


# -- the scheduler alone (hand-built runner outputs, no model) -----------------------------
def _scheduler(num_blocks: int = 32, budget: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, 64), KVCacheManager(num_blocks, 4, enable_prefix_caching=True))


def _run_step(sched: Scheduler, pooled: dict | None = None):
    """One step whose sampling requests sample token 7 (and pooling ones get ``pooled``)."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if rid in out.sampling_request_ids else [] for rid in ids]
    return out, sched.update_from_output(out, ModelRunnerOutput(ids, sampled, pooled=pooled))


def test_scheduler_pools_a_prompt_in_chunks_and_samples_nothing():
    sched = _scheduler()
    params = SamplingParams.for_pooling(PoolingParams("mean", True))
    sched.add_request(Request("p", list(range(10, 30)), params))  # 20 tokens: chunks of 8, 8, 4
    sched.add_request(Request("g", list(range(40, 44)), SamplingParams(max_tokens=3, temperature=0)))
    chunks = []
    while "p" in sched.requests:
        remaining = 20 - sched.requests["p"].num_computed_tokens
        out, updates = _run_step(sched, pooled={"p": "vec"} if remaining <= 8 else None)
        assert "p" not in out.sampling_request_ids
        chunks.append(out.num_scheduled_tokens.get("p", 0))
    assert chunks == [8, 8, 4]
    finished = next(u.request for u in updates if u.request.request_id == "p")
    assert finished.pooled == "vec" and finished.finish_reason == "stop" and finished.output_token_ids == []
    assert "g" in sched.requests  # the generating request goes on


@pytest.mark.parametrize("kind,reuses", [("mean", False), ("cls", False), ("last", True), ("logits", True)])
def test_scheduler_gives_cached_blocks_only_to_pooling_that_reads_the_last_position(kind, reuses):
    sched = _scheduler(budget=32)
    prompt = list(range(10, 30))
    sched.add_request(Request("first", prompt, SamplingParams(max_tokens=1, temperature=0)))
    _run_step(sched)
    assert "first" not in sched.requests  # finished: its full blocks are cached
    pooling = PoolingParams(kind, logit_token_ids=(1,) if kind == "logits" else ())
    sched.add_request(Request("pool", prompt, SamplingParams.for_pooling(pooling)))
    out = sched.schedule()
    new = out.new_requests[0]
    assert (new.num_computed_tokens > 0) == reuses
    assert out.num_scheduled_tokens["pool"] == 20 - new.num_computed_tokens


def test_a_preempted_pooling_request_recomputes_its_mean_from_the_start(tmp_path):
    """A KV pool too small for both: the pooling request (admitted last) is preempted
    mid-prefill, comes back and computes its prompt again; its mean is still exact."""
    hf = make_base_model("llama", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=20, block_size=4, max_num_batched_tokens=CHUNK,
              enable_prefix_caching=False)
    engine = llm.engine
    generating = engine.add_request("Once upon a time there was a quick brown fox",
                                    SamplingParams(max_tokens=36, temperature=0, ignore_eos=True))
    engine.step()
    pooling = engine.add_request(LONG, SamplingParams.for_pooling(PoolingParams("mean")))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    assert len(finished[generating].outputs[0].token_ids) == 36
    assert_close(torch.tensor(finished[pooling].pooled), reference(hf, llm.get_tokenizer().encode(LONG), "mean"))


def test_a_pooling_request_has_no_token_budget():
    """max_tokens does not apply to a request that generates nothing (so no speculator drafts for it either)."""
    assert SamplingParams(max_tokens=50, pooling=PoolingParams()).max_tokens == 1
    assert SamplingParams.for_pooling().max_tokens == 1
