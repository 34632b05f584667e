"""`ember chat`: the conversation object against a real server (history, /system,
/params, /reset, refusals shown and the chat going on; /image against a tiny LLaVA: the
answers equal the HTTP API's to the same messages, bad files are a message, a text-only
model's refusal), then the program itself in a real terminal under tmux (send-keys,
capture-pane): a streamed answer with its figures, the commands, Ctrl-C stopping a long
answer but not the program, Ctrl-D / /exit; with --url and with the model loaded in its
own process, and an image attached."""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from server_utils import running_server, wait_idle
from tiny_models import with_context

from ember.api import chat_cli
from ember.api.chat_cli import Chat, ChatError, repl

CONTEXT = 4096


@pytest.fixture(scope="module")
def long_model(tiny_llama_dir, tmp_path_factory):
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-chat") / "model", CONTEXT)
    return path


@pytest.fixture(scope="module")
def server(long_model):
    with running_server(long_model, engine={"num_kv_blocks": 1024}, served_model_name="tiny") as running:
        yield running


def test_a_conversation_keeps_its_history_and_settings(server):
    out = io.StringIO()
    chat = Chat(server.url, "tiny", params={"max_tokens": 6, "temperature": 0}, out=out)
    answer = chat.ask("hello")
    whole = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}).json()
    assert answer == whole["choices"][0]["message"]["content"]
    assert out.getvalue().startswith(answer) and "[6 tokens, first token" in out.getvalue()
    chat.command("/system be brief")
    chat.command("/params temperature=0.5 seed=3 stop=[\"zz\"]")
    body = chat.request("next")
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                                {"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    assert (body["temperature"], body["seed"], body["stop"], body["max_tokens"]) == (0.5, 3, ["zz"], 6)
    chat.command("/params seed=")
    assert "seed" not in chat.request("x")
    chat.command("/reset")
    assert chat.messages == [] and chat.system == "be brief"
    chat.command("/system -")
    assert chat.request("x")["messages"] == [{"role": "user", "content": "x"}]
    with pytest.raises(ChatError, match="KEY=VALUE"):
        chat.set_params("temperature")
    with pytest.raises(ChatError, match="use --model"):
        chat.set_params("model=x")
    chat.close()


def test_a_refusal_is_shown_and_the_chat_goes_on(server):
    out = io.StringIO()
    chat = Chat(server.url, "tiny", params={"max_tokens": 99999}, out=out)
    lines = iter(["hello", "/params max_tokens=3", "hello again", "/exit"])
    assert repl(chat, read=lambda prompt: next(lines)) == 0
    text = out.getvalue()
    assert "the server refused (422): " in text and "max_tokens" in text
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hello again"]  # the refused one is not kept
    assert "[3 tokens" in text
    bad = Chat("http://127.0.0.1:9", "tiny", out=io.StringIO())
    with pytest.raises(ChatError, match="could not be reached"):
        bad.ask("hi")


# -- images ----------------------------------------------------------------------------------------
LLAVA = "tiny-llava"
QUESTION = "What is this?"


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    from ember.testing.tiny_vlms import make_tiny_llava

    path = tmp_path_factory.mktemp("tiny-llava-chat")
    make_tiny_llava(path, seed=3)
    with running_server(path, max_total_tokens=256, served_model_name=LLAVA) as running:
        yield running


def random_png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 52, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(data).decode()}"}}


