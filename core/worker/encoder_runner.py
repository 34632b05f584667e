"""The runner's side of images: the encoder outputs it holds (by content hash), the
encoder passes the scheduler plans (`SchedulerOutput.encoder_inputs`), and a step's
input embeddings with each image's rows written over its placeholder positions.

A step whose tokens overlap no image never comes here: decode steps (and their
graphs) stay as they are."""

from __future__ import annotations

import torch

from ember.multimodal.inputs import embed_runs, overlapping
from ember.plugin.backend import AttentionBatch
from ember.sched.step import SchedulerOutput


class EncoderRunner:
    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        # an image's tokens attend to each other both ways (Gemma 3): the step's spans go to attention
        self.bidirectional = bool(getattr(model, "bidirectional_images", False))
        self.cache: dict[str, torch.Tensor] = {}  # content hash -> (num_embeds, hidden), compute dtype

    def run(self, scheduler_output: SchedulerOutput, requests: dict) -> None:
        """Drop evicted outputs, then encode this step's images (each distinct hash once, in one call)."""
        for content_hash in scheduler_output.freed_encoder_hashes:
            self.cache.pop(content_hash, None)
        todo: dict[str, dict[str, torch.Tensor]] = {}
        for request_id, indices in scheduler_output.encoder_inputs.items():
            items = requests[request_id].mm_items
            for index in indices:
                item = items[index]
                if item.content_hash not in self.cache:
                    todo.setdefault(item.content_hash, item.data)
        if todo:
            outputs = self.model.encode_images(list(todo.values()))
            for content_hash, rows in zip(todo, outputs):
                self.cache[content_hash] = rows

    def input_embeds(self, input_ids: torch.Tensor, requests: list, query_lens: list[int],
                     attention_batch: AttentionBatch) -> torch.Tensor | None:
        """The step's input embeddings with image rows in place, or None when no token
        of the step lies in an image's run; for a bidirectional model, the images' runs
        the step's queries touch go to ``attention_batch.bidirectional_spans``."""
        spans = []
        first = 0
        bidirectional: list[tuple] = []
        for request, num_tokens in zip(requests, query_lens):
            start = request.num_computed_tokens
            runs: tuple = ()
            if request.mm_items and start < len(request.prompt_token_ids):
                for index in overlapping(request.mm_items, start, start + num_tokens):
                    spans.append((request.mm_items[index], first, start, start + num_tokens))
                    if self.bidirectional:
                        runs += tuple(r for r in embed_runs(request.mm_items[index])
                                      if r[0] < start + num_tokens and start < r[1])
            bidirectional.append(runs)
            first += num_tokens
        if not spans:
            return None
        if self.bidirectional and any(bidirectional):
            attention_batch.bidirectional_spans = bidirectional
        embeds = self.model.embed(input_ids.to(self.device)).clone()
        for item, first, start, end in spans:
            rows = self.cache.get(item.content_hash)
            if rows is None:  # the scheduler's plan and the runner's cache disagree: a bug, never input
                raise RuntimeError(f"encoder output of image {item.content_hash[:12]} is not in the runner's cache")
            lo, hi = max(start, item.offset), min(end, item.end)
            row_lo, row_hi = item.embed_range(lo, hi)
            if item.embed_mask is None:
                embeds[first + lo - start : first + hi - start] = rows[row_lo:row_hi]
            else:
                positions = torch.nonzero(item.embed_mask[lo - item.offset : hi - item.offset]).flatten()
                embeds[first + lo - start + positions.to(embeds.device)] = rows[row_lo:row_hi]
        return embeds
