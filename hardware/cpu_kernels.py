"""Native kernels the CPU backend compiles for the machine it runs on, and the matrix
products (``linear_op``) of its two paths built on them and on oneDNN.

* ``gemv_bf16``: few-row linear over bfloat16 weights (decode of a small batch).
* ``paged_decode_attention``: decode attention read in place from the paged KV cache.
* ``rms_norm``, ``rope_``, ``silu_mul``: fused layer ops.
* ``greedy``: argmax and its log-probability per row of logits.
* ``onednn_linear``, ``SmallBatchLinear`` (fp32 path) and ``PackedLinear`` (bf16
  path): see ``ember.hardware.cpu_paths``.

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
system C compiler (``$CC``, else ``cc``) into ``<ember cache>/kernels/`` and loaded
with ctypes; it shares PyTorch's OpenMP runtime and thread count. Where the CPU lacks
AVX2/FMA, or no compiler works, ``load()`` returns None (the reason is logged once)
and the backend keeps PyTorch's kernels. ``EMBER_CPU_NATIVE=0`` turns this off.

A cached library is loaded only if it passes `ember.hardware.trusted_library`'s
checks (this user's, writable by no one else, the sha256 recorded when it was built);
one that fails is rebuilt (atomically replaced, so a process that has the old one
loaded keeps it), and a kernel directory others could write to turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.hardware.cpu_paths import cpu_flags
from ember.hardware.trusted_library import (
    UntrustedKernelError,
    check_library,
    load_checked,
    make_private_dir,
    record_path,
)

logger = logging.getLogger(__name__)

SOURCE = "ember_cpu.c"
# no FMA contraction: explicit intrinsics choose where to fuse, and ember_rope's
# plain C then rounds as PyTorch does
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of attention and the layer ops
MAX_ATTENTION_WIDTH = 16384  # heads * head_dim the attention kernel's accumulator holds
REQUIRED_CPU_FLAGS = ("avx2", "fma")


class NativeKernels:
    """The loaded library; call through the typed methods only."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        # gemv over bf16 weights: float32 x/bias/y, or bfloat16 ones (ember_gemv_bf16_bf16)
        self._gemv = _typed(lib, "ember_gemv_bf16", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
                            bf16_name="ember_gemv_bf16_bf16")
        # float32 and bfloat16 instantiations of attention and the layer ops, by dtype
        self._attention = _typed(lib, "ember_paged_decode_attention",
                                 [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int])
        self._greedy = lib.ember_greedy
        self._greedy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int]
        self._greedy.restype = None
        # greedy's outputs, per number of rows: reused (a decode step then creates no
        # tensor; each small allocation costs tens of microseconds right after a forward)
        self._greedy_out: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self._rms_norm = _typed(lib, "ember_rms_norm",
                                [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int])
        self._rope = _typed(lib, "ember_rope",
                            [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int])
        self._silu_mul = _typed(lib, "ember_silu_mul", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int])

    def gemv_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` (M, K) and ``bias`` (N,) both float32 or both
        bfloat16, and bfloat16 ``weight`` (N, K), accumulated in float32; returns
        x's dtype (M, N)."""
        if x.dtype not in KERNEL_DTYPES or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.dim() != 2:
            raise ValueError(
                f"gemv_bf16 takes float32 or bfloat16 x (M, K) and bfloat16 weight (N, K), "
                f"got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}"
            )
        M, K = x.shape
        N = weight.shape[0]
        if weight.shape[1] != K:
            raise ValueError(f"gemv_bf16: x has {K} columns, weight has {weight.shape[1]}")
        if bias is not None and (bias.dtype != x.dtype or bias.shape != (N,)):
            raise ValueError(f"gemv_bf16: bias must be {x.dtype} ({N},), got {bias.dtype} {tuple(bias.shape)}")
        x = x.contiguous()
        weight = weight.contiguous()
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        self._gemv[x.dtype](
            x.data_ptr(), weight.data_ptr(), bias.contiguous().data_ptr() if bias is not None else None,
            y.data_ptr(), M, N, K, torch.get_num_threads(),
        )
        return y

    @staticmethod
    def attention_supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        return (
            dtype in KERNEL_DTYPES and head_dim % 8 == 0 and num_heads % num_kv_heads == 0
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
        tables_checked: bool = False,
    ) -> torch.Tensor:
        """``q`` (B, Hq, D) float32 or bfloat16, one query token per request; ``k_cache``,
        ``v_cache`` (num_blocks, block_size, Hkv, D) of q's dtype; ``block_tables`` (B, max_blocks) and
        ``context_lens`` (B,) int64. Returns softmax(scale q K^T) V over each request's
        first ``context_lens[b]`` cached tokens, (B, Hq, D). ``tables_checked``: the
        caller ran :meth:`check_tables` on these tables already (once per step, not
        once per layer)."""
        B, Hq, D = q.shape
        num_blocks, block_size, Hkv, Dk = k_cache.shape
        if not self.attention_supports(Hq, Hkv, D, q.dtype) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(
                f"paged_decode_attention: unsupported q {q.dtype} {tuple(q.shape)} with cache "
                f"{k_cache.dtype} {tuple(k_cache.shape)} (float32 or bfloat16, head_dim a multiple of 8, "
                f"heads a multiple of KV heads, heads * head_dim <= {MAX_ATTENTION_WIDTH})"
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
        if not tables_checked:
            self.check_tables(block_tables, context_lens, num_blocks, block_size)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode_attention: the caches must be contiguous")
        q = q.contiguous()
        block_tables = block_tables.contiguous()
        out = torch.empty_like(q)
        self._attention[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), B, Hq, Hkv, D, block_size, max_blocks, scale, torch.get_num_threads(),
        )
        return out

    @staticmethod
    def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
        """Raise ValueError unless every block id and length stays inside the cache:
        the kernel reads where the tables point."""
        if not context_lens.numel():
            return
        max_len = block_tables.shape[1] * block_size
        low, high = (int(v) for v in torch.aminmax(context_lens))
        if low < 1 or high > max_len:
            raise ValueError(f"paged_decode_attention: context lengths must lie in [1, {max_len}]")
        if block_tables.numel():
            low, high = (int(v) for v in torch.aminmax(block_tables))
            if low < 0 or high >= num_blocks:
                raise ValueError(f"paged_decode_attention: block ids must lie in [0, {num_blocks})")

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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` (T, 2 I) = [gate | up]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out


