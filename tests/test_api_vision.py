"""Images on every generation API, end to end (docs/multimodal.md): a tiny random LLaVA
served in-process, called with the real clients (the openai SDK for chat, the anthropic
SDK for Messages, httpx for the Responses API and TGI). Every image answer equals the
offline `ember.LLM` on the same prompt ids and image (greedy, so exact); every refusal
is checked for its status, the part it names and the limit or flag it names, and the
server still answers afterwards."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import re
import struct
import threading
import time
import zlib

import anthropic  # the `test` extra installs it
import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from server_utils import running_server, wait_idle  # noqa: E402

from ember import LLM, SamplingParams
from ember.engine.input_processor import apply_chat_template
from ember.testing.tiny_vlms import make_tiny_llava

MODEL = "tiny-llava"
NEW_TOKENS = 8
MAX_IMAGE_BYTES = 64 * 1024  # the served limit: the test images are a few KiB
QUESTION = "What is this?"


# -- images ---------------------------------------------------------------------------------
def random_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def png(image: Image.Image, format: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A few dozen bytes whose IHDR claims a ``width`` x ``height`` RGB canvas (a
    decompression bomb's header), written by hand with correct CRCs."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def animated_gif(first: Image.Image, second: Image.Image) -> bytes:
    return png(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)


def decoded(data: bytes) -> Image.Image:
    """The first frame, in RGB: what the server reads of an image file."""
    return Image.open(io.BytesIO(data)).convert("RGB")


IMAGES = {name: png(random_image(seed)) for name, seed in (("cat", 1), ("dog", 2), ("owl", 3))}


# -- the servers and the reference ----------------------------------------------------------
@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    make_tiny_llava(path, seed=3)
    return path


@pytest.fixture(scope="module")
def media_dirs(tmp_path_factory):
    """(the allowed local media directory, a directory outside it), each holding cat.png."""
    allowed, outside = tmp_path_factory.mktemp("allowed-media"), tmp_path_factory.mktemp("other-media")
    for folder in (allowed, outside):
        (folder / "cat.png").write_bytes(IMAGES["cat"])
    return allowed, outside


@pytest.fixture(scope="module")
def image_host(media_dirs):
    """A loopback HTTP server of the allowed media directory's files: its base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dirs[0]))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(llava_dir, media_dirs):
    with running_server(llava_dir, max_total_tokens=256, served_model_name=MODEL, limit_mm_per_prompt="image=2",
                        allowed_media_domains=("127.0.0.1",), allowed_local_media_path=str(media_dirs[0]),
                        max_image_bytes=MAX_IMAGE_BYTES) as running:
        yield running


@pytest.fixture(scope="module")
def http_client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(llava_dir):
    """The offline answer (text, token ids, prompt length after expansion) to a prompt
    (chat content with "<image>" where each image goes, or TGI's raw text) and its images."""
    llm = LLM(model=str(llava_dir), dtype="float32")
    tokenizer = llm.get_tokenizer()

    @functools.cache
    def answer(content: str, images: tuple[bytes, ...], chat: bool = True) -> tuple[str, tuple[int, ...], int]:
        if chat:
            text = apply_chat_template(tokenizer, [{"role": "user", "content": content}])
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(content)
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [decoded(i) for i in images]}}
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
        return out.outputs[0].text, tuple(out.outputs[0].token_ids), len(out.prompt_token_ids)

    return answer


def image_part(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def chat_body(*parts: dict, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}],
            "max_tokens": NEW_TOKENS, "temperature": 0, **fields}


def ask(oai, *parts: dict, **fields):
    """A greedy chat request through the openai SDK: a question, then ``parts``."""
    return oai.chat.completions.create(model=MODEL, max_tokens=NEW_TOKENS, temperature=0,
                                       messages=chat_body(*parts)["messages"], **fields)


def still_serves(server, http_client) -> None:
    """The server answers a plain request (after a refused one) and holds no slot."""
    wait_idle(server.app)
    r = http_client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    wait_idle(server.app)
    assert server.app.state.service.num_in_flight == 0


