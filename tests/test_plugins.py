"""The plugin system: the example third-party plugin end to end, and the plugin manager's
loading rules (direct plugins, duplicates, broken, required and disabled entry points)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import uuid
from importlib import metadata
from pathlib import Path

import pytest

import ember
from ember import SamplingParams
from ember.api.cli import main
from ember.models.llama import LlamaForCausalLM
from ember.plugin import PluginLoadError, create_plugin_manager, hookimpl
from ember.plugin import manager as manager_module

EXAMPLE = "ember-legacy-llama"
INSTALL_HINT = f"the example plugin is not installed: pip install ./examples/{EXAMPLE}"


# --- the example plugin, installed as its own distribution -----------------------------------


@pytest.fixture(scope="module")
def example_version() -> str:
    try:
        return metadata.version(EXAMPLE)
    except metadata.PackageNotFoundError:
        pytest.fail(INSTALL_HINT)


@pytest.fixture(scope="module")
def legacy_llama_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama, its config.json naming the architecture as early conversions did."""
    out = tmp_path_factory.mktemp("legacy") / "model"
    shutil.copytree(tiny_llama_dir, out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["LLaMAForCausalLM"]
    config_path.write_text(json.dumps(config, indent=2))
    return out


def test_example_plugin_is_discovered(example_version):
    pm = create_plugin_manager()
    info = next((i for i in pm.plugin_infos if i.name == "legacy_llama"), None)
    assert info is not None, INSTALL_HINT
    assert (info.distribution, info.version, info.status) == (EXAMPLE, example_version, "loaded")
    assert info.value == "ember_legacy_llama.plugin"
    registry = pm.registries.model_architectures
    assert registry.get("LLaMAForCausalLM") is LlamaForCausalLM
    assert registry.owner("LLaMAForCausalLM") == "legacy_llama"
    assert registry.owner("LlamaForCausalLM") == "llama"


def test_example_plugin_in_ember_plugins(example_version, capsys):
    assert main(["plugins"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["legacy_llama", EXAMPLE, example_version, "loaded", "ember_legacy_llama.plugin"] in lines
    assert ["model_architectures", "LLaMAForCausalLM", "legacy_llama", "ember.models.llama.LlamaForCausalLM"] in lines
    assert main(["plugins", "--disable-plugin", "legacy_llama"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["legacy_llama", EXAMPLE, example_version, "blocked", "ember_legacy_llama.plugin"] in lines
    assert not any("LLaMAForCausalLM" in line for line in lines)


def test_legacy_checkpoint_generates_through_the_plugin(example_version, legacy_llama_dir, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6)
    legacy = ember.LLM(str(legacy_llama_dir), num_kv_blocks=64, required_plugins=("legacy_llama",))
    assert isinstance(legacy.engine.model, LlamaForCausalLM)
    got = legacy.generate("hello world", params)[0].outputs[0]
    modern = ember.LLM(str(tiny_llama_dir), num_kv_blocks=64).generate("hello world", params)[0].outputs[0]
    assert len(got.token_ids) == 6
    assert got.token_ids == modern.token_ids  # same weights, same class: same tokens


def test_legacy_checkpoint_without_the_plugin_lists_supported(example_version, legacy_llama_dir):
    with pytest.raises(ValueError) as excinfo:
        ember.LLM(str(legacy_llama_dir), num_kv_blocks=64, disabled_plugins=("legacy_llama",))
    message = str(excinfo.value)
    assert "['LLaMAForCausalLM'] is not supported" in message
    from ember.models import gemma, idefics3, llama, moe

    vision = ("Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration", *idefics3.ARCHITECTURES)
    built_in = sorted(llama.ARCHITECTURES + llama.BASE_ARCHITECTURES + moe.ARCHITECTURES + gemma.ARCHITECTURES + vision)
    assert f"supported architectures: {', '.join(built_in)} (install a plugin" in message


# --- the plugin manager ----------------------------------------------------------------------


class ArchitecturePlugin:
    """A plugin object registering one architecture name."""

    def __init__(self, name: str, cls: type = LlamaForCausalLM) -> None:
        self.name, self.cls = name, cls

    @hookimpl
    def ember_register_model_architectures(self, registry) -> None:
        registry.register(self.name, self.cls)


class FakeEntryPoints:
    """Modules written to tmp_path, announced as `ember` entry points instead of the installed ones."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp_path / "plugins"
        self.dir.mkdir()
        self.entry_points: list[metadata.EntryPoint] = []
        self.monkeypatch = monkeypatch
        monkeypatch.syspath_prepend(str(self.dir))
        monkeypatch.setattr(manager_module, "_entry_points", lambda: list(self.entry_points))

    def add(self, name: str, source: str) -> str:
        """Write `source` as a fresh module; announce it under entry point `name`; return the module name."""
        module = f"fake_ember_plugin_{name}_{uuid.uuid4().hex[:8]}"
        (self.dir / f"{module}.py").write_text(source)
        self.monkeypatch.delitem(sys.modules, module, raising=False)  # removed again on teardown
        self.entry_points.append(metadata.EntryPoint(name, module, group="ember"))
        return module


REGISTERS_OLDLLAMA = """
from ember.models.llama import LlamaForCausalLM
from ember.plugin import hookimpl

@hookimpl
def ember_register_model_architectures(registry):
    registry.register("OldLlama", LlamaForCausalLM)
"""

RAISES_ON_IMPORT = "raise ImportError('needs libfoo.so')\n"


@pytest.fixture
def fake_eps(tmp_path, monkeypatch) -> FakeEntryPoints:
    return FakeEntryPoints(tmp_path, monkeypatch)


def test_direct_plugin_fills_registry_with_owner():
    pm = create_plugin_manager(extra_plugins=[("my_arch", ArchitecturePlugin("MyArch"))])
    registry = pm.registries.model_architectures
    assert registry.get("MyArch") is LlamaForCausalLM
    assert registry.owner("MyArch") == "my_arch"
    assert registry.owner("LlamaForCausalLM") == "llama"  # the installed built-ins are still there
    info = pm.plugin_infos[-1]
    assert (info.name, info.value, info.status) == ("my_arch", "<direct>", "loaded")


def test_duplicate_name_from_two_plugins_names_both():
    class Other:
        pass

    plugins = [("first_plugin", ArchitecturePlugin("Dup")), ("second_plugin", ArchitecturePlugin("Dup", Other))]
    with pytest.raises(ValueError, match="'Dup' is registered twice: by 'first_plugin' and by 'second_plugin'"):
        create_plugin_manager(extra_plugins=plugins)


def test_duplicate_from_entry_points_is_skipped_or_fatal_when_required(fake_eps, caplog):
    fake_eps.add("aaa_first", REGISTERS_OLDLLAMA)
    fake_eps.add("zzz_second", REGISTERS_OLDLLAMA.replace("LlamaForCausalLM)", "object)"))
    with caplog.at_level(logging.WARNING, logger="ember.plugin"):
        pm = create_plugin_manager()
    assert pm.registries.model_architectures.owner("OldLlama") == "aaa_first"
    assert "by 'aaa_first' and by 'zzz_second'" in caplog.text
    with pytest.raises(PluginLoadError, match="zzz_second.*by 'aaa_first' and by 'zzz_second'"):
        create_plugin_manager(required=["zzz_second"])


def test_entry_point_plugin_is_loaded_with_its_registrations(fake_eps):
    module = fake_eps.add("old_llama", REGISTERS_OLDLLAMA)
    pm = create_plugin_manager()
    assert [(i.name, i.value, i.status) for i in pm.plugin_infos] == [("old_llama", module, "loaded")]
    assert pm.registries.model_architectures.owner("OldLlama") == "old_llama"
    assert pm.registries.model_architectures.names() == ["OldLlama"]  # installed plugins replaced by the fakes


def test_broken_discovered_plugin_is_logged_and_skipped(fake_eps, caplog):
    fake_eps.add("broken", RAISES_ON_IMPORT)
    fake_eps.add("works", REGISTERS_OLDLLAMA)
    with caplog.at_level(logging.WARNING, logger="ember.plugin"):
        pm = create_plugin_manager()
    statuses = {i.name: i.status for i in pm.plugin_infos}
    assert statuses["works"] == "loaded"
    assert statuses["broken"].startswith("failed: ") and "needs libfoo.so" in statuses["broken"]
    assert "plugin 'broken'" in caplog.text and "needs libfoo.so" in caplog.text and "skipping it" in caplog.text
    assert "OldLlama" in pm.registries.model_architectures
    assert not pm.has_plugin("broken")


def test_broken_required_plugin_raises_naming_it(fake_eps):
    fake_eps.add("broken", RAISES_ON_IMPORT)
    with pytest.raises(PluginLoadError, match="plugin 'broken' .* failed to load: ImportError\\('needs libfoo.so'\\)"):
        create_plugin_manager(required=["broken"])


def test_plugin_failing_half_way_leaves_nothing_registered(fake_eps):
    fake_eps.add("half", REGISTERS_OLDLLAMA + "\n    raise RuntimeError('second name failed')\n")
    pm = create_plugin_manager()
    assert "OldLlama" not in pm.registries.model_architectures
    assert pm.plugin_infos[0].status.startswith("failed: RuntimeError")


def test_disabled_plugin_is_blocked_and_never_imported(fake_eps, tmp_path):
    marker = tmp_path / "imported"
    module = fake_eps.add("unwanted", f"open({str(marker)!r}, 'w').close()\n" + REGISTERS_OLDLLAMA)
    pm = create_plugin_manager(disabled=["unwanted"])
    assert not marker.exists() and module not in sys.modules
    assert pm.is_blocked("unwanted")
    assert [(i.name, i.status) for i in pm.plugin_infos] == [("unwanted", "blocked")]
    assert "OldLlama" not in pm.registries.model_architectures
    # the same module loads when not disabled (the marker proves the fixture works)
    create_plugin_manager()
    assert marker.exists()


def test_required_and_disabled_conflict(fake_eps):
    fake_eps.add("both", REGISTERS_OLDLLAMA)
    with pytest.raises(PluginLoadError, match="\\['both'\\] are both required and disabled"):
        create_plugin_manager(disabled=["both"], required=["both"])


def test_required_plugin_not_installed(fake_eps):
    fake_eps.add("present", REGISTERS_OLDLLAMA)
    with pytest.raises(PluginLoadError, match="required plugin\\(s\\) \\['absent'\\] not found; discovered: present"):
        create_plugin_manager(required=["absent"])


# --- the versioned plugin API (docs/plugins.md) ---

def test_api_version_is_semantic_and_the_example_plugin_declares_a_range_that_admits_it(example_version):
    from packaging.version import Version

    import ember_legacy_llama.plugin as example
    from ember.plugin import API_VERSION
    from ember.plugin.api_version import api_range_problem

    assert Version(API_VERSION).release[0] >= 1 and len(Version(API_VERSION).release) == 3
    assert example.EMBER_PLUGIN_API and api_range_problem(example, "legacy_llama") is None


@pytest.mark.parametrize("declared, admitted", [
    (">=1.0,<2", True), ("~=1.0", True), (None, True), (">=2", False), ("<1", False), ("==0.9.*", False),
])
def test_a_declared_range_admits_this_api_or_names_plugin_range_and_version(declared, admitted):
    from ember.plugin import API_VERSION
    from ember.plugin.api_version import api_range_problem

    plugin = type("Plugin", (), {} if declared is None else {"EMBER_PLUGIN_API": declared})
    problem = api_range_problem(plugin, "acme_npu")
    if admitted:
        assert problem is None
    else:
        assert "'acme_npu'" in problem and declared in problem and API_VERSION in problem


def test_a_range_that_is_no_range_is_refused():
    from ember.plugin.api_version import api_range_problem

    problem = api_range_problem(type("Plugin", (), {"EMBER_PLUGIN_API": "one point oh"}), "acme_npu")
    assert "'one point oh'" in problem and "not a version range" in problem


OUT_OF_RANGE = REGISTERS_OLDLLAMA + '\nEMBER_PLUGIN_API = ">=2.0,<3"\n'


def test_discovered_plugin_outside_the_api_range_is_logged_and_skipped(fake_eps, caplog):
    fake_eps.add("future", OUT_OF_RANGE)
    fake_eps.add("works", REGISTERS_OLDLLAMA.replace('"OldLlama"', '"OtherLlama"') + '\nEMBER_PLUGIN_API = ">=1.0,<2"\n')
    with caplog.at_level(logging.WARNING, logger="ember.plugin"):
        pm = create_plugin_manager()
    statuses = {i.name: i.status for i in pm.plugin_infos}
    assert statuses["works"] == "loaded" and statuses["future"].startswith("skipped: ")
    assert "plugin 'future' supports Ember plugin API >=2.0,<3" in caplog.text and "skipping it" in caplog.text
    assert not pm.has_plugin("future") and "OldLlama" not in pm.registries.model_architectures
    assert "OtherLlama" in pm.registries.model_architectures


def test_required_plugin_outside_the_api_range_is_refused_naming_it(fake_eps):
    from ember.plugin import API_VERSION

    fake_eps.add("future", OUT_OF_RANGE)
    with pytest.raises(PluginLoadError, match=f"plugin 'future' supports Ember plugin API >=2.0,<3, .* {API_VERSION}"):
        create_plugin_manager(required=["future"])
    plugin = type("Plugin", (), {"EMBER_PLUGIN_API": "<1"})()
    with pytest.raises(PluginLoadError, match="plugin 'direct' supports Ember plugin API <1"):
        create_plugin_manager(extra_plugins=[("direct", plugin)])


def test_old_module_names_are_aliases_of_the_new_modules():
    """Plugins written against Ember 0.1's flat core (ember.backend, ember.logits_processor, ...)
    get the very modules that moved, with a DeprecationWarning naming the new place."""
    import importlib

    from ember._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
    from ember.backend import BaseBackend  # the backend template's import
    from ember.plugin.backend import BaseBackend as Contract

    assert BaseBackend is Contract
