"""Native kernels the CPU backend compiles for the machine it runs on.

* ``gemv_bf16``, ``gemv_bf16_dot``, ``gemv_f32``: few-row linear over bfloat16 or float32
  weights (decode of a small batch, a speculative verification).
* ``paged_decode_attention``: decode attention read in place from the paged KV cache.
* ``rms_norm``, ``rope_``, ``silu_mul``, ``embedding``: fused layer ops; ``kv_write``:
  a step's K/V into the paged cache.
* ``greedy``: argmax and its log-probability per row of logits.
(``ember.hardware.cpu_linear`` holds oneDNN's float32 product and the linear ops built
on the GEMVs; see ``ember.hardware.cpu_paths``.)

All but greedy take float32 or bfloat16 tensors (the bf16 path's); the bf16 ones
compute in float32 and round where PyTorch's bf16 ops round.

PyTorch has no fast product of float32 activations with bfloat16 weights on CPUs
without AVX512-BF16/AMX: a few-row ("GEMV") product then either reads float32
weights (twice the bytes) or runs bf16 math several times slower. A decode step of
one request is bound by reading the weights, so ``gemv_bf16`` reads them in bf16,
widens each to float32 in registers (exact) and accumulates in float32: the same
numbers as the float32 product of bf16-rounded weights, at half the memory traffic.
Decode attention in PyTorch first gathers every request's K and V out of the paged
cache (a copy of the whole context per layer) and then runs a masked attention; the
kernel reads each cached token once where it lies, for all query heads sharing its KV
head. Greedy sampling with PyTorch made four passes over the batch's logits, each into
a fresh tensor (argmax, max, exp, sum); the kernel makes two, into nothing.

The C source (``csrc/ember_cpu.c``, AVX2 + FMA, OpenMP) is compiled once with the
system C compiler (``$CC``, else ``cc``) into ``<ember cache>/kernels/``
(``trusted_library.build``) and loaded with ctypes; it shares PyTorch's OpenMP runtime
and thread count. Every C function Python calls, here and in ``cpu_quant``, is a
:class:`NativeFunction`, which a CPU graph can record (``ember.hardware.cpu_graphs``). Where the CPU lacks
AVX2/FMA, or no compiler works, ``load()`` returns None (the reason is logged once)
and the backend keeps PyTorch's kernels. The CPU backend's option ``native=false`` turns this off.

A cached library is loaded only if it passes `ember.hardware.trusted_library`'s
checks (this user's, writable by no one else, the sha256 recorded when it was built);
one that fails is rebuilt (atomically replaced, so a process that has the old one
loaded keeps it), and a kernel directory others could write to turns the kernels off.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import subprocess
import sys
import threading
from pathlib import Path

import torch

from ember.hardware.cpu_paths import cpu_flags
from ember.hardware.trusted_library import UntrustedKernelError, build, kernel_cache_dir, load_checked

logger = logging.getLogger(__name__)

# -- calls into the native libraries, which a CPU graph can record ----------------------------

POINTER, INTEGER, FLOAT = "p", "i", "f"
_KINDS = {ctypes.c_void_p: POINTER, ctypes.c_int: INTEGER, ctypes.c_int64: INTEGER, ctypes.c_float: FLOAT}
# this thread's recorder while it captures a CPU graph (ember.hardware.cpu_graphs), else None
_capture = threading.local()


class NativeFunction:
    """One C function of a native library: calling it calls the C function (ctypes),
    and while this thread captures a CPU graph it also hands the call to the graph's
    recorder. ``kinds``: its arguments' kinds (pointer, integer, float, from its ctypes
    argtypes); ``packed``: the address of its ``<name>__packed`` twin, which takes the
    same arguments as one int64 array and is what a replay calls (None: no twin, and a
    capture that meets a call of it is refused)."""

    __slots__ = ("name", "function", "kinds", "packed")

    def __init__(self, lib: ctypes.CDLL, name: str, argtypes: list, restype) -> None:
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
        self.name = name
        self.function = function
        self.kinds = tuple(_KINDS[t] for t in argtypes)
        twin = getattr(lib, f"{name}__packed", None)
        self.packed = ctypes.cast(twin, ctypes.c_void_p).value if twin is not None else None

    def __call__(self, *args):
        recorder = getattr(_capture, "recorder", None)
        if recorder is not None:
            recorder.record(self, args)
        return self.function(*args)

    def pack(self, args) -> list[int]:
        """``args`` as the ``__packed`` twin reads them: pointers and integers as int64,
        a float as its float32 bits."""
        if len(args) != len(self.kinds):
            raise TypeError(f"{self.name} takes {len(self.kinds)} arguments, got {len(args)}")
        return [
            struct.unpack("<I", struct.pack("<f", value))[0] if kind == FLOAT else int(value or 0)
            for kind, value in zip(self.kinds, args)
        ]


def set_recorder(recorder) -> None:
    """Make ``recorder`` (``record(function, args)``) see this thread's native calls; None stops."""
    _capture.recorder = recorder


