"""Offline beam search against transformers' num_beams (greedy beam search)."""

import pytest
import torch

from ember import LLM, BeamSearchParams

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-beam")
    hf = make_tiny_model("llama", path, seed=13, max_position_embeddings=256)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=256, block_size=4)
    return hf, llm


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_equals_transformers_num_beams(models, beam_width):
    hf, llm = models
    hf.generation_config.eos_token_id = None  # ignore_eos: run every beam to max_tokens
    gen = torch.Generator().manual_seed(beam_width)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 11)]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=10, ignore_eos=True)
    outs = llm.beam_search(prompt_token_ids=prompts, params=params)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), num_beams=beam_width, num_return_sequences=beam_width, do_sample=False,
                max_new_tokens=10, pad_token_id=0, length_penalty=1.0, output_scores=True, return_dict_in_generate=True,
            )
        ref_seqs = [s[len(prompt):].tolist() for s in ref.sequences]
        assert [s.token_ids for s in out.sequences] == ref_seqs
        # transformers' sequences_scores are sum(logprobs) / length ** length_penalty
        for seq, score in zip(out.sequences, ref.sequences_scores.tolist()):
            assert seq.score == pytest.approx(score, abs=1e-4)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.prefix_hit_rate > 0.5  # beams re-use their prefixes' blocks


def test_beam_width_one_is_greedy(models):
    _, llm = models
    from ember import SamplingParams

    prompt = [5, 6, 7, 8]
    greedy = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    beam = llm.beam_search(prompt_token_ids=[prompt], params=BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    assert beam[0].sequences[0].token_ids == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, match", [({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                                           ({"max_tokens": 0}, "max_tokens")])
def test_bad_beam_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)
