"""The logits-processor contract: what a plugin's processor implements (the pipeline
that runs an engine's processors is `ember.worker.logits_pipeline`).

The standard controls (temperature, top-k, top-p, min-p, penalties, logit_bias, bad
words, min_tokens) are core's own, in :class:`ember.worker.sampler.Sampler`. A processor is
what a plugin adds: registered by class through the ``ember_register_logits_processors``
hook (``registry.register(MyProcessor.name, MyProcessor)``). The engine builds one
instance of every registered class when it is constructed, orders them into a
:class:`ember.worker.logits_pipeline.LogitsPipeline`, and from then on the sampler calls the
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

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
