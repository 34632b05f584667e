"""Vision-language models against transformers, fp32, on tiny random models with their
families' real image processors: LLaVA-1.5 (CLIP tower + projector + Llama), SmolVLM and
Idefics3 (SigLIP over tiles, pixel shuffle, connector, Llama; an image is a grid of
tiles with row/column markers). Greedy tokens equal and logprobs within 1e-4 over
image+text prompts, in continuous batches that mix requests with and without images and
several images per request, with prefix caching, chunked prefill in chunks smaller than
one image, and preemption; the encoder cache runs each distinct image once; prefix
caching never lets two different images share a block."""

import numpy as np
import pytest
import torch
from PIL import Image

from ember import LLM, SamplingParams
from ember.multimodal.limits import MediaError
from ember.testing.tiny_vlms import make_tiny_gemma3_vlm, make_tiny_llava, make_tiny_smolvlm

LOGPROB_ATOL = 1e-4
NEW_TOKENS = 10


FAMILIES = {
    "llava": lambda path: make_tiny_llava(path, seed=3),
    "smolvlm": lambda path: make_tiny_smolvlm(path, seed=4),
    "idefics3": lambda path: make_tiny_smolvlm(path, seed=5, arch="idefics3"),
    # bidirectional attention among an image's tokens; a window of 6 keys in its sliding layers
    "gemma3": lambda path: make_tiny_gemma3_vlm(path, seed=6),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return path, FAMILIES[request.param](path)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    return path, make_tiny_llava(path, seed=3)


def image(seed: int, size=(40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def hf_greedy(hf_model, image_processor, ids: list[int], images: list) -> tuple[list[int], list[float]]:
    kwargs = {}
    if images:
        nested = "Idefics3" in type(image_processor).__name__ or "SmolVLM" in type(image_processor).__name__
        kwargs = dict(image_processor(images=[images] if nested else images, return_tensors="pt"))
        kwargs.pop("num_crops", None)
        if hf_model.config.model_type == "gemma3":  # its image tokens' bidirectional block
            kwargs["token_type_ids"] = (torch.tensor([ids]) == hf_model.config.image_token_id).long()
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                output_scores=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


PROMPTS = [  # (text, images): with and without images, two images, the same image again, an image first
    ("Look: <image> what is it?", [1]),
    ("no image at all, only words", []),
    ("<image> and <image>: which one is brighter?", [2, 3]),
    ("Look: <image> what is it?", [4]),  # same text as the first, another image
    ("Again: <image>", [1]),
    ("<image>", [5]),
]


def run_batch(llm: LLM, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    placeholder = llm.engine.multimodal_processor.spec.prompt_text
    inputs = [{"prompt": text.replace("<image>", placeholder), "multi_modal_data": {"image": [image(s) for s in seeds]}}
              for text, seeds in prompts]
    return llm.generate(inputs, params)


@pytest.mark.parametrize("engine_options", [
    dict(),  # defaults: prefix caching and chunked prefill on
    dict(max_num_batched_tokens=8, block_size=4),  # chunks of 8 tokens: every 16-token image spans chunks
    dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=16),  # a pool too small: preemptions
], ids=["default", "chunks-smaller-than-an-image", "preemption"])
def test_matches_transformers_in_mixed_batches(vlm, engine_options):
    path, hf_model = vlm
    llm = LLM(model=str(path), dtype="float32", **engine_options)
    outs = run_batch(llm)
    image_processor = llm.engine.multimodal_processor.image_processor
    for (text, seeds), out in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(hf_model, image_processor, out.prompt_token_ids, [image(s) for s in seeds])
        assert out.outputs[0].token_ids == tokens, (text, seeds)
        ember_lps = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        assert np.allclose(ember_lps, logprobs, atol=LOGPROB_ATOL), (text, seeds)
    if "num_kv_blocks" in engine_options:
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should have preempted"


def test_prompt_expansion_matches_the_transformers_processor(llava):
    from transformers import LlavaProcessor

    path, _ = llava
    llm = LLM(model=str(path), dtype="float32")
    processor = LlavaProcessor(image_processor=llm.engine.multimodal_processor.image_processor,
                               tokenizer=llm.get_tokenizer(), patch_size=7, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)
    text = "<image> and <image>: which one?"
    expected = processor(text=text, images=[image(2), image(3)], return_tensors="pt")["input_ids"][0].tolist()
    ids, items = llm.engine.process_images(llm.engine.tokenize(text), [image(2), image(3)])
    assert ids == expected
    assert [(i.offset, i.length) for i in items] == [(0, 16), (21, 16)]


def test_encoder_runs_once_per_distinct_image_and_prefix_cache_tells_images_apart(llava):
    path, _ = llava
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    same = {"prompt": "Look: <image> what is it?", "multi_modal_data": {"image": image(1)}}
    first = llm.generate([same], params)[0]
    cache = llm.engine.scheduler.encoder_cache
    assert cache.num_encoded == 1
    again = llm.generate([same, same, {**same, "multi_modal_data": {"image": image(1)}}], params)
    assert cache.num_encoded == 1, "the same image (same pixels) is never encoded again while cached"
    assert all(o.outputs[0].token_ids == first.outputs[0].token_ids for o in again)
    kv = llm.engine.kv_manager
    hits_before = kv.num_prefix_hits
    other = llm.generate([{**same, "multi_modal_data": {"image": image(9)}}], params)[0]
    # "Look: " is 6 tokens: one full block of 4 is shared; every block the image touches is not
    assert kv.num_prefix_hits - hits_before == 4
    assert cache.num_encoded == 2
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_bad_image_requests_are_clear_errors(llava, tiny_llama_dir):
    path, _ = llava
    llm = LLM(model=str(path), dtype="float32", limit_mm_per_prompt="image=2")
    params = SamplingParams(max_tokens=2)
    with pytest.raises(MediaError, match=r"1 image placeholder\(s\).*but 2 image\(s\)"):
        llm.generate({"prompt": "one <image>", "multi_modal_data": {"image": [image(1), image(2)]}}, params)
    with pytest.raises(MediaError, match="3 images, more than the limit of 2"):
        llm.generate({"prompt": "<image><image><image>", "multi_modal_data": {"image": [image(1)] * 3}}, params)
    with pytest.raises(MediaError, match=r"prompts\[0\]\.multi_modal_data\.image\[0\].*remote media fetching is off"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": "http://127.0.0.1:9/x.png"}}, params)
    text_only = LLM(model=str(tiny_llama_dir), dtype="float32")
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": image(1)}}, params)


def test_chat_takes_openai_image_parts_and_pil_images(llava):
    import base64
    import io

    path, _ = llava
    llm = LLM(model=str(path), dtype="float32")
    buffer = io.BytesIO()
    image(7).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "image", "image": image(8)}, {"type": "text", "text": "please"}]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.chat(messages, params)[0]
    assert out.prompt == "<|user|>Compare\n<image>\n<image>\nplease\n<|assistant|>"
    expected = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(out.prompt, add_special_tokens=False),
                             "multi_modal_data": {"image": [image(7), image(8)]}}, params)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.prompt_token_ids == expected.prompt_token_ids
    with pytest.raises(MediaError, match=r"messages\[0\]\.content\[1\].*`detail` must be one of"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "x"},
                                               {"type": "image_url", "image_url": {"url": url, "detail": "max"}}]}])


