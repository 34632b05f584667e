"""The CPU backend's product for GGUF weights (``GGUFLinearOp``, the ``"gguf"``
format) and the packed form it keeps them in (``PackedGGUFWeight``), over the native
kernels of ``ember.hardware.cpu_quant``.

Few rows (a decode step) run the integer kernel on the packed bytes; many rows
(prefill) dequantize the weight into float32 tiles and run PyTorch's GEMM, which is
compute-bound there and faster than integer dot products one row at a time
(``cpu_quant.MAX_KERNEL_ROWS`` is the crossover measured on SmolLM2's shapes).

Weights in the x8 layout (Q4_0, Q4_1, Q8_0, rows a multiple of 8) take the integer
kernel up to ``LARGE_ROWS`` rows. Larger products (prompt chunks, the largest
batches) run as ``select_prefill`` chose at startup, logged: ``bf16`` (dequantized
bfloat16 tiles through PyTorch's GEMM) where the CPU multiplies bfloat16 natively
(avx512_bf16, amx_bf16), else ``int8`` (the integer kernel, as llama.cpp does); the
CPU backend's option ``gguf_prefill=int8|bf16|float32`` forces one, ``float32`` being
exact (float tiles: the dequantized model's numbers). Its option ``gguf_x8=false``
keeps every weight as read (the one-row kernels).

How activations enter the integer kernels is the option ``gguf_activations``
(``select_activations``, logged): ``int8x2`` by default, two 8-bit stages per block
(``QuantKernels.quantize_split``: about 15 bits, both stages on one read of the weight),
since one stage (``int8``, llama.cpp's) flipped near ties of the float model's next
token (the README's chat example answered "L'Étoile, ..." for "Paris"); ``float`` runs
every product on dequantized float32 tiles.
"""

from __future__ import annotations

import logging
import sys

import torch

from ember.hardware.cpu_options import CPUOptions
from ember.hardware.cpu_paths import cpu_flags, select_path
from ember.hardware.cpu_quant import (
    AMX_BF16_MAX_ROWS, AMX_BF16_ROWS, AMX_MIN_ROWS, ISA_IDS, MAX_KERNEL_ROWS, X8_TYPES, QuantKernels, check_weight,
    load,
)
from ember.plugin.quantizer import QuantizedLinearOp, QuantizedWeight
from ember.weights.gguf_quants import QUANT_TYPES, q5_0_as_q8_0, quant_type

logger = logging.getLogger(__name__)

# x8 weights: the kernel up to this many rows, at least. On SmolLM2's shapes it beat
# dequantize + float32 GEMM at every size measured: Intel Xeon (VNNI), 8 to 256 rows
# (Q4_1 1536x576: 32 rows 0.22 against 0.48 ms; the Q8_0 LM head 49152x576 at 32 rows
# 7.6 against 47.6 ms); AMD EPYC (AVX-512 VNNI), 64 to 2048 rows, 3-4x. Dequantized
# bfloat16 tiles on that EPYC (avx512_bf16), 30 layers: 128 rows 71 against 44 ms
# (int8), 256 rows even, 512 rows 184 against 235, 2048 rows 589 against 724.
LARGE_ROWS = 256
PREFILL_MODES = ("int8", "bf16", "float32")
ACTIVATION_MODES = ("int8", "int8x2", "float")
TILE_VALUES = 1 << 22  # weight values dequantized per GEMM tile (16 MiB of float32)
_TYPE_NAMES = {t.type_id: t.name for t in QUANT_TYPES.values()}


def select_prefill(flags: set[str] | None = None, mode: str = "auto", path: str = "auto") -> tuple[str, str]:
    """``(mode, why)``: how products of more than ``LARGE_ROWS`` rows run (one of
    ``PREFILL_MODES``). ``mode`` (the CPU backend's option ``gguf_prefill``) unless
    ``auto``; else ``bf16`` where the CPU backend runs bf16 models on its bf16 path
    (``cpu_paths.select_path`` with ``path``, its option: AMX or AVX512-BF16, where
    oneDNN's bfloat16 GEMM outruns the integer kernel), ``int8`` elsewhere (emulated
    bfloat16 would not). ValueError naming an unknown mode."""
    forced = mode.strip().lower() or "auto"
    if forced != "auto":
        if forced not in PREFILL_MODES:
            raise ValueError(f"gguf_prefill={forced!r} is not one of: auto, {', '.join(PREFILL_MODES)}")
        return forced, "forced by the backend option gguf_prefill"
    chosen, why = select_path(flags, path)
    return ("bf16" if chosen == "bf16" else "int8"), f"the CPU backend's {chosen} path: {why}"


