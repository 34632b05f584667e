"""``POST /watermark/detect``: added to the app by this plugin's ``ember_api_routes``.

It uses only what the hook hands it (`ember.plugin.hookspecs.RouteContext`): the
engine client, to reach this plugin's own processor (its key and default gamma),
and the API's helpers for bodies, errors and long work. No ``ember.api`` import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from .processor import NAME, WatermarkProcessor

if TYPE_CHECKING:
    from ember.plugin.hookspecs import RouteContext


class DetectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, description="text to score, tokenized with the served model's tokenizer")
    token_ids: list[int] | None = Field(None, description="token ids to score (instead of text)")
    prefix_token_id: int | None = Field(None, ge=0, description="the token before token_ids, so the first is scored")
    gamma: float | None = Field(None, gt=0.0, lt=1.0, description="the gamma it was generated with (default: the server's)")


class WatermarkRoutes:
    def __init__(self, context: RouteContext) -> None:
        self.context = context

    def routes(self) -> list[Any]:
        return [self.context.route(
            "/watermark/detect", self.detect, methods=("POST",),
            summary="Score text or token ids for the watermark: green count, z-score, p-value",
            tag="Watermark", request_model=DetectRequest,
        )]

    async def detect(self, request: Any) -> dict:
        """Score text or token ids: green count, z-score, p-value."""
        ctx = self.context
        body = await ctx.read_body(request, DetectRequest)
        if (body.text is None) == (body.token_ids is None):
            raise ctx.validation_error("give exactly one of `text` and `token_ids`")
        processor: WatermarkProcessor = ctx.client.logits_processor(NAME)
        # what one request can generate at most is what there is to score
        max_tokens = ctx.max_total_tokens
        if body.token_ids is not None and len(body.token_ids) > max_tokens:
            raise ctx.validation_error(
                f"`token_ids` holds {len(body.token_ids)} tokens; at most --max-total-tokens ({max_tokens})",
                "token_ids",
            )
        if body.text is not None:
            ctx.check_chars(body.text, "text", max_tokens)
        try:
            detector = processor.create_detector(body.gamma)
            if body.text is not None:
                output = await ctx.run_blocking(detector.detect_text, body.text)
            else:
                output = await ctx.run_blocking(detector.detect, body.token_ids, body.prefix_token_id)
        except ValueError as exc:
            raise ctx.validation_error(str(exc)) from None
        return output.to_dict()
