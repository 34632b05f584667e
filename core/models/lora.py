"""Adapters inside the model: per-linear slot stacks and the batched products of a step.

`attach_adapters(model, max_slots, max_rank)` gives every adaptable ``Linear`` of a model
(its projections; not the LM head, nor MoE experts) a `LinearAdapters`: for each of
``max_slots`` adapter slots a stacked low-rank pair, ``a`` (slots * stride, in) and
``bt`` (slots * stride, out), a slot's ``stride = parts * max_rank`` rows holding the
parts of a fused projection (qkv, gate/up) one after another (each part's ``A`` in its
rows of ``a``, its ``B`` (scale folded in) in those rows of ``bt`` at that part's output
columns, zeros elsewhere; ``used[s]`` rows in use, the rest zero), so one product per
slot serves the fused module. Updates that are not low-rank are kept per slot and
applied as they are.

A step (`AdapterStep`, set by the runner) is the flat batch's runs of tokens of one slot,
the requests grouped by adapter by the scheduler. A backend with a ``lora_op`` (the
CPU's native kernel, the device backends' Triton kernels) gets each token's slot and
does every slot in one call per linear; where the op may run inside graphs
(``BaseBackend.lora_op_in_graphs``) the slots live in one buffer kept in place and the op
runs on every step, so a captured decode step holds it. Without an op, each run adds
``(x[run] @ a_s.T) @ bt_s`` to ``y[run]`` in place (two PyTorch products; Punica's SGMV
by segments; a run covering every token needs no slice). Tokens of the base model
(slot -1) are untouched.

The built-in adapter kind, LoRA (PEFT's ``LORA``: ``ember.weights.peft``), is registered
here through Ember's own ``ember`` entry point.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.models.layers import Linear
from ember.plugin import hookimpl
from ember.plugin.adapter import AdapterError, AdapterUpdate, AdapterWeights, BaseAdapterKind
from ember.weights.peft import WEIGHTS_FILE, read_lora_adapter


@dataclass(slots=True)
class AdapterStep:
    """One step's tokens by slot: ``runs`` are ``(slot, start, end)`` of the flat batch
    (slot >= 0 only; the base model's tokens are in none), ``num_tokens`` the batch's
    size, ``token_slots`` the per-token slot tensor (-1: base) for a backend's op."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)
    num_tokens: int = 0
    token_slots: torch.Tensor | None = None
    # run the op even without runs: a graph being captured records it (the state before any step)
    record: bool = False


class LinearAdapters:
    """One ``Linear``'s adapter slots (module docstring). ``step`` is shared by every
    layer of the model and replaced by the runner each step."""

    def __init__(self, linear: Linear, owner: AdapterModel, max_slots: int, max_rank: int, dtype, device) -> None:
        self.linear = linear
        self.owner = owner
        self.parts = len(linear.output_sizes)
        self.stride = self.parts * max_rank
        self.max_rank = max_rank
        out = sum(linear.output_sizes)
        self.a = torch.zeros(max_slots * self.stride, linear.in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_slots * self.stride, out, dtype=dtype, device=device)
        self.used = torch.zeros(max_slots, dtype=torch.int64, device=device)  # rows of each slot in use
        self.used_rows = [0] * max_slots  # the same, for Python
        self.low_rank = [False] * max_slots  # slot holds a low-rank update here
        self.other: list[list[AdapterUpdate | None] | None] = [None] * max_slots  # per slot, per part

    def load(self, slot: int, parts: Sequence[AdapterUpdate | None]) -> None:
        """Fill ``slot`` with the updates of each part (None: that part unchanged)."""
        s = slice(slot * self.stride, (slot + 1) * self.stride)
        self.a[s].zero_()
        self.bt[s].zero_()
        self.low_rank[slot] = False
        self.other[slot] = None
        others: list[AdapterUpdate | None] = [None] * self.parts
        col, row = 0, slot * self.stride
        for index, (size, update) in enumerate(zip(self.linear.output_sizes, parts)):
            if update is not None:
                factors = update.low_rank()
                if factors is None:
                    others[index] = update
                else:
                    a, b = factors
                    rank = a.shape[0]
                    self.a[row : row + rank] = a.to(self.a.dtype)
                    self.bt[row : row + rank, col : col + size] = b.T.to(self.bt.dtype)
                    self.low_rank[slot] = True
                    row += rank
            col += size
        self.used[slot] = self.used_rows[slot] = row - slot * self.stride
        if any(u is not None for u in others):
            self.other[slot] = others

    def clear(self, slot: int) -> None:
        self.load(slot, [None] * self.parts)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the step's updates to ``y`` (the linear's output for input ``x``), in place where it can."""
        step = self.owner.step
        op = self.owner.op
        stride = self.stride
        if op is not None and step.token_slots is not None and (
                step.runs or (step.record and x.shape[0] <= step.token_slots.shape[0])):  # every slot, one call
            op(y, x, self.a, self.bt, step.token_slots[: x.shape[0]], stride, self.used)
        if not step.runs:
            return y
        everyone = len(step.runs) == 1 and step.runs[0][1] == 0 and step.runs[0][2] == step.num_tokens
        for slot, start, end in step.runs:
            xs, ys = (x, y) if everyone else (x[start:end], y[start:end])
            if op is None and self.low_rank[slot]:
                s = slice(slot * stride, slot * stride + self.used_rows[slot])
                a, bt = self.a[s], self.bt[s]
                if a.dtype != xs.dtype:  # adapters kept in another dtype (EngineConfig.lora_dtype)
                    a, bt = a.to(xs.dtype), bt.to(xs.dtype)
                ys.addmm_(F.linear(xs, a), bt)
            others = self.other[slot]
            if others is not None:
                col = 0
                for size, update in zip(self.linear.output_sizes, others):
                    if update is not None:
                        ys[:, col : col + size] = update.apply(xs, ys[:, col : col + size], self.linear,
                                                               columns=(col, size))
                    col += size
        return y


class AdapterModel:
    """A model's adaptable linears (by checkpoint name: ``(LinearAdapters, part)``), the
    step's runs, and the backend's batched op."""

    def __init__(self, model, max_slots: int, max_rank: int, dtype: torch.dtype, device, op=None,
                 op_in_graphs: bool = False, max_step_slots: int = 256) -> None:
        if max_slots < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_slots}) and max_lora_rank ({max_rank}) must be >= 1")
        try:
            parts = model.linear_parts()
        except NotImplementedError as exc:
            raise ValueError(f"LoRA adapters: {type(model).__name__} has no named linear layers to adapt") from exc
        self.max_slots = max_slots
        self.max_rank = max_rank
        self.op = op
        # with an op that runs inside graphs: the slots of every step with at most
        # max_step_slots tokens (decodes, the graphs' sizes) in this one buffer, -1 past them
        self.slots_buffer = (torch.full((max_step_slots,), -1, dtype=torch.int64, device=device)
                             if op is not None and op_in_graphs else None)
        # on the host, the buffer is filled through NumPy (a microsecond where a torch op
        # right after a forward costs tens)
        self._slots_host = (self.slots_buffer.numpy() if self.slots_buffer is not None
                            and self.slots_buffer.device.type == "cpu" else None)
        self.other_slots: set[int] = set()  # slots holding an update that is not low-rank
        self.step = AdapterStep(token_slots=self.slots_buffer, record=True)
        self.layers: dict[int, LinearAdapters] = {}  # id(linear) -> its slots
        self.targets: dict[str, tuple[LinearAdapters, int]] = {}
        for name, (linear, index) in parts.items():
            if name == "lm_head" or ".experts." in name:
                continue  # the head runs over sampled rows only; experts are not Linear rows of the batch
            layer = self.layers.get(id(linear))
            if layer is None:
                layer = self.layers[id(linear)] = LinearAdapters(linear, self, max_slots, max_rank, dtype, device)
                linear.adapters = layer
            self.targets[name] = (layer, index)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Each adaptable module's checkpoint name -> (in_features, out_features)."""
        return {name: (layer.linear.in_features, layer.linear.output_sizes[index])
                for name, (layer, index) in self.targets.items()}

    def load(self, slot: int, adapter: AdapterWeights) -> None:
        """Put ``adapter`` in ``slot`` (every layer: its updates, zeros elsewhere)."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"adapter slot {slot} is not in 0..{self.max_slots - 1}")
        per_layer: dict[int, list[AdapterUpdate | None]] = {key: [None] * layer.parts
                                                            for key, layer in self.layers.items()}
        for name, update in adapter.updates.items():
            target = self.targets.get(name)
            if target is None:
                raise AdapterError(f"adapter {adapter.name!r}: targets module {name!r}, which this model cannot adapt")
            layer, index = target
            if update.rank > self.max_rank:
                raise AdapterError(f"adapter {adapter.name!r}: module {name!r} has rank {update.rank}, above "
                                   f"max_lora_rank {self.max_rank}")
            per_layer[id(layer.linear)][index] = update
        for key, layer in self.layers.items():
            layer.load(slot, per_layer[key])
        self.other_slots.discard(slot)
        if any(layer.other[slot] is not None for layer in self.layers.values()):
            self.other_slots.add(slot)

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        self.other_slots.discard(slot)

    def set_step(self, runs: list[tuple[int, int, int]], num_tokens: int, device=None) -> None:
        """The next forward's runs of adapter tokens (``(slot, start, end)``, slots >= 0)."""
        token_slots = None
        host = self._slots_host
        if host is not None and num_tokens <= host.shape[0]:
            host.fill(-1)
            for slot, start, end in runs:
                host[start:end] = slot
            self.step = AdapterStep(runs, num_tokens, self.slots_buffer)
            return
        if self.op is not None and (runs or self.slots_buffer is not None):
            slots = torch.full((num_tokens,), -1, dtype=torch.int64)
            for slot, start, end in runs:
                slots[start:end] = slot
            buffer = self.slots_buffer
            if buffer is not None and num_tokens <= buffer.shape[0]:
                buffer[num_tokens:].fill_(-1)
                buffer[:num_tokens].copy_(slots)
                token_slots = buffer
            else:
                token_slots = slots.to(device) if device is not None else slots
        self.step = AdapterStep(runs, num_tokens, token_slots)

    @property
    def graph_safe(self) -> bool:
        """Whether the step's adapter products may run in a captured graph: the op runs
        there and no slot of the step holds an update it does not cover."""
        if self.slots_buffer is None or self.step.token_slots is not self.slots_buffer:
            return False
        return not any(slot in self.other_slots for slot, _, _ in self.step.runs)


