"""Which adapter sits in which slot, and each step's runs of adapter tokens.

The model's linears hold ``max_loras`` slots (``ember.models.lora``). Before a forward
the runner asks `AdapterSlots.prepare` for the step's requests (in batch order, the
scheduler having grouped them by adapter and never scheduling more adapters at once
than there are slots): each adapter of the step that is not in a slot takes a free one,
else the least recently used slot whose adapter has no request in this step; its
weights come from ``fetch(adapter_id)`` (the engine's registry, which keeps the most
recently used adapters in host memory and reads the others again from disk). Then the
step's runs — consecutive requests of one adapter, as ``(slot, first token, end)`` —
are set on the model. Adapter id 0 is the base model: no slot, no run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ember.models.lora import AdapterModel
from ember.plugin.adapter import AdapterWeights

logger = logging.getLogger(__name__)


class AdapterSlots:
    def __init__(self, model: AdapterModel, fetch: Callable[[int], AdapterWeights], device=None) -> None:
        self.model = model
        self.fetch = fetch
        self.device = device
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(model.max_slots - 1, -1, -1))
        self.num_loads = 0
        self.load_seconds = 0.0
        self._last_key: tuple | None = None  # the last step's (adapter ids, query lengths) with adapters
        self._last_eager = False

    def prepare(self, adapter_ids: Sequence[int], query_lens: Sequence[int]) -> bool:
        """Seat the step's adapters and set its runs on the model (``adapter_ids[i]`` of
        the i-th request of the batch, ``query_lens[i]`` its tokens); whether the step
        has adapter tokens that a captured graph cannot compute (it then runs eagerly)."""
        if not any(adapter_ids):
            if self.model.step.runs or self.model.step.record:
                self.model.set_step([], 0)
                self._last_key = None
            return False
        key = (tuple(adapter_ids), tuple(query_lens))
        if key == self._last_key:  # a decode step like the last one: its slots and runs stand
            return self._last_eager
        wanted = {a for a in adapter_ids if a}
        for adapter_id in wanted:
            if adapter_id in self.slot_of:
                self.slot_of.move_to_end(adapter_id)
            else:
                self._seat(adapter_id, wanted)
        runs: list[tuple[int, int, int]] = []
        start = 0
        for adapter_id, n in zip(adapter_ids, query_lens):
            if adapter_id:
                slot = self.slot_of[adapter_id]
                if runs and runs[-1][0] == slot and runs[-1][2] == start:
                    runs[-1] = (slot, runs[-1][1], start + n)
                else:
                    runs.append((slot, start, start + n))
            start += n
        self.model.set_step(runs, start, self.device)
        self._last_key, self._last_eager = key, not self.model.graph_safe
        return self._last_eager

    def _seat(self, adapter_id: int, wanted: set[int]) -> None:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((a for a in self.slot_of if a not in wanted), None)
            if victim is None:  # the scheduler admits at most max_loras adapters at once
                raise RuntimeError(f"a step needs {len(wanted)} adapters, more than the {self.model.max_slots} slots")
            slot = self.slot_of.pop(victim)
        started = time.perf_counter()
        weights = self.fetch(adapter_id)
        self.model.load(slot, weights)
        self.load_seconds += time.perf_counter() - started
        self.num_loads += 1
        self.slot_of[adapter_id] = slot
        logger.debug("adapter %r (id %d) in slot %d", weights.name, adapter_id, slot)

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter leaves its slot (zeroed, free again)."""
        slot = self.slot_of.pop(adapter_id, None)
        self._last_key = None
        if slot is not None:
            self.model.clear(slot)
            self.free_slots.append(slot)
