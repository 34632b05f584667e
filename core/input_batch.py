"""The model runner's persistent batch: every request it holds, kept between steps.

The scheduler sends a request in full once (`ember.step.NewRequest`) and deltas
afterwards; this module keeps what the runner needs of each request in tensors
indexed by a row per request — token ids, block table — plus the request's token
lists for logits processors. A step gathers its input ids, positions and cache slots
from those tensors with a few tensor operations, so a decode step costs O(batch)
Python whatever the requests' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.sampling_params import SamplingParams
from ember.step import CachedRequest, NewRequest


@dataclass(slots=True, eq=False)
class RunnerRequest:
    """The runner's own copy of one request (never shared with the scheduler)."""

    request_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what the runner sampled (and was accepted)
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_blocks: int = 0
    # tokens proposed for this step (written after the request's tokens)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows of requests; row ``r``'s tokens are ``token_ids[r, :num_tokens]`` and its
    blocks ``block_table[r, :num_blocks]`` (on the backend's device)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        # token ids stay on the host (the step's input ids are gathered there and sent
        # once); the block table lives on the device, where attention reads it
        self.token_ids = torch.zeros(max_num_reqs, min(max_model_len, 1024), dtype=torch.int64)
        self.block_table = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int64, device=device)
        self.requests: dict[str, RunnerRequest] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def _ensure_width(self, num_tokens: int) -> None:
        width = self.token_ids.shape[1]
        if num_tokens > width:  # doubling: amortized O(1) per token
            grown = torch.zeros(self.token_ids.shape[0], min(max(num_tokens, 2 * width), self.max_model_len),
                                dtype=torch.int64)
            grown[:, :width] = self.token_ids
            self.token_ids = grown

    def add(self, new: NewRequest) -> RunnerRequest:
        if new.request_id in self.requests:
            raise ValueError(f"request {new.request_id!r} is already in the runner's batch")
        if not self._free_rows:
            raise RuntimeError("the runner's batch is full (more requests than max_num_seqs)")
        row = self._free_rows.pop()
        request = RunnerRequest(
            new.request_id, row, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
            tuple(new.eos_token_ids), new.num_computed_tokens,
        )
        tokens = request.prompt_token_ids + request.output_token_ids
        self._ensure_width(len(tokens))
        self.token_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self._add_blocks(request, new.block_ids)
        self.requests[new.request_id] = request
        return request

    def update(self, cached: CachedRequest) -> RunnerRequest:
        request = self.requests[cached.request_id]
        request.num_computed_tokens = cached.num_computed_tokens
        if cached.new_block_ids:
            self._add_blocks(request, cached.new_block_ids)
        return request

    def _add_blocks(self, request: RunnerRequest, block_ids: list[int]) -> None:
        n = len(block_ids)
        if not n:
            return
        end = request.num_blocks + n
        if end > self.block_table.shape[1]:
            raise ValueError(f"request {request.request_id!r} has {end} blocks, more than its context allows")
        self.block_table[request.row, request.num_blocks : end] = torch.tensor(block_ids, dtype=torch.int64)
        request.num_blocks = end

    def remove(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._free_rows.append(request.row)

    def set_drafts(self, request: RunnerRequest, draft_token_ids: list[int]) -> None:
        """Place proposed tokens after the request's tokens (input ids of this step)."""
        request.draft_token_ids = list(draft_token_ids)
        if draft_token_ids:
            start = request.num_tokens
            self._ensure_width(start + len(draft_token_ids))
            self.token_ids[request.row, start : start + len(draft_token_ids)] = torch.tensor(
                draft_token_ids, dtype=torch.int64
            )

    def append(self, request: RunnerRequest, token_ids: list[int]) -> None:
        """Tokens the request emitted this step (accepted drafts and the sampled one)."""
        start = request.num_tokens
        request.output_token_ids.extend(token_ids)
        request.draft_token_ids = []
        if start < self.max_model_len:
            end = min(start + len(token_ids), self.max_model_len)
            self._ensure_width(end)
            self.token_ids[request.row, start:end] = torch.tensor(token_ids[: end - start], dtype=torch.int64)

    def gather(
        self, requests: list[RunnerRequest], query_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's flat input ids and positions (host), cache slots and block-table
        rows (device), for ``query_lens[i]`` tokens of ``requests[i]`` from its computed count."""
        rows = torch.tensor([r.row for r in requests], dtype=torch.int64)
        starts = torch.tensor([r.num_computed_tokens for r in requests], dtype=torch.int64)
        if all(n == 1 for n in query_lens):  # decodes only: one token per row
            flat_rows, positions = rows, starts
        else:
            lens = torch.tensor(query_lens, dtype=torch.int64)
            flat_rows = rows.repeat_interleave(lens)
            first = torch.cumsum(lens, 0) - lens  # flat index of each request's first token
            positions = starts.repeat_interleave(lens) + torch.arange(int(lens.sum())) - first.repeat_interleave(lens)
        input_ids = self.token_ids[flat_rows, positions]
        device_rows = flat_rows.to(self.device)
        device_positions = positions.to(self.device)
        slots = (
            self.block_table[device_rows, device_positions // self.block_size] * self.block_size
            + device_positions % self.block_size
        )
        width = max(max(r.num_blocks for r in requests), 1)
        return input_ids, positions, slots, self.block_table[rows.to(self.device), :width]
