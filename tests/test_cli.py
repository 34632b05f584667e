"""The `ember` command line, run in-process through `main([...])` on a tiny random Llama."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ember
from ember import SamplingParams
from ember.api.cli import main
from ember.hardware.cpu import CPUBackend

GREEDY = ["--temperature", "0", "--max-tokens", "6"]
ENV_NAMES = (
    "EMBER_MODEL_ID", "EMBER_REVISION", "EMBER_DTYPE", "EMBER_MAX_TOKENS", "EMBER_TEMPERATURE",
    "EMBER_TOP_P", "EMBER_TOP_K", "EMBER_SEED", "EMBER_CHAT", "EMBER_DISABLE_PLUGIN", "EMBER_PLUGIN",
    "EMBER_LOG_LEVEL", "EMBER_PLUGINS_JSON",
)


@pytest.fixture(autouse=True)
def small_kv_cache_and_clean_env(monkeypatch):
    # The CPU backend's default KV budget is up to 4 GiB: far more than a tiny model needs.
    monkeypatch.setattr(CPUBackend, "kv_cache_memory_bytes", lambda self, model_bytes: 1 << 20)
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def reference_llm(tiny_llama_dir):
    return ember.LLM(str(tiny_llama_dir), num_kv_blocks=64)


def reference_text(llm, prompt: str, max_tokens: int = 6) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text


class RecordingStdout:
    """Records writes and flushes in order, to check that output is streamed."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def write(self, text: str) -> int:
        self.events.append(("write", text))
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush", ""))

    @property
    def text(self) -> str:
        return "".join(text for kind, text in self.events if kind == "write")


# --- generate --------------------------------------------------------------------------------


def test_generate_streams_the_greedy_completion(tiny_llama_dir, reference_llm, monkeypatch, capsys):
    out = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "hello world", "--model-id", str(tiny_llama_dir), *GREEDY]) == 0
    expected = reference_text(reference_llm, "hello world")
    assert expected, "the tiny model should produce text"
    assert out.text == expected + "\n"
    # piece by piece, each flushed as it came, newline last
    writes = [i for i, (kind, _) in enumerate(out.events) if kind == "write"]
    assert len(writes) >= 3
    assert all(out.events[i + 1][0] == "flush" for i in writes)
    assert out.events[writes[-1]] == ("write", "\n")


