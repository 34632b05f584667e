"""Building blocks shared by architectures: linear, RMSNorm, rotary embedding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ W.T + b`` with weights stored in one dtype and multiplied in the
    compute dtype (see ``BaseBackend.compute_dtype``). ``output_sizes`` records the
    row blocks of a fused projection (qkv, gate+up) so loaders can fill each part.
    ``linear_op`` is ``F.linear`` unless the loader sets the backend's
    (``BaseBackend.linear_op``).

    A quantized linear (docs/quantization.md) gets its parts as
    :class:`ember.plugin.quantizer.QuantizedWeight` through ``load_part``: the float
    ``weight`` is freed at the first one (``weight`` is None from then on), and
    ``set_quantized_op`` joins the parts and installs the backend's op for their format.
    """

    linear_op = staticmethod(F.linear)
    # the adapter slots of this linear (ember.models.lora.LinearAdapters) when the engine
    # serves adapters: their products are added to the output for the step's adapter tokens
    adapters = None

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.in_features = in_features
        out = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.compute_dtype = compute_dtype
        # quantized: the parts as loaded (None until each arrives), then the packed
        # weight(s) the op reads: one when the parts join, else one per part
        self.quant_parts: list | None = None
        self.qweights: list | None = None
        self.qop = None

    @property
    def is_quantized(self) -> bool:
        return self.quant_parts is not None

    def load_part(self, index: int, name: str, tensor) -> None:
        """Copy one part (``index`` into output_sizes) of the weight or bias; a
        ``QuantizedWeight`` part is kept as it is (its shape checked)."""
        if name == "weight" and not isinstance(tensor, torch.Tensor):
            self._load_quantized_part(index, tensor)
            return
        if name == "weight" and self.is_quantized:
            raise ValueError(f"part {index} is a float weight, but other parts of this linear are quantized")
        start = sum(self.output_sizes[:index])
        rows = self.output_sizes[index]
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer does not have")
        part = target.data[start : start + rows]
        if part.shape != tensor.shape:
            raise ValueError(f"{name} part {index}: expected shape {tuple(part.shape)}, got {tuple(tensor.shape)}")
        part.copy_(tensor)

    def _load_quantized_part(self, index: int, weight) -> None:
        expected = (self.output_sizes[index], self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"quantized weight part {index}: expected shape {expected}, got {tuple(weight.shape)}")
        if self.quant_parts is None:
            # the float weight is never filled: free it now, not after the whole load
            del self.weight
            self.weight = None
            self.quant_parts = [None] * len(self.output_sizes)
        self.quant_parts[index] = weight

    def missing_quantized_parts(self) -> list[int]:
        return [i for i, p in enumerate(self.quant_parts or []) if p is None]

    def set_quantized_op(self, op) -> None:
        """Join the loaded parts (``QuantizedWeight.concat``, else kept apart) and let
        ``op`` (``QuantizedLinearOp``) prepare and run them; the parts as loaded are dropped."""
        missing = self.missing_quantized_parts()
        if missing:
            raise ValueError(f"quantized linear is missing part(s) {missing} of {len(self.output_sizes)}")
        parts = self.quant_parts
        formats = {p.format for p in parts}
        if len(formats) != 1:
            raise ValueError(f"the parts of one fused linear have different formats: {sorted(formats)}")
        joined = type(parts[0]).concat(parts) if len(parts) > 1 else parts[0]
        self.qweights = [op.prepare(w) for w in ([joined] if joined is not None else parts)]
        self.quant_parts = [None] * len(parts)  # loaded forms dropped; is_quantized stays True
        self.qop = op
        if self.bias is not None and self.bias.dtype != self.compute_dtype:
            self.bias = nn.Parameter(self.bias.data.to(self.compute_dtype), requires_grad=False)

    def set_dequantized(self, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> None:
        """Replace the loaded quantized parts by their float weight: rounded to the
        model's ``dtype``, kept in ``weight_dtype`` (as float checkpoints load), for
        --dequantize (the backend has no kernel for their format)."""
        missing = self.missing_quantized_parts()
        if missing:
            raise ValueError(f"quantized linear is missing part(s) {missing} of {len(self.output_sizes)}")
        weight = torch.cat([p.dequantize(dtype).to(weight_dtype or dtype) for p in self.quant_parts])
        self.quant_parts = None
        self.weight = nn.Parameter(weight, requires_grad=False)

    def quantized_nbytes(self) -> int:
        return sum(w.nbytes for w in self.qweights or [])

    def set_packed_weight(self, packed: torch.Tensor) -> None:
        """Hold a backend's packed form of the weight (an opaque layout its
        ``linear_op`` reads) in place of the plain one, which is freed."""
        del self.weight
        self.register_buffer("weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweights is not None:
            if len(self.qweights) == 1:
                out = self.qop(x, self.qweights[0], self.bias)
            else:
                out = torch.cat([self.qop(x, w) for w in self.qweights], dim=-1)
                if self.bias is not None:
                    out = out + self.bias
        else:
            w = self.weight
            b = self.bias
            if w.dtype != self.compute_dtype:
                w = w.to(self.compute_dtype)
                b = b.to(self.compute_dtype) if b is not None else None
            out = self.linear_op(x, w, b)
        adapters = self.adapters
        return out if adapters is None else adapters.apply(x, out)


class FusableOp(nn.Module):
    """A layer a backend may run as one fused kernel: ``fused`` is None (PyTorch ops)
    unless the loader installs the backend's op named ``op_name``
    (``BaseBackend.layer_ops``), which takes the same inputs plus the layer's own
    tensors (see each subclass) and must give the same numbers to float rounding."""

    op_name: str = ""
    fused = None


class Embedding(nn.Embedding, FusableOp):
    """Token embeddings (an ``nn.Embedding`` whose weight is loaded, not trained): rows
    of ``weight`` (vocab, hidden) by id, in the weight's dtype. Fused op
    ``embedding(ids, weight)``.

    ``read_from(linear)`` makes it a view of a quantized linear's weight (a tied LM
    head kept quantized): its own table is freed, and rows come from the linear's op
    (``QuantizedLinearOp.embedding``, float32), or from the linear's float weight where
    it was dequantized at load."""

    op_name = "embedding"
    source: Linear | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.weight.requires_grad_(False)

    def read_from(self, linear: Linear) -> None:
        if linear.output_sizes != [self.num_embeddings] or linear.in_features != self.embedding_dim:
            raise ValueError(f"an embedding of {self.num_embeddings} x {self.embedding_dim} cannot read the rows "
                             f"of a linear of {sum(linear.output_sizes)} x {linear.in_features}")
        del self.weight
        self.weight = None
        self.__dict__["source"] = linear  # a reference, not a submodule: the linear is the model's already

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        source = self.source
        if source is not None:
            if source.qweights is not None:
                return source.qop.embedding(ids, source.qweights[0])
            return F.embedding(ids, source.weight)
        if self.fused is not None:
            return self.fused(ids, self.weight)
        return super().forward(ids)


class RMSNorm(FusableOp):
    """RMSNorm computed in float32, as the reference implementation does.
    Fused op ``rms_norm(x, residual, weight, eps)``."""

    op_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With ``residual``: returns ``(norm(x + residual), x + residual)``."""
        if self.fused is not None:
            return self.fused(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight.to(dtype) * h.to(dtype)
        return out if residual is None else (out, residual)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# model types whose transformers implementation rotates only part of each head
# (``partial_rotary_factor``); the others' rotate the whole head whatever the config says
PARTIAL_ROTARY_MODEL_TYPES = ("phi3",)


def rope_parameters(hf_config) -> dict:
    """Rope settings from either transformers 5 (`rope_parameters`) or 4 (`rope_theta`/`rope_scaling`).

    Normalised: ``rope_type`` ("su", Phi-3's old name of LongRoPE, becomes "longrope"),
    ``rope_theta``, ``partial_rotary_factor`` (1.0 unless a Phi-3 says otherwise) and, for
    LongRoPE, ``original_max_position_embeddings`` (from the config's top level if the
    rope settings lack it)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    params.setdefault("rope_theta", 10000.0)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    model_type = getattr(hf_config, "model_type", None)
    if partial != 1.0 and model_type not in PARTIAL_ROTARY_MODEL_TYPES:
        raise ValueError(
            f"partial_rotary_factor {partial} (RoPE on part of each head) is not supported for model type "
            f"{model_type!r}; only for {', '.join(PARTIAL_ROTARY_MODEL_TYPES)}"
        )
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor {partial} must be in (0, 1]")
    params["partial_rotary_factor"] = partial
    if params["rope_type"] == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None)
        if not original:
            raise ValueError("rope type 'longrope' needs original_max_position_embeddings (the pretraining length)")
        params["original_max_position_embeddings"] = int(original)
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many leading dims of each head are rotated (all of them unless a partial factor says less)."""
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if dim <= 0 or dim % 2:
        raise ValueError(f"partial_rotary_factor {params.get('partial_rotary_factor')} of a head of {head_dim} "
                         f"rotates {dim} dims; it must be a positive even number")
    return dim


def compute_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """``head_dim`` here is the rotated width (``rotary_dim``). LongRoPE is not here: its
    frequencies depend on the position (``longrope_cos_sin``)."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = int(params.get("original_max_position_embeddings", max_position_embeddings))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def longrope_cos_sin(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's (Phi-3 128k's) cos/sin tables, ``(max_position, dim)``, as transformers'
    ``_compute_longrope_parameters``: ``inv_freq = 1 / (ext_factor * theta^(2i/dim))`` and
    both tables times the attention factor (``sqrt(1 + ln(factor) / ln(original))``
    unless given, ``factor = max_position / original`` unless given).

    The short factors rotate positions below ``original_max_position_embeddings``, the
    long factors the positions from there on: a position's rotation depends on the
    position alone, as the paged KV cache (whose keys are rotated once, when written)
    and the prefix cache need. transformers instead picks one set for a whole forward
    by its longest position, so the two agree exactly on every sequence that stays
    below the original length and differ on longer ones (docs/moe.md, LongRoPE)."""
    original = int(params["original_max_position_embeddings"])
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if values is None or len(values) != dim // 2:
            raise ValueError(f"rope type 'longrope' needs {key} with {dim // 2} values (rotated dims / 2), "
                             f"got {None if values is None else len(values)}")
        factors[key] = torch.tensor([float(v) for v in values], dtype=torch.float32)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    t = torch.arange(max_position, dtype=torch.int64).float()
    short = torch.outer(t, 1.0 / (factors["short_factor"] * base**exponents))
    long = torch.outer(t, 1.0 / (factors["long_factor"] * base**exponents))
    freqs = torch.where((t < original)[:, None], short, long)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * float(scale), emb.sin() * float(scale)


class SiluAndMul(FusableOp):
    """SwiGLU's activation: ``silu(gate) * up`` for ``x = [gate | up]`` (last dim).
    Fused op ``silu_mul(x)``."""

    op_name = "silu_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(FusableOp):
    """GeGLU's activation (Gemma): ``gelu_tanh(gate) * up`` for ``x = [gate | up]``.
    Fused op ``gelu_tanh_mul(x)``."""

    op_name = "gelu_tanh_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each head of ``(T, heads, D)`` with one weight of ``D`` for all heads
    (Qwen3's and Gemma 3's q/k norms). Fused op ``head_rms_norm_(x, weight, eps)``, in
    place on a view whose heads and dims are contiguous (the q or k of a fused qkv)."""

    op_name = "head_rms_norm_"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            raise ValueError("HeadRMSNorm takes no residual")
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps)
        T, heads, D = x.shape
        h = x.reshape(-1, D).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(x.dtype) * h.to(x.dtype)).view(T, heads, D)