def select_activations(mode: str = "auto") -> tuple[str, str]:
    """``(mode, why)``: how activations enter the integer kernels (one of
    ``ACTIVATION_MODES``): ``mode`` (the CPU backend's option ``gguf_activations``)
    unless ``auto``, else ``int8x2``: with one 8-bit stage, SmolLM2's Q4_1 model answered
    the README's chat example and some held-out prompts otherwise than the float model
    (near ties of its first token), with two it gives the float model's first token on
    (nearly) all of them, for little decode speed (docs/quantization.md, "Activations").
    ValueError naming an unknown mode."""
    forced = mode.strip().lower() or "auto"
    if forced == "auto":
        return "int8x2", "auto: the float model's answers on chat prompts, measured"
    if forced not in ACTIVATION_MODES:
        raise ValueError(f"gguf_activations={forced!r} is not one of: auto, {', '.join(ACTIVATION_MODES)}")
    return forced, "forced by the backend option gguf_activations"


class PackedGGUFWeight(QuantizedWeight):
    """The CPU kernels' form of a ``GGUFWeight``: ``segments`` is ``[(type name, uint8
    (rows, row bytes), x8)]``, each Q4_0 / Q4_1 / Q8_0 segment whose rows are a multiple
    of 8 repacked into the x8 layout (``x8`` True: the same size, 8 rows per product),
    the others as read; with ``q5_0_x8`` Q5_0 segments first re-encoded as Q8_0
    (``q5_0_as_q8_0``, lossless); adjacent x8 segments of one type joined. ``dequantize``
    gives the same numbers as the weight it came from."""

    format = "gguf"

    def __init__(self, weight, kernels: QuantKernels, q5_0_x8: bool = False) -> None:
        super().__init__(weight.shape)
        K = weight.shape[1]
        self.kernels = kernels
        self.segments = []
        for type_name, data in weight.segments:
            if q5_0_x8 and type_name == "Q5_0" and kernels.x8_layout("Q8_0", data.shape[0]):
                type_name, data = "Q8_0", q5_0_as_q8_0(data)  # lossless: the same values, x8 kernels
            x8 = kernels.x8_layout(type_name, data.shape[0])
            data = kernels.repack_x8(data, type_name, K) if x8 else data
            if x8 and self.segments and self.segments[-1][0] == type_name and self.segments[-1][2]:
                # x8 groups of 8 rows are independent: two x8 segments of one type are one
                # (a fused qkv whose q and k were Q5_0 beside a Q8_0 v: one kernel call)
                data = torch.cat((self.segments.pop()[1], data))
            self.segments.append((type_name, data, x8))

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(t for t, _, _ in self.segments)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{t.lower()}_{i}{'_x8' if x8 else ''}": d for i, (t, d, x8) in enumerate(self.segments)}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        K = self.shape[1]
        return torch.cat([
            self.kernels.dequantize_x8(d, t, K) if x8 else quant_type(t).dequantize(d) for t, d, x8 in self.segments
        ]).to(dtype)