def api_answer(url: str, messages: list[dict]) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": LLAVA, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_images_go_with_the_next_message_and_stay_in_the_history(llava_server, tmp_path):
    cat, owl = random_png(1), random_png(3)
    (tmp_path / "cat.png").write_bytes(cat)
    (tmp_path / "my owl.png").write_bytes(owl)
    out = io.StringIO()
    chat = Chat(llava_server.url, LLAVA, params={"max_tokens": 8, "temperature": 0}, out=out)
    chat.command(f"/image {tmp_path / 'cat.png'}")
    chat.command(f"/image '{tmp_path / 'my owl.png'}'")  # quoted, as a terminal pastes a dragged file
    assert f"attached {tmp_path / 'my owl.png'} ({len(owl) / 1024:.1f} KiB, image/png); 2 images for the next message" \
        in out.getvalue()
    chat.command("/image")
    assert f"attached to the next message:\n  1. {tmp_path / 'cat.png'}\n  2. {tmp_path / 'my owl.png'}\n" \
        in out.getvalue()
    first = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(cat), image_part(owl)]}]
    assert chat.request(QUESTION)["messages"] == first
    answer = chat.ask(QUESTION)
    assert answer == api_answer(llava_server.url, first)
    assert answer != api_answer(llava_server.url, [{"role": "user", "content": QUESTION}])  # the images counted
    assert chat.images == []  # sent with that message only...
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    assert chat.ask("and then?") == api_answer(llava_server.url, second)  # ...and in the history after it
    assert chat.messages[:3] == second
    chat.command("/history")
    assert f"user: {QUESTION} [image {tmp_path / 'cat.png'}] [image {tmp_path / 'my owl.png'}]\n" in out.getvalue()
    chat.command("/image " + str(tmp_path / "cat.png"))
    chat.command("/image -")
    assert "dropped 1 attached image\n" in out.getvalue() and chat.images == []
    chat.close()


