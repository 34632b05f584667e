"""``eagle``: an EAGLE draft head (Li et al., 2024, EAGLE-1) on the target's hidden states.

The head is one decoder layer (rarely more) run autoregressively at the level of
the target's features. At position ``t`` its input is
``fc(concat(embed(token[t + 1]), feature[t]))``, where ``feature[t]`` is the
target's last hidden state at ``t`` — after the final norm: EAGLE's code takes the
output of the base model's ``model`` (Hugging Face's ``LlamaModel``, which applies
the norm) and feeds the same tensor to the LM head, and Ember's runner hands over
exactly that tensor. The layer (layer 0 has no input norm) attends causally over
the head's own K/V of earlier positions; its output is a predicted feature, and the
target's LM head on it (no norm in between, as in EAGLE) gives the next token's
logits. Drafting ``k`` tokens: the output at the request's last known position
proposes the first draft, then each predicted feature is fed back with the draft
token it proposed (a chain, top-1; no tree). The drafts are argmaxes, deterministic
proposals the target verifies by agreement: exact under greedy decoding and under
sampling (rejection sampling with a point mass for ``q``).

Positions. The head's K/V for position ``t`` needs the target's feature at ``t``,
which the runner sends after each step (``observe_hidden``: prefill chunks, each
decode's last token and accepted drafts; rejected drafts never). They wait in the
request's state until it is next proposed for; then the head catches up on them
in one batch, and the ``k`` drafting positions are written after them and never
counted: the next catch-up overwrites their slots, so a rejected draft leaves no
trace. A prefix the target found in its prefix cache was never computed, so the
head has no features for it and attends over the rest; features held longer than
``MAX_PENDING_TOKENS`` (a large batch stepped aside for long) are dropped the same
way, oldest first. Both cost acceptance only, never exactness.

The K/V lives in a paged pool of its own (``EAGLE_KV_TOKENS``) on the target's
backend, read by the backend's own attention; a full pool takes the blocks of the
requests not in the step, least recently proposed for first.

Checkpoints in the layout SafeAILab/EAGLE publishes for Llama-family targets
(``yuhuili/EAGLE-llama2-chat-7B``): a directory with ``config.json`` (a
LlamaConfig; ``bias`` false for a head without ``fc.bias``) and
``pytorch_model.bin`` or ``model.safetensors`` holding ``fc.weight`` ``(hidden,
2 * hidden)``, ``fc.bias``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.post_attention_layernorm.weight`` (``input_layernorm`` from layer 1
on, accepted on layer 0) and optionally ``embed_tokens.weight`` (else the
target's embedding is used). vLLM's converted form is read too: ``config.json``
of ``model_type`` ``eagle`` with the Llama config under ``model``, tensor names
with ``model.`` prefixes, and an ``lm_head.weight`` used in place of the target's.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ember.models.layers import Linear, RMSNorm, RotaryEmbedding, rope_parameters
from ember.models.llama import LlamaAttention, LlamaMLP
from ember.plugin import hookimpl
from ember.plugin.backend import AttentionBatch, SequenceSlice
from ember.plugin.speculator import BaseSpeculator, Proposal, SpecRequest, SpeculatorContext

logger = logging.getLogger(__name__)

EAGLE_KV_TOKENS = 16384
MAX_PENDING_TOKENS = 4096  # features kept per request between proposals
BLOCK_SIZE = 16

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _canonical(name: str) -> str:
    """EAGLE's own names are ``fc.weight``, ``layers.0...``; vLLM's converted heads
    prefix them with ``model.`` (once or twice)."""
    while name.startswith("model."):
        name = name[len("model."):]
    return name


def read_eagle_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the head's Llama config as a dict, tensors by EAGLE's names) of a checkpoint
    directory; ValueError naming what is missing."""
    if not path.is_dir():
        raise ValueError(f"EAGLE head {str(path)!r}: not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"EAGLE head at {path}: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"EAGLE head at {path}: config.json is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"EAGLE head at {path}: config.json must hold an object")
    config = raw["model"] if raw.get("model_type") == "eagle" and isinstance(raw.get("model"), dict) else raw
    if raw is not config:  # vLLM's EAGLEConfig keeps the head's own keys beside the Llama config
        config = {**config, **{k: v for k, v in raw.items() if k in ("bias", "truncated_vocab_size")}}
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        loaded = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        loaded = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"EAGLE head at {path}: no model.safetensors or pytorch_model.bin")
    tensors = {}
    for name, tensor in loaded.items():
        if not name.endswith("rotary_emb.inv_freq"):
            tensors[_canonical(name)] = tensor
    return config, tensors


