"""Adapter kinds: fine-tunes served beside the base model (docs/lora.md).

An adapter is a directory a training library saved (PEFT's ``adapter_config.json`` and
weights); its *kind* (PEFT's ``peft_type``: ``LORA``, ``IA3``, ...) says how to read it
and how it changes the model. A kind reduces an adapter to one `AdapterUpdate` per
linear module it targets, by the module's checkpoint name
(``"model.layers.3.self_attn.q_proj"``); the engine adds each request's updates to the
outputs of those modules, for the tokens of that request only, while requests of other
adapters and of the base model share the step.

Two ways an update runs:

* **low rank** (`AdapterUpdate.low_rank` returns ``(A, B)``): ``y += (x @ A.T) @ B.T``.
  The engine batches these for every adapter of a step at once (stacked per adapter
  slot, one pair of products per run of tokens, or the backend's ``lora_op``): LoRA
  and every kind that reduces to a low-rank delta get this path.
* **any other** (``low_rank`` returns None): `AdapterUpdate.apply` gets the module's
  input rows, its output rows and the module itself, once per run of tokens of that
  adapter, and returns the new output rows (an IA3 scale, a DoRA norm).

A kind is a `BaseAdapterKind` registered through ``ember_register_adapter_kinds``;
Ember's own LoRA is one (``ember.models.lora``). ``ember.testing.check_adapter_kind``
runs the conformance checks a third party's kind must pass. Every problem with an
adapter is an `AdapterError` naming the adapter and what is wrong.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

CONFIG_FILE = "adapter_config.json"


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the problem."""


class UnknownAdapterError(AdapterError):
    """A request names an adapter that is not loaded (the API answers 404)."""


