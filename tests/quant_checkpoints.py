"""Helpers for the quantization tests: tiny quantized checkpoints written in a format's
layout beside a float twin holding the format's own dequantization, and Ember's
logits of either (one prompt through ``load_model``, no engine)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.models.loader import load_hf_config, load_model
from ember.plugin.backend import AttentionBatch, SequenceSlice, select_backend
from ember.plugin.manager import create_plugin_manager
from ember.plugin.quantizer import select_quantizer
from ember.testing.tiny_models import make_tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = list(range(3, 60))


def tiny_float_model(out_dir: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    if not (out_dir / "config.json").exists():
        make_tiny_model(kind, out_dir, seed=seed, **overrides)
    return out_dir


def write_quantized(float_dir: Path, out_dir: Path, ref_dir: Path, quantization_config: dict,
                    quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
    """``quantize(prefix, weight) -> (tensors by suffix, dequantized weight)`` for every
    decoder linear: ``out_dir`` gets the tensors and ``quantization_config``, ``ref_dir``
    the float model with the dequantized weights."""
    state = load_file(str(float_dir / "model.safetensors"))
    packed, reference = {}, {}
    for name, tensor in state.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight" and prefix.rpartition(".")[2] in LINEARS:
            tensors, deq = quantize(prefix, tensor.float())
            packed.update({f"{prefix}.{s}": t.contiguous() for s, t in tensors.items()})
            reference[name] = deq.float().contiguous()
        else:
            packed[name] = tensor
            reference[name] = tensor
    for directory, tensors, qconfig in ((out_dir, packed, quantization_config), (ref_dir, reference, None)):
        directory.mkdir(parents=True, exist_ok=True)
        for f in float_dir.iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, directory / f.name)
        save_file(tensors, str(directory / "model.safetensors"))
        config = json.loads((directory / "config.json").read_text())
        config.pop("quantization_config", None)
        if qconfig is not None:
            config["quantization_config"] = qconfig
        (directory / "config.json").write_text(json.dumps(config))


_PM = None


def registries():
    global _PM
    if _PM is None:
        _PM = create_plugin_manager()
    return _PM.registries


def load(model_dir: Path, quantize: str | None = None, dtype=torch.float32, dequantize: bool = False):
    reg = registries()
    backend = select_backend(reg.backends, "cpu")
    hf_config = load_hf_config(model_dir)
    quantizer = select_quantizer(reg.quantizers, getattr(hf_config, "quantization_config", None), quantize)
    attention = backend.create_attention()
    model = load_model(model_dir, hf_config, backend, attention, dtype, reg.model_architectures, quantizer, dequantize)
    return model, attention, backend


def logits(model_dir: Path, quantize: str | None = None, dtype=torch.float32, dequantize: bool = False,
           prompt: list[int] = PROMPT) -> torch.Tensor:
    """Float32 logits ``(len(prompt), vocab)`` of one prompt."""
    model, attention, backend = load(model_dir, quantize, dtype, dequantize)
    return forward(model, attention, backend, dtype, prompt)


def forward(model, attention, backend, dtype, prompt=PROMPT) -> torch.Tensor:
    ids = torch.tensor(prompt)
    spec, block = model.kv_cache_spec, 16
    blocks = -(-len(prompt) // block)
    kv_dtype = backend.kv_cache_dtype(dtype)
    caches = [torch.zeros(2, blocks, block, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype)
              for _ in range(spec.num_layers)]
    metadata = attention.prepare(AttentionBatch.from_slices(
        [SequenceSlice(len(prompt), 0, list(range(blocks)))], block, torch.device("cpu")))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(prompt)), caches, metadata))


def assert_close_logits(got: torch.Tensor, want: torch.Tensor, rtol: float, min_argmax: float = 0.95) -> None:
    """``max|got - want| <= rtol * max|want|`` and the argmax agreeing at ``min_argmax`` of positions."""
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert err <= rtol * scale, f"logits differ by {err:.4g}, over {rtol} x {scale:.4g}"
    assert agree >= min_argmax, f"argmax agrees at {agree:.1%} of positions, under {min_argmax:.0%}"
