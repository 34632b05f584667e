"""How long a request may be and how large the KV cache is: the model's context
(`resolve_max_model_len`), the budget a profiling forward pass leaves
(`profile_kv_budget`, vLLM's approach) and whether the pool holds a request
(`check_kv_cache`)."""

from __future__ import annotations

import logging
import time

import torch

from ember.config import EngineConfig
from ember.models.base import KVCacheSpec
from ember.models.loader import get_model_class
from ember.plugin.backend import AttentionBatch, SequenceSlice

logger = logging.getLogger("ember.engine.core")  # start-up figures, logged as the engine core's


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """``requested`` (None: the model's context), checked against the model's context."""
    # sliding-window layers attend within their window at any length (the attention's
    # window=): the context is the model's whole one
    model_max_len = int(getattr(hf_config, "max_position_embeddings", 2048))
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


def resolve_block_size(requested: int | None, attention) -> int:
    """Tokens per KV block: ``requested``, or the attention's ``default_block_size``
    when None; a size the attention cannot run (not a multiple of its
    ``block_size_multiple``) is a ValueError naming both."""
    block_size = attention.default_block_size if requested is None else requested
    multiple = attention.block_size_multiple
    if block_size % multiple:
        raise ValueError(
            f"block_size {block_size} does not suit the {attention.name} attention, whose paged KV cache needs "
            f"blocks of a multiple of {multiple} tokens; leave block_size unset (default {attention.default_block_size}) "
            "or choose another attention (--backend-option attention=..., docs/backends.md)"
        )
    return block_size


def check_kv_cache(
    num_blocks: int, block_size: int, config: EngineConfig, max_model_len: int,
    bytes_per_token: int | None = None, budget_bytes: int | None = None,
) -> None:
    """Refuse a pool of less than one block, and (``config.require_kv_for_max_model_len``)
    one that cannot hold a request of ``max_model_len`` tokens. ``bytes_per_token`` and
    ``budget_bytes``: how the pool was sized, when it was sized from memory."""
    if num_blocks < 1:
        raise ValueError("the KV cache budget holds less than one block; raise kv_cache_memory_bytes")
    num_tokens = num_blocks * block_size
    if config.require_kv_for_max_model_len and num_tokens < max_model_len:
        raise KVCacheTooSmallError(num_tokens, max_model_len, block_size, bytes_per_token, budget_bytes)


def profile_kv_budget(model, backend, attention, kv_dtype, num_tokens: int, block_size: int, max_num_seqs: int) -> int:
    """Bytes the backend gives the KV cache: its share of the memory left after the
    weights and the peak of one profiling forward pass at the largest step."""
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    started = time.perf_counter()
    activation_bytes = backend.peak_memory_of(
        lambda: _profile_forward(model, backend, attention, kv_dtype, num_tokens, block_size, max_num_seqs)
    )
    logger.info(
        "profiling forward pass of %d tokens: peak %s in %.2f s", num_tokens,
        "unknown" if activation_bytes is None else f"{activation_bytes / 2**20:.1f} MiB",
        time.perf_counter() - started,
    )
    return backend.kv_cache_memory_bytes(model_bytes, activation_bytes or 0)


@torch.inference_mode()
def _profile_forward(model, backend, attention, kv_dtype, num_tokens: int, block_size: int, max_num_seqs: int) -> None:
    """One forward pass over ``num_tokens`` dummy tokens (one sequence: prefill
    attention's peak), with logits for ``max_num_seqs`` rows, into a throwaway cache."""
    spec, device = model.kv_cache_spec, backend.device
    num_blocks = -(-num_tokens // block_size)
    caches = [
        torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype, device=device)
        for _ in range(spec.num_layers)
    ]
    batch = AttentionBatch.from_slices([SequenceSlice(num_tokens, 0, list(range(num_blocks)))], block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), caches, attention.prepare(batch))
    model.compute_logits(hidden[-min(max_num_seqs, num_tokens):])
    backend.synchronize()


def kv_cache_spec_from_config(hf_config, backend, dtype, attention, architectures) -> KVCacheSpec:
    """The model's KV shape from its config alone: the model built on the meta device."""
    cls = get_model_class(hf_config, architectures)
    model = cls(hf_config, attention, backend.compute_dtype(dtype), dtype=backend.weight_dtype(dtype), device="meta")
    return model.kv_cache_spec


def explicit_num_blocks(config, block_size: int, max_model_len: int, bytes_per_token) -> int | None:
    """The KV pool's blocks where the user sized it (``num_kv_blocks``, ``num_kv_tokens``,
    ``kv_cache_memory_bytes``; ``bytes_per_token()`` is asked only for the last), checked;
    None when the pool is to be measured after the weights load."""
    num_blocks = config.num_kv_blocks
    if num_blocks is None and config.num_kv_tokens is not None:
        num_blocks = -(-config.num_kv_tokens // block_size)
    if num_blocks is not None:
        check_kv_cache(num_blocks, block_size, config, max_model_len)
    elif config.kv_cache_memory_bytes is not None:
        per_token = bytes_per_token()
        budget = config.kv_cache_memory_bytes
        num_blocks = budget // (per_token * block_size)
        check_kv_cache(num_blocks, block_size, config, max_model_len, per_token, budget)
    return num_blocks


def step_token_budgets(config, backend, hf_config, dtype: torch.dtype, max_model_len: int) -> tuple[int, int | None]:
    """A step's token budget and that of a step with no decode (None: the same): the
    user's ``max_num_batched_tokens``, else with chunked prefill the backend's default
    (at least one decode token for every running request) and its prefill-only budget,
    else one whole prompt of the context."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens, None
    if config.enable_chunked_prefill:
        max_batched = max(backend.default_step_tokens, config.max_num_seqs)
        prefill_tokens = backend.prefill_step_tokens(hf_config, backend.compute_dtype(dtype))
        return max_batched, max(max_batched, prefill_tokens or 0)
    return max(8192, max_model_len), None
