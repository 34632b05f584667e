"""The logits-processor contract (what a plugin's processor implements) and the
pipeline that runs an engine's processors.

The standard controls (temperature, top-k, top-p, min-p, penalties, logit_bias, bad
words, min_tokens) are core's own, in :class:`ember.worker.sampler.Sampler`. A processor is
what a plugin adds: registered by class through the ``ember_register_logits_processors``
hook (``registry.register(MyProcessor.name, MyProcessor)``). The engine builds one
instance of every registered class when it is constructed, orders them into a
:class:`LogitsPipeline`, and from then on the sampler calls the
instances directly, once per step, on whole batches: no hook call per token.

A processor applies to a request when the request names it and its
:meth:`BaseLogitsProcessor.is_enabled` agrees. A request names a processor by a key
of ``SamplingParams.extra`` equal to its name (whose value is that request's
parameters for it), or by setting one of the SamplingParams fields core leaves to
plugins (``sampling_params.PLUGIN_FIELDS``, e.g. ``typical_p``) that the processor
declares in ``params_fields``. A request that names no processor never reaches the
pipeline: it costs nothing per step.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from ember.plugin.registry import Registry
from ember.sampling_params import SamplingParams

# Where a processor runs (lower first; ties by name), between core's steps, which
# follow transformers' `generate`: adjustments, then temperature, then truncations,
# so that truncation sees the final shape of the distribution. A processor with
#   order < ORDER_TEMPERATURE runs after core's adjustments (logit_bias, penalties,
#       bad words, min_tokens) and before temperature;
#   ORDER_TEMPERATURE <= order < ORDER_TRUNCATE after temperature, before top-k;
#   order >= ORDER_TRUNCATE after core's top-k, top-p and min-p (typical-p does).
ORDER_ADJUST = 100  # the default
ORDER_TEMPERATURE = 200
ORDER_TRUNCATE = 300


@dataclass(slots=True)
class SamplingRow:
    """One request that samples this step, as processors and the sampler see it.

    ``prompt_token_ids`` and ``output_token_ids`` are the request's own lists, not
    copies: read them, never modify them. ``output_token_ids`` holds every token
    generated so far (not the one about to be sampled).
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class LogitsProcessorContext:
    """What a processor may need to know of the served model, given to its constructor.

    ``vocab_size`` is the width of the logits (the model's output vocabulary, which
    may exceed the tokenizer's). ``tokenizer`` is the served model's Hugging Face
    tokenizer, or None where a processor is built without a model (tests).
    ``options`` are the server's settings for this processor
    (``EngineConfig.processor_options[name]``; empty when none were given), such as
    the watermark's secret key: what a request may not choose for itself.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)


class BaseLogitsProcessor(abc.ABC):
    """A batch-level logits processor.

    Lifecycle, for each request the processor applies to (:meth:`is_enabled`):

    1. :meth:`validate` when the request is submitted (from any thread; it must not
       touch per-request state);
    2. :meth:`add_request` once, before the first :meth:`apply` that holds the request;
    3. :meth:`apply` on the steps where the request samples (not every step holds
       every request: a long prompt is prefilled in chunks, a request may be
       preempted and recomputed);
    4. :meth:`remove_request` once, after its last step (finished, stopped or aborted).

    Rows of greedy requests (``temperature == 0``) never reach a processor whose
    ``is_argmax_invariant`` is True, and a processor none of whose requests is in a
    step is not called at all: an all-greedy batch without adjustments costs nothing.
    A request may have several rows in one step (speculative decoding verifies
    several positions at once), each with its own ``output_token_ids``.
    """

    #: The registry name; a request switches the processor on by this name (by default).
    name: ClassVar[str]
    #: The SamplingParams fields this processor implements, among those core leaves
    #: to plugins (``ember.sampling_params.PLUGIN_FIELDS``), e.g. ``("typical_p",)``.
    #: A request that sets such a field is refused when no loaded processor declares it.
    params_fields: ClassVar[tuple[str, ...]] = ()
    #: Where the processor runs in the pipeline: see ``ORDER_*`` above.
    order: ClassVar[int] = ORDER_ADJUST
    #: True when :meth:`apply` never changes which token has the largest logit in a
    #: row (temperature and truncations). Greedy rows then skip the processor.
    is_argmax_invariant: ClassVar[bool] = False

    def __init__(self, context: LogitsProcessorContext) -> None:
        self.context = context

    @classmethod
    def is_enabled(cls, params: SamplingParams) -> bool:
        """Does a request with ``params`` run through this processor? Asked only of
        requests that name it (an ``extra`` key :attr:`name`, or one of its
        :attr:`params_fields` set): by default yes when ``extra`` names it; a processor
        of :attr:`params_fields` answers from those fields (typical-p: not when greedy).
        Cheap and stateless."""
        return cls.name in params.extra

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError naming the offending value if ``params`` (for which
        :meth:`is_enabled` is True) cannot be served, e.g. a token id outside
        ``context.vocab_size``. Stateless."""

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        """A request joins: build its per-request state (the prompt's token set, a
        count tensor, a compiled mask...). ``prompt_token_ids`` is read-only."""

    def remove_request(self, request_id: str) -> None:
        """The request left for good: drop its state. Called once per added request."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Process one step's logits of the rows this processor applies to.

        ``logits``: ``(len(rows), vocab_size)`` float32, row ``i`` belonging to
        ``rows[i]``; every row has this processor switched on. Return a tensor of the
        same shape and dtype (``logits`` itself, changed in place, is fine: the
        pipeline owns it). Masked tokens get ``-inf``; never return NaN, and leave at
        least one finite logit in a row that had one. Row ``i``'s result must depend
        only on ``logits[i]`` and ``rows[i]`` (and that request's state), never on the
        other rows: a seeded request samples the same tokens whatever its batch mates.
        """


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
