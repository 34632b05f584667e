"""The portable packed forms every quantizer can produce and any backend can read
(docs/quantization.md): uniform integer grids with per-group scales, and two
non-uniform forms (NF4, FP8) that backends without a kernel dequantize on request.

Common layout: the weight is ``(N, K)`` = ``(out_features, in_features)``; its ``K``
columns are stored in the order ``perm`` (``perm[j]`` is the logical column stored at
``j``; None: the identity), so that GPTQ's act-order groups are contiguous; groups of
``group_size`` stored columns share a scale (and an offset): ``w = q * scale + offset``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember.plugin.quantizer import QuantizedWeight, check_parts


def _check_grid(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, perm, k: int, what: str) -> int:
    n = q.shape[0]
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] < 1 or k % scales.shape[1]:
        raise ValueError(f"{what}: scales of shape {tuple(scales.shape)} do not fit a ({n}, {k}) weight "
                         f"(expected (out_features, groups) with groups dividing {k})")
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"{what}: offsets {tuple(offsets.shape)} differ from scales {tuple(scales.shape)}")
    if perm is not None and (perm.dim() != 1 or perm.numel() != k):
        raise ValueError(f"{what}: column order of shape {tuple(perm.shape)} does not fit {k} input features")
    return k // scales.shape[1]


def _unpermute(stored: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    if perm is None:
        return stored
    out = torch.empty_like(stored)
    out[:, perm] = stored
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class _GridWeight(QuantizedWeight):
    """Shared parts of the integer grids: scales, offsets, column order."""

    def __init__(self, shape, scales: torch.Tensor, offsets: torch.Tensor | None, perm: torch.Tensor | None):
        super().__init__(shape)
        self.scales = scales.float().contiguous()
        self.offsets = offsets.float().contiguous() if offsets is not None else None
        self.perm = perm.long().contiguous() if perm is not None else None

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scales and offsets expanded to ``(N, K)`` in stored column order."""
        g = self.group_size
        s = self.scales.repeat_interleave(g, dim=1)
        m = self.offsets.repeat_interleave(g, dim=1) if self.offsets is not None else None
        return s, m

    def _values(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s, m = self._grid()
        w = self._values().float() * s
        if m is not None:
            w += m
        return _unpermute(w, self.perm).to(dtype)

    @classmethod
    def _joinable(cls, parts: Sequence[_GridWeight]) -> bool:
        first = parts[0]
        return all(
            type(p) is type(first) and p.scales.shape[1] == first.scales.shape[1] and _same(p.perm, first.perm)
            and (p.offsets is None) == (first.offsets is None)
            for p in parts
        )

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {"scales": self.scales}
        if self.offsets is not None:
            out["offsets"] = self.offsets
        if self.perm is not None:
            out["perm"] = self.perm
        return out


class Int8Weight(_GridWeight):
    """``qweight``: int8 ``(N, K)``; ``w = qweight * scale (+ offset)`` per group
    (one group per row: per-channel). bitsandbytes int8, GPTQ/compressed-tensors 8-bit
    (their unsigned values re-centred by 128 into ``offset``), ``--quantize int8``."""

    format = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None) -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"int8 weight: qweight must be a 2-D int8 tensor, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        _check_grid(qweight, scales, offsets, perm, qweight.shape[1], "int8 weight")
        super().__init__(qweight.shape, scales, offsets, perm)
        self.qweight = qweight.contiguous()

    def _values(self) -> torch.Tensor:
        return self.qweight

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, **self._tensors()}

    @classmethod
    def concat(cls, parts: Sequence[Int8Weight]) -> Int8Weight | None:
        if not cls._joinable(parts):
            return None
        check_parts(parts)
        offsets = torch.cat([p.offsets for p in parts]) if parts[0].offsets is not None else None
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), offsets, parts[0].perm)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` values 0..15 -> ``(N, K / 2)`` uint8, column ``2j`` in the low nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``(N, K)`` uint8 values 0..15."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


class Int4Weight(_GridWeight):
    """``qweight``: uint8 ``(N, K / 2)``, two values 0..15 per byte (column ``2j`` low
    nibble); ``w = q * scale + offset`` per group of ``group_size`` stored columns.
    GPTQ/AWQ/compressed-tensors 4-bit, ``--quantize int4``."""

    format = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 perm: torch.Tensor | None = None) -> None:
        if qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise ValueError(f"int4 weight: qweight must be a 2-D uint8 tensor of packed pairs, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        if offsets is None:
            raise ValueError("int4 weight: offsets are required (w = q * scale + offset; symmetric: -8 * scale)")
        k = qweight.shape[1] * 2
        _check_grid(qweight, scales, offsets, perm, k, "int4 weight")
        super().__init__((qweight.shape[0], k), scales, offsets, perm)
        self.qweight = qweight.contiguous()

    def _values(self) -> torch.Tensor:
        return unpack_nibbles(self.qweight)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, **self._tensors()}

    @classmethod
    def concat(cls, parts: Sequence[Int4Weight]) -> Int4Weight | None:
        if not cls._joinable(parts):
            return None
        check_parts(parts)
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                   torch.cat([p.offsets for p in parts]), parts[0].perm)


class NF4Weight(QuantizedWeight):
    """bitsandbytes NF4: ``codes`` uint8 ``(N * K / 2,)`` (first value of a pair in the
    high nibble, bitsandbytes' order), ``absmax`` float32 per ``blocksize`` values,
    ``code`` the 16-entry float32 table: ``w = code[q] * absmax[i // blocksize]``."""

    format = "nf4"

    def __init__(self, shape, codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> None:
        super().__init__(shape)
        numel = self.shape[0] * self.shape[1]
        if codes.numel() * 2 != numel or code.numel() != 16 or blocksize < 1 or absmax.numel() != -(-numel // blocksize):
            raise ValueError(f"nf4 weight: {codes.numel()} packed bytes, {absmax.numel()} absmax, {code.numel()} "
                             f"table entries and blocksize {blocksize} do not fit shape {self.shape}")
        self.codes, self.absmax, self.code, self.blocksize = codes.reshape(-1), absmax.float(), code.float(), blocksize

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "absmax": self.absmax, "code": self.code}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = torch.stack([self.codes >> 4, self.codes & 0xF], dim=1).reshape(-1).long()
        values = self.code[q]
        scale = self.absmax.repeat_interleave(self.blocksize)[: values.numel()]
        return (values * scale).reshape(self.shape).to(dtype)


class FP8Weight(QuantizedWeight):
    """FP8 e4m3 ``weight`` ``(N, K)`` with ``scale`` float32 of shape ``(1, 1)``
    (per tensor), ``(N, 1)`` (per channel) or ``(N / bn, K / bk)`` (blocks):
    ``w = weight * scale``."""

    format = "fp8_e4m3"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"fp8 weight: expected a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        super().__init__(weight.shape)
        scale = scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float()
        if scale.dim() == 1:
            scale = scale[:, None]
        n, k = self.shape
        if scale.dim() != 2 or n % scale.shape[0] or k % scale.shape[1]:
            raise ValueError(f"fp8 weight: scale of shape {tuple(scale.shape)} does not fit a weight of {self.shape}")
        self.weight, self.scale = weight.contiguous(), scale.contiguous()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale": self.scale}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        s = self.scale.repeat_interleave(n // self.scale.shape[0], 0).repeat_interleave(k // self.scale.shape[1], 1)
        return (self.weight.float() * s).to(dtype)