# -- the kernels of csrc/ember_cpu.c ---------------------------------------------------------------

SOURCE = "ember_cpu.c"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of attention and the layer ops
MAX_ATTENTION_WIDTH = 16384  # heads * head_dim the attention kernel's accumulator holds
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# the paged KV cache's element types the kernels read and write (ember_cpu.c's KV_*): the
# compute dtype's, or a 16-bit cache beside float32 activations (EngineConfig.kv_cache_dtype)
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
KV_PAIRS = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
            (torch.float32, torch.float16)}  # (compute dtype, cache dtype)


class NativeKernels:
    """The loaded library; call through the typed methods only."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        # gemv over bf16 weights: float32 x/bias/y, or bfloat16 ones (ember_gemv_bf16_bf16)
        self._gemv = _typed(lib, "ember_gemv_bf16", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
                            bf16_name="ember_gemv_bf16_bf16")
        # float32 and bfloat16 instantiations of attention and the layer ops, by dtype
        vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._gemv_f32 = NativeFunction(lib, "ember_gemv_f32", [vp] * 4 + [i64] * 3 + [ci], None)
        self._gemv_dp = NativeFunction(lib, "ember_gemv_bf16_dp", [vp] * 4 + [i64] * 3 + [ci], None)
        # the bf16 dot-product GEMV runs AVX512-BF16 instructions: only where the CPU has them
        self.has_bf16_dot = {"avx512_bf16", "avx512bw", "avx512f"} <= cpu_flags()
        cf = ctypes.c_float
        # ... scale, nthreads[, kv], window, softcap
        self._attention = _typed(lib, "ember_paged_decode_attention",
                                 [vp, i64] + [vp] * 5 + [i64] * 7 + [cf, ci, i64, cf], restype=ci)
        self._greedy = NativeFunction(lib, "ember_greedy", [vp, i64, i64, vp, vp, ci], None)
        # greedy's outputs, per number of rows: reused (a decode step then creates no
        # tensor; each small allocation costs tens of microseconds right after a forward)
        self._greedy_out: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self._rms_norm = _typed(lib, "ember_rms_norm",
                                [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int])
        self._rope = _typed(lib, "ember_rope",
                            [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int])
        self._silu_mul = _typed(lib, "ember_silu_mul", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int])
        self._gelu_tanh_mul = _typed(lib, "ember_gelu_tanh_mul", [vp] * 2 + [i64] * 2 + [ci])
        self._head_rms_norm = _typed(lib, "ember_head_rms_norm", [vp] + [i64] * 4 + [vp, cf, ci])
        self._scale = _typed(lib, "ember_scale", [vp, i64, cf])
        self._attention_kv16 = NativeFunction(lib, "ember_paged_decode_attention_kv16",
                                              [vp, i64] + [vp] * 5 + [i64] * 7 + [cf, ci, ci, i64, cf], ci)
        self._kv_write = NativeFunction(lib, "ember_kv_write", [vp, vp, i64, vp, i64, vp, vp, i64, i64, ci, ci, ci], ci)
        self._embedding = NativeFunction(lib, "ember_embedding", [vp, i64, i64, vp, i64, vp], ci)
        self._lora = _typed(lib, "ember_lora", [vp, i64, vp, i64, vp, vp, vp, vp] + [i64] * 5 + [ci], restype=ci)
        self._lora_w16 = NativeFunction(lib, "ember_lora_w16", [vp, i64, vp, i64, vp, vp, vp, vp] + [i64] * 5 + [ci], ci)
        # a CPU graph's replay (ember.hardware.cpu_graphs): records, count, &failed index
        self.replay = NativeFunction(lib, "ember_replay", [vp, i64, vp], ci)

    @staticmethod
    def _run_gemv(name: str, function, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  x_dtypes: tuple[torch.dtype, ...], weight_dtype: torch.dtype, wanted: str) -> torch.Tensor:
        """Check a GEMV's arguments (ValueError naming what is wrong) and run it: y (M, N)
        in x's dtype, bias (N,) in x's dtype or None."""
        if x.dtype not in x_dtypes or weight.dtype != weight_dtype or x.dim() != 2 or weight.dim() != 2:
            raise ValueError(f"{name} takes {wanted}, got {x.dtype} {tuple(x.shape)} and {weight.dtype} "
                             f"{tuple(weight.shape)}")
        M, K = x.shape
        N = weight.shape[0]
        if weight.shape[1] != K:
            raise ValueError(f"{name}: x has {K} columns, weight has {weight.shape[1]}")
        if bias is not None and (bias.dtype != x.dtype or bias.shape != (N,)):
            raise ValueError(f"{name}: bias must be {x.dtype} ({N},), got {bias.dtype} {tuple(bias.shape)}")
        x = x.contiguous()
        weight = weight.contiguous()
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        function(x.data_ptr(), weight.data_ptr(), bias.contiguous().data_ptr() if bias is not None else None,
                 y.data_ptr(), M, N, K, torch.get_num_threads())
        return y

    def gemv_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` (M, K) and ``bias`` (N,) both float32 or both
        bfloat16, and bfloat16 ``weight`` (N, K), accumulated in float32; returns
        x's dtype (M, N)."""
        return self._run_gemv("gemv_bf16", self._gemv.get(x.dtype), x, weight, bias, KERNEL_DTYPES, torch.bfloat16,
                              "float32 or bfloat16 x (M, K) and bfloat16 weight (N, K)")

    def gemv_bf16_dot(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for bfloat16 ``x`` (M, K), ``weight`` (N, K) and
        ``bias`` (N,) on the CPU's bf16 dot-product instruction (AVX512-BF16), float32
        sums rounded to bfloat16 once; each output row is computed as it would be alone.
        RuntimeError where the CPU lacks avx512_bf16."""
        if not self.has_bf16_dot:
            raise RuntimeError("gemv_bf16_dot needs a CPU with avx512_bf16; this one has none")
        return self._run_gemv("gemv_bf16_dot", self._gemv_dp, x, weight, bias, (torch.bfloat16,), torch.bfloat16,
                              "bfloat16 x (M, K) and weight (N, K)")

    def gemv_f32(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for float32 ``x`` (M, K), ``weight`` (N, K) and
        ``bias`` (N,); each output row is computed as it would be alone."""
        return self._run_gemv("gemv_f32", self._gemv_f32, x, weight, bias, (torch.float32,), torch.float32,
                              "float32 x (M, K) and weight (N, K)")

    @staticmethod
    def attention_supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           kv_dtype: torch.dtype | None = None) -> bool:
        """Whether ``paged_decode_attention`` runs these heads with queries of ``dtype``
        over a cache of ``kv_dtype`` (default: the same)."""
        return (
            (dtype, kv_dtype or dtype) in KV_PAIRS and head_dim % 8 == 0 and num_heads % num_kv_heads == 0
            and num_heads * head_dim <= MAX_ATTENTION_WIDTH and num_heads <= 4096
        )

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``q`` (B, Hq, D) float32 or bfloat16, one query token per request (heads and
        dims contiguous, rows any stride apart: the q part of a fused qkv); ``k_cache``,
        ``v_cache`` (num_blocks, block_size, Hkv, D) of q's dtype; ``block_tables`` (B, max_blocks) and
        ``context_lens`` (B,) int64. Returns softmax(scale q K^T) V over each request's
        first ``context_lens[b]`` cached tokens (only its last ``window`` ones for a
        sliding-window layer; each score ``softcap tanh(s / softcap)`` with ``softcap``),
        (B, Hq, D). ValueError naming the
        problem, before any work, unless every length lies in ``[1, max_blocks *
        block_size]`` and every block id a request reads in ``[0, num_blocks)`` (the
        kernel checks: it reads where the tables point)."""
        B, Hq, D = q.shape
        num_blocks, block_size, Hkv, Dk = k_cache.shape
        if not self.attention_supports(Hq, Hkv, D, q.dtype, k_cache.dtype) or v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"paged_decode_attention: unsupported q {q.dtype} {tuple(q.shape)} with cache "
                f"{k_cache.dtype} {tuple(k_cache.shape)} (float32 or bfloat16 q, a cache of q's dtype or a 16-bit "
                f"one beside float32 q, head_dim a multiple of 8, heads a multiple of KV heads, heads * head_dim "
                f"<= {MAX_ATTENTION_WIDTH})"
            )
        if Dk != D or v_cache.shape != k_cache.shape:
            raise ValueError(f"paged_decode_attention: cache shapes {tuple(k_cache.shape)}, "
                             f"{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
        if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != B:
            raise ValueError(f"paged_decode_attention: block_tables must be int64 ({B}, max_blocks), "
                             f"got {block_tables.dtype} {tuple(block_tables.shape)}")
        if context_lens.dtype != torch.int64 or context_lens.shape != (B,):
            raise ValueError(f"paged_decode_attention: context_lens must be int64 ({B},), "
                             f"got {context_lens.dtype} {tuple(context_lens.shape)}")
        max_blocks = block_tables.shape[1]
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode_attention: the caches must be contiguous")
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        block_tables = block_tables.contiguous()
        out = torch.empty(B, Hq, D, dtype=q.dtype)
        args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                context_lens.data_ptr(), out.data_ptr(), B, Hq, Hkv, D, block_size, max_blocks, num_blocks, scale,
                torch.get_num_threads())
        if window is not None and window < 1 or softcap is not None and not softcap > 0:
            raise ValueError(f"paged_decode_attention: window must be >= 1 and softcap > 0, got {window}, {softcap}")
        extra = (window or 0, float(softcap or 0.0))
        if k_cache.dtype == q.dtype:
            rc = self._attention[q.dtype](*args, *extra)
        else:
            rc = self._attention_kv16(*args, KV_TYPES[k_cache.dtype], *extra)
        if rc == -1:
            raise ValueError(f"paged_decode_attention: context lengths must lie in [1, {max_blocks * block_size}]")
        if rc:
            raise ValueError(f"paged_decode_attention: block ids must lie in [0, {num_blocks})")
        return out

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of float32 ``logits`` (rows, vocab): the first index of the largest
        value and its log-softmax. NaN never wins (torch.argmax would pick it). The
        returned tensors are reused by the next call with as many rows: read or copy
        them before calling again."""
        if logits.dtype != torch.float32 or logits.dim() != 2:
            raise ValueError(f"greedy takes float32 logits (rows, vocab), got {logits.dtype} {tuple(logits.shape)}")
        if not logits.is_contiguous():
            logits = logits.contiguous()
        rows, vocab = logits.shape
        out = self._greedy_out.get(rows)
        if out is None:
            if len(self._greedy_out) > 1024:
                self._greedy_out.clear()
            ids, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
            out = self._greedy_out[rows] = (ids, logprobs, ids.data_ptr(), logprobs.data_ptr())
        ids, logprobs, ids_ptr, logprobs_ptr = out
        self._greedy(logits.data_ptr(), rows, vocab, ids_ptr, logprobs_ptr, torch.get_num_threads() if rows > 1 else 1)
        return ids, logprobs


    # -- fused layer ops (BaseBackend.layer_ops): float32 or bfloat16 tensors, one dtype
    # for all of a call's tensors (cos/sin caches float32); callers check -----------------

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """``ember.models.layers.RMSNorm`` in one pass: ``norm(x)``, or with
        ``residual`` ``(norm(x + residual), x + residual)``."""
        x = x.contiguous()
        hidden = x.shape[-1]
        out = torch.empty_like(x)
        total = None
        if residual is not None:
            residual = residual.contiguous()
            total = torch.empty_like(x)
        if weight.dtype != x.dtype:
            raise ValueError(f"rms_norm: weight is {weight.dtype}, x is {x.dtype}")
        self._rms_norm[x.dtype](
            x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), out.data_ptr(),
            total.data_ptr() if total is not None else None, x.numel() // hidden, hidden, eps,
            torch.get_num_threads(),
        )
        return out if residual is None else (out, total)

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor):
        """Rotate-half RoPE in place on ``x`` (T, heads, D), a view whose heads and
        dims are contiguous (rows may be apart: the q or k part of a fused qkv)."""
        T, heads, D = x.shape
        if x.stride(2) != 1 or x.stride(1) != D:
            raise ValueError(f"rope_ needs contiguous heads, got strides {x.stride()}")
        self._rope[x.dtype](
            x.data_ptr(), T, x.stride(0), heads, D, positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
            torch.get_num_threads(),
        )
        return x

    def lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slots: torch.Tensor,
             rank: int, slot_ranks: torch.Tensor | None = None) -> None:
        """``BaseBackend.lora_op``: ``y[t] += (x[t] @ A_s.T) @ Bt_s`` in place for every token
        ``t`` of slot ``s = token_slots[t] >= 0`` (``rank`` rows of ``a`` and ``bt`` per slot;
        ``slot_ranks[s]``: the rows of slot ``s`` in use, the rest zero and skipped). ``x`` and
        ``y`` may be row-strided views; float32 or bfloat16 throughout, or bfloat16 ``a`` and
        ``bt`` beside float32 ``x`` and ``y``."""
        T, K = x.shape
        N = y.shape[1]
        dtype = x.dtype
        wide = dtype == torch.float32 and a.dtype == torch.bfloat16
        if (dtype not in KERNEL_DTYPES or y.dtype != dtype or a.dtype != (torch.bfloat16 if wide else dtype)
                or bt.dtype != a.dtype
                or y.shape[0] != T or x.stride(1) != 1 or y.stride(1) != 1 or a.dim() != 2 or a.shape[1] != K
                or not a.is_contiguous() or not bt.is_contiguous() or bt.shape != (a.shape[0], N)
                or rank < 1 or a.shape[0] % rank or token_slots.dtype != torch.int64 or token_slots.shape[0] < T):
            raise ValueError(f"lora: x {dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}, a {a.dtype} "
                             f"{tuple(a.shape)}, bt {bt.dtype} {tuple(bt.shape)}, rank {rank}, slots "
                             f"{token_slots.dtype} {tuple(token_slots.shape)} do not fit")
        S = a.shape[0] // rank
        if slot_ranks is None:
            slot_ranks = torch.full((S,), rank, dtype=torch.int64)
        if slot_ranks.dtype != torch.int64 or slot_ranks.shape != (S,):
            raise ValueError(f"lora: slot_ranks must be int64 ({S},), got {slot_ranks.dtype} {tuple(slot_ranks.shape)}")
        rc = (self._lora_w16 if wide else self._lora[dtype])(
                               x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), bt.data_ptr(),
                               token_slots.data_ptr(), slot_ranks.data_ptr(), T, K, N, rank, S,
                               torch.get_num_threads())
        if rc:
            raise ValueError(f"lora: a token's slot is outside 0..{S - 1} or a slot uses more than {rank} rows")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` (T, 2 I) = [gate | up]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` for ``gate_up`` (T, 2 I) = [gate | up] (GeGLU)."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._gelu_tanh_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                                           torch.get_num_threads())
        return out

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of every head of ``x`` (T, heads, D) in place, one ``weight`` (D,) for all
        heads; ``x`` a view whose heads and dims are contiguous (rows may be apart: the q
        or k part of a fused qkv). Returns ``x``."""
        T, heads, D = x.shape
        if x.stride(2) != 1 or x.stride(1) != D or weight.shape != (D,) or weight.dtype != x.dtype:
            raise ValueError(f"head_rms_norm_: x {tuple(x.shape)} strides {x.stride()} with weight "
                             f"{weight.dtype} {tuple(weight.shape)}: heads and dims must be contiguous, the "
                             f"weight ({D},) of x's dtype")
        self._head_rms_norm[x.dtype](x.data_ptr(), T, x.stride(0), heads, D, weight.data_ptr(), eps,
                                     torch.get_num_threads())
        return x

    def scale_(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        """``x *= factor`` in place, each product rounded to x's dtype (``factor`` as the
        caller rounded it: `ember.models.layers.Scale`). Returns ``x``."""
        if not x.is_contiguous():
            raise ValueError("scale_: x must be contiguous")
        self._scale[x.dtype](x.data_ptr(), x.numel(), factor)
        return x

    @staticmethod
    def kv_write_supports(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether ``kv_write`` takes K/V of ``dtype`` into a cache of ``kv_dtype``."""
        return (dtype, kv_dtype) in KV_PAIRS

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        """``k_cache[slots[t]] = k[t]`` and the same for v, for ``k``, ``v`` (T, Hkv, D)
        (heads and dims contiguous, rows any stride apart, the same for both) and caches
        (num_slots, Hkv, D) of their dtype, or 16-bit ones beside float32 K/V (rounded to
        nearest even); a negative slot (padding) writes nothing. ValueError naming a
        slot past the cache (nothing written then)."""
        T, heads, D = k.shape
        if v.shape != k.shape or v.stride() != k.stride() or k.stride(2) != 1 or k.stride(1) != D:
            raise ValueError(f"kv_write: k {tuple(k.shape)} {k.stride()} and v {tuple(v.shape)} {v.stride()} "
                             "must have contiguous heads and the same strides")
        if v.dtype != k.dtype or v_cache.dtype != k_cache.dtype or not self.kv_write_supports(k.dtype, k_cache.dtype):
            raise ValueError(f"kv_write: k {k.dtype} and v {v.dtype} into caches {k_cache.dtype} and "
                             f"{v_cache.dtype}: one dtype, or float32 into a 16-bit cache")
        if k_cache.shape[1:] != (heads, D) or v_cache.shape != k_cache.shape or not k_cache.is_contiguous() \
                or not v_cache.is_contiguous() or slots.dtype != torch.int64 or slots.shape != (T,):
            raise ValueError(f"kv_write: caches {tuple(k_cache.shape)} and slots {slots.dtype} "
                             f"{tuple(slots.shape)} do not fit k {tuple(k.shape)}")
        rc = self._kv_write(k.data_ptr(), v.data_ptr(), k.stride(0), slots.data_ptr(), T, k_cache.data_ptr(),
                            v_cache.data_ptr(), k_cache.shape[0], heads * D, KV_TYPES[k.dtype],
                            KV_TYPES[k_cache.dtype], torch.get_num_threads())
        if rc:
            raise ValueError(f"kv_write: a slot lies past the cache's {k_cache.shape[0]} slots")

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``table[ids]`` for int64 ``ids`` (T,) and a contiguous ``table`` (V, H) of any
        dtype: (T, H) of the table's. IndexError naming the vocabulary for an id
        outside it (nothing computed then)."""
        if ids.dtype != torch.int64 or ids.dim() != 1 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"embedding takes int64 ids (T,) and a contiguous table (V, H), "
                             f"got {ids.dtype} {tuple(ids.shape)} and {tuple(table.shape)}")
        ids = ids.contiguous()
        V, H = table.shape
        out = torch.empty(ids.shape[0], H, dtype=table.dtype)
        rc = self._embedding(table.data_ptr(), V, H * table.element_size(), ids.data_ptr(), ids.shape[0],
                             out.data_ptr())
        if rc:
            raise IndexError(f"embedding: a token id lies outside the vocabulary [0, {V})")
        return out


def _typed(lib: ctypes.CDLL, name: str, argtypes: list, bf16_name: str | None = None,
           restype=None) -> dict[torch.dtype, object]:
    """``{torch.float32: name, torch.bfloat16: name_bf16}`` (or ``bf16_name``) as
    :class:`NativeFunction`s with their argument types."""
    return {dtype: NativeFunction(lib, symbol, argtypes, restype)
            for dtype, symbol in ((torch.float32, name), (torch.bfloat16, bf16_name or name + "_bf16"))}


_LOADED: NativeKernels | None = None
_TRIED = False


_SAID_OFF = False


def load(enabled: bool = True) -> NativeKernels | None:
    """The compiled kernels, or None where they cannot run here (reason logged once),
    or when not ``enabled`` (the CPU backend's option ``native=false``: nothing is
    built or loaded)."""
    global _LOADED, _TRIED, _SAID_OFF
    if not enabled:
        if not _SAID_OFF:
            _SAID_OFF = True
            logger.info("native CPU kernels off (backend option native=false): PyTorch's kernels are used")
        return None
    if _TRIED:
        return _LOADED
    _TRIED = True
    reason, level = None, logging.INFO
    if not sys.platform.startswith("linux"):
        reason = f"native CPU kernels are built on Linux only (this is {sys.platform})"
    else:
        missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
        if missing:
            reason = f"this CPU lacks {', '.join(missing)}"
    if reason is None:
        try:
            path = build(SOURCE, kernel_cache_dir())
            _LOADED = NativeKernels(load_checked(path), path)
        except UntrustedKernelError as exc:
            reason, level = str(exc), logging.WARNING
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = str(exc)
    if _LOADED is None:
        logger.log(level, "native CPU kernels off (%s): PyTorch's kernels are used", reason)
    else:
        logger.info("native CPU kernels loaded from %s", _LOADED.path)
    return _LOADED