class EagleHead(nn.Module):
    """The draft layers with EAGLE's ``fc`` in front, built from a checkpoint's
    config and tensors, and the embedding and LM head when the checkpoint has its
    own (``embed_tokens``, ``lm_head``: None where the target's are shared)."""

    def __init__(self, cfg, tensors: dict[str, torch.Tensor], context: SpeculatorContext, attention, where: str):
        super().__init__()
        backend = context.backend
        device = backend.device
        self.compute_dtype = compute_dtype = backend.compute_dtype(context.dtype)
        dtype = backend.weight_dtype(context.dtype)
        hidden = cfg.hidden_size
        num_layers = cfg.num_hidden_layers
        self.fc = Linear(2 * hidden, [hidden], "fc.bias" in tensors, dtype, compute_dtype, device)
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            layer = nn.Module()
            layer.self_attn = LlamaAttention(cfg, attention, dtype, compute_dtype, device)
            layer.mlp = LlamaMLP(cfg, dtype, compute_dtype, device)
            has_input_norm = i > 0 or f"layers.{i}.input_layernorm.weight" in tensors
            layer.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device) if has_input_norm else None
            layer.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device)
            self.layers.append(layer)
        max_position = int(getattr(cfg, "max_position_embeddings", 4096))
        self.max_position = max_position
        self.rotary = RotaryEmbedding(self.layers[0].self_attn.head_dim, max_position, rope_parameters(cfg), device)
        self.embed_tokens = None
        if "embed_tokens.weight" in tensors:
            self.embed_tokens = nn.Embedding(context.vocab_size, hidden, dtype=dtype, device=device)
            self.embed_tokens.weight.requires_grad_(False)
        elif not isinstance(getattr(context.target_model, "embed_tokens", None), nn.Embedding):
            raise ValueError(f"EAGLE head at {where}: no embed_tokens.weight, and the target model has no "
                             "embed_tokens to share")
        self.lm_head = Linear(hidden, [context.vocab_size], False, dtype, compute_dtype, device) \
            if "lm_head.weight" in tensors else None
        self._load(tensors, context, where)

    def _load(self, tensors: dict[str, torch.Tensor], context: SpeculatorContext, where: str) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected = []
        for name, tensor in tensors.items():
            tensor = tensor.to(context.dtype).to(self.fc.weight.dtype)
            match = _LAYER_RE.match(name)
            if match and match.group(3) in _FUSED and int(match.group(1)) < len(self.layers):
                index, block, proj, kind = match.groups()
                fused, part = _FUSED[proj]
                module = getattr(getattr(self.layers[int(index)], block), fused)
                try:
                    module.load_part(part, kind, tensor)
                except ValueError as exc:
                    raise ValueError(f"EAGLE head at {where}: tensor {name!r}: {exc}") from None
                loaded.add(f"layers.{index}.{block}.{fused}.{kind}#{part}")
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if param.shape != tensor.shape:
                raise ValueError(f"EAGLE head at {where}: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                                 f"target needs {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        if "token_map" in unexpected:
            raise ValueError(f"EAGLE head at {where}: a truncated vocabulary (token_map) is not supported")
        expected = set()
        for pname, _ in self.named_parameters():
            module_name, _, kind = pname.rpartition(".")
            if module_name.endswith(("qkv_proj", "gate_up_proj")):
                expected.update(f"{module_name}.{kind}#{i}" for i in range(3 if module_name.endswith("qkv_proj") else 2))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing or unexpected:
            raise ValueError(f"EAGLE head at {where}: missing tensors {[m.split('#')[0] for m in missing][:6]}, "
                             f"unexpected {sorted(unexpected)[:6]}")

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata, last_rows: torch.Tensor) -> torch.Tensor:
        """Predicted features ``(len(last_rows), hidden)`` at the flat rows ``last_rows``
        from token embeddings ``embeds`` and the target's features ``features`` (both
        ``(num_tokens, hidden)``); K/V of every row are written. The last layer's MLP
        runs on ``last_rows`` only: the other rows matter through their K/V alone."""
        x = torch.cat([embeds.to(self.compute_dtype), features.to(self.compute_dtype)], dim=-1)
        hidden = self.fc(x)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            residual = hidden
            if layer.input_layernorm is not None:
                hidden = layer.input_layernorm(hidden)
            hidden = layer.self_attn(positions, hidden, kv_cache, metadata, self.rotary)
            if i == len(self.layers) - 1:
                hidden, residual = hidden[last_rows], residual[last_rows]
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden) + residual
        return hidden


