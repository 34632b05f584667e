"""Backend options: the contract's parsing (ember.plugin.backend.BackendOptions), the CPU
and device backends' options, and how users set them (EngineConfig.backend_options,
`--backend-option KEY=VALUE`, EMBER_BACKEND_OPTIONS, `ember backends options NAME`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from typing import Literal

import pytest

from ember.api.cli import main
from ember.config import EngineConfig
from ember.hardware.cpu import CPUBackend
from ember.hardware.cpu_options import CPUOptions
from ember.hardware.torch_device import TorchDeviceOptions
from ember.plugin import create_plugin_manager
from ember.plugin.backend import BackendOptions, BaseBackend, option, select_backend


@dataclasses.dataclass(frozen=True)
class _Options(BackendOptions):
    count: int = option(3, "a count")
    ratio: float = option(0.5, "a ratio")
    flag: bool = option(False, "a flag")
    label: str = option("x", "a label")
    mode: Literal["fast", "exact"] = option("fast", "a mode")
    limit: int | None = option(None, "a limit, auto when None")


def test_values_are_converted_to_each_fields_type():
    got = _Options.parse({"count": " 7", "ratio": "0.25", "flag": "yes", "label": "y", "mode": "EXACT",
                          "limit": "12"}, "acme")
    assert got == _Options(7, 0.25, True, "y", "exact", 12)
    assert _Options.parse({"limit": "auto"}).limit is None
    assert _Options.parse({"count": 9, "flag": True}) == _Options(count=9, flag=True)  # typed values pass
    assert _Options.parse(None) == _Options()


@pytest.mark.parametrize("text,want", [(t, True) for t in ("1", "true", "Yes", "on")]
                         + [(t, False) for t in ("0", "false", "NO", "off")])
def test_booleans_take_the_usual_spellings(text, want):
    assert _Options.parse({"flag": text}).flag is want


@pytest.mark.parametrize("values,message", [
    ({"colour": "red"}, "the acme backend has no option 'colour'; its options: count, ratio, flag, label, mode, limit"),
    ({"count": "many"}, "the acme backend's option count='many' is invalid: expected an integer"),
    ({"ratio": "half"}, "the acme backend's option ratio='half' is invalid: expected a number"),
    ({"flag": "maybe"}, "the acme backend's option flag='maybe' is invalid: expected a boolean"),
    ({"mode": "quick"}, "the acme backend's option mode='quick' is invalid: choose one of: fast, exact"),
])
def test_unknown_keys_and_malformed_values_are_named(values, message):
    with pytest.raises(ValueError) as info:
        _Options.parse(values, "acme")
    assert str(info.value).startswith(message)


def test_a_backend_without_options_refuses_any_and_is_built_without_arguments():
    class Bare(BaseBackend):  # a third-party backend written before options: __init__ takes nothing
        name = "bare"

        def __init__(self):
            pass

        is_available = classmethod(lambda cls: True)
        device = supported_dtypes = None
        resolve_dtype = kv_cache_memory_bytes = create_attention = lambda *a: None

    registry = create_plugin_manager().registries.backends  # a fresh registry of this test's own
    registry.register("bare", Bare)
    backend = select_backend(registry, "bare")
    assert type(backend) is Bare and backend.options == BackendOptions()
    with pytest.raises(ValueError, match="the bare backend has no option 'x'; its options: none"):
        select_backend(registry, "bare", {"x": "1"})


def test_defaults_are_todays_behaviour():
    options = CPUBackend().options
    assert options == CPUOptions() and not options.non_default()
    assert (options.path, options.native, options.linear, options.batch_invariant) == ("auto", True, "onednn", False)
    assert options.decode_group_bytes == 4 << 20
    assert options.small_batch_rows_for("fp32") == 8 and options.small_batch_rows_for("bf16") == 2
    assert (options.quant_isa, options.gguf_x8, options.gguf_prefill) == ("auto", True, "auto")
    device = TorchDeviceOptions()
    assert (device.attention, device.gpu_memory_utilization, device.device_index) == ("auto", 0.9, 0)


def test_every_option_has_a_doc():
    registry = create_plugin_manager().registries.backends
    for name, cls in registry.items():
        for info in cls.options_class.describe():
            assert len(info.doc) > 20, (name, info.name)


def test_options_checked_beyond_their_type_are_refused_with_the_backend_named():
    with pytest.raises(ValueError, match=r"the cuda backend's options: gpu_memory_utilization must lie in \(0, 1\]"):
        create_plugin_manager().registries.backends.get("cuda").parse_options({"gpu_memory_utilization": "1.5"})
    with pytest.raises(ValueError, match="small_batch_rows must be >= 0"):
        CPUBackend.parse_options({"small_batch_rows": "-1"})


def test_a_non_default_option_is_logged_once_at_start(caplog):
    registry = create_plugin_manager().registries.backends
    with caplog.at_level(logging.INFO, logger="ember.plugin.backend"):
        backend = select_backend(registry, "cpu", {"linear": "plain", "path": "auto"})
    assert backend.options.linear == "plain"
    lines = [r.getMessage() for r in caplog.records if r.name == "ember.plugin.backend"]
    assert lines == ["cpu backend: option linear=plain"]


def test_a_parallel_rank_takes_its_device_index_as_an_option():
    registry = create_plugin_manager().registries.backends
    assert select_backend(registry, "cpu", device_index=3).options == CPUOptions()  # no device_index: ignored
    device = registry.get("cuda").interpreted()
    from ember.plugin.backend import create_backend

    backend = create_backend(device, {"device_index": "1"}, device_index=2)
    assert backend.options.device_index == 2


def test_engine_config_keeps_the_options_as_sorted_string_pairs():
    config = EngineConfig(backend_options={"native": False, "decode_group_bytes": 64, "linear": "plain"})
    assert config.backend_options == (("decode_group_bytes", "64"), ("linear", "plain"), ("native", "false"))
    with pytest.raises(ValueError, match="backend_options must map option names to values"):
        EngineConfig(backend_options="linear=plain")
    with pytest.raises(ValueError, match=r"backend_options: linear=\[1\] must be a string, number or boolean"):
        EngineConfig(backend_options={"linear": [1]})


def test_engine_config_options_reach_the_engines_backend(tiny_llama_dir):
    from ember import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16,
              backend_options={"decode_group_bytes": "4096", "batch_invariant": "true"})
    backend = llm.engine.core.backend
    assert backend.options == CPUOptions(decode_group_bytes=4096, batch_invariant=True)
    assert llm.engine.runner.attention.decode_group_bytes == 4096 and llm.engine.runner.attention.row_invariant
    with pytest.raises(ValueError, match="the cpu backend has no option 'colour'"):
        LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, backend_options={"colour": "red"})


@pytest.fixture
def captured_options(monkeypatch):
    """What the engine built by `ember generate` was given: its EngineConfig's options
    and its backend's parsed options (the engine is stopped after construction)."""
    import ember.engine.llm as llm_module

    seen = {}
    real = llm_module.LLMEngine

    class Recording(real):
        def __init__(self, config, plugin_manager=None):
            super().__init__(config, plugin_manager)
            seen["config"] = config.backend_options
            seen["options"] = self.core.backend.options

    monkeypatch.setattr(llm_module, "LLMEngine", Recording)
    return seen


