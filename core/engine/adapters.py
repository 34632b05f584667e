"""The engine's adapters by name: loaded, in use, unloading (docs/lora.md).

Each load gets a fresh id (never reused: the prefix cache keys blocks by it, so a
name loaded again with other weights shares no block with its former self; id 0 is the
base model). A request names an adapter; `AdapterRegistry.resolve` turns the name into
the id the request keeps to its end. Unloading takes the name away at once (new
requests are refused) while requests already holding the id finish; the engine drops
the adapter for good (`drop_unused`) once none does.

Host memory: the ``max_cpu_loras`` most recently used adapters stay read; the others
keep their path and are read again when a step needs them (vLLM's --max-cpu-loras).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.engine.client import AdapterInfo, LoRAInfo
from ember.models.layers import Linear
from ember.models.lora import AdapterModel, attach_adapters
from ember.plugin.adapter import AdapterError, AdapterWeights, BaseAdapterKind, UnknownAdapterError, read_adapter

logger = logging.getLogger("ember.engine.core")


@dataclass
class AdapterEntry:
    name: str
    adapter_id: int
    path: str
    kind: str
    rank: int
    unloading: bool = False


def resolve_adapter_path(name: str, path: str, revision: str | None = None) -> Path:
    """A local directory as it is; anything else is a Hub repository id, downloaded
    (adapter files only) through Ember's Hub resolver."""
    local = Path(path).expanduser()
    if local.is_dir() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        return local
    from ember.weights.hub import download_adapter
    from ember.weights.resolver import hf_hub_cache_dir

    try:
        return download_adapter(path, revision, hf_hub_cache_dir())
    except Exception as exc:  # noqa: BLE001 - a Hub failure of any kind is this adapter's error
        raise AdapterError(f"adapter {name!r}: {path!r} is no local directory, and the Hub gave no adapter "
                           f"under that id ({exc})") from exc


class AdapterRegistry:
    def __init__(self, kinds: Mapping[str, BaseAdapterKind], targets: Mapping[str, tuple[int, int]],
                 max_rank: int, max_cpu_loras: int) -> None:
        self.kinds = kinds
        self.targets = dict(targets)
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.entries: dict[str, AdapterEntry] = {}  # by name: loaded (and unloading) adapters
        self.by_id: dict[int, AdapterEntry] = {}
        self._cache: OrderedDict[int, AdapterWeights] = OrderedDict()  # read adapters, least recently used first
        self._ids = itertools.count(1)
        self.num_reads = 0

    def read(self, name: str, path: str) -> AdapterWeights:
        """Read and check the adapter at ``path`` (a local directory or a Hub id) for this model."""
        return read_adapter(self.kinds, name, resolve_adapter_path(name, path), targets=self.targets,
                            max_rank=self.max_rank)

    def add(self, name: str, path: str, weights: AdapterWeights | None = None) -> AdapterEntry:
        """Register ``name`` (read from ``path`` unless ``weights`` are given, already read
        and checked); `AdapterError` for a name in use or an adapter that cannot serve."""
        check_adapter_name(name)
        if name in self.entries:
            state = "being unloaded" if self.entries[name].unloading else "already loaded"
            raise AdapterError(f"adapter {name!r} is {state}; unload it first or choose another name")
        if weights is None:
            weights = self.read(name, path)
            self.num_reads += 1
        entry = AdapterEntry(name, next(self._ids), str(path), weights.kind, weights.max_rank)
        self.entries[name] = entry
        self.by_id[entry.adapter_id] = entry
        self._keep(entry.adapter_id, weights)
        logger.info("adapter %r (%s, rank %d, id %d) from %s", name, entry.kind, entry.rank, entry.adapter_id, path)
        return entry

    def resolve(self, name: str | None) -> int:
        """The id a new request of adapter ``name`` runs under (0: the base model)."""
        if name is None:
            return 0
        entry = self.entries.get(name)
        if entry is None or entry.unloading:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded adapters: "
                                      f"{', '.join(self.names()) or 'none'}")
        return entry.adapter_id

    def unload(self, name: str) -> AdapterEntry:
        """Refuse new requests of ``name`` from now on; the caller drops it when unused."""
        entry = self.entries.get(name)
        if entry is None or entry.unloading:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded adapters: "
                                      f"{', '.join(self.names()) or 'none'}")
        entry.unloading = True
        return entry

    def drop_unused(self, in_use: Iterable[int]) -> list[int]:
        """Forget the unloading adapters no request holds; their ids (to clear their slots)."""
        busy = set(in_use)
        dropped = [e.adapter_id for e in self.entries.values() if e.unloading and e.adapter_id not in busy]
        for adapter_id in dropped:
            entry = self.by_id.pop(adapter_id)
            del self.entries[entry.name]
            self._cache.pop(adapter_id, None)
        return dropped

    def weights(self, adapter_id: int) -> AdapterWeights:
        """The adapter's weights: from host memory, else read again from its path."""
        weights = self._cache.get(adapter_id)
        if weights is not None:
            self._cache.move_to_end(adapter_id)
            return weights
        entry = self.by_id.get(adapter_id)
        if entry is None:
            raise KeyError(f"no adapter with id {adapter_id}")
        weights = self.read(entry.name, entry.path)
        self.num_reads += 1
        self._keep(adapter_id, weights)
        return weights

    def _keep(self, adapter_id: int, weights: AdapterWeights) -> None:
        self._cache[adapter_id] = weights
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)

    def names_of(self, adapter_ids: Iterable[int]) -> tuple[str, ...]:
        """The names of these adapter ids (the base model's 0 and dropped ids left out), sorted."""
        return tuple(sorted({self.by_id[a].name for a in adapter_ids if a in self.by_id}))

    def info(self, max_loras: int) -> LoRAInfo:
        adapters = tuple(AdapterInfo(e.name, e.path, e.kind, e.rank) for e in self.entries.values() if not e.unloading)
        return LoRAInfo(max_loras, self.max_rank, self.max_cpu_loras, dict(self.targets), adapters)

    def names(self) -> list[str]:
        return [name for name, entry in self.entries.items() if not entry.unloading]

    def name_of(self, adapter_id: int) -> str | None:
        entry = self.by_id.get(adapter_id)
        return None if entry is None else entry.name


