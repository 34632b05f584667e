"""The quantizer contract (docs/quantization.md), checked: a quantizer's packed weight
against its own float reference, and a backend's op for its format against
``F.linear`` on that reference.

    from ember.testing import check_quantizer
    check_quantizer(MyQuantizer(config), {"qweight": ..., "scales": ...}, backend=CPUBackend())

Raises AssertionError naming the first broken rule; returns the packed weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ember.models.layers import Linear
from ember.plugin.quantizer import BaseQuantizer, QuantizedLinearOp, QuantizedWeight

BATCH_SIZES = (1, 2, 7, 33)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)


def check_quantized_weight(weight: QuantizedWeight, formats: Sequence[str] | None = None) -> torch.Tensor:
    """The weight's own rules: a declared format, its shape, a deterministic finite
    ``dequantize`` in the dtype asked for, ``nbytes`` as its tensors, joins along the
    output dimension that dequantize to the stacked parts. Returns ``dequantize()``."""
    assert isinstance(weight, QuantizedWeight), f"expected a QuantizedWeight, got {type(weight).__name__}"
    assert weight.format, f"{type(weight).__name__} has no format name"
    if formats is not None:
        assert weight.format in formats, f"format {weight.format!r} is not one of the declared {tuple(formats)}"
    n, k = weight.shape
    ref = weight.dequantize(torch.float32)
    assert ref.shape == (n, k), f"dequantize gave shape {tuple(ref.shape)}, the weight's shape is {weight.shape}"
    assert ref.dtype == torch.float32, f"dequantize(torch.float32) gave {ref.dtype}"
    assert torch.isfinite(ref).all(), "dequantize gave non-finite values"
    assert torch.equal(ref, weight.dequantize(torch.float32)), "dequantize is not deterministic"
    bf16 = weight.dequantize(torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, ref.to(torch.bfloat16)), (
        "dequantize(torch.bfloat16) is not dequantize(torch.float32) rounded once to bfloat16"
    )
    tensors = weight.tensors()
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values()), "tensors() must name its tensors"
    assert weight.nbytes == sum(t.numel() * t.element_size() for t in tensors.values()), "nbytes is not its tensors'"
    joined = type(weight).concat([weight, weight])
    if joined is not None:
        assert joined.format == weight.format and joined.shape == (2 * n, k), (
            f"concat of two {weight.shape} parts gave {joined.format!r} {joined.shape}"
        )
        assert torch.equal(joined.dequantize(), torch.cat([ref, ref])), "concat does not dequantize to the parts"
    return ref


def check_quantized_linear_op(
    op: QuantizedLinearOp, weight: QuantizedWeight, compute_dtype: torch.dtype = torch.float32,
    batch_sizes: Sequence[int] = BATCH_SIZES, seed: int = 0,
) -> QuantizedWeight:
    """``op.prepare(weight)`` keeps the format, shape and numbers (within
    ``op.max_relative_error``); ``op(x, prepared, bias)`` equals
    ``F.linear(x, prepared.dequantize(), bias)`` within ``op.max_relative_error`` of the
    output's largest magnitude at each batch size, with and without a bias, in
    ``compute_dtype``; ``op.embedding(ids, prepared)`` (rows read as a token embedding)
    equals the dequantized weight's rows exactly and refuses an id past them. Returns
    the prepared weight."""
    assert op.format == weight.format, f"op for {op.format!r} given a {weight.format!r} weight"
    tol = op.max_relative_error
    ref = weight.dequantize(torch.float32)
    prepared = op.prepare(weight)
    assert isinstance(prepared, QuantizedWeight), f"prepare returned {type(prepared).__name__}, not a QuantizedWeight"
    assert prepared.format == weight.format and prepared.shape == weight.shape, (
        f"prepare turned a {weight.format!r} {weight.shape} weight into {prepared.format!r} {prepared.shape}"
    )
    w = prepared.dequantize(torch.float32)
    err = _relative_error(w, ref)
    assert err <= tol, f"the prepared weight dequantizes {err:.3g} (relative) away from the weight, over {tol:.3g}"
    generator = torch.Generator().manual_seed(seed)
    n, k = weight.shape
    bias = torch.randn(n, generator=generator).to(compute_dtype)
    for rows in batch_sizes:
        x = torch.randn(rows, k, generator=generator).to(compute_dtype)
        for b in (None, bias):
            y = op(x, prepared, b)
            assert y.shape == (rows, n) and y.dtype == compute_dtype, (
                f"op gave {tuple(y.shape)} {y.dtype} for {rows} rows of {compute_dtype}; expected ({rows}, {n}) "
                f"{compute_dtype}"
            )
            want = F.linear(x.float(), w, None if b is None else b.float())
            err = _relative_error(y, want)
            assert err <= tol, (
                f"{op.format} op at {rows} rows{' with a bias' if b is not None else ''}: {err:.3g} relative to "
                f"the dequantized float linear, over the op's max_relative_error {tol:.3g}"
            )
    ids = torch.tensor([n - 1, 0, n // 2, 0], dtype=torch.int64)
    rows = op.embedding(ids, prepared)
    assert rows.dtype == torch.float32 and torch.equal(rows, w[ids]), (
        f"{op.format} op's embedding rows differ from the dequantized weight's rows"
    )
    try:
        op.embedding(torch.tensor([n]), prepared)
    except IndexError:
        pass
    else:
        raise AssertionError(f"{op.format} op's embedding read row {n} of a weight of {n} rows")
    return prepared


def check_quantizer(
    quantizer: BaseQuantizer, tensors: Mapping[str, torch.Tensor], backend=None, *,
    prefix: str = "model.layers.0.mlp.down_proj", dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype = torch.float32, reference: torch.Tensor | None = None,
    reference_tolerance: float = 0.0, batch_sizes: Sequence[int] = BATCH_SIZES,
) -> QuantizedWeight:
    """Run the contract on one linear's checkpoint ``tensors`` (by suffix, as stored):

    * ``create_weight`` gives a :class:`QuantizedWeight` of a declared format whose own
      rules hold (`check_quantized_weight`), and equals ``reference`` (the format's own
      library's dequantization, when given) within ``reference_tolerance`` (relative);
    * with ``backend``: its op for the format (``quantized_linear_op``) passes
      `check_quantized_linear_op`, and a :class:`ember.models.layers.Linear` loaded with
      the weight computes what the op does; a Linear of another shape refuses it.
      A backend without an op for the format fails the check.
    """
    assert isinstance(quantizer, BaseQuantizer), f"expected a BaseQuantizer, got {type(quantizer).__name__}"
    assert isinstance(quantizer.name, str) and quantizer.name, "a quantizer needs a name"
    formats = quantizer.weight_formats()
    assert formats, f"quantizer {quantizer.name!r} declares no weight formats"
    assert quantizer.is_complete(tensors), (
        f"quantizer {quantizer.name!r} does not take {sorted(tensors)} as a complete linear "
        f"(required: {quantizer.required_suffixes})"
    )
    assert set(tensors) <= set(quantizer.tensor_suffixes), (
        f"tensors {sorted(set(tensors) - set(quantizer.tensor_suffixes))} are not among the quantizer's "
        f"tensor_suffixes {quantizer.tensor_suffixes}"
    )
    weight = quantizer.create_weight(prefix, dict(tensors), dtype)
    ref = check_quantized_weight(weight, formats)
    if reference is not None:
        assert reference.shape == ref.shape, f"the weight has shape {tuple(ref.shape)}, the reference {tuple(reference.shape)}"
        err = _relative_error(ref, reference.float())
        assert err <= reference_tolerance, (
            f"{quantizer.name}: dequantized weight is {err:.3g} (relative) from the reference, over {reference_tolerance:.3g}"
        )
    if backend is None:
        return weight
    op = backend.quantized_linear_op(weight.format, compute_dtype)
    assert op is not None, (
        f"backend {backend.name!r} has no op for {weight.format!r} in {compute_dtype} "
        f"(it runs: {backend.quantized_formats(compute_dtype)})"
    )
    assert weight.format in backend.quantized_formats(compute_dtype), (
        f"backend {backend.name!r} runs {weight.format!r} but does not list it in quantized_formats"
    )
    check_quantized_linear_op(op, weight, compute_dtype, batch_sizes)
    n, k = weight.shape
    linear = Linear(k, [n], False, compute_dtype, compute_dtype)
    linear.load_part(0, "weight", weight)
    assert linear.weight is None and linear.is_quantized, "a Linear keeps a float weight beside the quantized one"
    linear.set_quantized_op(op)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(compute_dtype)
    want = op(x, linear.qweights[0])
    assert torch.equal(linear(x), want), "a Linear holding the weight does not compute what the op does"
    wrong = Linear(k, [n + 8], False, compute_dtype, compute_dtype)
    try:
        wrong.load_part(0, "weight", weight)
    except ValueError:
        pass
    else:
        raise AssertionError(f"a Linear of shape ({n + 8}, {k}) took a {weight.shape} quantized weight")
    return weight
