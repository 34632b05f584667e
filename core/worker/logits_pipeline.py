"""The pipeline that runs an engine's logits processors (the contract they implement
is `ember.plugin.logits_processor`): one instance of each, ordered, which of them each
request uses and their per-request state; a request that names none never reaches it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ember.plugin.logits_processor import BaseLogitsProcessor, LogitsProcessorContext, SamplingRow
from ember.plugin.registry import Registry
from ember.sampling_params import SamplingParams

# The pipeline. Core's :class:`ember.worker.sampler.Sampler` does the standard controls itself
# and calls :meth:`LogitsPipeline.apply` once per band of ``order`` between its own
# steps: core adjustments, processors with ``order < ORDER_TEMPERATURE``, temperature,
# processors in ``[ORDER_TEMPERATURE, ORDER_TRUNCATE)``, top-k / top-p / min-p,
# processors with ``order >= ORDER_TRUNCATE`` (typical-p), then the sampler's `repair_non_finite`,
# so that the sampler always draws from a distribution: every row finite or -inf (a
# ban) with at least one finite entry.

class LogitsPipeline:
    """Owns one instance of each processor and which of them each request uses.

    Not thread-safe except :meth:`validate`: the engine thread calls the rest.
    """

    def __init__(self, processors: Sequence[BaseLogitsProcessor]) -> None:
        self.processors = sorted(processors, key=lambda p: (p.order, p.name))
        self._by_name: dict[str, BaseLogitsProcessor] = {}
        for processor in self.processors:
            if processor.name in self._by_name:
                raise ValueError(f"two logits processors are named {processor.name!r}")
            self._by_name[processor.name] = processor
        # field -> the processor that implements it (first by order)
        self._by_field: dict[str, BaseLogitsProcessor] = {}
        for processor in self.processors:
            for name in processor.params_fields:
                self._by_field.setdefault(name, processor)
        # field -> positions of every processor that declares it
        self._declaring: dict[str, list[int]] = {}
        for k, processor in enumerate(self.processors):
            for name in processor.params_fields:
                self._declaring.setdefault(name, []).append(k)
        # request id -> positions in `self.processors` it was added to (and runs through)
        self.active: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_registry(
        cls, registry: Registry, context: LogitsProcessorContext,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> LogitsPipeline:
        """Build one instance of every registered processor class; each gets
        ``options[name]`` (the server's settings for it) as ``context.options``."""
        options = options or {}
        unknown = sorted(set(options) - set(registry.names()))
        if unknown:
            raise ValueError(f"processor_options name logits processor(s) {unknown} that are not loaded")
        processors = []
        for name, processor_cls in registry.items():
            if not (isinstance(processor_cls, type) and issubclass(processor_cls, BaseLogitsProcessor)):
                raise TypeError(
                    f"logits processor {name!r} (plugin {registry.owner(name)!r}) is {processor_cls!r}, "
                    "not a subclass of ember.plugin.logits_processor.BaseLogitsProcessor"
                )
            if getattr(processor_cls, "name", None) != name:
                raise ValueError(
                    f"logits processor registered as {name!r} (plugin {registry.owner(name)!r}) names itself "
                    f"{getattr(processor_cls, 'name', None)!r}; register it under its `name`"
                )
            processors.append(processor_cls(replace(context, options=dict(options.get(name, {})))))
        return cls(processors)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.processors]

    @property
    def served_fields(self) -> frozenset[str]:
        """The SamplingParams fields (of ``PLUGIN_FIELDS``) that loaded processors implement."""
        return frozenset(self._by_field)

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError if a processor the request needs is missing or refuses it."""
        known = ", ".join(sorted(self._by_name)) or "none"
        for name in params.plugin_fields_used:
            if name not in self._by_field:
                raise ValueError(
                    f"{name}={getattr(params, name)!r} needs a logits processor plugin that implements {name!r}, "
                    f"which is not loaded (a plugin disabled or not installed?); loaded processors: {known}"
                )
        for name in params.extra:
            if name not in self._by_name:
                raise ValueError(
                    f"extra[{name!r}] needs the logits processor {name!r}, which is not loaded "
                    f"(a plugin disabled or not installed?); loaded: {known}"
                )
        for k in self._named_by(params):
            if self.processors[k].is_enabled(params):
                self.processors[k].validate(params)

    def _named_by(self, params: SamplingParams) -> list[int]:
        """Positions of the processors ``params`` names (by `extra` key or by a
        declared field it sets), in pipeline order: only these are asked `is_enabled`."""
        named = {self.processors.index(self._by_name[n]) for n in params.extra if n in self._by_name}
        for name in params.plugin_fields_used:
            named.update(self._declaring.get(name, ()))
        return sorted(named)

    def remove_request(self, request_id: str) -> None:
        """The request finished or was aborted: its processors drop their state."""
        for k in self.active.pop(request_id, ()):
            self.processors[k].remove_request(request_id)

    @property
    def num_active_requests(self) -> int:
        return len(self.active)

    def uses_any(self, rows: list[SamplingRow]) -> bool:
        """Whether any processor applies to any of these rows."""
        return bool(self.processors) and any(self._processors_of(row) for row in rows)

    def apply(
        self, logits: torch.Tensor, rows: list[SamplingRow],
        min_order: int | None = None, max_order: int | None = None,
    ) -> torch.Tensor:
        """Run the processors with ``min_order <= order < max_order`` (None: no bound)
        over the rows that use them, in order; each is called once, with exactly
        those rows, or not at all. ``logits``: ``(len(rows), vocab)`` float32, changed
        in place where the rows are a subset; returns the result, same shape."""
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        rows_of: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            for k in self._processors_of(row):
                order = self.processors[k].order
                if (min_order is None or order >= min_order) and (max_order is None or order < max_order):
                    rows_of.setdefault(k, []).append(i)
        for k in sorted(rows_of):
            processor, indices = self.processors[k], rows_of[k]
            if len(indices) == len(rows):
                logits = processor.apply(logits, rows)
            else:
                index = torch.tensor(indices, dtype=torch.int64, device=logits.device)
                sub = processor.apply(logits.index_select(0, index), [rows[i] for i in indices])
                logits.index_copy_(0, index, sub)
            assert logits.shape[0] == len(rows), f"logits processor {processor.name!r} changed the batch size"
        return logits

    def _processors_of(self, row: SamplingRow) -> tuple[int, ...]:
        active = self.active.get(row.request_id)
        if active is None:
            params = row.params
            missing = [n for n in params.extra if n not in self._by_name]
            if missing:  # validate() refuses these; a request that skipped it fails here
                raise ValueError(f"request {row.request_id!r} needs logits processor(s) {missing}, not loaded")
            active = tuple(
                k for k in self._named_by(params)
                if self.processors[k].is_enabled(params)
                and not (params.is_greedy and self.processors[k].is_argmax_invariant)
            )
            for k in active:
                self.processors[k].add_request(row.request_id, params, row.prompt_token_ids)
            self.active[row.request_id] = active
        return active


def apply_token_masks(logits: torch.Tensor, masks: dict[str, torch.Tensor], requests, sample_spans) -> None:
    """Ban, in place, the tokens each request's allowed-token mask (``masks`` by request
    id, bool ``(positions, vocab)``) leaves out: ``requests[i]`` (anything with a
    ``request_id``) samples ``sample_spans[i] = (first row, positions)`` of ``logits``."""
    if not masks:
        return
    for request, (first, num_positions) in zip(requests, sample_spans):
        mask = masks.get(request.request_id)
        if mask is None or not num_positions:
            continue
        if mask.dtype != torch.bool or mask.shape[-1] != logits.shape[-1] or mask.shape[0] < num_positions:
            raise ValueError(
                f"allowed-token mask of {request.request_id!r} must be bool (positions >= {num_positions}, "
                f"{logits.shape[-1]}), got {mask.dtype} {tuple(mask.shape)}"
            )
        logits[first : first + num_positions].masked_fill_(~mask[:num_positions].to(logits.device), float("-inf"))
