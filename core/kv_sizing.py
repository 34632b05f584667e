"""How long a request may be and whether the KV cache holds one: the model's context
(`resolve_max_model_len`) against the pool the budget buys (`check_kv_cache`)."""

from __future__ import annotations

from ember.config import EngineConfig


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """``requested`` (None: the model's context), checked against the model's context."""
    model_max_len = int(getattr(hf_config, "max_position_embeddings", 2048))
    sliding_window = getattr(hf_config, "sliding_window", None)
    if sliding_window and getattr(hf_config, "use_sliding_window", True):
        # Ember has no sliding-window attention yet: stay within the window,
        # where full attention is exact.
        model_max_len = min(model_max_len, int(sliding_window))
    max_model_len = requested or model_max_len
    if max_model_len > model_max_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {model_max_len}")
    return max_model_len


class KVCacheTooSmallError(ValueError):
    """The KV cache cannot hold one request of ``max_model_len`` tokens (raised only with
    ``EngineConfig.require_kv_for_max_model_len``). ``budget_bytes``: the memory the pool
    was sized from, and ``bytes_per_token`` the model's; both None when the pool was
    given in blocks (then the check runs before the model is built)."""

    def __init__(
        self, num_kv_tokens: int, max_model_len: int, block_size: int,
        bytes_per_token: int | None, budget_bytes: int | None,
    ) -> None:
        self.num_kv_tokens = num_kv_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        needed_blocks = -(-max_model_len // block_size)
        if budget_bytes is None or bytes_per_token is None:
            fix = f"num_kv_blocks to at least {needed_blocks}"
        else:
            fix = f"kv_cache_memory_bytes to at least {needed_blocks * block_size * bytes_per_token}"
        super().__init__(
            f"the KV cache holds {num_kv_tokens} tokens, less than one request of max_model_len {max_model_len}; "
            f"lower max_model_len to at most {num_kv_tokens} or raise {fix}"
        )

    def __reduce__(self):  # pickles across the engine-core process boundary
        return (type(self), (self.num_kv_tokens, self.max_model_len, self.block_size, self.bytes_per_token,
                             self.budget_bytes))


def check_kv_cache(
    num_blocks: int, config: EngineConfig, max_model_len: int,
    bytes_per_token: int | None = None, budget_bytes: int | None = None,
) -> None:
    """Refuse a pool of less than one block, and (``config.require_kv_for_max_model_len``)
    one that cannot hold a request of ``max_model_len`` tokens. ``bytes_per_token`` and
    ``budget_bytes``: how the pool was sized, when it was sized from memory."""
    if num_blocks < 1:
        raise ValueError("the KV cache budget holds less than one block; raise kv_cache_memory_bytes")
    num_tokens = num_blocks * config.block_size
    if config.require_kv_for_max_model_len and num_tokens < max_model_len:
        raise KVCacheTooSmallError(num_tokens, max_model_len, config.block_size, bytes_per_token, budget_bytes)
