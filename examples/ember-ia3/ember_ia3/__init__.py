"""PEFT's IA3 adapters served by Ember: an adapter kind from outside Ember (docs/lora.md).

(IA)^3 (Liu et al. 2022, "Few-Shot Parameter-Efficient Fine-Tuning is Better and Cheaper
than In-Context Learning") learns one vector ``l`` per target module and rescales, as
peft 0.21's ``peft.tuners.ia3.layer.Linear.forward`` does:

* a module in ``feedforward_modules``: its input, ``y = W (x * l) + b`` (``l`` saved as
  ``(1, in)``);
* any other module: its output, bias included, ``y = (W x + b) * l`` (``l`` saved as
  ``(out, 1)``).

There is no other scale (no alpha, no rank). peft saves ``l`` in
``adapter_model.safetensors`` as ``base_model.model.<module>.ia3_l``; a module is
feed-forward when its name ends with one of ``feedforward_modules`` (a list; plain
``str.endswith``, as peft tests it) or fully matches it (a string: a regular
expression). Refused by name: ``fan_in_fan_out`` (GPT-2's Conv1D weights),
``modules_to_save``, a config without ``feedforward_modules`` (peft would fill in its
per-architecture default, which the adapter alone does not say), tensors that are not
IA3 vectors, a vector whose shape disagrees with ``feedforward_modules``.

An update is not low rank (`IA3Update.low_rank` is None): Ember calls `IA3Update.apply`
with the module's input rows, its output rows and the ``Linear``. Output scaling needs
only ``y``. Input scaling needs the module's product of ``x * l``: the module's own
``forward`` with its adapter slots set aside for the call (so quantized, packed and
backend products all work as for the base model), of which ``apply``'s ``columns`` (the
part of a fused module Ember's ``gate_up_proj`` or ``qkv_proj`` this update belongs to)
are kept. That costs one extra product of the whole (fused) module per run of the
adapter's tokens.

An IA3 file holds only the width its vector scales: the other width of an update is
None (not fixed), and ``read_adapter`` checks the one it has against the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ember.plugin import hookimpl
from ember.plugin.adapter import AdapterError, AdapterUpdate, AdapterWeights, BaseAdapterKind

# the Ember plugin API versions this plugin was written for (docs/plugins.md)
EMBER_PLUGIN_API = ">=1.2,<2"

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.ia3_l(?:\.[^.]+)?$")


def is_feedforward(feedforward_modules: str | list[str], module: str) -> bool:
    """peft's ``IA3Model._check_target_module_feedforward`` for the module named ``module``."""
    if isinstance(feedforward_modules, str):
        return re.fullmatch(feedforward_modules, module) is not None
    return any(module.endswith(key) for key in feedforward_modules)


def _base_product(module: Any, x: torch.Tensor) -> torch.Tensor:
    """``module``'s own product of ``x`` (an Ember ``Linear``) without its adapters."""
    state = vars(module)
    had = "adapters" in state
    saved = state.pop("adapters", None)
    try:
        return module.forward(x)
    finally:
        if had:
            state["adapters"] = saved


class IA3Update(AdapterUpdate):
    """One module's IA3 vector ``l``: scales the module's input (``feedforward``) or output."""

    def __init__(self, module: str, vector: torch.Tensor, feedforward: bool) -> None:
        self.module = module
        self.vector = vector  # (n,) float32, on the CPU; a copy per device in _on
        self.feedforward = feedforward
        self._on: dict[torch.device, torch.Tensor] = {}

    @property
    def in_features(self) -> int | None:  # the width it scales; the other is not in the file
        return self.vector.numel() if self.feedforward else None

    @property
    def out_features(self) -> int | None:
        return None if self.feedforward else self.vector.numel()

    def _vector(self, like: torch.Tensor) -> torch.Tensor:
        if like.device not in self._on:
            self._on[like.device] = self.vector.to(like.device)
        return self._on[like.device]

    def apply(self, x: torch.Tensor, y: torch.Tensor, module: Any,
              columns: tuple[int, int] | None = None) -> torch.Tensor:
        n = self.vector.numel()
        scale = self._vector(x)
        if not self.feedforward:  # peft: (result * ia3_scaling).to(result.dtype)
            if y.shape[-1] != n:
                raise AdapterError(f"IA3 {self.module!r}: a vector of {n} for an output of {y.shape[-1]} features")
            return (y * scale).to(y.dtype)
        if x.shape[-1] != n:
            raise AdapterError(f"IA3 {self.module!r}: a vector of {n} for an input of {x.shape[-1]} features")
        start, size = columns if columns is not None else (0, y.shape[-1])
        if size != y.shape[-1]:
            raise AdapterError(f"IA3 {self.module!r}: its part has {size} outputs, the rows have {y.shape[-1]}")
        scaled = (x.to(scale.dtype) * scale).to(x.dtype)  # as peft, then the base layer on it
        return _base_product(module, scaled)[..., start : start + size].to(y.dtype)