@pytest.fixture(scope="module")
def tiled_llms(tmp_path_factory):
    built = {}

    def get(family: str) -> LLM:
        if family not in built:
            path = tmp_path_factory.mktemp(f"tiled-{family}")
            make_tiny_smolvlm(path, arch=family)
            built[family] = LLM(model=str(path), dtype="float32")
        return built[family]
    return get


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
@pytest.mark.parametrize("size", [(40, 52), (1, 1), (300, 20), (20, 300)])
def test_tiled_prompt_expansion_matches_the_families_processor_text(family, size, tiled_llms):
    """Each image's run is the text the family's own processor writes (transformers'
    get_image_prompt_string), tokenized in place of its placeholder."""
    import importlib

    llm = tiled_llms(family)
    processing = importlib.import_module(f"transformers.models.{family}.processing_{family}")
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (*size, 3), dtype=np.uint8))
    info = llm.engine.multimodal_processor.image_processor(images=[picture], return_row_col_info=True)
    if family == "smolvlm":  # (SmolVLMProcessor itself needs num2words, for videos)
        run = processing.get_image_prompt_string(info["rows"][0][0], info["cols"][0][0], 4,
                                                 "<fake_token_around_image>", "<image>", "<global-img>")
    else:
        hf_processor = processing.Idefics3Processor(llm.engine.multimodal_processor.image_processor,
                                                    llm.get_tokenizer(), image_seq_len=4)
        run = hf_processor.replace_image_token(info, 0)
    text = "Before <image> after"
    ids, items = llm.engine.process_images(llm.engine.tokenize(text), [picture])
    assert ids == llm.get_tokenizer().encode(text.replace("<image>", run), add_special_tokens=False)
    (item,) = items
    assert item.num_embeds == 4 * int(info["pixel_values"].shape[1])  # 4 tokens a tile
    assert item.embed_mask is not None and item.embed_mask.sum() == item.num_embeds