class AdapterUpdate(ABC):
    """One module's change under one adapter, for a module ``(in_features -> out_features)``;
    a width the adapter does not fix (an IA3 vector scales only one side) is None, and
    `read_adapter` checks the others against the model."""

    @property
    @abstractmethod
    def in_features(self) -> int | None: ...

    @property
    @abstractmethod
    def out_features(self) -> int | None: ...

    @property
    def rank(self) -> int:
        """The rank of a low-rank update (0 for other kinds)."""
        factors = self.low_rank()
        return 0 if factors is None else int(factors[0].shape[0])

    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A (rank, in), B (out, rank))`` with any scale folded into ``B``, for
        ``y += (x @ A.T) @ B.T``; None for an update that is not low-rank."""
        return None

    def apply(self, x: torch.Tensor, y: torch.Tensor, module: Any,
              columns: tuple[int, int] | None = None) -> torch.Tensor:
        """The module's new output rows: ``x`` (n, in) its input rows, ``y`` (n, out) its
        base output rows (which may be changed in place), ``module`` the
        ``ember.models.layers.Linear`` itself (its product, for kinds that need it), and
        ``columns`` = (first, count): the columns of ``module``'s output that ``y`` holds
        (one part of a fused projection: ``q_proj`` in ``qkv_proj``; None: all of them).
        The default applies the low-rank form."""
        factors = self.low_rank()
        if factors is None:
            raise NotImplementedError(f"{type(self).__name__} must implement low_rank() or apply()")
        a, b = factors
        return y.add_(((x.to(a.dtype) @ a.T) @ b.T).to(y.dtype))


@dataclass
class AdapterWeights:
    """An adapter as read: its updates by module name, and where it came from."""

    name: str
    kind: str
    path: str
    updates: dict[str, AdapterUpdate] = field(default_factory=dict)
    base_model: str | None = None  # what the adapter says it was trained on (informative)

    @property
    def max_rank(self) -> int:
        return max((u.rank for u in self.updates.values()), default=0)

    @property
    def nbytes(self) -> int:
        total = 0
        for update in self.updates.values():
            factors = update.low_rank()
            if factors is not None:
                total += sum(t.numel() * t.element_size() for t in factors)
        return total


class BaseAdapterKind(ABC):
    """Reads adapters of one kind. Subclasses set ``name`` and ``peft_types`` (the
    ``peft_type`` values of ``adapter_config.json`` they read) and implement `read`
    and `write_example` (the conformance check's adapter)."""

    name: ClassVar[str] = ""
    peft_types: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def read(self, name: str, path: Path, config: dict, *, max_rank: int | None = None) -> AdapterWeights:
        """The adapter saved at ``path`` (a directory; ``config`` its parsed
        ``adapter_config.json``) as `AdapterWeights`, its updates keyed by the modules'
        checkpoint names without PEFT's ``base_model.model.`` prefix. `AdapterError`
        naming the adapter for anything it cannot serve (a setting it does not run, a
        damaged file, a rank above ``max_rank``), never a silent partial read."""

    @abstractmethod
    def write_example(self, path: Path, modules: Mapping[str, tuple[int, int]], *, rank: int, seed: int) -> None:
        """Save a random adapter of this kind at ``path`` for ``modules`` (checkpoint
        name -> (in_features, out_features)), as the training library would save it:
        the conformance check reads it back and runs it (``ember.testing``)."""


def read_adapter_config(name: str, path: Path) -> dict:
    """``adapter_config.json`` of the adapter at ``path`` as a dict; `AdapterError` naming what is wrong."""
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {str(path)!r} is not a directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError as exc:
        raise AdapterError(f"adapter {name!r} ({str(path)!r}): no {CONFIG_FILE}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {name!r} ({str(path)!r}): {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r} ({str(path)!r}): {CONFIG_FILE} is not a JSON object")
    return config


def read_adapter(kinds: Mapping[str, BaseAdapterKind], name: str, path: str | Path, *,
                 targets: Mapping[str, tuple[int, int]], max_rank: int | None = None) -> AdapterWeights:
    """Read the adapter at the local directory ``path`` with the kind whose
    ``peft_types`` hold its ``peft_type`` (LORA when it names none), and check it
    against the model: every module it targets must be one of ``targets`` (checkpoint
    name -> (in, out)) with the same shape. `AdapterError` names the adapter, the
    module or tensor and both shapes."""
    directory = Path(path).expanduser()
    config = read_adapter_config(name, directory)
    peft_type = str(config.get("peft_type") or "LORA").upper()
    kind = next((k for k in kinds.values() if peft_type in (t.upper() for t in k.peft_types)), None)
    if kind is None:
        known = sorted({t for k in kinds.values() for t in k.peft_types})
        raise AdapterError(f"adapter {name!r} ({str(directory)!r}): peft_type {peft_type!r} is not served "
                           f"(adapter kinds here read: {', '.join(known) or 'none'})")
    weights = kind.read(name, directory, config, max_rank=max_rank)
    if not weights.updates:
        raise AdapterError(f"adapter {name!r} ({str(directory)!r}) changes no module")
    for module, update in weights.updates.items():
        shape = targets.get(module)
        if shape is None:
            near = sorted(t for t in targets if t.rsplit(".", 1)[-1] == module.rsplit(".", 1)[-1])[:3]
            hint = f" (modules of that name here: {', '.join(near)})" if near else ""
            raise AdapterError(f"adapter {name!r}: targets module {module!r}, which this model does not have "
                               f"or cannot adapt{hint}")
        got = (update.in_features, update.out_features)
        if any(g is not None and g != want for g, want in zip(got, shape)):
            raise AdapterError(f"adapter {name!r}: module {module!r} maps {got[0]} -> {got[1]} features but the "
                               f"model's maps {shape[0]} -> {shape[1]} (an adapter trained for another base model?)")
        if max_rank is not None and update.rank > max_rank:
            raise AdapterError(f"adapter {name!r}: module {module!r} has rank {update.rank}, above max_lora_rank "
                               f"{max_rank} (raise --max-lora-rank)")
    return weights
