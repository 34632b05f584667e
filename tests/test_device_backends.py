"""The accelerator backends (cuda, rocm, xpu, gaudi) as plugins on a machine without
their devices: registered through the `ember` entry points like `cpu`, each saying
why it is unavailable, never chosen, refused by name with the reason; and the parts
of their shared base (ember.hardware.torch_device) that need no device: dtype
resolution, the KV budget arithmetic and the attention they run (the Triton kernels,
tested under the interpreter in test_triton_attention.py). Nothing here stands in
for a device: what needs one is run by benchmarks/device_check.py on a lent GPU."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it: no GPU here

import pytest
import torch

from ember.hardware.torch_device import TorchDeviceBackend, kv_budget_bytes
from ember.plugin import create_plugin_manager
from ember.plugin.backend import select_backend

DEVICE_BACKENDS = ("cuda", "rocm", "xpu", "gaudi")


@pytest.fixture(scope="module")
def backends():
    return create_plugin_manager().registries.backends


@pytest.mark.parametrize("name", DEVICE_BACKENDS)
def test_each_device_backend_is_a_registered_plugin_that_says_why_it_is_unavailable(backends, name):
    cls = backends.get(name)
    assert issubclass(cls, TorchDeviceBackend) and cls.name == name
    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        pytest.skip("this machine has a GPU: the unavailable case is not what it shows")
    reason = cls.unavailable_reason()
    assert not cls.is_available() and isinstance(reason, str) and reason
    with pytest.raises(ValueError, match=f"backend '{name}' is not available on this machine: .*"):
        select_backend(backends, name)


def test_the_reasons_name_what_is_missing_on_a_cpu_torch(backends):
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("this torch is a GPU build")
    assert backends.get("cuda").unavailable_reason() == f"this torch ({torch.__version__}) is not built with CUDA"
    assert backends.get("rocm").unavailable_reason() == f"this torch ({torch.__version__}) is not a ROCm (HIP) build"
    assert "Intel Gaudi's PyTorch bridge (habana_frameworks.torch) is not installed" in (
        backends.get("gaudi").unavailable_reason()
    )
    assert select_backend(backends, None).name == "cpu"  # the only one available here


def test_ember_plugins_lists_the_backends_with_their_status(capsys):
    from ember.api.cli import main

    assert main(["plugins", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    status = {b["name"]: b for b in payload["registries"]["backends"]}
    assert set(DEVICE_BACKENDS) | {"cpu"} <= set(status)
    assert status["cpu"]["available"] is True and status["cpu"]["unavailable_reason"] is None
    for name in DEVICE_BACKENDS:
        assert status[name]["available"] == (status[name]["unavailable_reason"] is None)
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "backends on this machine:" in text
    for name in DEVICE_BACKENDS:
        reason = status[name]["unavailable_reason"]
        assert (f"unavailable: {reason}" if reason else "available") in text


@pytest.mark.parametrize(
    "requested,model_dtype,want",
    [
        ("auto", torch.float16, torch.float16),
        ("auto", torch.bfloat16, torch.bfloat16),
        ("auto", torch.float32, torch.bfloat16),  # a float32 checkpoint runs in bf16 on a GPU
        ("auto", None, torch.bfloat16),
        ("float32", torch.bfloat16, torch.float32),
        ("half", None, torch.float16),
    ],
)
def test_device_backends_resolve_dtypes_as_gpu_servers_do(backends, requested, model_dtype, want):
    backend = backends.get("cuda")()  # construction touches no device (the backend contract)
    assert backend.resolve_dtype(requested, model_dtype) == want
    with pytest.raises(ValueError, match="dtype 'int4' is not supported by the cuda backend"):
        backend.resolve_dtype("int4", None)


def test_kv_budget_is_the_utilization_share_minus_what_is_in_use_and_the_activations():
    gib = 1 << 30
    # 80 GiB device, 70 free after the weights (10 in use), 90% usable, 2 GiB activation peak
    assert kv_budget_bytes(70 * gib, 80 * gib, 0.9, 2 * gib) == int(72 * gib) - 10 * gib - 2 * gib
    assert kv_budget_bytes(1 * gib, 80 * gib, 0.9, 0) == 0  # another process holds the device


def test_gpu_backends_run_the_triton_attention_and_gaudi_pytorchs(backends):
    from ember.hardware.cpu import CPUAttention
    from ember.hardware.triton_attention import TritonAttention

    for name in ("cuda", "rocm", "xpu"):
        assert isinstance(backends.get(name)().create_attention(), TritonAttention)
    attention = backends.get("gaudi")().create_attention()
    assert isinstance(attention, CPUAttention) and attention.kernels is None


def test_ember_backends_check(capsys):
    """`ember backends check`: the CPU backend passes, cuda's Triton kernels pass under
    the interpreter (contract, attention in float32/bf16/fp16 against float64, a tiny
    Llama's greedy tokens equal to the CPU backend's); cuda itself is refused with
    the reason here, as are unknown names and --interpret without Triton."""
    from ember.api.cli import main

    assert main(["backends", "check", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cpu: contract and attention conformance passed" in out and "equal the CPU backend's" in out
    assert main(["backends", "check", "cuda", "--interpret"]) == 0
    assert "cuda (Triton interpreter, CPU tensors): greedy tokens on a tiny Llama equal" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["backends", "check", "cuda"]) == 1
        assert "backend 'cuda' is not available on this machine" in capsys.readouterr().err
    assert main(["backends", "check", "nope"]) == 2
    assert "no backend named 'nope'; registered: cpu, cuda" in capsys.readouterr().err
    # Gaudi's PyTorch-ops attention and its fixed-shape graph form, on CPU tensors
    assert main(["backends", "check", "gaudi", "--interpret"]) == 0
    assert "gaudi (CPU tensors): greedy tokens on a tiny Llama equal the CPU backend's" in capsys.readouterr().out
    assert main(["backends", "check", "cpu", "--interpret"]) == 2
    assert "'cpu' is not one" in capsys.readouterr().err


def test_the_end_to_end_check_catches_an_attention_that_forgets_the_context(tmp_path):
    from ember.hardware.cpu import CPUAttention, CPUBackend
    from ember.testing import check_end_to_end

    class SelfOnly(CPUAttention):
        def forward(self, q, k, v, kv_cache, metadata, scale):
            super().forward(q, k, v, kv_cache, metadata, scale)  # the cache writes stay right
            return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # each token sees only itself

    class Forgetful(CPUBackend):
        name = "forgetful"

        def create_attention(self):
            return SelfOnly(None)

    with pytest.raises(AssertionError, match="forgetful: greedy tokens on a tiny Llama differ from the CPU backend's"):
        check_end_to_end(Forgetful, tmp_path)


def test_the_backend_template_installs_with_pip_and_passes_the_check(tmp_path):
    """examples/ember-backend-template, installed by pip (its entry point found by
    Ember's plugin manager), passes `ember backends check template`."""
    import subprocess
    import sys
    from pathlib import Path

    template = Path(__file__).resolve().parents[1] / "examples" / "ember-backend-template"
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(template)],
        check=True, capture_output=True, timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    ember = Path(sys.executable).with_name("ember")
    result = subprocess.run([str(ember), "backends", "check", "template"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "template: contract and attention conformance passed" in result.stdout
    assert "template: greedy tokens on a tiny Llama equal the CPU backend's" in result.stdout


def test_the_device_check_script_runs_its_steps_on_the_cpu_in_a_dry_run(tmp_path):
    """benchmarks/device_check.py, prepared for a lent GPU, runs every step here at tiny
    sizes on the CPU backend (the script's own code, not a device's numbers)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"
    out = tmp_path / "device_check.json"
    result = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(out)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    steps = json.loads(out.read_text())["steps"]
    assert steps["conformance"]["passed"] is True
    assert steps["greedy_vs_transformers"]["first_token_equal"] == steps["greedy_vs_transformers"]["of"]
    assert set(steps["offline"]) >= {"8", "16"} and steps["decode_batch1"]["ember_tokens_per_s"] > 0
