"""The watermark as a logits processor: add ``delta`` to the green logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.plugin.logits_processor import ORDER_ADJUST, BaseLogitsProcessor, LogitsProcessorContext, SamplingRow
from ember.sampling_params import SamplingParams

from .detector import Detector
from .green_list import GreenList, WatermarkSettings, check_delta, check_gamma

NAME = "watermark"
REQUEST_FIELDS = ("gamma", "delta")


@dataclass(frozen=True, slots=True)
class _RequestWatermark:
    green_list: GreenList
    delta: float


class WatermarkProcessor(BaseLogitsProcessor):
    """Kirchenbauer et al.'s soft watermark: ``logit[g] += delta`` for every green
    ``g`` of the list seeded by the previous token (the last prompt token for the
    first generated one).

    Server settings (``context.options``, from ``EngineConfig.processor_options
    ["watermark"]``): ``key`` (secret), ``gamma``, ``delta``. A request switches it on
    with ``SamplingParams(extra={"watermark": {}})`` and may set its own ``gamma``
    and ``delta`` (``{"gamma": 0.5, "delta": 4.0}``); the key is the server's alone.
    Greedy requests are watermarked too (it changes the argmax), as in TGI.
    """

    name = NAME
    order = ORDER_ADJUST + 90  # after biases and penalties, before temperature
    is_argmax_invariant = False

    def __init__(self, context: LogitsProcessorContext) -> None:
        super().__init__(context)
        self.settings = WatermarkSettings.from_options(dict(context.options))
        self._green_lists: dict[float, GreenList] = {}
        self._requests: dict[str, _RequestWatermark] = {}

    def green_list(self, gamma: float | None = None) -> GreenList:
        """The green lists at ``gamma`` (default: the server's) under the server's key."""
        gamma = self.settings.gamma if gamma is None else check_gamma(gamma)
        green_list = self._green_lists.get(gamma)
        if green_list is None:
            green_list = GreenList(self.context.vocab_size, gamma, self.settings.key)
            self._green_lists[gamma] = green_list
        return green_list

    def create_detector(self, gamma: float | None = None) -> Detector:
        """A detector for text this server watermarked at ``gamma`` (default: the server's)."""
        return Detector(self.green_list(gamma), self.context.tokenizer)

    def request_settings(self, params: SamplingParams) -> tuple[float, float]:
        """(gamma, delta) of one request; ValueError naming a bad value."""
        value = params.extra.get(NAME)
        if value is None or value is True:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"extra['watermark'] must be an object with gamma and/or delta, got {value!r}")
        unknown = sorted(set(value) - set(REQUEST_FIELDS))
        if unknown:
            raise ValueError(
                f"extra['watermark'] has unknown field(s) {unknown}; a request may set gamma and delta "
                "(the key is the server's)"
            )
        gamma = check_gamma(value.get("gamma", self.settings.gamma), "extra['watermark'].gamma")
        delta = check_delta(value.get("delta", self.settings.delta), "extra['watermark'].delta")
        if int(gamma * self.context.vocab_size) < 1:
            raise ValueError(f"watermark gamma {gamma} leaves no green token in {self.context.vocab_size}")
        return gamma, delta

    def validate(self, params: SamplingParams) -> None:
        self.request_settings(params)

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        gamma, delta = self.request_settings(params)
        self._requests[request_id] = _RequestWatermark(self.green_list(gamma), delta)

    def remove_request(self, request_id: str) -> None:
        del self._requests[request_id]

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            state = self._requests[row.request_id]
            prev = row.output_token_ids[-1] if row.output_token_ids else row.prompt_token_ids[-1]
            logits[i, state.green_list.ids(prev).to(logits.device)] += state.delta
        return logits
