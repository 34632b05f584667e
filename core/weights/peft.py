"""PEFT LoRA adapters as saved by ``peft`` (``adapter_config.json`` +
``adapter_model.safetensors``): read, checked, and reduced to what a LoRA product needs.

An adapter is, per target module (``model.layers.3.self_attn.q_proj``), the pair
``A`` (rank, in) and ``B`` (out, rank) and a scale: ``y = W x + scale * B (A x)``, with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), ``r`` and ``lora_alpha``
per module where ``rank_pattern`` / ``alpha_pattern`` say so, as peft computes them.

What peft can save but Ember does not run is refused by name, never ignored: DoRA,
trained biases, ``modules_to_save``, ``fan_in_fan_out`` weights, embedding or other
non-linear targets. Every error is `AdapterError` (a ValueError) naming the adapter,
the file or tensor, and what is wrong.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.plugin.adapter import CONFIG_FILE, AdapterError, AdapterUpdate, AdapterWeights, read_adapter_config

__all__ = ["AdapterError", "LoRAModule", "read_lora_adapter"]

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRAModule(AdapterUpdate):
    """One target module's low-rank update: ``A`` (rank, in), ``B`` (out, rank), ``scale``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def in_features(self) -> int:
        return self.a.shape[1]

    @property
    def out_features(self) -> int:
        return self.b.shape[0]

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a, self.b * self.scale


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the first key that is the module's name or a
    suffix of it after a dot (peft matches ``re.match(rf".*\\.{key}$", name)``)."""
    for key, value in (patterns or {}).items():
        if module == key or re.match(rf".*\.{key}$", module):
            return value
    return default


def read_lora_adapter(name: str, path: str | Path, *, max_rank: int | None = None,
                      config: dict | None = None) -> AdapterWeights:
    """The PEFT LoRA adapter at ``path`` (a directory; ``config`` its parsed
    ``adapter_config.json`` where the caller read it), as `AdapterWeights` of
    `LoRAModule` updates keyed by module name; `AdapterError`
    for a missing or damaged file, a setting Ember does not run, a tensor without its pair
    or of the wrong shape, or a rank above ``max_rank``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path).expanduser()

    def fail(problem: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({str(directory)!r}): {problem}")

    if config is None:
        if not directory.is_dir():
            raise fail("no such directory")
        config = read_adapter_config(name, directory)
    kind = config.get("peft_type") or "LORA"
    if str(kind).upper() != "LORA":
        raise fail(f"peft_type {kind!r} is not supported (only LORA)")
    for key, refused in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if config.get(key):
            raise fail(f"{refused} ({key}: true) is not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"bias {config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save {config['modules_to_save']} (fully trained modules) is not supported")
    try:
        r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise fail(f"{CONFIG_FILE} needs an integer r and a number lora_alpha ({exc})") from exc
    rslora = bool(config.get("use_rslora", False))
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except FileNotFoundError as exc:
        raise fail(f"no {WEIGHTS_FILE} (adapters saved as .bin pickles are not read)") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise fail(f"{WEIGHTS_FILE} is damaged ({exc})") from exc

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise fail(f"tensor {key!r} is not a LoRA A/B weight (embedding or other adapters are not supported)")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor
    adapter = AdapterWeights(name, "lora", str(directory), base_model=config.get("base_model_name_or_path"))
    for module, parts in sorted(pairs.items()):
        if set(parts) != {"A", "B"}:
            raise fail(f"module {module!r} has lora_{''.join(parts)} without its pair")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise fail(f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not chain "
                       "(A is (rank, in), B (out, rank))")
        rank = int(_pattern_value(config.get("rank_pattern"), module, r))
        if a.shape[0] != rank:
            raise fail(f"module {module!r}: lora_A has rank {a.shape[0]}, the config says {rank}")
        if max_rank is not None and rank > max_rank:
            raise fail(f"module {module!r} has rank {rank}, above max_lora_rank {max_rank}")
        module_alpha = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        adapter.updates[module] = LoRAModule(a.float().contiguous(), b.float().contiguous(), scale)
    if not adapter.updates:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return adapter
