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

from ember.engine.client import ModelInfo
from ember.grammar_limits import check_constraint
from ember.sampling_params import SamplingParams
from ember.sched.request import check_priority, check_request_fits

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase



def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None,
) -> str:
    """The prompt text of a chat; ``tools`` go to a template that renders them
    (`ember.engine.tool_calls.chat_messages` prepares both)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)



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
        if params.constraint is not None:
            check_constraint(params.constraint, self.info.grammar_limits)
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
        if params.pooling is not None:
            info.pooling.apply(params.pooling)  # ValueError for dimensions the model cannot give
            bad = [t for t in params.pooling.logit_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"logit token id {bad[0]} is outside the vocabulary [0, {vocab})")
        check_request_fits(
            len(prompt_token_ids), params.max_tokens, max_model_len=info.max_model_len,
            chunked_prefill=info.is_chunked_prefill, max_num_batched_tokens=info.max_num_batched_tokens,
            num_kv_blocks=info.num_kv_blocks, block_size=info.block_size, pooling=params.pooling is not None,
        )
        return prompt_token_ids
