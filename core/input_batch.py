"""The model runner's persistent batch: every request it holds, kept between steps.

The scheduler sends a request in full once (`ember.step.NewRequest`) and deltas
afterwards; this module keeps what the runner needs of each request in arrays
indexed by a row per request — token ids, block table — plus the request's token
lists for logits processors. A step gathers its input ids, positions, cache slots
and block-table rows from those arrays with a few vectorized operations and sends
them to the device once, so a decode step costs O(batch) Python whatever the
requests' lengths. The arrays live on the host (NumPy, whose small indexing
operations cost a microsecond where a torch operation costs several; the CPU
backend reads the step's tensors without a copy) — the same layout a device
backend copies from, as vLLM's host-side input batch does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ember.backend import AttentionBatch
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
    # its block ids as a list too: a decode row's cache slot in O(1) Python
    block_ids: list[int] = field(default_factory=list)
    # tokens copied into the batch's token array so far (decode steps read the
    # lists; the array catches up only when a multi-token step needs it)
    num_written: int = 0
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
    blocks ``block_table[r, :num_blocks]`` (host arrays)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, min(max_model_len, 1024)), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.requests: dict[str, RunnerRequest] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def _ensure_width(self, num_tokens: int) -> None:
        width = self.token_ids.shape[1]
        if num_tokens > width:  # doubling: amortized O(1) per token
            grown = np.zeros((self.token_ids.shape[0], min(max(num_tokens, 2 * width), self.max_model_len)),
                             dtype=np.int64)
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
        self.token_ids[row, : len(tokens)] = tokens
        request.num_written = len(tokens)
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
        self.block_table[request.row, request.num_blocks : end] = block_ids
        request.block_ids.extend(block_ids)
        request.num_blocks = end

    def remove(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._free_rows.append(request.row)

    def _write_tokens(self, request: RunnerRequest) -> None:
        """Copy the request's tokens not in the token array yet (its latest outputs)."""
        end = min(request.num_tokens, self.max_model_len)
        if request.num_written < end:
            self._ensure_width(end)
            first = request.num_written - request.num_prompt_tokens
            self.token_ids[request.row, request.num_written : end] = request.output_token_ids[first : first + end - request.num_written]
            request.num_written = end

    def set_drafts(self, request: RunnerRequest, draft_token_ids: list[int]) -> None:
        """Place proposed tokens after the request's tokens (input ids of this step)."""
        request.draft_token_ids = list(draft_token_ids)
        if draft_token_ids:
            self._write_tokens(request)
            start = request.num_tokens
            self._ensure_width(start + len(draft_token_ids))
            self.token_ids[request.row, start : start + len(draft_token_ids)] = draft_token_ids

    def append(self, request: RunnerRequest, token_ids: list[int]) -> None:
        """Tokens the request emitted this step (accepted drafts and the sampled one)."""
        request.output_token_ids.extend(token_ids)
        request.draft_token_ids = []

    def gather(self, requests: list[RunnerRequest], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """This step's flat input ids and positions (host tensors) and its attention
        batch (slots, block-table rows, lengths on the device), for ``query_lens[i]``
        tokens of ``requests[i]`` from its computed count.

        Right after a forward pass every small operation runs cold (tens of
        microseconds each), so the step's integers are built as one list and sent as
        one tensor; only the block-table rows come from the host array."""
        bs, n, device = self.block_size, len(requests), self.device
        starts = [r.num_computed_tokens for r in requests]
        rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=n)
        width = max(max(r.num_blocks for r in requests), 1)
        tables = torch.from_numpy(self.block_table[rows, :width])
        if len(query_lens) == sum(query_lens):
            # decodes only: each row's one token is its last, at position num_computed
            flat = [0] * (6 * n + 1)
            for i, r in enumerate(requests):
                p = starts[i]
                flat[i] = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                flat[n + i] = p
                flat[2 * n + i] = r.block_ids[p // bs] * bs + p % bs
                flat[3 * n + i] = p + 1
                flat[4 * n + i] = i
            flat[5 * n] = n
            step = torch.tensor(flat[: 5 * n + 1], dtype=torch.int64)
            input_ids, positions, rest = step.split([n, n, 3 * n + 1])
        else:
            for r in requests:
                self._write_tokens(r)
            lens = np.asarray(query_lens, dtype=np.int64)
            np_starts = np.asarray(starts, dtype=np.int64)
            flat_rows = np.repeat(rows, lens)
            cum = np.cumsum(lens)
            first = cum - lens  # flat index of each request's first token
            np_positions = np.repeat(np_starts, lens) + np.arange(int(cum[-1])) - np.repeat(first, lens)
            slots = self.block_table[flat_rows, np_positions // bs] * bs + np_positions % bs
            step = torch.from_numpy(np.concatenate([
                self.token_ids[flat_rows, np_positions], np_positions, slots, np_starts + lens, first, cum[-1:],
            ]))
            num_tokens = int(cum[-1])
            input_ids, positions, rest = step.split([num_tokens, num_tokens, len(slots) + 2 * n + 1])
        if device.type != "cpu":
            rest, tables = rest.to(device), tables.to(device)
        slots, seq_lens, query_start_loc = rest.split([len(rest) - 2 * n - 1, n, n + 1])
        return input_ids, positions, AttentionBatch(
            query_lens, starts, tables, slots, bs, seq_lens, query_start_loc,
        )