def check_adapter_name(name: object) -> str:
    """An adapter's name is a non-empty string without whitespace, 200 characters at most."""
    if not isinstance(name, str) or not name or len(name) > 200 or any(c.isspace() for c in name):
        raise AdapterError(f"adapter name must be a non-empty string without spaces (at most 200 characters), "
                           f"got {name!r}")
    return name


def lora_dtype(name: str, model) -> torch.dtype:
    """The adapters' weight dtype for ``EngineConfig.lora_dtype`` on ``model``."""
    if name != "auto":
        return getattr(torch, name)
    quantized = any(isinstance(m, Linear) and m.is_quantized for m in model.modules())
    return torch.bfloat16 if quantized and model.compute_dtype == torch.float32 else model.compute_dtype


def create_adapters(config, model, backend, kinds) -> tuple[AdapterRegistry | None, AdapterModel | None]:
    """For an engine with adapters on (``config.lora_enabled``): ``model``'s linears given
    their slots, and the registry holding the adapters of ``config.lora_modules`` (an
    `AdapterError` at start for one that cannot serve); (None, None) when adapters are off."""
    if not config.lora_enabled:
        return None, None
    dtype = lora_dtype(config.lora_dtype, model)
    adapter_model = attach_adapters(model, config.max_loras, config.max_lora_rank, dtype,
                                    backend.device, backend.lora_op(), backend.lora_op_in_graphs, config.max_num_seqs)
    registry = AdapterRegistry({name: kind() for name, kind in kinds.items()}, adapter_model.shapes(),
                               config.max_lora_rank, config.max_cpu_loras or config.max_loras)
    for name, path in config.lora_modules:
        registry.add(name, path)
    logger.info("LoRA: %d adapter slot(s) of rank <= %d in %s; %s products", config.max_loras, config.max_lora_rank,
                str(dtype).removeprefix("torch."),
                "the backend's batched op" if adapter_model.op is not None else "PyTorch's")
    return registry, adapter_model


def apply_adapter_command(core, action: str, name: str, path: str, weights) -> None:
    """Load or unload an adapter in the core for a client that checked the request (a
    failure here is a race the client could not see: logged, nothing else changes)."""
    try:
        if action == "add":
            core.add_adapter(name, path, weights)
        else:
            core.remove_adapter(name)
    except AdapterError as exc:
        logger.error("adapter %s of %r failed in the engine core: %s", action, name, exc)