class IA3Kind(BaseAdapterKind):
    """PEFT's ``IA3`` adapters (module docstring)."""

    name = "ia3"
    peft_types = ("IA3",)

    def read(self, name: str, path: Path, config: dict, *, max_rank: int | None = None) -> AdapterWeights:
        """``max_rank`` does not apply: IA3 has no rank (its updates report 0)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(path).expanduser()

        def fail(problem: str) -> AdapterError:
            return AdapterError(f"IA3 adapter {name!r} ({str(directory)!r}): {problem}")

        kind = str(config.get("peft_type") or "").upper()
        if kind != "IA3":
            raise fail(f"peft_type {config.get('peft_type')!r} is not IA3")
        if config.get("fan_in_fan_out"):
            raise fail("fan_in_fan_out weights (fan_in_fan_out: true, GPT-2's Conv1D layers) are not supported")
        if config.get("modules_to_save"):
            raise fail(f"modules_to_save {config['modules_to_save']} (fully trained modules) is not supported")
        feedforward = config.get("feedforward_modules")
        if feedforward is None:
            raise fail("adapter_config.json has no feedforward_modules (peft would take its per-architecture "
                       "default); write them into it")
        if not isinstance(feedforward, str):
            if not isinstance(feedforward, list) or not all(isinstance(k, str) for k in feedforward):
                raise fail(f"feedforward_modules must be a list of names or a regular expression, "
                           f"got {feedforward!r}")
        try:
            tensors = load_file(str(directory / WEIGHTS_FILE))
        except FileNotFoundError as exc:
            raise fail(f"no {WEIGHTS_FILE} (adapters saved as .bin pickles are not read)") from exc
        except (SafetensorError, OSError, ValueError) as exc:
            raise fail(f"{WEIGHTS_FILE} is damaged ({exc})") from exc
        adapter = AdapterWeights(name, self.name, str(directory), base_model=config.get("base_model_name_or_path"))
        for key, tensor in sorted(tensors.items()):
            match = _KEY.match(key)
            if match is None:
                raise fail(f"tensor {key!r} is not an IA3 vector (ia3_l)")
            module = match["module"]
            if module in adapter.updates:
                raise fail(f"module {module!r} has two IA3 vectors")
            ff = is_feedforward(feedforward, module)
            want = "(1, in): it scales the input" if ff else "(out, 1): it scales the output"
            if tensor.dim() != 2 or tensor.shape[0 if ff else 1] != 1 or not tensor.is_floating_point():
                raise fail(f"module {module!r}: ia3_l is {tuple(tensor.shape)} {tensor.dtype}; feedforward_modules "
                           f"{feedforward!r} make it {want}")
            adapter.updates[module] = IA3Update(module, tensor.reshape(-1).float().contiguous(), ff)
        if not adapter.updates:
            raise fail(f"{WEIGHTS_FILE} holds no IA3 vectors")
        return adapter

    def write_example(self, path: Path, modules: Mapping[str, tuple[int, int]], *, rank: int, seed: int) -> None:
        """Random vectors around 1 (``rank`` does not apply); every other module name feed-forward."""
        from safetensors.torch import save_file

        generator = torch.Generator().manual_seed(seed)
        short = sorted({m.rsplit(".", 1)[-1] for m in modules})
        feedforward = short[::2]
        tensors = {}
        for module, (fan_in, fan_out) in sorted(modules.items()):
            ff = is_feedforward(feedforward, module)
            shape = (1, fan_in) if ff else (fan_out, 1)
            tensors[f"base_model.model.{module}.ia3_l"] = 1.0 + 0.8 * torch.randn(shape, generator=generator)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / WEIGHTS_FILE))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "IA3", "target_modules": short, "feedforward_modules": feedforward,
            "fan_in_fan_out": False, "modules_to_save": None, "init_ia3_weights": False}, indent=2))


@hookimpl
def ember_register_adapter_kinds(registry) -> None:
    registry.register(IA3Kind.name, IA3Kind)
