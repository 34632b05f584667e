"""Native CPU kernels for GGUF quantized weights (``csrc/ember_quant.c``), and the
choice of their instruction set. The op that multiplies by GGUF weights with them is
``ember.hardware.cpu_gguf``.

``QuantKernels.linear`` computes ``x @ W.T (+ b)`` for W kept in its GGUF type
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the activation rows are quantized
to 8 bits per block of 32 (llama.cpp's scheme) and multiplied with the weights'
integers exactly, each block's sum scaled in float. Up to ``MAX_KERNEL_ROWS`` rows run
this way, reading the packed bytes only; more dequantize the weight into float32
(``dequantize``, bit for bit ``gguf.quants.dequantize``) and run PyTorch's GEMM.

Instruction sets (``ISAS``): ``amx`` (``avx512vnni``'s kernels, and x8 products of
``AMX_MIN_ROWS`` rows or more on AMX-INT8 tiles: ``TDPBSSD``, 16 x 16 outputs per block
of 32 columns), ``avx512vnni`` (``_mm256_dpbusd_epi32``; x8 products of 5 rows or more
``_mm512_dpbusd_epi32``, 16 output rows at a time), ``avx2`` (``_mm256_maddubs_epi16``),
``ref`` (plain C, the check for the others). One library holds them all, each compiled
under its own target attribute; ``select_isa`` picks the best the CPU's flags allow,
logged, and the CPU backend's option ``quant_isa=amx|avx512vnni|avx2|ref`` forces one
(refused, naming the missing flags, where the CPU cannot run it). ``amx`` also needs
Linux to grant the process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked
once in ``load``): where it refuses, ``load`` falls back to ``avx512vnni`` (logged), or
fails when ``amx`` was forced.

The library is compiled and trusted as ``ember.hardware.cpu_kernels`` does its own
(``trusted_library.build``: once per machine, into ``<ember cache>/kernels/``, sha256
recorded and checked before loading). The option ``native=false`` turns it off with
the others; where it cannot be built or loaded, ``load()`` returns None (reason
logged) and quantized linears dequantize per call.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from pathlib import Path

import torch

from ember.hardware.cpu_kernels import NativeFunction
from ember.hardware.cpu_paths import cpu_flags
from ember.hardware.trusted_library import UntrustedKernelError, build, kernel_cache_dir, load_checked
from ember.weights.gguf_quants import quant_type

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
# the option gguf_x8=false keeps every weight as read (the one-row-at-a-time kernels)
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


def runnable_isas(flags: set[str]) -> list[str]:
    """The instruction sets whose CPU flags are all in ``flags``, best first."""
    return [isa for isa in ISAS if all(flag in flags for flag in ISA_CPU_FLAGS[isa])]



def select_isa(flags: set[str] | None = None, isa: str = "auto") -> tuple[str, str]:
    """``(isa, why)``: ``isa`` (the CPU backend's option ``quant_isa``) unless ``auto``
    (then it must be runnable here), else the best the CPU can run. ValueError naming
    the value for an unknown ISA or one whose flags the CPU lacks; RuntimeError when it
    can run none (no AVX2/FMA)."""
    flags = cpu_flags() if flags is None else flags
    forced = isa.strip().lower() or "auto"
    runnable = runnable_isas(flags)
    if forced != "auto":
        if forced not in ISAS:
            raise ValueError(f"quant_isa={forced!r} is not one of: auto, {', '.join(ISAS)}")
        if forced not in runnable:
            missing = [flag for flag in ISA_CPU_FLAGS[forced] if flag not in flags]
            raise ValueError(f"quant_isa={forced!r}: this CPU lacks {', '.join(missing)}")
        return forced, "forced by the backend option quant_isa"
    if not runnable:
        raise RuntimeError(f"this CPU lacks {', '.join(f for f in ISA_CPU_FLAGS['avx2'] if f not in flags)}")
    return runnable[0], f"the best this CPU runs (runnable: {', '.join(runnable)})"


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
        # two-stage activations (SPLIT_ACTIVATIONS): the same products, about 15 bits per block
        self._act_split = native(lib, "ember_quant_act_split", [vp, i64, i64, vp, vp, vp, ci], None)
        self._linear_f32_split = native(lib, "ember_quant_linear_f32_split", [ci, ci, vp, i64, i64, vp, i64, vp, vp,
                                                                              ci], ci)
        self._linear_x8_split = native(lib, "ember_quant_linear_x8_split", [ci, ci, vp, i64, i64, vp, i64, vp, vp,
                                                                            ci], ci)
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
        split: bool = False,
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` (M, K) and W given as its GGUF bytes
        ``data`` (N, row bytes) of ``type_name``; float32 (M, N). Up to
        ``max_kernel_rows`` rows run the integer kernel of ``isa`` (default: the
        selected one), with two-stage activations if ``split`` (``quantize_split``),
        more dequantize W and run PyTorch's GEMM."""
        x = _rows(x)
        M, K = x.shape
        N = check_weight(data, type_name, K)
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,)):
            raise ValueError(f"bias must be float32 ({N},), got {bias.dtype} {tuple(bias.shape)}")
        if M > max_kernel_rows or not self.has_kernel(type_name, isa):
            return torch.nn.functional.linear(x, self.dequantize(data, type_name, K), bias)
        y = torch.empty(M, N, dtype=torch.float32)
        rc = (self._linear_f32_split if split else self._linear_f32)(
            ISA_IDS[isa or self.isa], quant_type(type_name).type_id, data.data_ptr(), N, K, x.data_ptr(), M,
            bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(f"ember_quant_linear_f32 failed ({rc}) for {type_name} ({N}, {K})")
        return y

    def quantize_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two-stage activations: ``quantize_activations``' blocks of 2M rows, row ``2i``
        those of ``x[i]`` and row ``2i + 1`` those of what they leave, ``x[i] - d q``; so
        ``x[i] ~= d[2i] q[2i] + d[2i + 1] q[2i + 1]`` blockwise, within ``max|x_b| / 64516``
        (half a step of the second stage, whose block max is at most half the first's step)."""
        x = _rows(x)
        M, K = x.shape
        if K % 32:
            raise ValueError(f"quantize_split: K={K} is not a multiple of 32")
        q = torch.empty(2 * M, K, dtype=torch.int8)
        d = torch.empty(2 * M, K // 32, dtype=torch.float32)
        s = torch.empty(2 * M, K // 16, dtype=torch.int16)
        self._act_split(x.data_ptr(), M, K, q.data_ptr(), d.data_ptr(), s.data_ptr(), torch.get_num_threads())
        return q, d, s

    def linear_quantized(self, q, d, s, data: torch.Tensor, type_name: str, isa: str | None = None) -> torch.Tensor:
        """The integer kernel on activations already quantized (``quantize_activations``)."""
        M, K = q.shape
        N = check_weight(data, type_name, K)
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
        N = check_weight(data, type_name, in_features)
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
        N = check_weight(data, type_name, in_features)
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
        N = check_weight(data, type_name, in_features)
        out = torch.empty_like(data)
        rc = self._repack_x8(quant_type(type_name).type_id, data.data_ptr(), N, in_features, out.data_ptr())
        if rc:
            raise ValueError(f"{type_name} ({N}, {in_features}) has no x8 layout (Q4_0, Q4_1, Q8_0; rows % 8 == 0)")
        return out

    def dequantize_x8(self, packed: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
        """float32 (N, ``in_features``) of x8-layout bytes: ``dequantize``'s numbers for the
        rows they were repacked from."""
        N = check_weight(packed, type_name, in_features)
        out = torch.empty(N, in_features, dtype=torch.float32)
        rc = self._dequant_x8(quant_type(type_name).type_id, packed.data_ptr(), N, in_features, out.data_ptr(),
                              torch.get_num_threads())
        if rc:
            raise ValueError(f"{type_name} ({N}, {in_features}) has no x8 layout")
        return out

    def linear_x8(self, x: torch.Tensor, packed: torch.Tensor, type_name: str, bias: torch.Tensor | None = None,
                  isa: str | None = None, split: bool = False) -> torch.Tensor:
        """``x @ W.T + bias`` for W in the x8 layout, any number of rows, float32 (M, N);
        ``split``: two-stage activations (``quantize_split``), both stages of a row in one
        pass over W."""
        x = _rows(x)
        M, K = x.shape
        N = check_weight(packed, type_name, K)
        y = torch.empty(M, N, dtype=torch.float32)
        rc = (self._linear_x8_split if split else self._linear_x8)(
            ISA_IDS[isa or self.isa], quant_type(type_name).type_id, packed.data_ptr(), N, K, x.data_ptr(), M,
            bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads())
        _check_x8_rc(rc, f"{type_name} ({N}, {K}) under {isa or self.isa}")
        return y

    def linear_x8_bf16(self, x: torch.Tensor, packed: torch.Tensor, type_name: str,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for W in the x8 layout on AMX-BF16 tiles: W's dequantized
        numbers and x rounded to bfloat16 (nearest even), float32 sums, float32 (M, N).
        RuntimeError unless ``amx_granted()``."""
        x = _rows(x)
        M, K = x.shape
        N = check_weight(packed, type_name, K)
        y = torch.empty(M, N, dtype=torch.float32)
        rc = self._linear_x8_bf16(quant_type(type_name).type_id, packed.data_ptr(), N, K, x.data_ptr(), M,
                                  bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(),
                                  torch.get_num_threads())
        _check_x8_rc(rc, f"{type_name} ({N}, {K}) on AMX-BF16 tiles")
        return y



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


def check_weight(data: torch.Tensor, type_name: str, in_features: int) -> int:
    """Rows of ``data``, after checking it holds ``type_name`` rows of ``in_features`` values."""
    row_bytes = quant_type(type_name).row_bytes(in_features)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes or not data.is_contiguous():
        raise ValueError(
            f"{type_name} weight of {in_features} columns must be contiguous uint8 (N, {row_bytes}), "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    return data.shape[0]



_LIBRARY: tuple[ctypes.CDLL, Path] | None = None
_LIBRARY_ERROR: tuple[str, int] | None = None  # (reason, log level) the library could not load
_LOADED: dict[str, QuantKernels | None] = {}  # by the ISA asked for
_SAID_OFF = False


def _library() -> tuple[ctypes.CDLL, Path] | None:
    """The built and checked library (once per process), or None (``_LIBRARY_ERROR`` says why)."""
    global _LIBRARY, _LIBRARY_ERROR
    if _LIBRARY is None and _LIBRARY_ERROR is None:
        try:
            path = build(SOURCE, kernel_cache_dir())
            _LIBRARY = load_checked(path), path
        except UntrustedKernelError as exc:
            _LIBRARY_ERROR = str(exc), logging.WARNING
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _LIBRARY_ERROR = str(exc), logging.INFO
    return _LIBRARY


def load(isa: str = "auto", enabled: bool = True) -> QuantKernels | None:
    """The compiled kernels with instruction set ``isa`` (the CPU backend's option
    ``quant_isa``; ``auto``: the best the CPU runs), or None where they cannot run here
    (reason logged once) or when not ``enabled`` (option ``native=false``). ValueError
    for an ISA the CPU cannot run, RuntimeError when ``amx`` is forced and Linux refuses
    the process the tile state."""
    global _SAID_OFF
    if not enabled:
        if not _SAID_OFF:
            _SAID_OFF = True
            logger.info("native GGUF kernels off (backend option native=false): quantized weights are "
                        "dequantized per product")
        return None
    if isa in _LOADED:
        return _LOADED[isa]
    reason, level = None, logging.INFO
    chosen, why = None, ""
    if not sys.platform.startswith("linux"):
        reason = f"native CPU kernels are built on Linux only (this is {sys.platform})"
    else:
        try:
            chosen, why = select_isa(isa=isa)
        except RuntimeError as exc:
            reason = str(exc)
    kernels = None
    if reason is None:
        library = _library()
        if library is None:
            reason, level = _LIBRARY_ERROR
        else:
            kernels = QuantKernels(library[0], library[1], chosen)
    if kernels is not None and chosen == "amx" and not kernels.amx_granted():
        # the CPU has the tiles, but Linux did not grant this process their state (a
        # kernel before 5.16, or a seccomp policy): tile instructions would fault
        if why.startswith("forced"):
            raise RuntimeError("quant_isa='amx': Linux refused this process the AMX tile state "
                               "(arch_prctl ARCH_REQ_XCOMP_PERM)")
        logger.info("AMX tiles refused by the kernel (arch_prctl ARCH_REQ_XCOMP_PERM): using avx512vnni")
        chosen, why = "avx512vnni", "AMX tile state refused by Linux"
        kernels.isa = chosen
    _LOADED[isa] = kernels
    if kernels is None:
        logger.log(level, "native GGUF kernels off (%s): quantized weights are dequantized per product", reason)
    else:
        logger.info("native GGUF kernels loaded from %s: instruction set %s (%s)", kernels.path, chosen, why)
    return kernels