def test_a_bad_image_path_is_a_message(llava_server, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("not a picture")
    (tmp_path / "empty.png").write_bytes(b"")
    with open(tmp_path / "huge.png", "wb") as file:
        file.truncate(21 * 1024 * 1024)
    (tmp_path / "cat.png").write_bytes(random_png(1))
    out = io.StringIO()
    chat = Chat(llava_server.url, LLAVA, out=out)
    lines = iter([f"/image {tmp_path / 'nope.png'}", f"/image {tmp_path / 'notes.txt'}", f"/image {tmp_path}",
                  f"/image {tmp_path / 'empty.png'}", f"/image {tmp_path / 'huge.png'}", "/image", "/help", "/exit"])
    assert repl(chat, read=lambda prompt: next(lines)) == 0
    shown = out.getvalue().splitlines()
    assert shown[:6] == [
        f"cannot attach {str(tmp_path / 'nope.png')!r}: no such file",
        f"cannot attach {str(tmp_path / 'notes.txt')!r}: not an image (PNG, JPEG, GIF, WebP, BMP or TIFF)",
        f"cannot attach {str(tmp_path)!r}: it is a directory",
        f"cannot attach {str(tmp_path / 'empty.png')!r}: the file is empty",
        f"cannot attach {str(tmp_path / 'huge.png')!r}: 21.0 MiB, more than the 20 MiB an image may be",
        "no image attached (/image PATH attaches one)",
    ]
    assert any(line.startswith("  /image [PATH]") for line in shown[6:])  # /help lists it
    assert chat.images == []

    def unreadable(*args, **kwargs):  # as root every file is readable: the error as a user would get it
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(chat_cli, "open", unreadable, raising=False)
    with pytest.raises(ChatError, match=r"^cannot attach '.*cat.png': permission denied$"):
        chat.command(f"/image {tmp_path / 'cat.png'}")
    chat.close()


def test_a_text_only_model_refuses_the_images(server, tmp_path):
    (tmp_path / "cat.png").write_bytes(random_png(1))
    out = io.StringIO()
    chat = Chat(server.url, "tiny", params={"max_tokens": 3}, out=out)
    lines = iter([f"/image {tmp_path / 'cat.png'}", "hello", "/image -", "hello", "/exit"])
    assert repl(chat, read=lambda prompt: next(lines)) == 0
    text = out.getvalue()
    assert "the server refused (400): `messages[0].content[1]`: model 'tiny' takes no images" in text, text
    assert "(the 1 attached image stays attached; /image - drops them)" in text
    assert "[3 tokens" in text
    assert chat.messages[0] == {"role": "user", "content": "hello"} and len(chat.messages) == 2


# -- the program in a terminal -------------------------------------------------------------------
class Terminal:
    """A tmux session running one command; `screen` is what it shows."""

    def __init__(self, command: list[str]) -> None:
        if shutil.which("tmux") is None:  # in CI (CI set) the terminal test must run: a failure, not a skip
            (pytest.fail if os.environ.get("CI") else pytest.skip)("tmux is not installed (Debian's tmux)")
        self.name = f"ember-chat-{uuid.uuid4().hex[:8]}"
        line = " ".join(subprocess.list2cmdline([part]) for part in command)
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50",
                        f"{line}; echo EXIT=$?; sleep 60"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def type(self, text: str) -> None:
        self.keys("-l", text)
        self.keys("Enter")

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name, "-S", "-500"], check=True,
                              capture_output=True, text=True).stdout

    def wait_for(self, predicate, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"not seen within {timeout} s; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], check=False, capture_output=True)


@pytest.fixture()
def terminal():
    opened: list[Terminal] = []

    def open_(command: list[str]) -> Terminal:
        opened.append(Terminal(command))
        return opened[-1]

    yield open_
    for term in opened:
        term.close()


EMBER = [sys.executable, "-m", "ember.api.cli", "chat"]


def test_in_a_terminal_with_url(server, terminal):
    term = terminal([*EMBER, "--url", server.url, "--max-tokens", "8"])
    term.wait_for(lambda s: "ember chat: tiny at " in s and s.rstrip().endswith(">>>"))
    term.type("hello")
    term.wait_for(lambda s: "[8 tokens, first token" in s)
    term.type("/system be brief")
    term.wait_for(lambda s: "system prompt: 'be brief'" in s)
    term.type(f"/params max_tokens={CONTEXT - 200}")  # long enough to stop by hand
    term.wait_for(lambda s: f'"max_tokens": {CONTEXT - 200}' in s)
    term.type("tell me everything")
    time.sleep(1.0)
    term.keys("C-c")
    term.wait_for(lambda s: "[stopped" in s and s.rstrip().endswith(">>>"), timeout=30)
    wait_idle(server.app)  # the server dropped the request
    assert server.app.state.service.num_in_flight == 0
    term.keys("C-c")  # at the prompt: a hint, still running
    term.wait_for(lambda s: "(Ctrl-D or /exit to leave)" in s)
    term.type("/params max_tokens=4")
    term.type("/history")
    term.wait_for(lambda s: "system: be brief" in s and "user: tell me everything" in s)
    term.keys("C-d")
    term.wait_for(lambda s: "EXIT=0" in s)


def test_in_a_terminal_with_the_model_loaded_here(long_model, terminal):
    term = terminal([*EMBER, "--model-id", str(long_model), "--dtype", "float32", "--max-tokens", "5"])
    term.wait_for(lambda s: "ember chat: " in s and s.rstrip().endswith(">>>"), timeout=120)
    term.type("hello")
    term.wait_for(lambda s: "[5 tokens, first token" in s)
    term.type("/exit")
    term.wait_for(lambda s: "EXIT=0" in s, timeout=60)


def test_in_a_terminal_with_an_image(llava_server, terminal, tmp_path):
    (tmp_path / "cat.png").write_bytes(random_png(1))
    term = terminal([*EMBER, "--url", llava_server.url, "--max-tokens", "8"])
    term.wait_for(lambda s: f"ember chat: {LLAVA} at " in s and s.rstrip().endswith(">>>"))
    term.type(f"/image {tmp_path / 'nope.png'}")
    term.wait_for(lambda s: "cannot attach" in s and "nope.png': no such file" in s)
    term.type(f"/image {tmp_path / 'cat.png'}")
    term.wait_for(lambda s: "1 image for the next message" in s)
    term.type(QUESTION)
    term.wait_for(lambda s: "8 tokens, first token" in s)  # the random answer's control bytes may eat the "["
    term.type("/history")
    term.wait_for(lambda s: f"user: {QUESTION} [image {tmp_path / 'cat.png'}]" in s)
    term.type("/exit")
    term.wait_for(lambda s: "EXIT=0" in s)
