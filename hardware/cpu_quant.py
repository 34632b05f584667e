"""Native CPU kernels for GGUF quantized weights (``csrc/ember_quant.c``), and the
choice of their instruction set.

``QuantKernels.linear`` computes ``x @ W.T (+ b)`` for W kept in its GGUF type
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the activation rows are quantized
to 8 bits per block of 32 (llama.cpp's scheme) and multiplied with the weights'
integers exactly, each block's sum scaled in float. Few rows (a decode step) run this
way, reading the packed bytes only; many rows (prefill) dequantize the weight into
float32 (``dequantize``, bit for bit ``gguf.quants.dequantize``) and run PyTorch's
GEMM, which is compute-bound there and faster than integer dot products one row at a
time. ``MAX_KERNEL_ROWS`` is the crossover measured on SmolLM2's shapes.

Weights in the x8 layout (Q4_0, Q4_1, Q8_0, rows a multiple of 8) take the integer
kernel up to ``LARGE_ROWS`` rows. Larger products (prompt chunks, the largest
batches) run as ``select_prefill`` chose at startup, logged: ``bf16`` (dequantized
bfloat16 tiles through PyTorch's GEMM) where the CPU multiplies bfloat16 natively
(avx512_bf16, amx_bf16), else ``int8`` (the integer kernel, as llama.cpp does);
``EMBER_GGUF_PREFILL=int8|bf16|float32`` forces one, ``float32`` being exact (float
tiles: the dequantized model's numbers).

Instruction sets (``ISAS``): ``amx`` (``avx512vnni``'s kernels, and x8 products of
``AMX_MIN_ROWS`` rows or more on AMX-INT8 tiles: ``TDPBSSD``, 16 x 16 outputs per block
of 32 columns), ``avx512vnni`` (``_mm256_dpbusd_epi32``; x8 products of 5 rows or more
``_mm512_dpbusd_epi32``, 16 output rows at a time), ``avx2`` (``_mm256_maddubs_epi16``),
``ref`` (plain C, the check for the others). One library holds them all, each compiled
under its own target attribute; ``select_isa`` picks the best the CPU's flags allow,
once, logged, and ``EMBER_QUANT_ISA=amx|avx512vnni|avx2|ref`` forces one (refused,
naming the missing flags, where the CPU cannot run it). ``amx`` also needs Linux to
grant the process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked once in
``load``): where it refuses, ``load`` falls back to ``avx512vnni`` (logged), or fails
when ``amx`` was forced.

The library is compiled and trusted as ``ember.hardware.cpu_kernels`` does its own
(``trusted_library.build``: once per machine, into ``<ember cache>/kernels/``, sha256
recorded and checked before loading). ``EMBER_CPU_NATIVE=0`` turns it off with the
others; where it cannot be built or loaded, ``load()`` returns None (reason logged)
and quantized linears dequantize per call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from ember.hardware.cpu_kernels import NativeFunction
from ember.hardware.cpu_paths import cpu_flags, select_path
from ember.hardware.trusted_library import UntrustedKernelError, build, kernel_cache_dir, load_checked
from ember.plugin.quantizer import QuantizedLinearOp, QuantizedWeight
from ember.weights.gguf_quants import QUANT_TYPES, quant_type

logger = logging.getLogger(__name__)

SOURCE = "ember_quant.c"
ISAS = ("amx", "avx512vnni", "avx2", "ref")  # best first
ISA_IDS = {"ref": 0, "avx2": 1, "avx512vnni": 2, "amx": 3}
# the whole library is compiled with -mavx2 -mfma (trusted_library.FLAGS), ref included
ISA_CPU_FLAGS = {
    "amx": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
    "avx512vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
    "ref": ("avx2", "fma", "f16c"),
}
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# types the op repacks 8 rows at a time (ember_quant_repack_x8) where the rows allow;
# EMBER_GGUF_X8=0 keeps every weight as read (the one-row-at-a-time kernels)
X8_TYPES = ("Q4_0", "Q4_1", "Q8_0")
X8_ISAS = ("amx", "avx512vnni", "avx2")  # the ISAs with x8 kernels
# the amx ISA's x8 products of this many rows or more run on AMX-INT8 tiles (the C file's
# AMX_MIN_ROWS), bit for bit the avx512vnni kernels' numbers; in bf16 prefill mode, those
# of AMX_BF16_ROWS rows or more multiply bfloat16 on AMX-BF16 tiles instead (float32
# sums inside the tiles, no per-block scaling). Intel Xeon (SPR), 2 threads, 1536 x 576
# Q4_1, ms: 64 rows int8 tiles 0.14, VNNI 0.20; 128 rows bf16 tiles 0.18, int8 tiles
# 0.23, VNNI 0.37, oneDNN bf16 on a plain bf16 weight 0.14-0.19
AMX_MIN_ROWS = 64
AMX_BF16_ROWS = 128
# ... up to this many rows: larger ones (long prompts) take the bf16 mode's dequantized
# tiles through oneDNN, which its own blocking serves better there (4096 rows, ms: 1536 x
# 576 4.1 against 7.0, 960 x 576 2.6 against 3.5, 576 x 1536 4.8 against 5.2; at 300-1024
# rows the AMX-BF16 kernel was as fast or faster: 576 x 1536 at 1024 rows 1.25 against 1.94)
AMX_BF16_MAX_ROWS = 2048
# Products of up to this many rows take the integer kernel; more dequantize and GEMM.
# SmolLM2 shapes on a 2-core AVX2 EPYC: the kernel wins up to about 8 rows.
MAX_KERNEL_ROWS = 8
# x8 weights: the kernel up to this many rows, at least. On SmolLM2's shapes it beat
# dequantize + float32 GEMM at every size measured: Intel Xeon (VNNI), 8 to 256 rows
# (Q4_1 1536x576: 32 rows 0.22 against 0.48 ms; the Q8_0 LM head 49152x576 at 32 rows
# 7.6 against 47.6 ms); AMD EPYC (AVX-512 VNNI), 64 to 2048 rows, 3-4x. Dequantized
# bfloat16 tiles on that EPYC (avx512_bf16), 30 layers: 128 rows 71 against 44 ms
# (int8), 256 rows even, 512 rows 184 against 235, 2048 rows 589 against 724.
LARGE_ROWS = 256
PREFILL_MODES = ("int8", "bf16", "float32")
TILE_VALUES = 1 << 22  # weight values dequantized per GEMM tile (16 MiB of float32)
_TYPE_NAMES = {t.type_id: t.name for t in QUANT_TYPES.values()}


def runnable_isas(flags: set[str]) -> list[str]:
    """The instruction sets whose CPU flags are all in ``flags``, best first."""
    return [isa for isa in ISAS if all(flag in flags for flag in ISA_CPU_FLAGS[isa])]


def select_isa(flags: set[str] | None = None, environ=os.environ) -> tuple[str, str]:
    """``(isa, why)``: ``EMBER_QUANT_ISA`` if set (and runnable here), else the best the
    CPU can run. ValueError naming the value for an unknown ISA or one whose flags the
    CPU lacks; RuntimeError when it can run none (no AVX2/FMA)."""
    flags = cpu_flags() if flags is None else flags
    forced = environ.get("EMBER_QUANT_ISA", "auto").strip().lower() or "auto"
    runnable = runnable_isas(flags)
    if forced != "auto":
        if forced not in ISAS:
            raise ValueError(f"EMBER_QUANT_ISA={forced!r} is not one of: auto, {', '.join(ISAS)}")
        if forced not in runnable:
            missing = [flag for flag in ISA_CPU_FLAGS[forced] if flag not in flags]
            raise ValueError(f"EMBER_QUANT_ISA={forced!r}: this CPU lacks {', '.join(missing)}")
        return forced, "forced by EMBER_QUANT_ISA"
    if not runnable:
        raise RuntimeError(f"this CPU lacks {', '.join(f for f in ISA_CPU_FLAGS['avx2'] if f not in flags)}")
    return runnable[0], f"the best this CPU runs (runnable: {', '.join(runnable)})"


def select_prefill(flags: set[str] | None = None, environ=os.environ) -> tuple[str, str]:
    """``(mode, why)``: how products of more than ``LARGE_ROWS`` rows run (one of
    ``PREFILL_MODES``). ``EMBER_GGUF_PREFILL`` if set; else ``bf16`` where the CPU
    backend runs bf16 models on its bf16 path (``cpu_paths.select_path``: AMX or
    AVX512-BF16, where oneDNN's bfloat16 GEMM outruns the integer kernel), ``int8``
    elsewhere (emulated bfloat16 would not). ValueError naming an unknown value."""
    forced = environ.get("EMBER_GGUF_PREFILL", "auto").strip().lower() or "auto"
    if forced != "auto":
        if forced not in PREFILL_MODES:
            raise ValueError(f"EMBER_GGUF_PREFILL={forced!r} is not one of: auto, {', '.join(PREFILL_MODES)}")
        return forced, "forced by EMBER_GGUF_PREFILL"
    path, why = select_path(flags, environ)
    return ("bf16" if path == "bf16" else "int8"), f"the CPU backend's {path} path: {why}"


class QuantKernels:
    """The loaded library, with the instruction set ``isa`` used by default."""

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str) -> None:
        self.path = path
        self.isa = isa
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        native = NativeFunction  # every product and conversion: a CPU graph records them
        self._act = native(lib, "ember_quant_act", [vp, i64, i64, vp, vp, vp, ci], None)
        self._linear = native(lib, "ember_quant_linear", [ci, ci, vp, i64, i64, vp, vp, vp, i64, vp, vp, ci], ci)
        self._linear_f32 = native(lib, "ember_quant_linear_f32", [ci, ci, vp, i64, i64, vp, i64, vp, vp, ci], ci)
        self._dequant = native(lib, "ember_quant_dequant", [ci, vp, i64, i64, vp, ci], ci)
        self._has_kernel = _fn(lib, "ember_quant_has_kernel", [ci, ci], ci)
        self._repack_x8 = native(lib, "ember_quant_repack_x8", [ci, vp, i64, i64, vp], ci)
        self._dequant_x8 = native(lib, "ember_quant_dequant_x8", [ci, vp, i64, i64, vp, ci], ci)
        self._linear_x8 = native(lib, "ember_quant_linear_x8", [ci, ci, vp, i64, i64, vp, i64, vp, vp, ci], ci)
        self._amx_init = _fn(lib, "ember_quant_amx_init", [], ci)
        self._linear_x8_bf16 = native(lib, "ember_quant_linear_x8_bf16", [ci, vp, i64, i64, vp, i64, vp, vp, ci], ci)
        self._rows = native(lib, "ember_quant_rows", [ci, vp, i64, i64, ci, vp, i64, vp, ci], ci)
        self._amx: bool | None = None

    def amx_granted(self) -> bool:
        """Whether Linux lets this process use the AMX tiles (asked once: the C side
        remembers, and refuses the amx ISA's products until it has)."""
        if self._amx is None:
            self._amx = self._amx_init() == 0
        return self._amx

    def has_kernel(self, type_name: str, isa: str | None = None) -> bool:
        """Whether the library has an integer kernel for ``type_name`` in ``isa``."""
        return bool(self._has_kernel(ISA_IDS[isa or self.isa], quant_type(type_name).type_id))

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``x`` (M, K), K a multiple of 32 -> ``(q, d, s)``: int8 (M, K), the
        float32 scale of each block of 32 (M, K / 32) and the int16 sum of q over each 16
        (M, K / 16); ``x ~= d * q`` blockwise."""
        x = _rows(x)
        M, K = x.shape
        if K % 32:
            raise ValueError(f"quantize_activations: K={K} is not a multiple of 32")
        q = torch.empty(M, K, dtype=torch.int8)
        d = torch.empty(M, K // 32, dtype=torch.float32)
        s = torch.empty(M, K // 16, dtype=torch.int16)
        self._act(x.data_ptr(), M, K, q.data_ptr(), d.data_ptr(), s.data_ptr(), torch.get_num_threads())
        return q, d, s

    def linear(
        self,
        x: torch.Tensor,
        data: torch.Tensor,
        type_name: str,
        bias: torch.Tensor | None = None,
        *,
        isa: str | None = None,
        max_kernel_rows: int = MAX_KERNEL_ROWS,
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` (M, K) and W given as its GGUF bytes
        ``data`` (N, row bytes) of ``type_name``; float32 (M, N). Up to
        ``max_kernel_rows`` rows run the integer kernel of ``isa`` (default: the
        selected one), more dequantize W and run PyTorch's GEMM."""
        x = _rows(x)
        M, K = x.shape
        N = _check_weight(data, type_name, K)
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,)):
            raise ValueError(f"bias must be float32 ({N},), got {bias.dtype} {tuple(bias.shape)}")
        if M > max_kernel_rows or not self.has_kernel(type_name, isa):
            return torch.nn.functional.linear(x, self.dequantize(data, type_name, K), bias)
        y = torch.empty(M, N, dtype=torch.float32)
        rc = self._linear_f32(
            ISA_IDS[isa or self.isa], quant_type(type_name).type_id, data.data_ptr(), N, K, x.data_ptr(), M,
            bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(f"ember_quant_linear_f32 failed ({rc}) for {type_name} ({N}, {K})")
        return y

    def linear_quantized(self, q, d, s, data: torch.Tensor, type_name: str, isa: str | None = None) -> torch.Tensor:
        """The integer kernel on activations already quantized (``quantize_activations``)."""
        M, K = q.shape
        N = _check_weight(data, type_name, K)
        if not self.has_kernel(type_name, isa):
            raise ValueError(f"no {isa or self.isa} kernel for {type_name}")
        y = torch.empty(M, N, dtype=torch.float32)
        rc = self._linear(ISA_IDS[isa or self.isa], quant_type(type_name).type_id, data.data_ptr(), N, K,
                          q.data_ptr(), d.data_ptr(), s.data_ptr(), M, None, y.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"ember_quant_linear failed ({rc}) for {type_name} ({N}, {K})")
        return y

    def dequantize(self, data: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
        """float32 (N, ``in_features``) of GGUF bytes ``data`` (N, row bytes); the numbers
        of ``gguf.quants.dequantize``. Types without a native kernel dequantize in torch."""
        N = _check_weight(data, type_name, in_features)
        qtype = quant_type(type_name)
        if type_name not in KERNEL_TYPES:
            return qtype.dequantize(data)
        out = torch.empty(N, in_features, dtype=torch.float32)
        rc = self._dequant(qtype.type_id, data.data_ptr(), N, in_features, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"ember_quant_dequant failed ({rc}) for {type_name} ({N}, {in_features})")
        return out

    def rows(self, data: torch.Tensor, type_name: str, in_features: int, ids: torch.Tensor, x8: bool = False
             ) -> torch.Tensor:
        """Rows ``ids`` (int64 (T,)) of the GGUF weight ``data`` (N, row bytes; in the x8
        layout with ``x8``), dequantized: float32 (T, ``in_features``), ``dequantize``'s
        numbers bit for bit. IndexError for an id outside [0, N)."""
        N = _check_weight(data, type_name, in_features)
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"rows takes int64 ids (T,), got {ids.dtype} {tuple(ids.shape)}")
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
        rc = self._rows(quant_type(type_name).type_id, data.data_ptr(), N, in_features, int(x8), ids.data_ptr(),
                        ids.shape[0], out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"rows of {type_name} ({N}, {in_features}): out of memory")
        if rc:
            raise IndexError(f"token ids must lie in [0, {N}) (rows of {type_name} ({N}, {in_features})"
                             f"{', x8 layout' if x8 else ''})")
        return out

    def x8_layout(self, type_name: str, rows: int, isa: str | None = None) -> bool:
        """Whether weights of ``type_name`` with ``rows`` rows run in the x8 layout under
        ``isa``: Q4_0, Q4_1 and Q8_0, rows a multiple of 8, the amx, avx512vnni or avx2 kernels."""
        return type_name in X8_TYPES and rows % 8 == 0 and (isa or self.isa) in X8_ISAS

    def repack_x8(self, data: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
        """GGUF rows ``data`` (N, row bytes) rearranged 8 rows at a time (the C file's
        "x8" layout): the same bytes' worth, the same numbers, one product per 8 rows."""
        N = _check_weight(data, type_name, in_features)
        out = torch.empty_like(data)
        rc = self._repack_x8(quant_type(type_name).type_id, data.data_ptr(), N, in_features, out.data_ptr())
        if rc:
            raise ValueError(f"{type_name} ({N}, {in_features}) has no x8 layout (Q4_0, Q4_1, Q8_0; rows % 8 == 0)")
        return out

    def dequantize_x8(self, packed: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
        """float32 (N, ``in_features``) of x8-layout bytes: ``dequantize``'s numbers for the
        rows they were repacked from."""
        N = _check_weight(packed, type_name, in_features)
        out = torch.empty(N, in_features, dtype=torch.float32)
        rc = self._dequant_x8(quant_type(type_name).type_id, packed.data_ptr(), N, in_features, out.data_ptr(),
                              torch.get_num_threads())
        if rc:
            raise ValueError(f"{type_name} ({N}, {in_features}) has no x8 layout")
        return out

    def linear_x8(self, x: torch.Tensor, packed: torch.Tensor, type_name: str, bias: torch.Tensor | None = None,
                  isa: str | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for W in the x8 layout, any number of rows, float32 (M, N)."""
        x = _rows(x)
        M, K = x.shape
        N = _check_weight(packed, type_name, K)
        y = torch.empty(M, N, dtype=torch.float32)
        rc = self._linear_x8(ISA_IDS[isa or self.isa], quant_type(type_name).type_id, packed.data_ptr(), N, K,
                             x.data_ptr(), M, bias.contiguous().data_ptr() if bias is not None else None,
                             y.data_ptr(), torch.get_num_threads())
        _check_x8_rc(rc, f"{type_name} ({N}, {K}) under {isa or self.isa}")
        return y

    def linear_x8_bf16(self, x: torch.Tensor, packed: torch.Tensor, type_name: str,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for W in the x8 layout on AMX-BF16 tiles: W's dequantized
        numbers and x rounded to bfloat16 (nearest even), float32 sums, float32 (M, N).
        RuntimeError unless ``amx_granted()``."""
        x = _rows(x)
        M, K = x.shape
        N = _check_weight(packed, type_name, K)
        y = torch.empty(M, N, dtype=torch.float32)
        rc = self._linear_x8_bf16(quant_type(type_name).type_id, packed.data_ptr(), N, K, x.data_ptr(), M,
                                  bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(),
                                  torch.get_num_threads())
        _check_x8_rc(rc, f"{type_name} ({N}, {K}) on AMX-BF16 tiles")
        return y


class PackedGGUFWeight(QuantizedWeight):
    """The CPU kernels' form of a ``GGUFWeight``: ``segments`` is ``[(type name, uint8
    (rows, row bytes), x8)]``, each Q4_0 / Q4_1 / Q8_0 segment whose rows are a multiple
    of 8 repacked into the x8 layout (``x8`` True: the same size, 8 rows per product),
    the others as read. ``dequantize`` gives the same numbers as the weight it came from."""

    format = "gguf"

    def __init__(self, weight, kernels: QuantKernels) -> None:
        super().__init__(weight.shape)
        K = weight.shape[1]
        self.kernels = kernels
        self.segments = []
        for type_name, data in weight.segments:
            x8 = kernels.x8_layout(type_name, data.shape[0])
            self.segments.append((type_name, kernels.repack_x8(data, type_name, K) if x8 else data, x8))

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
    ``EMBER_GGUF_X8=0`` or the ISA is ``ref``.

    Per call it does little in Python: a decode step of SmolLM2 makes 211 of these
    products, so the checks of ``QuantKernels.linear`` run once, in ``prepare``."""

    format = "gguf"
    # rounding the activation to 8 bits per block of 32 moves each value by up to half a
    # step of max|x_b| / 127: over random rows, up to about 1e-2 of the largest output
    # (1.1e-2 seen with random Q4_K bytes, whose large sub-block offsets add up);
    # tests/test_gguf_quant.py bounds the error of every output exactly
    max_relative_error = 2e-2

    def __init__(self) -> None:
        self.kernels = load()
        self._scratch = torch.empty(0)
        self._scratch_bf16 = torch.empty(0, dtype=torch.bfloat16)
        self.x8 = False
        self.prefill, why = select_prefill()
        # x8 products of this many rows or more run on AMX-BF16 tiles (amx ISA, bf16 mode)
        self.amx_bf16_rows = sys.maxsize
        if self.kernels is not None:
            self._linear_f32 = self.kernels._linear_f32
            self._linear_x8 = self.kernels._linear_x8
            self._linear_x8_bf16 = self.kernels._linear_x8_bf16
            self._isa = ISA_IDS[self.kernels.isa]
            off = "EMBER_GGUF_X8=0" if os.environ.get("EMBER_GGUF_X8", "1") == "0" else \
                "ref ISA" if self.kernels.isa == "ref" else None
            self.x8 = off is None
            tiles = ""
            if self.x8 and self.kernels.isa == "amx":
                tiles = f"; AMX-INT8 tiles from {AMX_MIN_ROWS} rows"
                if self.prefill == "bf16" and {"amx_bf16", "avx512_bf16"} <= cpu_flags():
                    self.amx_bf16_rows = AMX_BF16_ROWS
                    tiles = (f"; AMX-INT8 tiles from {AMX_MIN_ROWS} rows, AMX-BF16 tiles from {AMX_BF16_ROWS} "
                             f"to {AMX_BF16_MAX_ROWS}")
            logger.info("GGUF %s weights: %s%s; products of more than %d rows: %s (%s)", "/".join(X8_TYPES),
                        "x8 layout" if self.x8 else f"as read, one-row kernels ({off})", tiles, LARGE_ROWS,
                        self.prefill, why)

    def prepare(self, weight):
        if isinstance(weight, PackedGGUFWeight):
            segments = weight.segments
        else:
            for type_name, data in weight.segments:
                _check_weight(data, type_name, weight.shape[1])
            if self.x8:
                weight = PackedGGUFWeight(weight, self.kernels)
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

    def _segment(self, x, plan, K, bias):
        type_id, data, N, has_kernel, data_ptr, x8 = plan
        M = x.shape[0]
        large = M > LARGE_ROWS
        if x8 and self.amx_bf16_rows <= M <= AMX_BF16_MAX_ROWS:
            y = torch.empty(M, N, dtype=torch.float32)
            rc = self._linear_x8_bf16(type_id, data_ptr, N, K, x.data_ptr(), M,
                                      bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                      torch.get_num_threads())
            if rc:
                raise RuntimeError(f"GGUF AMX-BF16 kernel failed ({rc}) for type {type_id} ({N}, {K})")
            return y
        if has_kernel and (M <= MAX_KERNEL_ROWS or x8 and (not large or self.prefill == "int8")):
            y = torch.empty(M, N, dtype=torch.float32)
            call = self._linear_x8 if x8 else self._linear_f32
            rc = call(self._isa, type_id, data_ptr, N, K, x.data_ptr(), M,
                      bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads())
            if rc:
                raise RuntimeError(f"GGUF kernel failed ({rc}) for type {type_id} ({N}, {K}, x8={x8})")
            return y
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


def linear_ops() -> dict[str, type[QuantizedLinearOp]]:
    """The quantized formats this module runs, by format (the CPU backend's registry)."""
    return {GGUFLinearOp.format: GGUFLinearOp}


def _fn(lib, name: str, argtypes: list, restype):
    """A plain ctypes function: for queries that touch no tensor (the products are
    :class:`NativeFunction`s, which a CPU graph records)."""
    function = getattr(lib, name)
    function.argtypes = argtypes
    function.restype = restype
    return function


def _check_x8_rc(rc: int, what: str) -> None:
    """The x8 entry points' return codes: -3 the AMX tile state not granted, else none for that shape."""
    if rc == -3:
        raise RuntimeError(f"{what}: AMX tile products need the AMX tile state, which Linux has not granted "
                           "this process (QuantKernels.amx_granted)")
    if rc:
        raise ValueError(f"no x8 kernel for {what}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"quantized linear takes float32 x (M, K), got {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def _check_weight(data: torch.Tensor, type_name: str, in_features: int) -> int:
    """Rows of ``data``, after checking it holds ``type_name`` rows of ``in_features`` values."""
    row_bytes = quant_type(type_name).row_bytes(in_features)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes or not data.is_contiguous():
        raise ValueError(
            f"{type_name} weight of {in_features} columns must be contiguous uint8 (N, {row_bytes}), "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    return data.shape[0]


_LOADED: QuantKernels | None = None
_TRIED = False


def load() -> QuantKernels | None:
    """The compiled kernels with the selected instruction set, or None where they cannot
    run here (reason logged once). ValueError for a bad ``EMBER_QUANT_ISA``, RuntimeError
    when it forces ``amx`` and Linux refuses the process the tile state."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    reason, level = None, logging.INFO
    isa, why = None, ""
    if os.environ.get("EMBER_CPU_NATIVE", "1") == "0":
        reason = "EMBER_CPU_NATIVE=0"
    elif not sys.platform.startswith("linux"):
        reason = f"native CPU kernels are built on Linux only (this is {sys.platform})"
    else:
        try:
            isa, why = select_isa()
        except RuntimeError as exc:
            reason = str(exc)
    _TRIED = True
    if reason is None:
        try:
            path = build(SOURCE, kernel_cache_dir())
            _LOADED = QuantKernels(load_checked(path), path, isa)
        except UntrustedKernelError as exc:
            reason, level = str(exc), logging.WARNING
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = str(exc)
    if _LOADED is not None and isa == "amx" and not _LOADED.amx_granted():
        # the CPU has the tiles, but Linux did not grant this process their state (a
        # kernel before 5.16, or a seccomp policy): tile instructions would fault
        if why.startswith("forced"):
            _LOADED = None
            raise RuntimeError("EMBER_QUANT_ISA='amx': Linux refused this process the AMX tile state "
                               "(arch_prctl ARCH_REQ_XCOMP_PERM)")
        logger.info("AMX tiles refused by the kernel (arch_prctl ARCH_REQ_XCOMP_PERM): using avx512vnni")
        isa, why = "avx512vnni", "AMX tile state refused by Linux"
        _LOADED.isa = isa
    if _LOADED is None:
        logger.log(level, "native GGUF kernels off (%s): quantized weights are dequantized per product", reason)
    else:
        logger.info("native GGUF kernels loaded from %s: instruction set %s (%s)", _LOADED.path, isa, why)
    return _LOADED