def test_vision_models_ember_does_not_run_are_refused_by_name(tmp_path):
    """A vision-language checkpoint of an unsupported family, through either implementation,
    and a llama.cpp vision projector (mmproj) GGUF: a ValueError naming what and why, before
    any weight is read."""
    import gguf
    import transformers

    from ember.testing.tiny_models import byte_tokenizer

    config = transformers.LlavaNextConfig(  # LLaVA-NeXT's tiling: not yet
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7))
    config.architectures = ["LlavaNextForConditionalGeneration"]
    config.save_pretrained(tmp_path / "next")
    byte_tokenizer().save_pretrained(tmp_path / "next")
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match=r"\['LlavaNextForConditionalGeneration'\] is a vision-language model "
                                             r"Ember does not run yet \(vision-language architectures: .*Gemma3"):
            LLM(model=str(tmp_path / "next"), dtype="float32", model_impl=impl)
    writer = gguf.GGUFWriter(str(tmp_path / "mmproj.gguf"), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"is a vision projector \(llama.cpp's mmproj, architecture 'clip'\)"):
        LLM(model=str(tmp_path / "mmproj.gguf"), dtype="float32")


def test_lora_adapter_on_the_language_model_works_with_images(llava, tmp_path):
    """A peft LoRA adapter trained on the whole LLaVA model, targeting its decoder's q/v
    projections: Ember's greedy tokens with the adapter and an image equal peft's; an adapter
    that also targets the vision tower is refused by name."""
    import peft

    path, _ = llava
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=r".*language_model.*\.(q_proj|v_proj)")
    torch.manual_seed(0)
    tuned = peft.get_peft_model(base, config, adapter_name="vis")
    tuned.save_pretrained(tmp_path / "vis", selected_adapters=["vis"])
    adapter_dir = tmp_path / "vis" / "vis" if (tmp_path / "vis" / "vis").is_dir() else tmp_path / "vis"
    llm = LLM(model=str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = {"prompt": "Look: <image> what is it?", "multi_modal_data": {"image": image(1)}}

    class Request:  # vLLM's LoRARequest shape
        lora_name, lora_path = "vis", str(adapter_dir)

    with_adapter = llm.generate(prompt, params, lora_request=Request())[0]
    plain = llm.generate(prompt, params)[0]
    image_processor = llm.engine.multimodal_processor.image_processor
    tuned.eval()
    tokens, _ = hf_greedy(tuned, image_processor, with_adapter.prompt_token_ids, [image(1)])
    assert with_adapter.outputs[0].token_ids == tokens
    assert plain.outputs[0].token_ids != tokens, "the adapter changes the answer (else this test proves nothing)"
    both = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32), both,
                        adapter_name="tower").save_pretrained(tmp_path / "tower", selected_adapters=["tower"])
    tower_dir = tmp_path / "tower" / "tower" if (tmp_path / "tower" / "tower").is_dir() else tmp_path / "tower"

    class Tower:
        lora_name, lora_path = "tower", str(tower_dir)

    with pytest.raises(Exception, match=r"vision_tower.*(not|no) ") as refused:
        llm.generate(prompt, params, lora_request=Tower())
    assert "Traceback" not in str(refused.value)


def test_a_one_token_chunk_before_an_image_reads_its_own_token(vlm, monkeypatch):
    """Chunks of 2, 1, 4, ... tokens (a chunk stops before an image's run; the next may be one
    token long beside decodes): a step where every request computes one token is not all
    decodes, each row reads the token at its position (it read the prompt's last token)."""
    from ember.sched.encoder_planner import EncoderPlanner

    path, hf_model = vlm
    fit = EncoderPlanner.fit

    def small_chunks(self, request, start, num_new):
        return fit(self, request, start, min(num_new, 2 if start == 0 else 1 if start == 2 else num_new))

    monkeypatch.setattr(EncoderPlanner, "fit", small_chunks)
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    placeholder = llm.engine.multimodal_processor.spec.prompt_text
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate({"prompt": f"ab{placeholder} what?", "multi_modal_data": {"image": image(5)}}, params)[0]
    tokens, _ = hf_greedy(hf_model, llm.engine.multimodal_processor.image_processor, out.prompt_token_ids, [image(5)])
    assert out.outputs[0].token_ids == tokens