# -- matrix products: the linear_op of each CPU path (ember.hardware.cpu_paths) -------------

# oneDNN picks the blocked layout for a batch size; one layout serves every size
# (1 to 512 rows measured within 3% of a layout picked for their own size).
PACK_ROWS = 128


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        # float32 only: without AVX512-BF16/AMX oneDNN has no bf16 inner product, and
        # F.linear gives the clear error for mixed dtypes
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_ONEDNN_OK: bool | None = None


def onednn_linear_works() -> bool:
    """Whether this torch has oneDNN's linear and it agrees with F.linear (checked once)."""
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        try:
            x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
            _ONEDNN_OK = bool(
                torch.backends.mkldnn.is_available()
                and torch.allclose(onednn_linear(x, w, b), F.linear(x, w, b), atol=1e-5)
                and torch.allclose(onednn_linear(x, w), F.linear(x, w), atol=1e-5)
            )
        except (RuntimeError, AttributeError):
            _ONEDNN_OK = False
    return _ONEDNN_OK


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) bf16, reordered into oneDNN's blocked layout (an opaque
    ``mkldnn`` tensor that only ``PackedLinear`` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


_PACKING_OK: bool | None = None


def packing_works() -> bool:
    """Whether this torch reorders bf16 weights and its packed product agrees with
    F.linear (checked once; a CPU oneDNN cannot run bf16 on fails here)."""
    global _PACKING_OK
    if _PACKING_OK is None:
        try:
            x, w, b = (torch.randn(3, 64).bfloat16(), torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16())
            got = torch.ops.mkldnn._linear_pointwise(x, pack_bf16(w), b, "none", [], "")
            _PACKING_OK = bool(torch.allclose(got.float(), F.linear(x.float(), w.float(), b.float()), atol=0.1))
        except (RuntimeError, AttributeError):
            _PACKING_OK = False
    return _PACKING_OK


class PackedLinear:
    """The CPU ``linear_op`` of the bf16 path. A ``Linear`` whose weight was packed
    (``pack``, then ``Linear.set_packed_weight``) passes the packed tensor itself; a
    weight also used elsewhere (a tied LM head, which the embedding reads) gets a
    packed copy (``add``). Anything else goes to ``base``.

    With ``kernels`` and ``max_rows`` > 0, the plain bf16 weights are kept beside the
    packed ones and products of up to ``max_rows`` rows (decode of a small batch,
    bound by reading the weights) take the native kernel over them: oneDNN's packed
    product of one row read SmolLM2's weights from memory at 19 GB/s on a 2-core
    AVX512-BF16 EPYC, the kernel at about 28."""

    def __init__(self, base, kernels=None, max_rows: int = 0) -> None:
        self.base = base
        self.kernels = kernels
        self.max_rows = max_rows if kernels is not None else 0
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(plain) -> (plain, packed)
        self._plain: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(packed) -> (packed, plain)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed form of a ``Linear``'s weight (which the caller installs)."""
        packed = pack_bf16(weight)
        if self.max_rows > 0:
            self._plain[id(packed)] = (packed, weight.detach())
        return packed

    def add(self, weight: torch.Tensor) -> None:
        """A packed copy of ``weight``, which stays in use elsewhere too."""
        self._packed[id(weight)] = (weight, pack_bf16(weight))

    @property
    def plain_bytes(self) -> int:
        """Bytes of the plain weights kept for small batches beside the packed ones."""
        return sum(p.numel() * p.element_size() for _, p in self._plain.values())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.is_mkldnn:
            packed = weight
            if x.dim() == 2 and x.shape[0] <= self.max_rows:
                entry = self._plain.get(id(weight))
                if entry is not None and entry[0] is weight:
                    return self.kernels.gemv_bf16(x, entry[1], bias)
        else:
            entry = self._packed.get(id(weight))
            if entry is None or entry[0] is not weight or x.dtype != torch.bfloat16:
                return self.base(x, weight, bias)
            if x.dim() == 2 and x.shape[0] <= self.max_rows:
                return self.kernels.gemv_bf16(x, weight, bias)
            packed = entry[1]
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class SmallBatchLinear:
    """The CPU ``linear_op`` of a bf16 model computed in float32: products of up to
    ``max_rows`` rows read a bfloat16 copy of the weight through the native kernel
    (half the bytes; the same bf16-rounded numbers, accumulated in float32), larger
    ones run ``base`` on the float32 weight, where the GEMM is compute-bound and
    oneDNN's blocking wins. Weights without a copy (none registered) take ``base``."""

    def __init__(self, base, kernels, max_rows: int) -> None:
        self.base = base
        self.kernels = kernels
        self.max_rows = max_rows
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, weight: torch.Tensor) -> None:
        self._copies[id(weight)] = (weight, weight.detach().to(torch.bfloat16))

    @property
    def copy_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for _, c in self._copies.values())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.float32:
            entry = self._copies.get(id(weight))
            if entry is not None and entry[0] is weight:
                return self.kernels.gemv_bf16(x, entry[1], bias)
        return self.base(x, weight, bias)


