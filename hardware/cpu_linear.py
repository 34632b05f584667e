"""The CPU backend's matrix products (``linear_op`` of its paths,
``ember.hardware.cpu_paths``), built on oneDNN and the native GEMVs
(``cpu_kernels.NativeKernels.gemv_bf16`` and ``gemv_f32``):

* ``FewRowLinear``: a float32 model: few rows through the float32 GEMV, more run oneDNN;
* ``SmallBatchLinear``: a bf16 model computed in float32 (the fp32 path): few rows read
  bf16 copies through the GEMV, more run oneDNN on the float32 weights;
* ``PackedLinear``: the bf16 path: weights packed for oneDNN, few rows through the GEMV;
* ``RowInvariantLinear``: batch-invariant products (the CPU backend's option ``batch_invariant``).

and ``onednn_linear``, oneDNN's float32 product (the fp32 path's and float32 models'
``linear_op`` beyond the few rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.hardware.cpu_kernels import KERNEL_DTYPES

# oneDNN picks the blocked layout for a batch size; one layout serves every size
# (1 to 512 rows measured within 3% of a layout picked for their own size).
PACK_ROWS = 128


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

    def __init__(self, base, kernels=None, max_rows: int = 0, dot: bool = False) -> None:
        self.base = base
        self.kernels = kernels
        self.max_rows = max_rows if kernels is not None else 0
        self.dot = dot and kernels is not None  # the few-row kernel: bf16 dot products, else widening
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

    def _few_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dot and x.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
            return self.kernels.gemv_bf16_dot(x, weight, bias)
        return self.kernels.gemv_bf16(x, weight, bias)

    def weight_read(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        """The tensor a product of ``rows`` rows over ``weight`` reads (benchmarks
        count bytes per token by it): the plain copy or the packed form."""
        if weight.is_mkldnn:
            entry = self._plain.get(id(weight))
            return entry[1] if rows <= self.max_rows and entry is not None and entry[0] is weight else weight
        entry = self._packed.get(id(weight))
        return entry[1] if rows > self.max_rows and entry is not None and entry[0] is weight else weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.is_mkldnn:
            packed = weight
            if x.dim() == 2 and x.shape[0] <= self.max_rows:
                entry = self._plain.get(id(weight))
                if entry is not None and entry[0] is weight:
                    return self._few_rows(x, entry[1], bias)
        else:
            entry = self._packed.get(id(weight))
            if entry is None or entry[0] is not weight or x.dtype != torch.bfloat16:
                return self.base(x, weight, bias)
            if x.dim() == 2 and x.shape[0] <= self.max_rows:
                return self._few_rows(x, weight, bias)
            packed = entry[1]
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class FewRowLinear:
    """The CPU ``linear_op`` of a float32 model: products of up to ``max_rows`` rows
    over a registered float32 weight run the native GEMV (``gemv_f32``: each weight row
    read from memory once for all rows, each output one dot product in a fixed order, so
    a row's numbers are those it gets alone); larger ones, and weights not registered,
    run ``base``. From memory on SmolLM2's weights (2-core AVX-512 EPYC), one row took
    13.9 ms against oneDNN's 24.2, 6 rows 24.1 against 36.4, 8 rows 37.6 against 39.5."""

    def __init__(self, base, kernels, max_rows: int) -> None:
        self.base = base
        self.kernels = kernels
        self.max_rows = max_rows
        self._weights: dict[int, torch.Tensor] = {}

    def add(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"FewRowLinear takes contiguous float32 (N, K) weights, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self._weights[id(weight)] = weight

    def __len__(self) -> int:
        return len(self._weights)

    def weight_read(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        """The tensor a product of ``rows`` rows over ``weight`` reads: the weight itself."""
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.float32
                and self._weights.get(id(weight)) is weight and (bias is None or bias.dtype == torch.float32)):
            return self.kernels.gemv_f32(x, weight, bias)
        return self.base(x, weight, bias)


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

    def weight_read(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        """The tensor a product of ``rows`` rows over ``weight`` reads: its bf16 copy
        up to ``max_rows`` rows, else the weight."""
        entry = self._copies.get(id(weight))
        return entry[1] if rows <= self.max_rows and entry is not None and entry[0] is weight else weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.float32:
            entry = self._copies.get(id(weight))
            if entry is not None and entry[0] is weight:
                return self.kernels.gemv_bf16(x, entry[1], bias)
        return self.base(x, weight, bias)


class RowInvariantLinear:
    """Batch-invariant products (option ``batch_invariant``): each row of ``x @ w.T``
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


# -- oneDNN's float32 product -----------------------------------------------------------------

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
