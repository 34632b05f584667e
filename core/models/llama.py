"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM): GQA, RoPE, RMSNorm,
SwiGLU, fused qkv and gate/up projections, tied embeddings, paged KV cache; Qwen3 adds an
RMSNorm over each head's query and key (``q_norm``, ``k_norm``) before RoPE; Phi-3's
checkpoints store the qkv and gate/up projections already fused.

Registered as a built-in plugin through Ember's own `ember` entry point.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember.models.base import BaseCausalLM, KVCacheSpec, layer_sliding_window
from ember.models.layers import (
    Embedding,
    HeadRMSNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    rope_parameters,
)
from ember.models.parallel.model import (
    build_parallel_shard,
    gather_logits,
    parallel_attention,
    parallel_mlp,
    pipeline_forward,
)
from ember.plugin import hookimpl
from ember.plugin.backend import BaseAttention, require_attention_features

ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
)
# transformers' bare decoders (``AutoModel``: saved without the LM head and without the "model."
# prefix, as embedding models are): `LlamaBaseModel`; their logits read the tied embedding
BASE_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# model types that normalise each head's query and key (RMSNorm over head_dim) before RoPE
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg, attention: BaseAttention, dtype, compute_dtype, device, parallel=None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self.head_dim = _head_dim(cfg)
        # Qwen2 has q/k/v biases without declaring attention_bias.
        bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        o_bias = bool(getattr(cfg, "attention_bias", False)) and cfg.model_type != "qwen2"
        if parallel is not None and parallel.tp_size > 1:  # tensor parallelism: this rank's heads
            self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = parallel_attention(
                parallel, cfg.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, bias, o_bias,
                dtype, compute_dtype, device,
            )
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        else:
            self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias, dtype, compute_dtype, device)
            self.o_proj = Linear(q_size, [cfg.hidden_size], o_bias, dtype, compute_dtype, device)
        self.sizes = (q_size, kv_size, kv_size)
        self.scale = self.head_dim**-0.5
        self.attn = attention
        self.limits: dict = {}  # this layer's attention keywords: its sliding window (set by the model)
        self.q_norm = self.k_norm = None
        if cfg.model_type in QK_NORM_MODEL_TYPES:  # one weight of head_dim, shared by every head (and rank)
            self.q_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions, hidden, kv_cache, attn_metadata, rotary: RotaryEmbedding):
        q, k, v = self.qkv_proj.forward(hidden).split(self.sizes, dim=-1)
        num_tokens = hidden.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head, in place where the backend fuses it
            q = self.q_norm.forward(q)
            k = self.k_norm.forward(k)
        q, k = rotary.forward(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata, self.scale, **self.limits)
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, dtype, compute_dtype, device, parallel=None) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the Llama family (only 'silu')")
        inter = cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        if parallel is not None and parallel.tp_size > 1:  # tensor parallelism: this rank's slice
            self.gate_up_proj, self.down_proj = parallel_mlp(
                parallel, cfg.hidden_size, inter, bias, dtype, compute_dtype, device,
            )
        else:
            self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], bias, dtype, compute_dtype, device)
            self.down_proj = Linear(inter, [cfg.hidden_size], bias, dtype, compute_dtype, device)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    """``mlp``: the layer's feed-forward block where it is not the dense SwiGLU
    (a sparse MoE block, ember.models.moe): any module mapping (T, hidden) to (T, hidden)."""

    def __init__(self, cfg, attention, dtype, compute_dtype, device, parallel=None, mlp=None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, attention, dtype, compute_dtype, device, parallel)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, dtype, compute_dtype, device, parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata, rotary):
        # .forward, not __call__, on the hot path: nn.Module.__call__'s hook checks cost
        # about 2 us a call, 11 calls a layer (Ember registers no hooks)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, kv_cache, attn_metadata, rotary)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class LlamaForCausalLM(BaseCausalLM):
    """Weights are stored in the dtype of ``hf_config``'s load (``dtype``) and
    multiplied in ``compute_dtype``; activations are kept in ``compute_dtype``.

    ``parallel`` (an ``ember.parallel.ParallelContext``, None for one process): build
    this rank's shard: its heads and slices (tensor parallelism), its stage's layers
    (pipeline parallelism; the other layers are empty placeholders)."""

    supports_parallel = True  # ember.parallel builds it with ``parallel=``
    is_base_model = False  # a bare decoder (no LM head of its own: LlamaBaseModel)

    def __init__(
        self,
        hf_config,
        attention: BaseAttention,
        compute_dtype: torch.dtype,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        parallel=None,
    ) -> None:
        super().__init__()
        cfg = hf_config
        dtype = dtype or compute_dtype
        self.config = cfg
        self.compute_dtype = compute_dtype
        self.parallel = parallel
        self.layer_range = (0, cfg.num_hidden_layers) if parallel is None else parallel.layer_range(cfg.num_hidden_layers)
        self.tie_word_embeddings = self.is_base_model or bool(getattr(cfg, "tie_word_embeddings", False))
        if parallel is None:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(cfg, attention, dtype, compute_dtype, device,
                                  mlp=self.create_mlp(cfg, index, dtype, compute_dtype, device))
                for index in range(cfg.num_hidden_layers)
            )
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            self.lm_head = (
                None
                if self.tie_word_embeddings
                else Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, compute_dtype, device)
            )
        else:  # this rank's shard (ember.models.parallel.layers)
            self.embed_tokens, self.layers, self.norm, self.lm_head = build_parallel_shard(
                self, cfg, parallel, lambda: LlamaDecoderLayer(cfg, attention, dtype, compute_dtype, device, parallel),
                dtype, compute_dtype, device,
            )
        self.rotary = RotaryEmbedding(_head_dim(cfg), cfg.max_position_embeddings, rope_parameters(cfg), device)
        # sliding-window layers (Mistral, Phi-3, Qwen2/3 where the config says so)
        windows = {i: layer_sliding_window(cfg, i) for i in range(*self.layer_range)}
        if any(windows.values()):
            require_attention_features(attention, (getattr(cfg, "architectures", None) or [cfg.model_type])[0],
                                       window=True)
            for index, window in windows.items():
                if window is not None:
                    self.layers[index].self_attn.limits["window"] = window

    def create_mlp(self, cfg, index: int, dtype, compute_dtype, device) -> nn.Module | None:
        """Layer ``index``'s feed-forward block where a subclass has its own (None: the
        dense SwiGLU). Called during ``__init__``, without parallelism."""
        return None

    def matmul_weights(self) -> list[torch.Tensor]:
        weights = super().matmul_weights()
        has_head = self.parallel is None or self.parallel.is_last_stage
        return weights + [self.embed_tokens.weight] if self.lm_head is None and has_head else weights

    def embed_from(self, linear: Linear) -> None:
        if self.parallel is not None:
            raise NotImplementedError("a sharded model cannot read its embedding from a linear's weight")
        self.embed_tokens.read_from(linear)

    def holds_layer(self, index: int) -> bool:
        """Whether this rank computes layer ``index`` (all of them without pipeline stages)."""
        return self.layer_range[0] <= index < self.layer_range[1]

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        start, end = self.layer_range
        attn = self.layers[start].self_attn
        return KVCacheSpec(end - start, attn.num_kv_heads, attn.head_dim)

    def forward(self, input_ids, positions, kv_caches, attn_metadata: Any) -> torch.Tensor:
        if self.parallel is not None and self.parallel.pp_size > 1:  # stage by stage: ember.models.parallel.pipeline
            return pipeline_forward(self, input_ids, positions, kv_caches, attn_metadata)
        hidden, residual = self.run_layers(positions, self.embed(input_ids), None, kv_caches, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.forward(input_ids).to(self.compute_dtype)

    def run_layers(self, positions, hidden, residual, kv_caches, attn_metadata):
        """This rank's layers (``layer_range``) over ``hidden`` (and the running residual, None before the first)."""
        start, end = self.layer_range
        layers = self.layers if (start, end) == (0, len(self.layers)) else self.layers[start:end]
        for layer, kv_cache in zip(layers, kv_caches):
            hidden, residual = layer.forward(positions, hidden, residual, kv_cache, attn_metadata, self.rotary)
        return hidden, residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:  # full logits on every rank: ember.models.parallel.layers.gather_logits
            local = self._local_logits(hidden_states) if self.parallel.is_last_stage else None
            return gather_logits(self.parallel, local, hidden_states.shape[0], self.config.vocab_size,
                                 hidden_states.device)
        return self._local_logits(hidden_states)

    def _local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            weight = self.embed_tokens.weight
            if weight.dtype != self.compute_dtype:
                weight = weight.to(self.compute_dtype)
            logits = self.linear_op(hidden_states, weight)
        else:
            logits = self.lm_head(hidden_states)
        return logits.float()

    # -- weights ------------------------------------------------------------
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            saved = name  # errors name the tensor as the checkpoint does
            if not name.startswith(("model.", "lm_head.")):  # saved from a bare decoder (AutoModel)
                name = "model." + name
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # some checkpoints store the tied copy too
            keys = self.load_extra_weight(name, tensor)
            if keys is not None:
                loaded.update(keys)
                continue
            match = self._LAYER_RE.match(name)
            if match and match.group(3) in ("qkv_proj", "gate_up_proj"):  # stored fused (Phi-3): split it
                layer, block, fused, kind = match.groups()
                module = getattr(getattr(self.layers[int(layer)], block), fused)
                sizes = module.output_sizes
                if tensor.shape[0] != sum(sizes):
                    raise ValueError(f"tensor {name!r} has {tensor.shape[0]} rows, model expects {sum(sizes)}")
                for index, part in enumerate(tensor.split(list(sizes), dim=0)):
                    module.load_part(index, kind, part)
                    loaded.add(f"layers.{layer}.{block}.{fused}.{kind}#{index}")
                continue
            if match and match.group(3) in self._FUSED:
                layer, block, proj, kind = match.groups()
                fused, index = self._FUSED[proj]
                module = getattr(getattr(self.layers[int(layer)], block), fused)
                module.load_part(index, kind, tensor)
                loaded.add(f"layers.{layer}.{block}.{fused}.{kind}#{index}")
                continue
            # "model.layers.0..." -> "layers.0..."; "lm_head.weight" stays at the top level
            target = name[len("model.") :] if name.startswith("model.") else name
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected tensor {saved!r} in checkpoint")
            if param.shape != tensor.shape:
                raise ValueError(
                    f"tensor {saved!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(target)
        missing = sorted(self.expected_weight_keys() - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def load_extra_weight(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        """A subclass's own checkpoint tensor (an MoE block's router or experts): load it
        and return the keys it fills (of ``expected_weight_keys``); None for a name the
        Llama family loads itself."""
        return None

    def expected_weight_keys(self) -> set[str]:
        """What ``load_weights`` must have filled: parameter names, ``<fused>.<kind>#<part>`` for fused ones."""
        expected = set()
        for pname, _ in self.named_parameters():
            module_name, _, kind = pname.rpartition(".")
            if module_name.endswith(("qkv_proj", "gate_up_proj")):
                parts = 3 if module_name.endswith("qkv_proj") else 2
                expected.update(f"{module_name}.{kind}#{i}" for i in range(parts))
            else:
                expected.add(pname)
        return expected

    def linear_parts(self) -> dict[str, tuple[Linear, int]]:
        # quantized checkpoints name the unfused projections (q_proj, gate_proj, ...)
        parts: dict[str, tuple[Linear, int]] = {}
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            owner, _, attr = name.rpartition(".")
            fused = [(proj, index) for proj, (target, index) in self._FUSED.items() if target == attr]
            for proj, index in fused or [(attr, 0)]:
                prefix = f"{owner}.{proj}" if owner else proj
                parts[prefix if prefix == "lm_head" else f"model.{prefix}"] = (module, index)
        return parts


class LlamaBaseModel(LlamaForCausalLM):
    """A bare decoder of the Llama family as transformers' ``AutoModel`` saves it
    (``LlamaModel``, ``Qwen3Model``, ...: embedding models): the same layers, no LM head
    of its own (its logits, when asked, read the token embedding as a tied head)."""

    supports_parallel = False
    is_base_model = True


@hookimpl
def ember_register_model_architectures(registry) -> None:
    for name in ARCHITECTURES:
        registry.register(name, LlamaForCausalLM)
    for name in BASE_ARCHITECTURES:
        registry.register(name, LlamaBaseModel)