class RowInvariantLinear:
    """Batch-invariant products (``EMBER_BATCH_INVARIANT=1``): each row of ``x @ w.T``
    comes out bit for bit as it would alone, whatever the other rows. bf16 weights go
    through the native kernel, whose every output is one row's dot product in a fixed
    order (reading the weights once for all rows); other weights run one row at a time
    (PyTorch's GEMM picks its blocking, hence its summation order, by the number of
    rows). Slower for prefill: what it buys is outputs that do not depend on batching,
    chunking or speculation."""

    def __init__(self, kernels=None) -> None:
        self.kernels = kernels

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if (self.kernels is not None and weight.dtype == torch.bfloat16 and rows.dtype in KERNEL_DTYPES
                and (bias is None or bias.dtype == rows.dtype)):
            out = self.kernels.gemv_bf16(rows, weight, bias)
        else:
            out = torch.cat([F.linear(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _typed(lib: ctypes.CDLL, name: str, argtypes: list, bf16_name: str | None = None) -> dict[torch.dtype, object]:
    """``{torch.float32: name, torch.bfloat16: name_bf16}`` (or ``bf16_name``) with
    their argument types."""
    functions = {}
    for dtype, symbol in ((torch.float32, name), (torch.bfloat16, bf16_name or name + "_bf16")):
        function = getattr(lib, symbol)
        function.argtypes = argtypes
        function.restype = None
        functions[dtype] = function
    return functions


_LOADED: NativeKernels | None = None
_TRIED = False


def _cache_dir() -> Path:
    from ember.weights.resolver import ember_cache_dir

    return ember_cache_dir() / "kernels"


def build(source: str, out_dir: Path) -> Path:
    """Compile ``source`` into ``out_dir`` (named by the source and flags' hash) and
    record its sha256 beside it; reuse an earlier build that passes `check_library`,
    rebuild one that does not (the reason logged). Raises RuntimeError naming the
    compiler's complaint, or why ``out_dir`` cannot be trusted."""
    text = (resources.files("ember.hardware") / "csrc" / source).read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (set CC or install gcc)")
    digest = hashlib.sha256(text + " ".join(FLAGS + LIBS).encode() + compiler.encode()).hexdigest()[:16]
    target = out_dir / f"{Path(source).stem}-{digest}.so"
    make_private_dir(out_dir)
    if target.exists():
        with open(target, "rb") as f:
            problem = check_library(f, target)
        if problem is None:
            return target
        logger.warning("rebuilding the native CPU kernels %s: %s", target, problem)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / source
        src.write_bytes(text)
        built = Path(tmp) / target.name
        # relative names: no temporary path in the output, so concurrent builds write the same bytes
        proc = subprocess.run(
            [compiler, *FLAGS, src.name, "-o", built.name, *LIBS], cwd=tmp, capture_output=True, text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        built.chmod(0o755)  # whatever the umask: writable by this user only
        sha256 = hashlib.sha256(built.read_bytes()).hexdigest()
        os.replace(built, target)  # atomic: concurrent builders leave one whole file
        record = Path(tmp) / "record"
        record.write_text(f"{sha256}  {target.name}\n")
        record.chmod(0o644)
        os.replace(record, record_path(target))  # after the library: a record never names a missing build
    return target


def load() -> NativeKernels | None:
    """The compiled kernels, or None where they cannot run here (reason logged once)."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    _TRIED = True
    reason, level = None, logging.INFO
    if os.environ.get("EMBER_CPU_NATIVE", "1") == "0":
        reason = "EMBER_CPU_NATIVE=0"
    elif not sys.platform.startswith("linux"):
        reason = f"native CPU kernels are built on Linux only (this is {sys.platform})"
    else:
        missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
        if missing:
            reason = f"this CPU lacks {', '.join(missing)}"
    if reason is None:
        try:
            path = build(SOURCE, _cache_dir())
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