@dataclass(slots=True)
class _State:
    base: int = 0  # the position of the first feature the head's K/V holds
    num_fed: int = 0  # positions base ... base + num_fed - 1 are in the head's K/V
    blocks: list[int] = field(default_factory=list)
    pending: list[torch.Tensor] = field(default_factory=list)  # features from position base + num_fed on
    num_pending: int = 0

    @property
    def end(self) -> int:
        """The position of the next feature expected."""
        return self.base + self.num_fed + self.num_pending

    def restart(self, base: int) -> None:
        """Forget the K/V (its blocks stay with the request) and the features: the
        head continues from position ``base``."""
        self.base, self.num_fed, self.pending, self.num_pending = base, 0, [], 0


class EagleSpeculator(BaseSpeculator):
    name = "eagle"
    uses_all_hidden_states = True

    def __init__(self, context: SpeculatorContext) -> None:
        super().__init__(context)
        import transformers

        if not context.config.model:
            raise ValueError("speculative method 'eagle' needs 'model': the directory of the EAGLE head")
        path = Path(context.config.model)
        raw, tensors = read_eagle_checkpoint(path)
        if raw.get("truncated_vocab_size") not in (None, raw.get("vocab_size")):
            raise ValueError(f"EAGLE head at {path}: a truncated vocabulary (truncated_vocab_size "
                             f"{raw['truncated_vocab_size']}) is not supported")
        known = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
        try:
            cfg = transformers.LlamaConfig(**known)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"EAGLE head at {path}: config.json is not a Llama config: {exc}") from None
        target_hidden = context.hf_config.hidden_size
        if cfg.hidden_size != target_hidden:
            raise ValueError(f"EAGLE head at {path}: hidden size {cfg.hidden_size}, the target's is {target_hidden}")
        if cfg.vocab_size != context.vocab_size:
            raise ValueError(f"EAGLE head at {path}: vocab_size {cfg.vocab_size}, the target's is {context.vocab_size}")
        # the q/k/v and o biases the head's tensors have
        q_bias = any(re.fullmatch(r"layers\.\d+\.self_attn\.q_proj\.bias", n) for n in tensors)
        o_bias = any(re.fullmatch(r"layers\.\d+\.self_attn\.o_proj\.bias", n) for n in tensors)
        cfg.model_type = "qwen2" if q_bias and not o_bias else "llama"  # (Ember's LlamaAttention reads q/k/v-only biases so)
        cfg.attention_bias = q_bias and o_bias
        backend = context.backend
        self.device = backend.device
        self.attention = backend.create_attention()
        self.block_size = max(BLOCK_SIZE, self.attention.block_size_multiple)
        self.head = EagleHead(cfg, tensors, context, self.attention, str(path)).eval()
        # the target's embedding and LM head unless the head brings its own
        target = context.target_model
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else target.embed_tokens
        self.compute_logits = (lambda h: self.head.lm_head(h).float()) if self.head.lm_head is not None \
            else target.compute_logits
        linear_op = backend.linear_op()
        for module in self.head.modules():
            if isinstance(module, Linear):
                module.linear_op = linear_op
        attn = self.head.layers[0].self_attn
        kv_dtype = backend.kv_cache_dtype(context.dtype)
        num_blocks = max(1, EAGLE_KV_TOKENS // self.block_size)
        self.kv_caches = [
            torch.zeros(2, num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim, dtype=kv_dtype,
                        device=self.device)
            for _ in self.head.layers
        ]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._states: OrderedDict[str, _State] = OrderedDict()  # least recently proposed for first
        logger.info("eagle: %d-layer head from %s (fc bias %s, own embedding %s, own LM head %s), KV pool of %d "
                    "tokens", len(self.head.layers), path, "fc.bias" in tensors, self.head.embed_tokens is not None,
                    self.head.lm_head is not None, num_blocks * self.block_size)

    # -- features from the target ----------------------------------------------------------------
    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _State(base=start)
            self._states.move_to_end(request_id, last=False)  # not proposed for yet: evicted first
        end = state.end
        if start > end:  # positions the head will never see (not expected: the runner sends them all)
            state.restart(start)
            end = start
        rows = hidden[end - start :]
        if not len(rows):
            return  # recomputed after preemption: the head has them already
        state.pending.append(rows)
        state.num_pending += len(rows)
        if state.num_pending > MAX_PENDING_TOKENS:  # the oldest go (views: nothing is copied)
            end, pending, excess = state.end, state.pending, state.num_pending - MAX_PENDING_TOKENS
            while excess >= len(pending[0]):
                excess -= len(pending.pop(0))
            pending[0] = pending[0][excess:]
            state.restart(end - MAX_PENDING_TOKENS)  # the K/V no longer joins the features
            state.pending, state.num_pending = pending, MAX_PENDING_TOKENS

    # -- the KV pool -----------------------------------------------------------------------------
    def _ensure_blocks(self, state: _State, num_slots: int, keep: set[str]) -> bool:
        needed = -(-num_slots // self.block_size) - len(state.blocks)
        while needed > len(self._free):
            victim = next((s for rid, s in self._states.items() if rid not in keep and s.blocks), None)
            if victim is None:
                return False
            self._free.extend(victim.blocks)
            victim.blocks = []
            pending, num_pending = victim.pending, victim.num_pending  # its K/V is gone; its features stay
            victim.restart(victim.base + victim.num_fed)
            victim.pending, victim.num_pending = pending, num_pending
        for _ in range(max(0, needed)):
            state.blocks.append(self._free.pop())
        return True

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(state.blocks)

    # -- proposing -------------------------------------------------------------------------------
    def _forward(self, chunks: list[tuple[_State, list[int], torch.Tensor, int]]) -> torch.Tensor:
        """Run the head over ``(state, tokens, features, first slot)`` chunks in one flat
        batch (the chunk's positions follow from the slot and ``state.base``);
        returns the predicted feature at each chunk's last row."""
        slices = [SequenceSlice(len(tokens), slot, state.blocks) for state, tokens, _, slot in chunks]
        batch = AttentionBatch.from_slices(slices, self.block_size, self.device)
        ids = torch.tensor([t for _, tokens, _, _ in chunks for t in tokens], dtype=torch.int64, device=self.device)
        positions = torch.tensor([state.base + slot + j for state, tokens, _, slot in chunks for j in range(len(tokens))],
                                 dtype=torch.int64, device=self.device)
        features = torch.cat([f for _, _, f, _ in chunks]).to(self.device)
        last = batch.query_start_loc[1:] - 1
        return self.head(self.embed(ids), features, positions, self.kv_caches, self.attention.prepare(batch), last)

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        keep = {r.request_id for r in requests}
        active: list[tuple[int, SpecRequest, _State]] = []
        chunks = []
        for index, request in enumerate(requests):
            state = self._states.get(request.request_id)
            num_tokens = request.num_tokens
            # the features must reach the one at the request's second-to-last token
            # (the row that sampled its last token), whose prediction is the first draft
            if state is None or not state.num_pending or state.end != num_tokens - 1:
                continue
            if num_tokens - 2 + request.max_drafts >= self.head.max_position:
                continue
            self._states.move_to_end(request.request_id)
            if not self._ensure_blocks(state, state.end - state.base + request.max_drafts, keep):
                continue
            # feature t goes with token t + 1
            first, prompt, output = state.base + state.num_fed + 1, request.prompt_token_ids, request.output_token_ids
            tokens = output[first - len(prompt) :] if first >= len(prompt) else prompt[first:] + output
            features = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
            chunks.append((state, tokens, features, state.num_fed))
            active.append((index, request, state))
        drafts: dict[int, list[int]] = {index: [] for index, _, _ in active}
        if active:
            predicted = self._forward(chunks)
            for _, _, state in active:  # the catch-up positions are the request's own: kept
                state.num_fed += state.num_pending
                state.pending, state.num_pending = [], 0
            live = list(range(len(active)))
            while True:
                next_ids = self.compute_logits(predicted).argmax(dim=-1).tolist()
                for row, slot in enumerate(live):
                    drafts[active[slot][0]].append(next_ids[row])
                still = [row for row, slot in enumerate(live) if len(drafts[active[slot][0]]) < active[slot][1].max_drafts]
                if not still:
                    break
                # the drafting positions are written after the kept ones and never counted
                step_chunks = []
                for row in still:
                    index, _, state = active[live[row]]
                    step_chunks.append((state, [drafts[index][-1]], predicted[row : row + 1],
                                        state.num_fed + len(drafts[index]) - 1))
                live = [live[row] for row in still]
                predicted = self._forward(step_chunks)
        return [Proposal(drafts.get(index, [])) for index in range(len(requests))]


@hookimpl
def ember_register_speculators(registry) -> None:
    registry.register("eagle", EagleSpeculator)