def refused(r: httpx.Response, status: int, param: str, *words: str) -> str:
    """An OpenAI-shaped refusal with this status and param whose message holds ``words``."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert not re.search(r"0x[0-9a-fA-F]{6,}|PIL|Traceback", error["message"]), error["message"]  # no internals
    return error["message"]


# -- OpenAI chat ----------------------------------------------------------------------------
def test_reference_depends_on_the_image(reference):
    """The checks below can fail: different images give different answers."""
    answers = {reference(f"{QUESTION}\n<image>", (IMAGES[name],))[:2] for name in IMAGES}
    assert len(answers) == len(IMAGES)
    assert all(len(ids) == NEW_TOKENS for _, ids in answers)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_a_data_url_image_equals_the_offline_answer(oai, reference, stream):
    text, ids, num_prompt = reference(f"{QUESTION}\n<image>", (IMAGES["cat"],))
    part = image_part(data_url(IMAGES["cat"]), "high")
    if not stream:
        r = ask(oai, part)
        assert r.choices[0].message.content == text
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (num_prompt, len(ids))
        return
    chunks = list(ask(oai, part, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (num_prompt, len(ids))


def test_chat_with_two_images_in_order(oai, reference):
    text, _, num_prompt = reference(f"{QUESTION}\n<image>\nand\n<image>", (IMAGES["dog"], IMAGES["owl"]))
    r = ask(oai, image_part(data_url(IMAGES["dog"])), {"type": "text", "text": "and"}, image_part(data_url(IMAGES["owl"])))
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == (text, num_prompt)


def test_a_1x1_image_and_an_animated_gif_first_frame(oai, reference):
    tiny = png(random_image(7, (1, 1)))
    first, second = random_image(8), random_image(9)
    gif = animated_gif(first, second)
    for data, media_type in ((tiny, "image/png"), (gif, "image/gif")):
        text, _, _ = reference(f"{QUESTION}\n<image>", (data,))
        assert ask(oai, image_part(data_url(data, media_type))).choices[0].message.content == text
    with Image.open(io.BytesIO(gif)) as animation:
        animation.seek(1)
        second_frame = png(animation.convert("RGB"))
    assert reference(f"{QUESTION}\n<image>", (second_frame,))[0] != text  # the first frame it was


def test_chat_fetches_from_an_allowed_host_and_a_local_folder(oai, reference, image_host, media_dirs):
    text, _, _ = reference(f"{QUESTION}\n<image>", (IMAGES["cat"],))
    for url in (f"{image_host}/cat.png", (media_dirs[0] / "cat.png").as_uri()):
        assert ask(oai, image_part(url)).choices[0].message.content == text, url


def test_remote_fetching_off_names_the_part_and_the_flag(server, http_client, image_host, monkeypatch):
    from ember.api.media import fetch_policy
    from ember.api.settings import ServerSettings

    # the policy `ember serve` makes without --allowed-media-domains
    monkeypatch.setattr(server.app.state.service.media, "policy", fetch_policy(ServerSettings()))
    r = http_client.post("/v1/chat/completions", json=chat_body(image_part(f"{image_host}/cat.png")))
    refused(r, 400, "messages[0].content[1]", "remote media fetching is off", "--allowed-media-domains")
    monkeypatch.undo()
    still_serves(server, http_client)


@pytest.mark.parametrize("name, part, status, param, words", [
    ("host not allowed", image_part("http://example.com/cat.png"), 400, "messages[0].content[1]",
     ("host is not in --allowed-media-domains",)),
    ("file outside the folder", None, 400, "messages[0].content[1]", ("outside the allowed local media directory",)),
    ("corrupt image", image_part(data_url(b"this is not an image at all")), 400, "messages[0].content[1]",
     ("not an image in a format Ember reads",)),
    ("over the byte limit", image_part(data_url(png(random_image(5, (200, 200))))), 413, "messages[0].content[1]",
     (f"limit of {MAX_IMAGE_BYTES}", "--max-image-bytes")),
    ("bad detail", image_part(data_url(IMAGES["cat"]), "ultra"), 400, "messages[0].content[1]",
     ("`detail` must be one of auto, low, high",)),
    ("not base64", image_part("data:image/png;base64,!!!!"), 400, "messages[0].content[1]",
     ("not valid base64",)),
    ("a 1 x 1000 strip", image_part(data_url(png(Image.new("RGB", (1000, 1))))), 400, "messages[0].content[1]",
     ("image is 1000x1: an aspect ratio over 200:1 is refused",)),
])
def test_bad_images_are_named(server, http_client, media_dirs, name, part, status, param, words):
    if part is None:
        part = image_part((media_dirs[1] / "cat.png").as_uri())
    refused(http_client.post("/v1/chat/completions", json=chat_body(part)), status, param, *words)
    still_serves(server, http_client)


def test_too_many_images_names_the_first_past_the_limit(server, http_client):
    parts = [image_part(data_url(IMAGES[name])) for name in ("cat", "dog", "owl")]
    refused(http_client.post("/v1/chat/completions", json=chat_body(*parts)), 400, "messages[0].content[3]",
            "the prompt has 3 images, more than the limit of 2 per prompt", "--limit-mm-per-prompt")
    still_serves(server, http_client)


def test_a_decompression_bomb_header_is_refused_at_once(server, http_client):
    started = time.monotonic()
    r = http_client.post("/v1/chat/completions", json=chat_body(image_part(data_url(bomb_png()))))
    refused(r, 400, "messages[0].content[1]", "limit of 40000000", "--max-image-pixels")
    assert time.monotonic() - started < 5.0  # no canvas of 10^10 pixels was allocated
    still_serves(server, http_client)


def test_images_are_loaded_and_processed_on_preparation_threads(server, oai, monkeypatch):
    """Never on the event loop (its thread is the server's), never in the engine's step."""
    media, threads = server.app.state.service.media, []

    def recording(fn):
        def run(*args):
            threads.append((fn.__name__, threading.current_thread().name))
            return fn(*args)
        return run

    monkeypatch.setattr(media, "load", recording(media.load))
    monkeypatch.setattr(media, "process", recording(media.process))
    ask(oai, image_part(data_url(IMAGES["cat"])))
    assert [name for name, _ in threads] == ["load", "process"]
    assert all(thread.startswith("ember-prepare") for _, thread in threads), threads


def test_a_placeholder_typed_in_the_text_is_a_mismatch(server, http_client):
    body = chat_body(image_part(data_url(IMAGES["cat"])))
    body["messages"][0]["content"][0]["text"] = "What is <image>?"
    refused(http_client.post("/v1/chat/completions", json=body), 400, "messages",
            "2 image placeholder(s)", "1 image(s)")
    still_serves(server, http_client)


# -- Anthropic Messages ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def image_block(source: dict) -> dict:
    return {"type": "image", "source": source}


def base64_source(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()}


def test_messages_base64_and_url_images_equal_the_offline_answer(claude, reference, image_host):
    text, ids, num_prompt = reference(f"{QUESTION}\n<image>", (IMAGES["cat"],))
    for source in (base64_source(IMAGES["cat"]), {"type": "url", "url": f"{image_host}/cat.png"}):
        content = [{"type": "text", "text": QUESTION}, image_block(source)]
        r = claude.messages.create(model=MODEL, max_tokens=NEW_TOKENS, messages=[{"role": "user", "content": content}],
                                   extra_body={"temperature": 0})
        assert r.content[0].text == text
        assert (r.usage.input_tokens, r.usage.output_tokens) == (num_prompt, len(ids))
        counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": content}])
        assert counted.input_tokens == num_prompt


def test_messages_stream_with_an_image(claude, reference):
    text, _, _ = reference(f"{QUESTION}\n<image>", (IMAGES["dog"],))
    content = [{"type": "text", "text": QUESTION}, image_block(base64_source(IMAGES["dog"]))]
    with claude.messages.stream(model=MODEL, max_tokens=NEW_TOKENS, messages=[{"role": "user", "content": content}],
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == text


@pytest.mark.parametrize("source, words", [
    (base64_source(IMAGES["cat"], "image/bmp"), ("`messages[0].content[1].source.media_type`", "'image/bmp'")),
    ({"type": "file", "file_id": "f"}, ("`messages[0].content[1].source.type`", "'file'")),
    ({"type": "url", "url": "http://example.com/cat.png"},
     ("`messages[0].content[1].source`", "--allowed-media-domains")),
    (base64_source(b"GIF89a but not really"), ("`messages[0].content[1].source`", "not an image in a format")),
])
def test_messages_bad_image_sources_are_named(server, http_client, source, words):
    body = {"model": MODEL, "max_tokens": 4, "system": "be brief", "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, image_block(source)]}]}
    r = http_client.post("/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert all(word in r.json()["error"]["message"] for word in words), r.text
    still_serves(server, http_client)


# -- the Responses API ----------------------------------------------------------------------
def responses_body(*parts: dict) -> dict:
    return {"model": MODEL, "max_output_tokens": NEW_TOKENS, "temperature": 0, "store": False,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}, *parts]}]}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_input_image_equals_the_offline_answer(http_client, reference, stream):
    text, ids, num_prompt = reference(f"{QUESTION}\n<image>", (IMAGES["owl"],))
    body = responses_body({"type": "input_image", "image_url": data_url(IMAGES["owl"]), "detail": "auto"})
    if not stream:
        r = http_client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["output"][-1]["content"][0]["text"] == text
        assert (data["usage"]["input_tokens"], data["usage"]["output_tokens"]) == (num_prompt, len(ids))
        return
    with http_client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text


@pytest.mark.parametrize("part, param, words", [
    ({"type": "input_image", "file_id": "file-123"}, "input[0].content[1].file_id",
     ("file_id is not supported: send image_url",)),
    ({"type": "input_image", "image_url": "http://example.com/x.png"}, "input[0].content[1]",
     ("`input[0].content[1]`", "--allowed-media-domains")),
    ({"type": "input_image", "image_url": data_url(b"\x89PNG\r\n\x1a\nbroken")}, "input[0].content[1]",
     ("not an image in a format Ember reads",)),
])
def test_responses_bad_images_are_named(server, http_client, part, param, words):
    body = {**responses_body(part), "instructions": "be brief"}  # a system message first: the part is still named
    refused(http_client.post("/v1/responses", json=body), 400, param, *words)
    still_serves(server, http_client)


# -- TGI --------------------------------------------------------------------------------------
@pytest.mark.parametrize("markdown", ["![]({})", "![a cat]({})"])
def test_tgi_markdown_images_equal_the_offline_answer(http_client, reference, markdown):
    text, ids, num_prompt = reference(f"{QUESTION}<image>", (IMAGES["cat"],), chat=False)
    inputs = QUESTION + markdown.format(data_url(IMAGES["cat"]))
    r = http_client.post("/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}})
    assert r.status_code == 200 and r.json()["generated_text"] == text, r.text
    assert tuple(t["id"] for t in r.json()["details"]["tokens"]) == ids
    with http_client.stream("POST", "/generate_stream", json={"inputs": inputs, "parameters": {
            "max_new_tokens": NEW_TOKENS}}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    last = json.loads(events[-1].removeprefix("data:"))
    assert last["generated_text"] == text and last["details"]["input_length"] == num_prompt


def test_tgi_bad_images_name_inputs(server, http_client):
    for inputs, status, words in [
        (f"{QUESTION}![](http://example.com/cat.png)", 400, ("`inputs`", "--allowed-media-domains")),
        (f"{QUESTION}![]({data_url(bomb_png())})", 400, ("`inputs`", "--max-image-pixels")),
        ("".join(f"![]({data_url(IMAGES[n])})" for n in ("cat", "dog", "owl")), 400, ("--limit-mm-per-prompt",)),
    ]:
        r = http_client.post("/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == status and set(r.json()) == {"error", "error_type"}, r.text
        assert all(word in r.json()["error"] for word in words), r.text
        still_serves(server, http_client)
    r = http_client.post("/generate", json={"inputs": f"![]({data_url(IMAGES['cat'])})", "parameters": {
        "max_new_tokens": 2, "truncate": 10}})
    assert r.status_code == 422 and "`truncate`" in r.json()["error"], r.text


# -- a text-only model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=128, served_model_name="tiny-text") as running:
        yield running


def test_a_text_only_model_refuses_images_naming_itself(text_server):
    no_images = "model 'tiny-text' takes no images (it is a text-only model)"
    image, block = data_url(IMAGES["cat"]), image_block(base64_source(IMAGES["cat"]))
    with httpx.Client(base_url=text_server.url, timeout=60) as c:
        body = {**chat_body(image_part(image)), "model": "tiny-text"}
        refused(c.post("/v1/chat/completions", json=body), 400, "messages[0].content[1]", no_images)
        body = {**responses_body({"type": "input_image", "image_url": image}), "model": "tiny-text"}
        refused(c.post("/v1/responses", json=body), 400, "input[0].content[1]", no_images)
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {"model": "tiny-text", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, block]}]}
            r = c.post(path, json={**body, "max_tokens": 4} if path == "/v1/messages" else body)
            assert r.status_code == 400 and f"`messages[0].content[1]`: {no_images}" in r.json()["error"]["message"], r.text
        # TGI's text models read markdown images as text, as TGI does
        r = c.post("/generate", json={"inputs": "see ![](http://x/y.png)", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"model": "tiny-text", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
        assert r.status_code == 200, r.text


# -- the flags ------------------------------------------------------------------------------
def test_serve_flags_and_variables_make_the_limits_the_policy_and_the_engine_config(tmp_path, monkeypatch, capsys):
    import ember.api.server
    from ember.api.cli import main
    from ember.api.media import fetch_policy, media_limits
    from ember.api.settings import engine_config_kwargs

    seen = []
    monkeypatch.setattr(ember.api.server, "serve", lambda settings: seen.append(settings) or 0)
    monkeypatch.setenv("EMBER_MEDIA_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("EMBER_MAX_IMAGE_PIXELS", "500")
    assert main(["serve", "--model-id", "/nonexistent", "--limit-mm-per-prompt", "image=3", "--allowed-media-domains",
                 "a.example,*.b.example", "--allowed-media-domains", "c.example", "--allowed-local-media-path",
                 str(tmp_path), "--max-image-bytes", "1000B", "--encoder-cache-size", "99"]) == 0
    monkeypatch.delenv("EMBER_MEDIA_FETCH_TIMEOUT")
    monkeypatch.delenv("EMBER_MAX_IMAGE_PIXELS")
    assert main(["serve", "--model-id", "/nonexistent"]) == 0
    (limits, policy), defaults = (media_limits(seen[0]), fetch_policy(seen[0])), (media_limits(seen[1]), fetch_policy(seen[1]))
    assert (limits.max_items("image"), limits.max_image_bytes, limits.max_image_pixels) == (3, 1000, 500)
    assert (policy.allowed_domains, policy.allowed_local_path, policy.timeout_s, policy.max_bytes) == (
        ("a.example", "*.b.example", "c.example"), str(tmp_path), 2.5, 1000)
    kwargs = engine_config_kwargs(seen[0])
    assert (kwargs["limit_mm_per_prompt"], kwargs["encoder_cache_size"]) == ("image=3", 99)
    assert (defaults[0].max_items("image"), defaults[0].max_image_bytes, defaults[0].max_image_pixels) == (
        4, 20 * 2**20, 40_000_000)  # the defaults: 4 images, 20 MiB, 40 MP; fetching and file:// off
    assert (defaults[1].allowed_domains, defaults[1].allowed_local_path, defaults[1].timeout_s) == ((), None, 10.0)
    assert engine_config_kwargs(seen[1])["encoder_cache_size"] is None
    for argv, message in [
        (["--limit-mm-per-prompt", "video=1"], "--limit-mm-per-prompt: unknown modality 'video'"),
        (["--limit-mm-per-prompt", "image=-1"], "--limit-mm-per-prompt: image=-1 must be >= 0"),
        (["--allowed-media-domains", "a b"], "--allowed-media-domains: entry 'a b' is not a host name"),
        (["--allowed-local-media-path", str(tmp_path / "nope")], "--allowed-local-media-path"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be a number of seconds > 0"),
        (["--max-image-bytes", "0"], "--max-image-bytes: '0' is not a size of at least 1 byte"),
        (["--max-image-bytes", "lots"], "--max-image-bytes: 'lots' is not a size"),
        (["--max-image-pixels", "0"], "--max-image-pixels must be a positive integer"),
        (["--encoder-cache-size", "0"], "--encoder-cache-size must be a positive number of embeddings"),
    ]:
        assert main(["serve", "--model-id", "/nonexistent", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_an_image_request_with_the_engine_core_in_its_own_process(llava_dir, reference):
    """`ember serve`'s default engine mode: the processed image crosses the process boundary."""
    text, ids, num_prompt = reference(f"{QUESTION}\n<image>", (IMAGES["dog"],))
    with running_server(llava_dir, max_total_tokens=256, served_model_name=MODEL, engine_mode="process") as running:
        with httpx.Client(base_url=running.url, timeout=120) as c:
            r = c.post("/v1/chat/completions", json=chat_body(image_part(data_url(IMAGES["dog"]))))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text
    assert (r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) == (num_prompt, len(ids))