def attach_adapters(model, max_slots: int, max_rank: int, dtype: torch.dtype, device=None, op=None,
                    op_in_graphs: bool = False, max_step_slots: int = 256) -> AdapterModel:
    """Give ``model``'s adaptable linears ``max_slots`` adapter slots of rank up to ``max_rank``
    (``op``: the backend's ``lora_op``; ``op_in_graphs``: it may run inside its graphs)."""
    return AdapterModel(model, max_slots, max_rank, dtype, device, op, op_in_graphs, max_step_slots)


# -- the built-in kind -------------------------------------------------------------------------------------------
class LoRAKind(BaseAdapterKind):
    """PEFT's LoRA (and rsLoRA, per-module ranks and alphas): ``ember.weights.peft``."""

    name = "lora"
    peft_types = ("LORA",)

    def read(self, name: str, path: Path, config: dict, *, max_rank: int | None = None) -> AdapterWeights:
        return read_lora_adapter(name, path, max_rank=max_rank, config=config)

    def write_example(self, path: Path, modules: Mapping[str, tuple[int, int]], *, rank: int, seed: int) -> None:
        import json

        from safetensors.torch import save_file

        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for module, (fan_in, fan_out) in modules.items():
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * rank**-0.5
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / WEIGHTS_FILE))
        short = sorted({m.rsplit(".", 1)[-1] for m in modules})
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": short, "bias": "none"}))


@hookimpl
def ember_register_adapter_kinds(registry) -> None:
    registry.register(LoRAKind.name, LoRAKind)
