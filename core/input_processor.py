"""Chat templates and validation, once, before a request enters the engine core.

The :class:`InputProcessor` turns a prompt (text or token ids) and its
`SamplingParams` into the core's request, or raises ValueError naming the problem:
an empty prompt, token ids outside the vocabulary, a prompt the context cannot hold,
a request larger than the whole KV cache, sampling parameters the sampler or a
logits processor refuses. It needs only the tokenizer, the engine's figures
(`ModelInfo`) and a validator (`Sampler.validate`), so it works the same beside an
engine core in this thread, another thread or another process. Thread-safe: it
keeps no per-request state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ember.engine_client import ModelInfo
from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase



def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None,
) -> str:
    """The prompt text of a chat; ``tools`` go to a template that renders them
    (`ember.tool_calls.chat_messages` prepares both)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)



def check_priority(priority: object) -> int:
    """A request's priority is a plain integer (lower runs first); ValueError names anything else."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
    return priority


def check_request_fits(
    num_prompt_tokens: int, max_tokens: int, *, max_model_len: int, chunked_prefill: bool,
    max_num_batched_tokens: int, num_kv_blocks: int, block_size: int,
) -> None:
    """Raise ValueError naming the limit if a request could never be scheduled: a
    prompt that leaves no room in the context, one larger than a step without chunked
    prefill, or a worst case (prompt + max_tokens, capped at the context) larger than
    the whole KV cache. A pure function of the engine's figures, so that validation
    outside the engine core (another thread or process) asks the same question."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens; the model's context "
            f"(max_model_len) is {max_model_len}, which leaves no room for a generated token"
        )
    if not chunked_prefill and num_prompt_tokens > max_num_batched_tokens:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens ({max_num_batched_tokens})"
        )
    needed = -(-min(num_prompt_tokens + max_tokens, max_model_len) // block_size)
    if needed > num_kv_blocks:
        raise ValueError(
            f"request needs {needed} KV blocks (prompt {num_prompt_tokens} + max_tokens {max_tokens} tokens) "
            f"but the whole KV cache has {num_kv_blocks}"
        )


class InputProcessor:
    def __init__(self, tokenizer, info: ModelInfo, validate_params: Callable[[SamplingParams], None]) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.validate_params = validate_params

    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt)

    def validate(
        self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None, priority: int = 0,
    ) -> list[int]:
        """The prompt's token ids, checked; ValueError names the first problem."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        self.validate_params(params)
        if prompt_token_ids is None:
            if prompt is None or (isinstance(prompt, str) and not prompt):
                raise ValueError("prompt is empty: give a non-empty prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.info.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        info = self.info
        check_request_fits(
            len(prompt_token_ids), params.max_tokens, max_model_len=info.max_model_len,
            chunked_prefill=info.is_chunked_prefill, max_num_batched_tokens=info.max_num_batched_tokens,
            num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
        )
        return prompt_token_ids
