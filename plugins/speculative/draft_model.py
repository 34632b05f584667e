"""``draft_model``: a smaller model with the target's tokenizer proposes the next
``k`` tokens autoregressively; the target verifies them in one step.

The draft runs in the engine's process on the target's backend and dtype, through
Ember's own model code and paged attention, with a KV pool of its own
(``DRAFT_KV_TOKENS`` tokens). Each request keeps the tokens whose K/V its blocks
hold; a step first brings the draft up to the request's tokens (its whole prompt
the first time, afterwards the tokens accepted and emitted since, keeping the
longest prefix still valid: K/V of rejected drafts are simply overwritten), then
decodes ``k`` tokens, all requests in one batch per position. A greedy request
takes the draft's argmax (a point mass); a sampled one draws from the draft's
softmax at the request's temperature and sends that distribution along for
rejection sampling. When the pool is full, the requests not in the step lose their
draft state (least recently used first) and rebuild it when next proposed for.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ember.models.loader import load_hf_config, load_model
from ember.models.tokenizer import load_tokenizer
from ember.plugin import hookimpl
from ember.plugin.backend import AttentionBatch, SequenceSlice
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext
from ember.sampling_params import position_seed
from ember.weights import resolve_model

logger = logging.getLogger(__name__)

DRAFT_KV_TOKENS = 16384
BLOCK_SIZE = 16


@dataclass(slots=True)
class _State:
    fed: list[int] = field(default_factory=list)  # tokens whose K/V the draft's cache holds, in order
    blocks: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded request's own draws


class DraftModelSpeculator(BaseSpeculator):
    name = "draft_model"

    def __init__(self, context: SpeculatorContext) -> None:
        super().__init__(context)
        config = context.config
        if not config.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft model's id or directory")
        model_dir = resolve_model(config.model, None)
        hf_config = load_hf_config(model_dir)
        tokenizer = load_tokenizer(model_dir)
        if context.tokenizer is not None and tokenizer.get_vocab() != context.tokenizer.get_vocab():
            raise ValueError(f"draft model {config.model!r} does not share the target's tokenizer (their vocabularies "
                             "differ); a draft model must tokenize exactly as the target does")
        if hf_config.vocab_size > context.vocab_size:
            raise ValueError(f"draft model {config.model!r} has {hf_config.vocab_size} logits, more than the target's "
                             f"{context.vocab_size}")
        backend = context.backend
        self.attention = backend.create_attention()
        self.model = load_model(model_dir, hf_config, backend, self.attention, context.dtype, context.architectures)
        self.max_len = int(getattr(hf_config, "max_position_embeddings", 1 << 30))
        self.device = backend.device
        spec = self.model.kv_cache_spec
        kv_dtype = backend.kv_cache_dtype(context.dtype)
        num_blocks = DRAFT_KV_TOKENS // BLOCK_SIZE
        self.kv_caches = [
            torch.zeros(2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._states: OrderedDict[str, _State] = OrderedDict()  # least recently proposed for first
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(0x5EED)
        logger.info("draft model %s: %s, KV pool of %d tokens", config.model, type(self.model).__name__,
                    num_blocks * BLOCK_SIZE)

    # -- the KV pool ---------------------------------------------------------------------------
    def _ensure_blocks(self, request_id: str, state: _State, num_tokens: int, keep: set[str]) -> bool:
        needed = -(-num_tokens // BLOCK_SIZE) - len(state.blocks)
        while needed > len(self._free):
            victim = next((s for rid, s in self._states.items() if rid not in keep and s.blocks), None)
            if victim is None:
                return False
            self._free.extend(victim.blocks)  # its K/V is dropped; its generator stays
            victim.blocks, victim.fed = [], []
        for _ in range(max(0, needed)):
            state.blocks.append(self._free.pop())
        return True

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(state.blocks)

    # -- proposing ---------------------------------------------------------------------------
    def _forward(self, chunks: list[tuple[_State, list[int], int]]) -> torch.Tensor:
        """Run the draft over ``(state, tokens, start)`` chunks (tokens at positions
        ``start ...``) in one flat batch; logits ``(len(chunks), vocab)`` at each
        chunk's last token."""
        slices = [SequenceSlice(len(tokens), start, state.blocks) for state, tokens, start in chunks]
        batch = AttentionBatch.from_slices(slices, BLOCK_SIZE, self.device)
        ids = torch.tensor([t for _, tokens, _ in chunks for t in tokens], dtype=torch.int64, device=self.device)
        positions = torch.tensor([start + j for _, tokens, start in chunks for j in range(len(tokens))],
                                 dtype=torch.int64, device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, self.attention.prepare(batch))
        last = torch.tensor(batch.query_start_loc[1:].tolist(), device=self.device) - 1
        for state, tokens, _ in chunks:
            state.fed.extend(tokens)
        return self.model.compute_logits(hidden[last]).float()

    def _choose(self, logits: torch.Tensor, request: SpecRequest, state: _State,
                position: int) -> tuple[int, torch.Tensor | None]:
        """The draft for the request's output token ``position``: the argmax when
        greedy, else a draw from ``q``, from a generator keyed by (seed, position)
        when seeded, as the target's sampler keys its own."""
        if request.temperature == 0:
            return int(logits.argmax()), None
        q = torch.softmax(logits / request.temperature, dim=-1)
        generator = self._generator
        if request.seed is not None:
            if state.generator is None:
                state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(position_seed(request.seed, position, stream=3))
            generator = state.generator
        return int(torch.multinomial(q, 1, generator=generator)), q

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        keep = {r.request_id for r in requests}
        active: list[tuple[int, SpecRequest, _State]] = []
        chunks = []
        for index, request in enumerate(requests):
            tokens = request.prompt_token_ids + request.output_token_ids
            k = request.max_drafts
            if len(tokens) + k > self.max_len:
                continue
            state = self._states.pop(request.request_id, None) or _State()
            self._states[request.request_id] = state  # most recently used last
            valid = 0  # the longest prefix of what the cache holds that is still the request's
            for a, b in zip(state.fed, tokens):
                if a != b:
                    break
                valid += 1
            valid = min(valid, len(tokens) - 1)  # the last token is fed again: its logits propose
            del state.fed[valid:]
            if not self._ensure_blocks(request.request_id, state, len(tokens) + k, keep):
                continue
            active.append((index, request, state))
            chunks.append((state, tokens[valid:], valid))
        drafts: dict[int, list[int]] = {index: [] for index, _, _ in active}
        probs: dict[int, list[torch.Tensor | None]] = {index: [] for index, _, _ in active}
        if active:
            logits = self._forward(chunks)
            live = list(range(len(active)))
            while True:
                for row, slot in enumerate(live):
                    index, request, state = active[slot]
                    token, q = self._choose(logits[row], request, state,
                                            len(request.output_token_ids) + len(drafts[index]))
                    drafts[index].append(token)
                    probs[index].append(q)
                live = [slot for slot in live if len(drafts[active[slot][0]]) < active[slot][1].max_drafts]
                if not live:
                    break
                logits = self._forward([
                    (active[slot][2], [drafts[active[slot][0]][-1]], len(active[slot][2].fed)) for slot in live
                ])
        proposals = []
        for index in range(len(requests)):
            ids = drafts.get(index, [])
            rows = probs.get(index, [])
            q = None
            if ids and rows[0] is not None:
                q = torch.stack(rows).cpu()
                if q.shape[1] < self.context.vocab_size:  # the target's padded rows: never drawn
                    q = torch.nn.functional.pad(q, (0, self.context.vocab_size - q.shape[1]))
            proposals.append(Proposal(ids, q))
        return proposals


@hookimpl
def ember_register_speculators(registry) -> None:
    registry.register("draft_model", DraftModelSpeculator)