class GGUFLinearOp(QuantizedLinearOp):
    """The CPU backend's product for ``"gguf"`` weights (``ember.plugins.quantizers.gguf.
    GGUFWeight``): float32 activations (bfloat16 ones are widened, and the result rounded
    back) through ``QuantKernels``; without the native library, the dequantized weight
    through PyTorch. Each segment of a joined weight is one kernel call. ``prepare``
    repacks Q4_0 / Q4_1 / Q8_0 segments into the x8 layout (``PackedGGUFWeight``) unless
    ``options.gguf_x8`` is off or the ISA is ``ref``. ``options``: the CPU backend's
    (``CPUOptions``; default: the defaults).

    Per call it does little in Python: a decode step of SmolLM2 makes 211 of these
    products, so the checks of ``QuantKernels.linear`` run once, in ``prepare``."""

    format = "gguf"
    # rounding the activation to 8 bits per block of 32 moves each value by up to half a
    # step of max|x_b| / 127: over random rows, up to about 1e-2 of the largest output
    # (1.1e-2 seen with random Q4_K bytes, whose large sub-block offsets add up);
    # tests/test_gguf_quant.py bounds the error of every output exactly
    max_relative_error = 2e-2

    def __init__(self, options: CPUOptions | None = None) -> None:
        options = options or CPUOptions()
        self.kernels = load(options.quant_isa, enabled=options.native)
        self._scratch = torch.empty(0)
        self._scratch_bf16 = torch.empty(0, dtype=torch.bfloat16)
        self.x8 = self.q5_0_x8 = False
        self.prefill, why = select_prefill(mode=options.gguf_prefill, path=options.path)
        self.activations, why_activations = select_activations(options.gguf_activations)
        self.split = self.activations == "int8x2"
        if self.activations == "float":  # every product on float32 tiles: the large ones too
            self.prefill, why = "float32", "gguf_activations=float"
        # x8 products of this many rows or more run on AMX-BF16 tiles (amx ISA, bf16 mode)
        self.amx_bf16_rows = sys.maxsize
        if self.kernels is not None:
            self._linear_f32 = self.kernels._linear_f32
            self._linear_x8 = self.kernels._linear_x8
            self._linear_x8_bf16 = self.kernels._linear_x8_bf16
            if self.split:
                self._linear_f32 = self.kernels._linear_f32_split
                self._linear_x8 = self.kernels._linear_x8_split
            self._isa = ISA_IDS[self.kernels.isa]
            off = "option gguf_x8=false" if not options.gguf_x8 else \
                "ref ISA" if self.kernels.isa == "ref" else None
            self.x8 = off is None
            self.q5_0_x8 = self.x8 and options.gguf_q5_0_x8
            tiles = ""
            if self.x8 and self.kernels.isa == "amx":
                tiles = f"; AMX-INT8 tiles from {AMX_MIN_ROWS} rows"
                if self.prefill == "bf16" and {"amx_bf16", "avx512_bf16"} <= cpu_flags():
                    self.amx_bf16_rows = AMX_BF16_ROWS
                    tiles = (f"; AMX-INT8 tiles from {AMX_MIN_ROWS} rows, AMX-BF16 tiles from {AMX_BF16_ROWS} "
                             f"to {AMX_BF16_MAX_ROWS}")
            logger.info("GGUF %s weights: %s%s; products of more than %d rows: %s (%s); activations: %s (%s)",
                        "/".join(X8_TYPES) + ("/Q5_0 (as Q8_0)" if self.q5_0_x8 else ""),
                        "x8 layout" if self.x8 else f"as read, one-row kernels ({off})", tiles,
                        LARGE_ROWS, self.prefill, why, self.activations, why_activations)

    def prepare(self, weight):
        if isinstance(weight, PackedGGUFWeight):
            segments = weight.segments
        else:
            for type_name, data in weight.segments:
                check_weight(data, type_name, weight.shape[1])
            if self.x8:
                weight = PackedGGUFWeight(weight, self.kernels, self.q5_0_x8)
                segments = weight.segments
            else:
                segments = [(t, d, False) for t, d in weight.segments]
        weight.kernel_plan = [
            (quant_type(t).type_id, d, d.shape[0], self.kernels is not None and self.kernels.has_kernel(t),
             d.data_ptr(), x8)
            for t, d, x8 in segments
        ]
        return weight

    def __call__(self, x, weight, bias=None):
        dtype = x.dtype
        K = weight.shape[1]
        x2 = x if x.dim() == 2 else x.reshape(-1, K)
        if dtype != torch.float32:
            x2 = x2.float()
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        b = bias.float() if bias is not None and bias.dtype != torch.float32 else bias
        plan = weight.kernel_plan
        if self.kernels is None:
            y = torch.nn.functional.linear(x2, weight.dequantize(torch.float32), b)
        elif len(plan) == 1:
            y = self._segment(x2, plan[0], K, b)
        elif x2.shape[0] == 1 and all(self._by_kernel(1, p) for p in plan):
            # one row (a batch-1 decode): each segment's kernel writes its columns of the
            # one output row in place; no torch.cat, so a CPU graph records the product
            # (Gemma 3 270M's qkv: Q5_0 q and k beside Q8_0 v)
            y = torch.empty(1, weight.shape[0], dtype=torch.float32)
            column = 0
            for p in plan:
                self._segment(x2, p, K, None, out=y.data_ptr() + 4 * column)
                column += p[2]
            if b is not None:
                y += b
        else:
            y = torch.cat([self._segment(x2, p, K, None) for p in plan], dim=1)
            if b is not None:
                y += b
        if dtype != torch.float32:
            y = y.to(dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], -1)

    def embedding(self, ids, weight):
        """Rows ``ids`` of the weight, dequantized (a tied LM head's rows as the token
        embedding), through the native row lookup; without the library, in PyTorch."""
        plan = weight.kernel_plan
        if self.kernels is None or len(plan) != 1 or not plan[0][3]:
            return super().embedding(ids, weight)
        type_id, data, _, _, _, x8 = plan[0]
        return self.kernels.rows(data, _TYPE_NAMES[type_id], weight.shape[1], ids, x8)

    def _by_kernel(self, M: int, plan) -> bool:
        """Whether ``_segment`` runs ``M`` rows of this segment through a native product
        kernel (which can write into a given output), not dequantized tiles."""
        _, _, _, has_kernel, _, x8 = plan
        if self.activations == "float":
            return False
        if x8 and self.amx_bf16_rows <= M <= AMX_BF16_MAX_ROWS:
            return True
        return has_kernel and (M <= MAX_KERNEL_ROWS or x8 and (M <= LARGE_ROWS or self.prefill == "int8"))

    def _segment(self, x, plan, K, bias, out: int | None = None):
        """``x @ W.T (+ bias)`` over one segment, (M, N) float32; with ``out`` (an address,
        only where `_by_kernel`) the kernel writes there (rows of N contiguous) and None
        is returned."""
        type_id, data, N, has_kernel, data_ptr, x8 = plan
        M = x.shape[0]
        large = M > LARGE_ROWS
        if self._by_kernel(M, plan):
            y = torch.empty(M, N, dtype=torch.float32) if out is None else None
            target = y.data_ptr() if out is None else out
            bias_ptr = bias.data_ptr() if bias is not None else None
            if x8 and self.amx_bf16_rows <= M <= AMX_BF16_MAX_ROWS:
                rc = self._linear_x8_bf16(type_id, data_ptr, N, K, x.data_ptr(), M, bias_ptr, target,
                                          torch.get_num_threads())
                if rc:
                    raise RuntimeError(f"GGUF AMX-BF16 kernel failed ({rc}) for type {type_id} ({N}, {K})")
                return y
            call = self._linear_x8 if x8 else self._linear_f32
            rc = call(self._isa, type_id, data_ptr, N, K, x.data_ptr(), M, bias_ptr, target, torch.get_num_threads())
            if rc:
                raise RuntimeError(f"GGUF kernel failed ({rc}) for type {type_id} ({N}, {K}, x8={x8})")
            return y
        if out is not None:
            raise ValueError("_segment: out= is only for products a kernel runs")
        kernels = self.kernels
        # many rows: dequantize tiles of weight rows into a reused buffer, F.linear each
        # tile (torch.mm into slices of a transposed output ran 2x slower here), the
        # buffer bounded for a large LM head; x8 tiles hold whole groups of 8 rows. In
        # bf16 mode a large product rounds each tile and the activations to bfloat16.
        tile = max(8, min(N, TILE_VALUES // K) // 8 * 8)
        if self._scratch.numel() < tile * K:
            self._scratch = torch.empty(tile * K, dtype=torch.float32)
        half = large and self.prefill == "bf16"
        if half:
            if self._scratch_bf16.numel() < tile * K:
                self._scratch_bf16 = torch.empty(tile * K, dtype=torch.bfloat16)
            x = x.to(torch.bfloat16)
            bias = bias.to(torch.bfloat16) if bias is not None else None
        type_name = _TYPE_NAMES[type_id]
        outs = []
        for start in range(0, N, tile):
            rows = min(tile, N - start)
            w = self._scratch[: rows * K].view(rows, K)
            part = data[start : start + rows]
            if x8:
                kernels._dequant_x8(type_id, part.data_ptr(), rows, K, w.data_ptr(), torch.get_num_threads())
            elif has_kernel:
                kernels._dequant(type_id, part.data_ptr(), rows, K, w.data_ptr(), torch.get_num_threads())
            else:
                w.copy_(quant_type(type_name).dequantize(part))
            if half:
                w = self._scratch_bf16[: rows * K].view(rows, K).copy_(w)
            outs.append(torch.nn.functional.linear(x, w, None if bias is None else bias[start : start + rows]))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.float() if half else y



def linear_ops(options: CPUOptions | None = None) -> dict:
    """The quantized formats this module runs, by format: zero-argument factories of
    their ops built with the CPU backend's ``options`` (the CPU backend's registry)."""
    return {GGUFLinearOp.format: lambda: GGUFLinearOp(options)}