def test_generate_flags_and_the_variable_reach_the_backend(tiny_llama_dir, captured_options, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_BACKEND_OPTIONS", json.dumps({"linear": "plain", "decode_group_bytes": 1024,
                                                            "native": True}))
    status = main(["--log-level", "warning", "generate", "--model-id", str(tiny_llama_dir), "--max-tokens", "2",
                   "--backend-option", "decode_group_bytes=2048", "--backend-option", "batch_invariant=1", "hi"])
    assert status == 0, capsys.readouterr().err
    assert captured_options["options"] == CPUOptions(linear="plain", decode_group_bytes=2048, batch_invariant=True)


@pytest.mark.parametrize("argv,env,message", [
    (["--backend-option", "linear"], None, "ember: error: --backend-option 'linear': expected KEY=VALUE"),
    (["--backend-option", "=plain"], None, "ember: error: --backend-option '=plain': expected KEY=VALUE"),
    ([], "{linear: plain}", "ember: error: environment variable EMBER_BACKEND_OPTIONS='{linear: plain}' is invalid: "
                            "not valid JSON"),
    ([], '["linear"]', "ember: error: environment variable EMBER_BACKEND_OPTIONS='[\"linear\"]' is invalid: "
                       "expected a JSON object"),
    (["--backend-option", "colour=red"], None, "ember: error: the cpu backend has no option 'colour'; its options: "),
])
def test_malformed_options_are_one_error_line(tiny_llama_dir, monkeypatch, capsys, argv, env, message):
    if env is not None:
        monkeypatch.setenv("EMBER_BACKEND_OPTIONS", env)
    status = main(["--log-level", "warning", "generate", "--model-id", str(tiny_llama_dir), *argv, "hi"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(message), err
    assert "Traceback" not in err


def test_serve_settings_carry_the_options(monkeypatch):
    from ember.api.cli import build_parser
    from ember.api.cli_env import apply_defaults
    from ember.api.settings import ServerSettings, engine_config_kwargs

    args = build_parser().parse_args(["serve", "--backend-option", "linear=plain"])
    apply_defaults(args, {"EMBER_BACKEND_OPTIONS": '{"linear": "onednn", "native": false}'})
    assert args.backend_option == {"linear": "plain", "native": "false"}  # the flag wins over the variable
    config = EngineConfig(**engine_config_kwargs(ServerSettings(backend_options=args.backend_option)))
    assert dict(config.backend_options) == {"linear": "plain", "native": "false"}


def test_a_retired_variable_is_named_with_its_option(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_CPU_LINEAR", "plain")
    monkeypatch.setenv("EMBER_BACKEND_OPTIONS", '{"colour": "red"}')  # fail fast, after the warning
    main(["--log-level", "warning", "generate", "--model-id", str(tiny_llama_dir), "hi"])
    err = capsys.readouterr().err
    assert "ember: warning: EMBER_CPU_LINEAR is no longer read; set the cpu backend's option instead: " \
           "--backend-option linear=VALUE" in err


def test_backends_options_lists_every_field_with_its_doc(capsys):
    assert main(["backends", "options", "cpu"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(CPUOptions):
        assert f"  {f.name}  (" in out
        assert f.metadata["doc"].split()[0] in out
    assert "quant_isa  (auto|amx|avx512vnni|avx2|ref; default auto)" in out
    assert "small_batch_rows  (int or auto; default auto)" in out
    assert main(["backends", "options", "cuda", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [o["name"] for o in listed] == ["attention", "gpu_memory_utilization", "device_index"]
    assert listed[1]["default"] == 0.9 and listed[1]["doc"]
    assert main(["backends", "options", "tpu"]) == 2
    assert "no backend named 'tpu'" in capsys.readouterr().err


def test_nothing_is_read_from_the_environment_at_import():
    """The retired variables, set to garbage, change nothing when the hardware modules
    are imported and a CPU backend is built: the defaults hold."""
    script = (
        "import ember.hardware.cpu as cpu, ember.hardware.cpu_quant, ember.hardware.cpu_gguf, "
        "ember.hardware.torch_device as td, ember.hardware.cuda\n"
        "from ember.hardware.cpu_options import CPUOptions\n"
        "b = cpu.CPUBackend()\n"
        "assert b.options == CPUOptions(), b.options\n"
        "a = b.create_attention()\n"
        "assert a.decode_group_bytes == 4 << 20 and not a.row_invariant\n"
        "assert ember.hardware.cuda.CUDABackend().options == td.TorchDeviceOptions()\n"
        "print('ok')\n"
    )
    garbage = {name: "garbage" for name in (
        "EMBER_CPU_DECODE_GROUP_BYTES", "EMBER_CPU_SMALL_BATCH_ROWS", "EMBER_CPU_LINEAR", "EMBER_CPU_PATH",
        "EMBER_BATCH_INVARIANT", "EMBER_QUANT_ISA", "EMBER_GGUF_X8", "EMBER_GGUF_PREFILL", "EMBER_ATTENTION",
        "EMBER_GPU_MEMORY_UTILIZATION", "EMBER_DEVICE_INDEX", "EMBER_CPU_NATIVE")}
    import os

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **garbage})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
