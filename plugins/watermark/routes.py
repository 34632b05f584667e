"""``POST /watermark/detect``: added to the app by this plugin's ``ember_api_routes``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, error_response, validation_error
from ember.api.http import read_model
from ember.api.openapi import documented

from .processor import NAME, WatermarkProcessor

if TYPE_CHECKING:
    from ember.api.service import GenerationService


class DetectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, description="text to score, tokenized with the served model's tokenizer")
    token_ids: list[int] | None = Field(None, description="token ids to score (instead of text)")
    prefix_token_id: int | None = Field(None, ge=0, description="the token before token_ids, so the first is scored")
    gamma: float | None = Field(None, gt=0.0, lt=1.0, description="the gamma it was generated with (default: the server's)")


def find_processor(service: GenerationService) -> WatermarkProcessor:
    for processor in service.engine.engine.logits_pipeline.processors:
        if processor.name == NAME:
            return processor
    raise LookupError("the watermark logits processor is not loaded")


class WatermarkRoutes:
    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def routes(self) -> list[Route]:
        return [Route("/watermark/detect", self.detect, methods=["POST"])]

    @documented(summary="Score text or token ids for the watermark: green count, z-score, p-value",
                tag="Watermark", request=DetectRequest)
    async def detect(self, request: Request) -> JSONResponse:
        """Score text or token ids: green count, z-score, p-value."""
        try:
            body = await read_model(request, DetectRequest)
            if (body.text is None) == (body.token_ids is None):
                raise validation_error("give exactly one of `text` and `token_ids`")
            processor = find_processor(self.service)
            # what one request can generate at most is what there is to score
            max_tokens = self.service.limits.max_total_tokens
            if body.token_ids is not None and len(body.token_ids) > max_tokens:
                raise validation_error(
                    f"`token_ids` holds {len(body.token_ids)} tokens; at most --max-total-tokens ({max_tokens})",
                    "token_ids",
                )
            if body.text is not None:
                self.service.check_chars(body.text, "text", max_tokens)
            try:
                detector = processor.create_detector(body.gamma)
                if body.text is not None:
                    output = await self.service.run_blocking(detector.detect_text, body.text)
                else:
                    output = await self.service.run_blocking(detector.detect, body.token_ids, body.prefix_token_id)
            except ValueError as exc:
                raise validation_error(str(exc)) from None
        except APIError as exc:
            return error_response(exc, Flavor.TGI)
        return JSONResponse(output.to_dict())