class Scale(FusableOp):
    """``x * factor`` (Gemma's embedding times sqrt(hidden)), the factor rounded to x's
    dtype first as a product with a tensor of that dtype rounds it. Fused op
    ``scale_(x, factor)``, in place on a fresh tensor."""

    op_name = "scale_"

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)
        self.rounded = {dtype: float(torch.tensor(self.factor, dtype=dtype))
                        for dtype in (torch.float32, torch.bfloat16, torch.float16)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = self.rounded.get(x.dtype, self.factor)
        if self.fused is not None and x.is_contiguous():
            return self.fused(x, factor)
        return x * factor


class RotaryEmbedding(FusableOp):
    """Rotate-half RoPE (the Hugging Face layout) with a cos/sin cache by position.
    Fused op ``rope_(x, positions, cos_cache, sin_cache)``, in place on ``q`` and ``k``.

    With a ``partial_rotary_factor`` below 1 (Phi-4-mini) only the first ``rotary_dim``
    dims of each head turn and the rest pass through (PyTorch ops: the fused op rotates
    whole heads); LongRoPE's tables come from ``longrope_cos_sin``."""

    op_name = "rope_"

    def __init__(self, head_dim: int, max_position: int, params: dict, device=None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)
        if params["rope_type"] == "longrope":
            cos, sin = longrope_cos_sin(self.rotary_dim, params, max_position)
        else:
            inv_freq = compute_inv_freq(self.rotary_dim, params, max_position)
            t = torch.arange(max_position, dtype=torch.int64).float()
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``q``: (T, Hq, D), ``k``: (T, Hkv, D) -> rotated, same shapes and dtype
        (the fused op rotates them in place: views of a fresh projection)."""
        partial = self.rotary_dim != self.head_dim
        if self.fused is not None and not partial:
            return (self.fused(q, positions, self.cos_cache, self.sin_cache),
                    self.fused(k, positions, self.cos_cache, self.sin_cache))
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        if partial:
            r = self.rotary_dim
            return (torch.cat((_apply(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                    torch.cat((_apply(k[..., :r], cos, sin), k[..., r:]), dim=-1))
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
