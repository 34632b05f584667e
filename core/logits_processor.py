"""The logits-processor contract: what a built-in or third-party processor implements.

A processor is registered by class through the ``ember_register_logits_processors``
hook (``registry.register(MyProcessor.name, MyProcessor)``). The engine builds one
instance of every registered class when it is constructed, orders them into a
:class:`ember.logits_pipeline.LogitsPipeline`, and from then on calls the instances
directly, once per step, on whole batches: no hook call per token.

A processor applies to a request when its name is one of the request's
``SamplingParams.logits_processor_names``: the built-in names follow from the
standard fields (``repetition_penalty != 1`` switches on ``"repetition_penalty"``),
and a third party's processor is switched on by its name as a key of
``SamplingParams.extra``, whose value is that request's parameters for it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ember.sampling_params import SamplingParams

# Where a processor runs in the pipeline (lower first; ties by name). The bands
# follow transformers' `generate`: logits adjustments, then temperature, then the
# truncations, so that truncation sees the final shape of the distribution.
ORDER_ADJUST = 100  # logit_bias, penalties, bad words, min_tokens, third parties by default
ORDER_TEMPERATURE = 200
ORDER_TRUNCATE = 300  # top-k, top-p, min-p, typical-p


@dataclass(frozen=True, slots=True)
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

    Lifecycle, for each request the processor applies to (its name is in the
    request's ``params.logits_processor_names``):

    1. :meth:`validate` when the request is submitted (from any thread; it must not
       touch per-request state);
    2. :meth:`add_request` once, before the first :meth:`apply` that holds the request;
    3. :meth:`apply` on the steps where the request samples (not every step holds
       every request: a long prompt is prefilled in chunks, a request may be
       preempted and recomputed);
    4. :meth:`remove_request` once, after its last step (finished, stopped or aborted).

    Rows of greedy requests (``temperature == 0``) never reach a processor whose
    ``is_argmax_invariant`` is True (the built-in temperature and truncations are not
    even switched on for them: greedy ignores them, as transformers' ``generate``
    does), and a processor none of whose requests is in a step is not called at all:
    an all-greedy batch without penalties costs nothing.
    """

    #: The registry name; a request switches the processor on by this name.
    name: ClassVar[str]
    #: Where the processor runs in the pipeline: see ``ORDER_*`` above.
    order: ClassVar[int] = ORDER_ADJUST
    #: True when :meth:`apply` never changes which token has the largest logit in a
    #: row (temperature and truncations). Greedy rows then skip the processor.
    is_argmax_invariant: ClassVar[bool] = False

    def __init__(self, context: LogitsProcessorContext) -> None:
        self.context = context

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError naming the offending value if ``params`` (whose
        ``logits_processor_names`` hold this processor's name) cannot be served,
        e.g. a token id outside ``context.vocab_size``. Stateless."""

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
