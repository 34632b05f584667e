"""`ember chat`: the conversation object against a real server (history, /system,
/params, /reset, refusals shown and the chat going on), then the program itself in a
real terminal under tmux (send-keys, capture-pane): a streamed answer with its figures,
the commands, Ctrl-C stopping a long answer but not the program, Ctrl-D / /exit; with
--url and with the model loaded in its own process."""

from __future__ import annotations

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
