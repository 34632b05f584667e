"""`ember serve` as users run it: the console script in a subprocess, and its checks."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ember.api.cli import main
from ember.api.settings import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-input-tokens", "100", "--max-total-tokens", "50"], "--max-input-tokens (100) must be < --max-total-tokens (50)"),
        (["--max-input-tokens", "100", "--max-batch-prefill-tokens", "10", "--disable-chunked-prefill"],
         "--max-batch-prefill-tokens (10) must be >= --max-input-tokens (100)"),
        (["--max-total-tokens", "100", "--max-batch-total-tokens", "10"], "--max-batch-total-tokens (10) must be >= --max-total-tokens (100)"),
        (["--port", "70000"], "--port must be at most 65535"),
        (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be a positive integer"),
        (["--kv-cache-memory", "1MiB", "--max-batch-total-tokens", "100"],
         "give --kv-cache-memory (1048576 bytes) or --max-batch-total-tokens (100 tokens), not both"),
        (["--kv-cache-memory", "lots"], "'lots' is not a size"),
        (["--kv-cache-memory", "0GiB"], "'0GiB' is not a size of at least 1 byte"),
        (["--max-batch-size", "0"], "--max-batch-size must be a positive integer"),
        (["--grammar-backend", "nope"],
         "--grammar-backend 'nope' is not a registered grammar backend; registered: outlines, xgrammar"),
        (["--grammar-compile-timeout", "0"], "--grammar-compile-timeout must be > 0 seconds, got 0.0"),
    ],
)
def test_contradictory_limits_are_refused_before_loading(capsys, argv, message):
    assert main(["serve", "--model-id", "/nonexistent", *argv]) == 2
    assert message in capsys.readouterr().err


def test_settings_read_from_environment(monkeypatch, capsys):
    monkeypatch.setenv("EMBER_MAX_TOTAL_TOKENS", "50")
    monkeypatch.setenv("EMBER_MAX_INPUT_TOKENS", "60")
    assert main(["serve", "--model-id", "/nonexistent"]) == 2
    assert "--max-input-tokens (60) must be < --max-total-tokens (50)" in capsys.readouterr().err


def test_kv_cache_memory_sizes_parse_and_the_variable_is_checked(monkeypatch, capsys):
    from ember.api.settings import parse_size

    assert [parse_size(t) for t in ["4096", "512MiB", "2GiB", "1.5GB", "64 kib", "3B"]] == [
        4096, 512 << 20, 2 << 30, 1_500_000_000, 64 << 10, 3,
    ]
    monkeypatch.setenv("EMBER_KV_CACHE_MEMORY", "a lot")
    assert main(["serve", "--model-id", "/nonexistent"]) == 2
    assert "EMBER_KV_CACHE_MEMORY='a lot' is invalid: 'a lot' is not a size" in capsys.readouterr().err


def test_limits_beyond_the_model_are_refused():
    from ember.api.settings import resolve_limits

    with pytest.raises(ValueError, match=r"--max-total-tokens \(4096\) exceeds the model's context \(256\)"):
        resolve_limits(ServerSettings(max_total_tokens=4096), max_model_len=256, num_kv_tokens=10_000)


def test_ember_serve_subprocess_answers_curl_style_requests(tiny_llama_dir, tmp_path):
    exe = shutil.which("ember", path=os.path.dirname(sys.executable))
    assert exe, "the `ember` console script is not installed next to this Python"
    port = free_port()
    log = tmp_path / "serve.log"
    key = "subprocess-key-42"
    env = {**os.environ, "EMBER_MAX_TOTAL_TOKENS": "128", "EMBER_API_KEY": key}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [exe, "serve", "--model-id", str(tiny_llama_dir), "--port", str(port), "--max-batch-total-tokens", "2048",
             "--disable-prefix-caching"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
            headers={"Authorization": f"Bearer {key}"}, timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        info = httpx.get(f"http://127.0.0.1:{port}/info").json()
        assert info["max_total_tokens"] == 128 and info["max_batch_total_tokens"] == 2048
        assert info["prefix_caching"] is False and info["chunked_prefill"] is True
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text()
    assert "KV cache holds" in text and "backend cpu" in text and "prefix caching off" in text, text
    assert "API-key auth on" in text and key not in text, text  # the key from EMBER_API_KEY, never logged