def test_generate_chat_uses_the_chat_template(tiny_llama_dir, reference_llm, capsys):
    assert main(["generate", "hi there", "--chat", "--model-id", str(tiny_llama_dir), *GREEDY]) == 0
    chat = reference_llm.chat([{"role": "user", "content": "hi there"}], SamplingParams(temperature=0, max_tokens=6))
    expected = chat[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"
    assert expected != reference_text(reference_llm, "hi there")


def test_generate_options_default_from_environment(tiny_llama_dir, reference_llm, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_MODEL_ID", str(tiny_llama_dir))
    monkeypatch.setenv("EMBER_TEMPERATURE", "0")
    monkeypatch.setenv("EMBER_MAX_TOKENS", "3")
    assert main(["generate", "hello"]) == 0
    assert capsys.readouterr().out == reference_text(reference_llm, "hello", 3) + "\n"
    # a flag wins over its variable
    assert main(["generate", "hello", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == reference_text(reference_llm, "hello", 5) + "\n"
    monkeypatch.setenv("EMBER_CHAT", "1")
    assert main(["generate", "hello"]) == 0
    chat = reference_llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=3))
    assert capsys.readouterr().out == chat[0].outputs[0].text + "\n"


def test_generate_seeded_sampling_is_reproducible(tiny_llama_dir, capsys):
    args = ["generate", "hello", "--model-id", str(tiny_llama_dir), "--max-tokens", "8", "--seed", "7",
            "--top-k", "50", "--top-p", "0.9", "--temperature", "1.5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_bfloat16(tiny_llama_dir, capsys):
    assert main(["generate", "hello", "--model-id", str(tiny_llama_dir), "--dtype", "bfloat16", *GREEDY]) == 0
    assert len(capsys.readouterr().out) > 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
        (["--temperature", "-1"], "temperature must be a number >= 0"),
    ],
)
def test_generate_bad_sampling_exits_2_before_loading(extra, message, capsys):
    # The model id does not exist: the sampling error must come first.
    assert main(["generate", "hello", "--model-id", "/nonexistent/model", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and message in err
    assert "Traceback" not in err


def test_generate_bad_environment_variable_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("EMBER_TOP_K", "many")
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert "ember: error: environment variable EMBER_TOP_K='many' is invalid" in err
    monkeypatch.delenv("EMBER_TOP_K")
    monkeypatch.setenv("EMBER_DTYPE", "float16")
    assert main(["generate", "hello"]) == 2
    assert "EMBER_DTYPE='float16'" in capsys.readouterr().err


def test_generate_empty_prompt_and_missing_model(tiny_llama_dir, capsys):
    assert main(["generate", "", "--model-id", str(tiny_llama_dir)]) == 2
    assert "ember: error: prompt is empty" in capsys.readouterr().err
    assert main(["generate", "hello", "--model-id", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert "ember: error: Could not find model '/nonexistent/model'" in err and "Traceback" not in err


def test_generate_bad_flag_is_an_argparse_usage_error(capsys):
    assert main(["generate", "hello", "--dtype", "float16"]) == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err
    assert main(["generate"]) == 2
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out


def test_generate_required_plugin_errors_name_it(tiny_llama_dir, capsys):
    assert main(["generate", "hello", "--model-id", str(tiny_llama_dir), "--plugin", "no_such_plugin"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and "no_such_plugin" in err
    assert main(["generate", "hello", "--plugin", "cpu", "--disable-plugin", "cpu"]) == 1
    assert "['cpu'] are both required and disabled" in capsys.readouterr().err


def test_generate_disabled_plugin_reaches_the_engine(tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.setenv("EMBER_DISABLE_PLUGIN", "llama")
    # without its native code, --model-impl ember refuses the architecture ...
    assert main(["generate", "hello", "--model-id", str(tiny_llama_dir), "--model-impl", "ember"]) == 2
    assert "model architecture ['LlamaForCausalLM'] is not supported" in capsys.readouterr().err
    # ... and auto (the default) runs it through the transformers fallback
    assert main(["generate", "hello", "--model-id", str(tiny_llama_dir), *GREEDY]) == 0
    assert "model implementation: transformers fallback (LlamaForCausalLM" in capsys.readouterr().err
    # the flag replaces the variable's list
    assert main(["generate", "hello", "--model-id", str(tiny_llama_dir), "--disable-plugin", "nothing", *GREEDY]) == 0


def test_log_level_controls_ember_logs_on_stderr(tiny_llama_dir, capsys):
    logger = logging.getLogger("ember")
    level, handlers = logger.level, list(logger.handlers)
    assert main(["generate", "hi", "--model-id", str(tiny_llama_dir), *GREEDY]) == 0
    assert "INFO ember.models.loader: loaded LlamaForCausalLM" in capsys.readouterr().err
    assert main(["--log-level", "warning", "generate", "hi", "--model-id", str(tiny_llama_dir), *GREEDY]) == 0
    assert "loaded LlamaForCausalLM" not in capsys.readouterr().err
    assert main(["generate", "hi", "--log-level", "DEBUG", "--model-id", str(tiny_llama_dir), *GREEDY]) == 0
    assert "INFO ember.models.loader" in capsys.readouterr().err
    assert (logger.level, logger.handlers) == (level, handlers)  # main leaves logging as it found it


def fail_if_called(what: str):
    def fail(*args, **kwargs):
        pytest.fail(f"{what} was called")

    return fail


@pytest.mark.parametrize("extra", [[], ["--chat"], ["--model-id", "nobody/no-such-model"]])
def test_generate_empty_prompt_is_refused_before_anything_loads(monkeypatch, capsys, extra):
    import ember.weights

    monkeypatch.setattr(ember, "LLM", fail_if_called("ember.LLM"))
    monkeypatch.setattr(ember.weights, "resolve_model", fail_if_called("resolve_model"))
    assert main(["generate", "", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: prompt is empty") and "Traceback" not in err


class RecordingLLM:
    """Stands in for `ember.LLM`: records what `generate` builds and streams one piece."""

    built: list["RecordingLLM"] = []

    def __init__(self, model=None, dtype="auto", **kwargs) -> None:
        self.model, self.dtype, self.kwargs = model, dtype, kwargs
        self.streamed: list[tuple] = []
        RecordingLLM.built.append(self)

    def stream(self, prompt=None, sampling_params=None, prompt_token_ids=None):
        self.streamed.append((prompt, sampling_params, prompt_token_ids))
        yield "x"

    def stream_chat(self, messages, sampling_params=None):
        self.streamed.append((messages, sampling_params, None))
        yield "x"


def test_generate_defaults_to_greedy_and_says_so(tiny_llama_dir, monkeypatch, capsys):
    RecordingLLM.built = []
    monkeypatch.setattr(ember, "LLM", RecordingLLM)
    assert main(["generate", "hello", "--model-id", str(tiny_llama_dir)]) == 0
    [(_, params, _)] = RecordingLLM.built[-1].streamed
    assert params.temperature == 0 and params.max_tokens == 128
    capsys.readouterr()
    assert main(["generate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--temperature T 0 (the default) is greedy" in help_text


@pytest.mark.parametrize("chat", [False, True])
def test_generate_sizes_the_kv_cache_to_the_request(tiny_llama_dir, reference_llm, monkeypatch, capsys, chat):
    built = []

    class Recording(ember.LLM):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(ember, "LLM", Recording)
    argv = ["generate", "hello world", "--model-id", str(tiny_llama_dir), "--max-tokens", "30", "--temperature", "0"]
    assert main(argv + (["--chat"] if chat else [])) == 0
    engine = built[0].engine
    if chat:
        num_prompt_tokens = len(reference_llm._encode_chat([{"role": "user", "content": "hello world"}])[1])
    else:
        num_prompt_tokens = len(engine.tokenizer.encode("hello world"))
    block_size = engine.kv_manager.block_size
    assert engine.config.num_kv_tokens == num_prompt_tokens + 30
    assert num_prompt_tokens + 30 <= engine.num_kv_cache_tokens < num_prompt_tokens + 30 + block_size
    params = SamplingParams(temperature=0, max_tokens=30)
    if chat:
        expected = reference_llm.chat([{"role": "user", "content": "hello world"}], params)[0].outputs[0].text
    else:
        expected = reference_llm.generate("hello world", params)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"


HEAVY_MODULES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "starlette", "uvicorn",
                 "pydantic", "httpx", "ember.engine.llm_engine", "ember.engine.llm")


def test_help_and_bad_input_import_no_heavy_module():
    """`ember --help` and each command's --help build the parser only, and an empty
    prompt is refused by the parser's checks: no torch, no server."""
    code = (
        "import contextlib, io, sys\n"
        "from ember.api.cli import build_parser, main\n"
        "build_parser()\n"
        "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['bench', 'serve', '--help'],\n"
        "             ['watermark', 'detect', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    assert main(['generate', '']) == 2\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_python_api_still_imports_from_ember():
    code = "from ember import LLM, LLMEngine, EngineConfig, SamplingParams, BeamSearchParams, RequestOutput, CompletionOutput"
    result = subprocess.run([sys.executable, "-c", code + "; import ember; print(ember.__version__, sorted(ember.__all__))"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == ember.__version__


# --- download --------------------------------------------------------------------------------


def test_download_prints_the_local_path(tiny_llama_dir, capsys, monkeypatch):
    assert main(["download", str(tiny_llama_dir)]) == 0
    assert capsys.readouterr().out == f"{tiny_llama_dir}\n"
    monkeypatch.setenv("EMBER_MODEL_ID", str(tiny_llama_dir))
    assert main(["download"]) == 0
    assert capsys.readouterr().out == f"{tiny_llama_dir}\n"


def test_download_failure_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only (the Hub's own failures: tests/test_hub_download.py)
    assert main(["download", "nobody/no-such-model", "--revision", "v1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("ember: error: Could not find model 'nobody/no-such-model'")
    assert "Traceback" not in captured.err


# --- plugins ---------------------------------------------------------------------------------


def test_plugins_lists_plugins_and_registries(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    cpu = next(line.split() for line in lines if line.split()[:1] == ["cpu"])
    assert cpu == ["cpu", "ember-serve", ember.__version__, "loaded", "ember.hardware.cpu"]
    assert any(line.split() == ["backends", "cpu", "cpu", "ember.hardware.cpu.CPUBackend"] for line in lines)
    assert any(
        line.split() == ["model_architectures", "LlamaForCausalLM", "llama", "ember.models.llama.LlamaForCausalLM"]
        for line in lines
    )
    assert any(line.split() == ["speculators", "ngram", "speculative_ngram",
                                "ember.plugins.speculative.ngram.NgramSpeculator"] for line in lines)
    assert any(line.split() == ["quantizers", "int8", "quantizer_weight_only",
                                "ember.plugins.quantizers.weight_only.Int8Quantizer"] for line in lines)


def test_plugins_json_and_disable(capsys, monkeypatch):
    assert main(["plugins", "--json", "--disable-plugin", "llama"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["entry_point_group"] == "ember"
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["llama"]["status"] == "blocked"
    assert by_name["cpu"] == {
        "name": "cpu", "distribution": "ember-serve", "version": ember.__version__,
        "status": "loaded", "value": "ember.hardware.cpu",
    }
    assert set(data["registries"]) == {
        "backends", "model_architectures", "logits_processors", "quantizers", "speculators", "grammar_backends",
        "tool_parsers", "reasoning_parsers", "adapter_kinds",
    }
    assert {e["name"] for e in data["registries"]["tool_parsers"]} >= {"hermes", "llama3_json"}
    assert {"name": "cpu", "plugin": "cpu", "implementation": "ember.hardware.cpu.CPUBackend", "available": True,
            "unavailable_reason": None} in data["registries"]["backends"]
    assert "LlamaForCausalLM" not in [e["name"] for e in data["registries"]["model_architectures"]]

    monkeypatch.setenv("EMBER_DISABLE_PLUGIN", "cpu, llama")
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["name"]: p["status"] for p in data["plugins"]}.items() >= {"cpu": "blocked", "llama": "blocked"}.items()
    assert "cpu" not in [b["name"] for b in data["registries"]["backends"]]  # the device backends remain


def test_installed_console_script_runs():
    script = Path(sys.executable).with_name("ember")
    command = str(script) if script.exists() else shutil.which("ember")
    assert command, "the `ember` console script is not installed: pip install -e ."
    result = subprocess.run([command, "plugins"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "entry-point group 'ember'" in result.stdout
    assert any(line.split()[:2] == ["cpu", "ember-serve"] for line in result.stdout.splitlines())


# --- LLM.stream, which `generate` is built on ---------------------------------------------------


def test_stream_takes_token_ids_and_aborts_when_closed_early(reference_llm):
    llm = reference_llm
    params = SamplingParams(temperature=0, max_tokens=6)
    ids = llm.get_tokenizer().encode("hello world")
    assert "".join(llm.stream(prompt_token_ids=ids, sampling_params=params)) == reference_text(llm, "hello world")
    pieces = llm.stream("hello world", SamplingParams(temperature=0, max_tokens=50))
    next(pieces)
    assert llm.engine.has_unfinished_requests()
    pieces.close()
    assert not llm.engine.has_unfinished_requests()
