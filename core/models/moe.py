"""Sparse mixture-of-experts members of the Llama family: Mixtral and Qwen3-MoE.

Attention, norms and rotary embeddings are the Llama family's (Qwen3-MoE with its
per-head q/k norms); the feed-forward block of a sparse layer is a router and a set of
SwiGLU experts (:class:`SparseMoeBlock`):

1. the router (a linear to ``num_experts`` logits), softmax in float32, top ``k``;
   the k weights renormalised to sum to 1 (Mixtral always, Qwen3-MoE per
   ``norm_topk_prob``);
2. the ``T * k`` (token, expert) pairs sorted by expert, so that each expert that got
   tokens computes them in one gate/up and one down product on its rows, whose
   weighted results are added back to their tokens (``index_add_``): as vLLM's
   fused_moe and transformers' grouped experts do. Experts that got no token cost
   nothing; there is no loop over all experts per token.

Experts are held stacked, ``w13`` ``(E, 2 * I, hidden)`` (gate rows, then up rows)
and ``w2`` ``(E, hidden, I)``, and loaded from either checkpoint form: one tensor per
expert and projection (``experts.E.w1/w3/w2`` in Mixtral's, ``experts.E.gate_proj/
up_proj/down_proj`` in Qwen3-MoE's; what transformers' ``save_pretrained`` writes) or
stacked 3-D (``experts.gate_up_proj`` / ``experts.down_proj``, transformers 5's
modules). A GGUF file kept quantized (``quant_method`` ``"gguf"``) gives each expert
its own :class:`~ember.models.layers.Linear` modules instead (gate_up and down, run by
the backend's op for the format: ``StackedExperts.create_linears``), still grouped by
expert. Tensor and pipeline parallelism and other quantized checkpoints are refused by
name (docs/moe.md).

Registered as a built-in plugin through Ember's own `ember` entry point (``moe``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.layers import Linear, SiluAndMul
from ember.models.llama import LlamaForCausalLM
from ember.plugin import hookimpl
from ember.weights.gguf_loader import QUANT_METHOD as GGUF_QUANT_METHOD

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")

# checkpoint names of a sparse block: Mixtral's `block_sparse_moe`, Qwen3-MoE's (and transformers 5's) `mlp`
_ROUTER_RE = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_STACKED_RE = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
# projection -> (stacked parameter, row block): gate rows first, then up rows
_EXPERT_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                 "w2": ("w2", None), "down_proj": ("w2", None)}
# projection -> (Linear of an ExpertMLP, part) where the experts are Linear modules
_EXPERT_LINEARS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                   "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


@dataclass(frozen=True)
class MoeSpec:
    """A config's sparse-MoE settings, read once and checked."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights divided by their sum
    float32_weights: bool  # results weighted in float32 (Mixtral), else in the compute dtype (Qwen3-MoE)

    @classmethod
    def from_config(cls, cfg) -> MoeSpec:
        num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
        top_k = getattr(cfg, "num_experts_per_tok", None)
        is_qwen = cfg.model_type == "qwen3_moe"
        inter = getattr(cfg, "moe_intermediate_size", None) if is_qwen else cfg.intermediate_size
        if not num_experts or int(num_experts) < 1:
            raise ValueError(f"{cfg.model_type}: num_experts {num_experts!r} must be a positive integer")
        if not top_k or not 1 <= int(top_k) <= int(num_experts):
            raise ValueError(f"{cfg.model_type}: num_experts_per_tok {top_k!r} must be in 1..{num_experts}")
        if not inter or int(inter) < 1:
            raise ValueError(f"{cfg.model_type}: the experts' intermediate size {inter!r} must be positive")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the sparse MoE experts (only 'silu')")
        renormalize = bool(getattr(cfg, "norm_topk_prob", False)) if is_qwen else True
        return cls(int(num_experts), int(top_k), int(inter), renormalize, float32_weights=not is_qwen)


def is_sparse_layer(cfg, index: int) -> bool:
    """Whether layer ``index`` has a sparse MoE block: every layer of Mixtral; a Qwen3-MoE
    layer unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` beat
    (those have the dense SwiGLU of ``intermediate_size``)."""
    if cfg.model_type != "qwen3_moe":
        return True
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return index not in dense and (index + 1) % step == 0


