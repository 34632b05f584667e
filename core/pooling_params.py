"""Per-request pooling parameters: a request that asks for a vector, not tokens.

A pooling request (``SamplingParams.pooling``) is prefilled like any prompt (chunked,
batched with generating requests) and ends when its last prompt token is computed,
with one vector instead of a sampled token (docs/embeddings.md):

* ``"last"``: the final hidden state (after the model's final norm, before the LM
  head) of the last prompt token — decoder embedding models (Qwen3-Embedding, E5-Mistral);
* ``"mean"``: the mean of the final hidden states over every prompt token;
* ``"cls"``: the final hidden state of the first prompt token;
* ``"logits"``: the next-token logits at the last prompt token, of ``logit_token_ids``
  only (a yes/no reranker's two logits), raw and never normalised.

``pooling_type=None`` and ``normalize=None`` take the engine's defaults for the model
(``EngineConfig.pooling``: the model's sentence-transformers config, else last token
and normalised). ``dimensions`` keeps the first that many components before
normalising (Matryoshka embeddings; refused unless the model supports it).
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls", "logits")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class PoolingParams:
    """How one request's prompt becomes a vector; validated at construction (ValueError naming the value)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    logit_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_token_ids", tuple(self.logit_token_ids or ()))
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)} or None, got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean or None, got {self.normalize!r}")
        if self.dimensions is not None and not _is_positive_int(self.dimensions):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        is_logits = self.pooling_type == "logits"
        if is_logits != bool(self.logit_token_ids):
            raise ValueError("logit_token_ids must be given with pooling_type 'logits', and only then, got "
                             f"{self.logit_token_ids!r} with {self.pooling_type!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logit_token_ids):
            raise ValueError(f"logit_token_ids must be non-negative token ids, got {self.logit_token_ids!r}")
        if is_logits and (self.dimensions is not None or self.normalize):
            raise ValueError("pooling_type 'logits' returns raw logits: dimensions and normalize do not apply")

    @property
    def needs_every_position(self) -> bool:
        """Whether the hidden states of positions before the last are read (mean, CLS):
        such a request must compute its whole prompt, so it takes no prefix-cache blocks."""
        return self.pooling_type in ("mean", "cls")


@dataclass(frozen=True)
class PoolingDefaults:
    """The engine's pooling for one model: what ``None`` fields of a request become,
    and whether the model supports ``dimensions`` (Matryoshka)."""

    pooling_type: str = "last"
    normalize: bool = True
    is_matryoshka: bool = False
    hidden_size: int = 0
    unsupported: str | None = None  # why this engine runs no pooling request (None: it does)

    def apply(self, params: PoolingParams) -> PoolingParams:
        """A request's params with every field set (ValueError for dimensions the model cannot give)."""
        if self.unsupported is not None:
            raise ValueError(self.unsupported)
        if params.dimensions is not None:
            if not self.is_matryoshka:
                raise ValueError("dimensions: this model does not support truncated (Matryoshka) embeddings")
            if params.dimensions > self.hidden_size:
                raise ValueError(f"dimensions must be at most the model's embedding size {self.hidden_size}, "
                                 f"got {params.dimensions}")
        kind = params.pooling_type or self.pooling_type
        normalize = (self.normalize if params.normalize is None else params.normalize) and kind != "logits"
        return PoolingParams(kind, normalize, params.dimensions, params.logit_token_ids)