class ExpertMLP(nn.Module):
    """One SwiGLU expert as Linear modules: ``gate_up_proj`` (parts [gate, up], as
    LlamaMLP's) and ``down_proj``; (n, hidden) -> (n, hidden)."""

    def __init__(self, hidden: int, inter: int, act: SiluAndMul, dtype, compute_dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [inter, inter], False, dtype, compute_dtype, device)
        self.down_proj = Linear(inter, [hidden], False, dtype, compute_dtype, device)
        self.__dict__["act"] = act  # shared by a block's experts (not a submodule of each)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(rows)))


class StackedExperts(nn.Module):
    """``E`` SwiGLU experts, their weights stacked: ``w13`` (E, 2I, hidden), ``w2`` (E, hidden, I),
    stored in ``dtype``, multiplied in ``compute_dtype``.

    Or, after ``create_linears`` (a quantized checkpoint), ``linears``: one
    :class:`ExpertMLP` per expert, whose Linear modules hold the expert's weights in
    whatever form the loader gives them (quantized parts, run by the backend's op);
    ``w13`` and ``w2`` are then None. Either way experts run grouped, one call of
    ``run_expert`` per expert with tokens."""

    def __init__(self, spec: MoeSpec, hidden: int, dtype, compute_dtype, device) -> None:
        super().__init__()
        self.num_experts, self.inter = spec.num_experts, spec.intermediate_size
        self.w13 = nn.Parameter(torch.empty(spec.num_experts, 2 * self.inter, hidden, dtype=dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(spec.num_experts, hidden, self.inter, dtype=dtype, device=device),
                               requires_grad=False)
        self.compute_dtype = compute_dtype
        self.linears = None

    def create_linears(self) -> None:
        """Hold each expert as an :class:`ExpertMLP` (its Linear modules, on the stacked
        weights' device and dtype) in place of the stacked weights, which are freed.
        Called before loading a quantized checkpoint; a second call does nothing."""
        if self.linears is not None:
            return
        (_, _, hidden), dtype, device = self.w13.shape, self.w13.dtype, self.w13.device
        del self.w13, self.w2
        self.w13 = self.w2 = None
        self.act = SiluAndMul()
        self.linears = nn.ModuleList(ExpertMLP(hidden, self.inter, self.act, dtype, self.compute_dtype, device)
                                     for _ in range(self.num_experts))

    def expert_linear(self, expert: int, proj: str) -> tuple[Linear, int]:
        """The Linear and part that hold projection ``proj`` (w1/w2/w3 or gate_proj/
        up_proj/down_proj) of ``expert`` (after ``create_linears``)."""
        attr, part = _EXPERT_LINEARS[proj]
        return getattr(self.linears[expert], attr), part

    def run_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` on ``rows`` (n, hidden) -> (n, hidden)."""
        if self.linears is not None:
            return self.linears[expert].forward(rows)
        w13, w2 = self.w13[expert], self.w2[expert]
        if w13.dtype != self.compute_dtype:
            w13, w2 = w13.to(self.compute_dtype), w2.to(self.compute_dtype)
        gate, up = F.linear(rows, w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                grouped_mm: bool | None = None) -> torch.Tensor:
        """``x`` (T, hidden), ``topk_ids`` (T, k) int64, ``topk_weights`` (T, k) -> (T, hidden):
        for each token, the sum of its k experts' outputs times their weights.

        Pairs sorted by expert (a stable sort: within an expert, tokens keep their order);
        each expert with tokens runs once on its rows (``run_expert``), and the sums are
        accumulated expert by expert in increasing order, as transformers does.
        ``grouped_mm`` (default: off a CPU, in bfloat16, where PyTorch has it): all the
        experts' products in two ``torch.nn.functional.grouped_mm`` calls instead of a
        loop, with no copy of the counts to the host, so that a device graph can record it."""
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // k  # pair t * k + j belongs to token t
        weights = topk_weights.reshape(-1)[order].unsqueeze(1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        if grouped_mm is None:
            grouped_mm = (self.linears is None and x.device.type != "cpu" and x.dtype == torch.bfloat16
                          and hasattr(F, "grouped_mm"))
        out = torch.zeros(x.shape, dtype=weights.dtype if weights.dtype == torch.float32 else x.dtype,
                          device=x.device)
        if grouped_mm:
            rows = self._grouped(x[tokens], torch.cumsum(counts, 0).to(torch.int32))
            return out.index_add_(0, tokens, (rows * weights).to(out.dtype)).to(x.dtype)
        start = 0
        for expert, num in enumerate(counts.tolist()):  # the one copy to the host per layer
            if num == 0:
                continue
            pairs = slice(start, start + num)
            start += num
            rows = self.run_expert(expert, x[tokens[pairs]]) * weights[pairs]
            out.index_add_(0, tokens[pairs], rows.to(out.dtype))
        return out.to(x.dtype)

    def _grouped(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.linears is not None:
            raise ValueError("grouped_mm multiplies stacked float experts; these experts are Linear modules")
        w13, w2 = self.w13, self.w2
        if w13.dtype != self.compute_dtype:
            w13, w2 = w13.to(self.compute_dtype), w2.to(self.compute_dtype)
        gate, up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, name: str) -> str:
        """One expert's projection (a checkpoint name's last part: w1/w2/w3 or
        gate_proj/up_proj/down_proj); returns its key (``expected_keys``)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"tensor {name!r} names expert {expert}; the model has {self.num_experts}")
        if self.linears is not None:  # a float expert weight in a quantized checkpoint
            linear, part = self.expert_linear(expert, proj)
            try:
                linear.load_part(part, "weight", tensor)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
            return f"linears.{expert}.{_EXPERT_LINEARS[proj][0]}.weight#{part}"
        param, block = _EXPERT_PARTS[proj]
        target = getattr(self, param).data[expert]
        if block is not None:
            target = target[block * self.inter : (block + 1) * self.inter]
        if target.shape != tensor.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}")
        target.copy_(tensor)
        return f"{param}#{expert}" + ("" if block is None else f".{block}")

    def load_stacked(self, proj: str, tensor: torch.Tensor, name: str) -> list[str]:
        """All experts' ``gate_up_proj`` (E, 2I, hidden) or ``down_proj`` (E, hidden, I) at once."""
        if self.linears is not None:
            if tensor.dim() != 3 or tensor.shape[0] != self.num_experts:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects "
                                 f"{self.num_experts} stacked experts")
            projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            return [self.load_expert(e, p, part, name) for e in range(self.num_experts)
                    for p, part in zip(projs, tensor[e].chunk(len(projs)))]
        param = self.w13 if proj == "gate_up_proj" else self.w2
        if param.shape != tensor.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
        param.data.copy_(tensor)
        return [key for key in self.expected_keys() if key.startswith("w13" if proj == "gate_up_proj" else "w2")]

    def expected_keys(self) -> list[str]:
        """What loading must fill; as Linear modules, the parts of those still float
        (a quantized one was filled when it got its first part, its missing parts are
        named when its op is installed)."""
        if self.linears is not None:
            return [f"linears.{e}.{attr}.weight#{part}" for e, mlp in enumerate(self.linears)
                    for attr in ("gate_up_proj", "down_proj") if not getattr(mlp, attr).is_quantized
                    for part in range(len(getattr(mlp, attr).output_sizes))]
        return [f"w13#{e}.{b}" for e in range(self.num_experts) for b in (0, 1)] + [
            f"w2#{e}" for e in range(self.num_experts)]


class SparseMoeBlock(nn.Module):
    """Router + experts: (T, hidden) -> (T, hidden). See the module docstring."""

    def __init__(self, spec: MoeSpec, hidden: int, dtype, compute_dtype, device) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(hidden, [spec.num_experts], False, dtype, compute_dtype, device)
        self.experts = StackedExperts(spec, hidden, dtype, compute_dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) -> top-k expert ids (T, k) and their weights (T, k): float32 for
        Mixtral, the compute dtype for Qwen3-MoE (as transformers multiplies)."""
        probs = torch.softmax(self.gate.forward(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.spec.float32_weights else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts.forward(x, ids, weights)


class MoeLlamaForCausalLM(LlamaForCausalLM):
    """Mixtral and Qwen3-MoE: the Llama family with sparse MoE feed-forward blocks
    (``is_sparse_layer``). One process only: no tensor or pipeline parallelism."""

    supports_parallel = False

    def __init__(self, hf_config, attention, compute_dtype, dtype=None, device=None, parallel=None) -> None:
        if parallel is not None:
            raise ValueError(
                f"{_arch(hf_config)} (sparse MoE) cannot run with tensor or pipeline parallelism yet: "
                "serve it with tensor_parallel_size=1 and pipeline_parallel_size=1"
            )
        super().__init__(hf_config, attention, compute_dtype, dtype=dtype, device=device)

    def create_mlp(self, cfg, index, dtype, compute_dtype, device):
        if not is_sparse_layer(cfg, index):
            return None
        return SparseMoeBlock(MoeSpec.from_config(cfg), cfg.hidden_size, dtype, compute_dtype, device)

    def _sparse_block(self, layer: str, name: str) -> SparseMoeBlock:
        index = int(layer)
        if index >= len(self.layers):
            raise ValueError(f"tensor {name!r} names layer {index}; the model has {len(self.layers)}")
        block = self.layers[index].mlp
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"tensor {name!r} belongs to a sparse MoE block, but layer {index} is dense "
                             "(mlp_only_layers / decoder_sparse_step in config.json)")
        return block

    def load_extra_weight(self, name, tensor):
        if match := _ROUTER_RE.match(name):
            self._sparse_block(match.group(1), name).gate.load_part(0, "weight", tensor)
            return [f"layers.{match.group(1)}.mlp.gate.weight"]
        if match := _EXPERT_RE.match(name):
            layer, expert, proj = match.groups()
            key = self._sparse_block(layer, name).experts.load_expert(int(expert), proj, tensor, name)
            return [f"layers.{layer}.mlp.experts.{key}"]
        if match := _STACKED_RE.match(name):
            layer, proj = match.groups()
            keys = self._sparse_block(layer, name).experts.load_stacked(proj, tensor, name)
            return [f"layers.{layer}.mlp.experts.{key}" for key in keys]
        return None

    def expected_weight_keys(self) -> set[str]:
        expected = super().expected_weight_keys()
        for index, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                prefix = f"layers.{index}.mlp.experts."
                expected = {key for key in expected if not key.startswith(prefix)}
                expected |= {prefix + key for key in layer.mlp.experts.expected_keys()}
        return expected

    def linear_parts(self) -> dict[str, tuple[Linear, int]]:
        """The Llama family's linears, less the routers (kept float), and each expert's
        projections under both checkpoint spellings (``block_sparse_moe.experts.E.w1``,
        ``mlp.experts.E.gate_proj``). The loader asks only for a quantized checkpoint:
        the experts become Linear modules here (``StackedExperts.create_linears``).
        Only GGUF files kept quantized are supported; other quantized checkpoints raise
        NotImplementedError naming the architecture."""
        config = getattr(self.config, "quantization_config", None)
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        if method != GGUF_QUANT_METHOD:
            raise NotImplementedError(
                f"{_arch(self.config)} (sparse MoE) keeps its experts quantized only from GGUF files: quantized "
                f"checkpoints of quant_method {method!r} are not supported"
            )
        parts = {name: part for name, part in super().linear_parts().items() if ".experts." not in name}
        for index, layer in enumerate(self.layers):
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            parts.pop(f"model.layers.{index}.mlp.gate", None)
            experts = layer.mlp.experts
            experts.create_linears()
            for expert in range(experts.num_experts):
                for proj in _EXPERT_LINEARS:
                    block = "block_sparse_moe" if proj in ("w1", "w2", "w3") else "mlp"
                    parts[f"model.layers.{index}.{block}.experts.{expert}.{proj}"] = experts.expert_linear(expert, proj)
        return parts


def _arch(cfg) -> str:
    names = getattr(cfg, "architectures", None) or [cfg.model_type]
    return names[0]


@hookimpl
def ember_register_model_architectures(registry) -> None:
    for name in ARCHITECTURES:
        registry.register(name, MoeLlamaForCausalLM)
