"""Conformance check for hardware backends: does a `BaseBackend` keep the contract in
:mod:`ember.plugin.backend`? Ember runs it against its own backends; a third party runs it
against theirs::

    from ember.testing import check_backend

    def test_my_backend_conforms():
        check_backend(MyBackend)

`check_backend` raises AssertionError describing the first broken rule, and ``unittest.SkipTest``
(which pytest reports as a skip) when the backend is not available on this machine.

Attention is checked against a reference computed in float64 on the CPU, for a
flat batch mixing every kind of request the scheduler produces: prefills from
position 0, decodes (cached context, one new token), and extends (cached context,
several new tokens), with shuffled, non-contiguous block tables (one longer than its
context needs), GQA, and ``block_size`` 4 so that contexts cross block boundaries.
"""

from __future__ import annotations

import math
import random
import unittest
from dataclasses import replace

import torch
import torch.nn.functional as F

from ember.plugin.backend import AttentionBatch, BaseAttention, BaseBackend, SequenceSlice
from ember.testing.attention_reference import (
    BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, RequestCase, block_tables, cache_with_context,
    make_requests, reference_attention,
)


# (cached tokens, new tokens) per request, in batch order: kinds interleaved.
MIXED_BATCH: tuple[tuple[int, int], ...] = (
    (0, 7),  # prefill, ends inside a block
    (9, 1),  # decode
    (5, 6),  # extend across two block boundaries
    (4, 1),  # decode whose token opens a new block
    (0, 1),  # one-token prefill
    (15, 1),  # decode, last slot of a block
    (8, 3),  # extend from a block boundary
    (0, 8),  # prefill of exactly two blocks
)

# Tolerances against the float64 reference, per dtype of q/k/v and the cache.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}


def attention_block_size(attention: BaseAttention) -> int:
    """The block size the check runs ``attention`` with: ``BLOCK_SIZE``, or the
    smallest multiple of it that the attention's ``block_size_multiple`` allows."""
    return math.lcm(BLOCK_SIZE, attention.block_size_multiple)


def scale_batch(batch: tuple[tuple[int, int], ...], factor: int) -> tuple[tuple[int, int], ...]:
    """``batch`` for blocks ``factor`` times larger: cached and new lengths scaled, so
    that contexts cross block boundaries as they do at ``BLOCK_SIZE``; a single new
    token (a decode, a one-token prompt) stays one."""
    return tuple((c * factor, n if n == 1 else n * factor) for c, n in batch)


def check_backend(backend_cls: type[BaseBackend], *, head_dim: int = 64, seed: int = 0) -> None:
    """Check `backend_cls` against the `BaseBackend` contract; see the module docstring.

    Attention runs in float32 and in every other dtype of ``supported_dtypes`` that
    `TOLERANCES` knows, on ``backend.device``.
    """
    backend = check_backend_basics(backend_cls)
    dtypes = [torch.float32] + [d for d in backend.supported_dtypes if d != torch.float32 and d in TOLERANCES]
    for dtype in dtypes:
        for window, softcap in attention_limits(backend.create_attention()):
            check_attention(backend, dtype=dtype, head_dim=head_dim, seed=seed, window=window, softcap=softcap)
            check_graph_attention(backend, dtype=dtype, head_dim=head_dim, seed=seed, window=window, softcap=softcap)
            if backend.create_attention().supports_bidirectional_spans and softcap is None:  # Gemma 3's images
                check_bidirectional_spans(backend, dtype=dtype, head_dim=head_dim, seed=seed, window=window)


# what the limited-attention checks use, at BLOCK_SIZE (scaled with larger blocks): a
# window shorter than most contexts of MIXED_BATCH, and a cap that bends typical scores
CHECK_WINDOW = 5
CHECK_SOFTCAP = 0.75


def attention_limits(attention: BaseAttention) -> list[tuple[int | None, float | None]]:
    """The (window, softcap) settings to check ``attention`` with: plain causal always,
    then each limit it declares (``supports_sliding_window``, ``supports_softcap``), and both."""
    limits: list[tuple[int | None, float | None]] = [(None, None)]
    if attention.supports_sliding_window:
        limits.append((CHECK_WINDOW, None))
    if attention.supports_softcap:
        limits.append((None, CHECK_SOFTCAP))
    if attention.supports_sliding_window and attention.supports_softcap:
        limits.append((CHECK_WINDOW, CHECK_SOFTCAP))
    return limits


def _limits(window: int | None, softcap: float | None, factor: int) -> dict:
    """forward's keyword arguments for these limits (none at all for plain causal)."""
    kwargs: dict = {}
    if window is not None:
        kwargs["window"] = window * factor
    if softcap is not None:
        kwargs["softcap"] = softcap
    return kwargs


def check_backend_basics(backend_cls: type[BaseBackend]) -> BaseBackend:
    """Everything but attention numerics. Returns a constructed backend."""
    assert isinstance(backend_cls, type) and issubclass(backend_cls, BaseBackend), (
        f"{backend_cls!r} is not a subclass of ember.plugin.backend.BaseBackend"
    )
    name = getattr(backend_cls, "name", None)
    assert isinstance(name, str) and name, f"{backend_cls.__name__}.name must be a non-empty string, got {name!r}"
    assert isinstance(backend_cls.priority, int), f"{name}: priority must be an int, got {backend_cls.priority!r}"
    try:
        available = backend_cls.is_available()
    except Exception as exc:  # the contract: is_available never raises
        raise AssertionError(f"{name}: is_available() raised {exc!r}; it must return False instead") from exc
    assert isinstance(available, bool), f"{name}: is_available() returned {available!r}, not a bool"
    if not available:
        raise unittest.SkipTest(f"backend {name!r} is not available on this machine")

    backend = backend_cls()
    device = backend.device
    assert isinstance(device, torch.device), f"{name}: device is {device!r}, not a torch.device"
    dtypes = tuple(backend.supported_dtypes)
    assert dtypes and all(isinstance(d, torch.dtype) for d in dtypes), (
        f"{name}: supported_dtypes must be torch dtypes, got {dtypes!r}"
    )
    assert torch.float32 in dtypes, f"{name}: supported_dtypes {dtypes} lacks torch.float32"

    for model_dtype in (None, torch.float32, torch.bfloat16):
        resolved = backend.resolve_dtype("auto", model_dtype)
        assert resolved in dtypes, (
            f"{name}: resolve_dtype('auto', {model_dtype}) gave {resolved!r}, not one of supported_dtypes {dtypes}"
        )
    resolved = backend.resolve_dtype("float32", None)
    assert resolved == torch.float32, f"{name}: resolve_dtype('float32') gave {resolved!r}"
    bogus = "float7_e9m3"
    try:
        backend.resolve_dtype(bogus, None)
    except ValueError as exc:
        assert bogus in str(exc), f"{name}: resolve_dtype({bogus!r}) raised ValueError not naming it: {exc}"
    else:
        raise AssertionError(f"{name}: resolve_dtype({bogus!r}) did not raise ValueError")
    for dtype in dtypes:
        compute = backend.compute_dtype(dtype)
        assert isinstance(compute, torch.dtype), f"{name}: compute_dtype({dtype}) gave {compute!r}"
        kept = backend.weight_dtype(dtype)
        assert kept in (dtype, compute), f"{name}: weight_dtype({dtype}) gave {kept!r}, neither {dtype} nor {compute}"

    op = backend.linear_op()
    for dtype in dtypes:
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
        w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        b = torch.randn(48, generator=torch.Generator().manual_seed(2)).to(dtype)
        device = backend.device
        for bias in (None, b):
            got = op(x.to(device), w.to(device), None if bias is None else bias.to(device)).float().cpu()
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            tol = 1e-4 if dtype == torch.float32 else 5e-2 * want.abs().max().item()
            assert got.shape == want.shape and torch.allclose(got, want, atol=tol), (
                f"{name}: linear_op disagrees with F.linear in {dtype} (max error {(got - want).abs().max().item():.3g})"
            )

    budget = backend.kv_cache_memory_bytes(100 << 20)
    assert isinstance(budget, int) and budget > 0, f"{name}: kv_cache_memory_bytes gave {budget!r}, not an int > 0"
    assert isinstance(backend.create_attention(), BaseAttention), f"{name}: create_attention() is not a BaseAttention"
    assert isinstance(backend.describe(), str), f"{name}: describe() must return a str"
    backend.synchronize()
    return backend


def check_attention(
    backend: BaseBackend,
    *,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 64,
    seed: int = 0,
    batch: tuple[tuple[int, int], ...] = MIXED_BATCH,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Run one step of `batch` through two layers sharing one metadata object, then
    check outputs against the reference and the caches slot by slot. Repeats with
    the prefills alone and the decodes alone, which backends often route to
    different kernels. ``window``/``softcap`` (at `BLOCK_SIZE`; the window scales with
    larger blocks): forward's limits, checked against the reference's."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prefills = tuple(r for r in batch if r[0] == 0)
    decodes = tuple(r for r in batch if r[0] > 0 and r[1] == 1)
    for sub_batch in (batch, prefills, decodes):
        if sub_batch:
            _check_step(backend, sub_batch, dtype, head_dim, rng, gen, window, softcap)


def check_graph_attention(
    backend: BaseBackend, *, dtype: torch.dtype = torch.float32, head_dim: int = 64, seed: int = 0,
    padding: int = 3, window: int | None = None, softcap: float | None = None,
) -> None:
    """For an attention with ``supports_graphs``: its static decode metadata
    (``graph_metadata`` once, ``fill_graph_metadata`` per step) gives the reference
    attention for two different decode batches in a row, each padded with
    ``padding`` rows, and the padding writes no cache slot. Nothing to check (None)
    for an attention without graphs."""
    attention = backend.create_attention()
    if not attention.supports_graphs:
        return
    device, scale = backend.device, 1.0 / math.sqrt(head_dim)
    atol, rtol = TOLERANCES[dtype]
    block_size = attention_block_size(attention)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    decodes = tuple(r for r in MIXED_BATCH if r[0] > 0 and r[1] == 1)
    size = len(decodes) + padding
    max_blocks = NUM_BLOCKS // 2
    metadata = attention.graph_metadata(size, max_blocks, block_size, device)
    # the second step: other requests, one fewer, longer contexts; the same static metadata
    for step, batch in enumerate((decodes, tuple((c + 5, 1) for c, _ in decodes[1:]))):
        batch = scale_batch(batch, block_size // BLOCK_SIZE)
        tables = block_tables(batch, rng, block_size)
        requests = make_requests(batch, tables, head_dim, gen, block_size)
        cache = cache_with_context(requests, block_size, head_dim, dtype, gen)
        before, kv_cache = cache.clone(), cache.to(device)
        slices = [SequenceSlice(1, c, list(t)) for (c, _), t in zip(batch, tables)]
        attention_batch = AttentionBatch.from_slices(slices, block_size, torch.device("cpu"))
        attention_batch = replace(
            attention_batch, block_table=attention_batch.block_table.to(device),
            slot_mapping=attention_batch.slot_mapping.to(device), seq_lens=attention_batch.seq_lens.to(device),
            query_start_loc=attention_batch.query_start_loc.to(device),
        )
        attention.fill_graph_metadata(metadata, attention_batch)
        pad = size - len(requests)

        def padded(rows: list[torch.Tensor], pad: int = pad) -> torch.Tensor:
            x = torch.cat(rows)
            return torch.cat([x, torch.randn(pad, *x.shape[1:], generator=gen, dtype=x.dtype)]).to(dtype).to(device)

        q = padded([r.q for r in requests])
        k = padded([r.k[r.num_cached :] for r in requests])
        v = padded([r.v[r.num_cached :] for r in requests])
        limits = _limits(window, softcap, block_size // BLOCK_SIZE)
        out = attention.forward(q, k, v, kv_cache, metadata, scale, **limits)
        backend.synchronize()
        where = (f"{backend.name}: graph metadata, step {step}, dtype {dtype}, {len(requests)} decodes + {pad} "
                 f"padding rows{_where_limits(limits)}")
        assert tuple(out.shape) == (size, NUM_HEADS, head_dim), f"{where}: output shape {tuple(out.shape)}"
        out = out.cpu().double()
        for index, r in enumerate(requests):
            rounded = RequestCase(r.num_cached, r.block_table, r.q.to(dtype).double(), r.k.to(dtype).double(),
                                  r.v.to(dtype).double(), block_size)
            expected = reference_attention(rounded, scale, **limits)
            if not torch.allclose(out[index : index + 1], expected, atol=atol, rtol=rtol):
                error = (out[index : index + 1] - expected).abs().max().item()
                raise AssertionError(f"{where}: request {index} (cached {r.num_cached}) differs from the reference "
                                     f"by up to {error:.3g}")
        _check_cache(kv_cache.cpu(), before, requests, dtype, where)


def _check_step(
    backend: BaseBackend,
    batch: tuple[tuple[int, int], ...],
    dtype: torch.dtype,
    head_dim: int,
    rng: random.Random,
    gen: torch.Generator,
    window: int | None = None,
    softcap: float | None = None,
    spans: tuple | None = None,  # per request: bidirectional spans (check_bidirectional_spans)
) -> None:
    device = backend.device
    name = backend.name
    scale = 1.0 / math.sqrt(head_dim)
    atol, rtol = TOLERANCES[dtype]
    attention = backend.create_attention()
    block_size = attention_block_size(attention)
    batch = scale_batch(batch, block_size // BLOCK_SIZE)
    tables = block_tables(batch, rng, block_size)
    # Every layer shares the batch's shape and block tables, with its own q/k/v and cache.
    layers = [make_requests(batch, tables, head_dim, gen, block_size) for _ in range(NUM_LAYERS)]
    slices = [SequenceSlice(num_new, num_cached, list(table)) for (num_cached, num_new), table in zip(batch, tables)]

    caches = [cache_with_context(requests, block_size, head_dim, dtype, gen) for requests in layers]
    before = [c.clone() for c in caches]
    device_caches = [c.to(device) for c in caches]

    attention_batch = AttentionBatch.from_slices(slices, block_size, torch.device("cpu"))
    # entries past each request's last block hold other valid block ids (as a
    # runner's reused rows do): attention must never read them
    table = attention_batch.block_table
    for i, s in enumerate(slices):
        table[i, len(s.block_table):] = torch.randint(0, NUM_BLOCKS, (table.shape[1] - len(s.block_table),), generator=gen)
    attention_batch = replace(
        attention_batch, block_table=table.to(device), slot_mapping=attention_batch.slot_mapping.to(device),
        seq_lens=attention_batch.seq_lens.to(device), query_start_loc=attention_batch.query_start_loc.to(device),
        bidirectional_spans=spans,
    )
    metadata = attention.prepare(attention_batch)
    limits = _limits(window, softcap, block_size // BLOCK_SIZE)
    outputs = []
    for requests, kv_cache in zip(layers, device_caches):
        q = torch.cat([r.q for r in requests]).to(dtype).to(device)
        k = torch.cat([r.k[r.num_cached :] for r in requests]).to(dtype).to(device)
        v = torch.cat([r.v[r.num_cached :] for r in requests]).to(dtype).to(device)
        outputs.append(attention.forward(q, k, v, kv_cache, metadata, scale, **limits))
    backend.synchronize()

    where = f"{name}, dtype {dtype}, batch (cached, new) = {list(batch)}{_where_limits({**limits, 'spans': spans})}"
    for layer, (requests, out, kv_cache, old) in enumerate(zip(layers, outputs, device_caches, before)):
        num_tokens = sum(r.num_new for r in requests)
        expected_shape = (num_tokens, NUM_HEADS, head_dim)
        assert tuple(out.shape) == expected_shape, f"{where}: output shape {tuple(out.shape)}, expected {expected_shape}"
        assert out.dtype == dtype, f"{where}: output dtype {out.dtype}, expected the dtype of q, {dtype}"
        assert out.device.type == device.type, f"{where}: output on {out.device}, expected {device}"
        out = out.cpu().double()
        row = 0
        for index, r in enumerate(requests):
            # The reference sees what the backend sees: inputs rounded to `dtype`.
            rounded = RequestCase(r.num_cached, r.block_table, r.q.to(dtype).double(), r.k.to(dtype).double(),
                                  r.v.to(dtype).double(), block_size)
            expected = reference_attention(rounded, scale, **limits, spans=spans[index] if spans else ())
            got = out[row : row + r.num_new]
            if not torch.allclose(got, expected, atol=atol, rtol=rtol):
                error = (got - expected).abs().max().item()
                raise AssertionError(
                    f"{where}: layer {layer}, request {index} (cached {r.num_cached}, new {r.num_new}, "
                    f"block table {r.block_table}): attention differs from the reference by up to {error:.3g}"
                )
            row += r.num_new
        _check_cache(kv_cache.cpu(), old, requests, dtype, f"{where}: layer {layer}")


# bidirectional spans (API 1.6) in a prompt, after a cached context, begun in the cache, a short chunk
# that is a span (not a decode), a decode beside them: (cached, new) and each request's spans
SPAN_BATCH = ((0, 24), (8, 20), (16, 12), (20, 4), (20, 1))
SPANS = (((5, 12), (14, 20)), ((10, 20),), ((12, 22),), ((20, 24),), ())


def check_bidirectional_spans(backend: BaseBackend, *, dtype=torch.float32, head_dim=64, seed=0, window=None) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    _check_step(backend, SPAN_BATCH, dtype, head_dim, rng, gen, window, None, SPANS)


def _where_limits(limits: dict) -> str:
    return "".join(f", {key} {value}" for key, value in limits.items() if value is not None)


def _check_cache(
    cache: torch.Tensor, before: torch.Tensor, requests: list[RequestCase], dtype: torch.dtype, where: str
) -> None:
    """This step's k/v sit at their slots; every other slot is bit-for-bit unchanged."""
    block_size = cache.shape[2]
    flat = cache.view(2, NUM_BLOCKS * block_size, NUM_KV_HEADS, -1)
    expected = before.view(2, NUM_BLOCKS * block_size, NUM_KV_HEADS, -1).clone()
    for index, r in enumerate(requests):
        for p in range(r.num_cached, r.num_cached + r.num_new):
            slot = r.slot(p)
            expected[0, slot] = r.k[p].to(dtype)
            expected[1, slot] = r.v[p].to(dtype)
            if not (torch.equal(flat[0, slot], expected[0, slot]) and torch.equal(flat[1, slot], expected[1, slot])):
                raise AssertionError(
                    f"{where}: request {index} position {p} was not written to its slot {slot} "
                    f"(block {r.block_table[p // block_size]}, offset {p % block_size})"
                )
    changed = (flat != expected).flatten(2).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    if changed:
        raise AssertionError(f"{where}: KV cache slots {changed[:10]} changed that this step's tokens do not own")


def check_end_to_end(backend_cls: type[BaseBackend], work_dir, *, num_tokens: int = 8) -> None:
    """A tiny random Llama (built in ``work_dir``) generates greedily with
    ``backend_cls`` and with the CPU backend, float32: the tokens must be equal."""
    from pathlib import Path

    from ember import EngineConfig, SamplingParams
    from ember.engine.llm_engine import LLMEngine
    from ember.plugin import create_plugin_manager, hookimpl
    from ember.testing.tiny_models import make_tiny_model

    class _Plugin:
        @hookimpl
        def ember_register_backends(self, registry) -> None:
            registry.register("under-check", backend_cls)

    model_dir = Path(work_dir) / "tiny-llama"
    make_tiny_model("llama", model_dir, seed=5)
    prompts = [[5, 77, 12], list(range(40, 61)), [300]]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    tokens = {}
    # small blocks, so that contexts cross block boundaries (the smallest the attention takes)
    block_size = attention_block_size(backend_cls().create_attention())
    for label, name, plugins in (("cpu", "cpu", ()), (backend_cls.name, "under-check", (("under-check", _Plugin()),))):
        # decode batches of 3 replay the graph of 4 (a padded row) where the backend has graphs
        config = EngineConfig(model=str(model_dir), dtype="float32", backend=name, num_kv_tokens=256,
                              block_size=BLOCK_SIZE if name == "cpu" else block_size, graph_sizes=(1, 4))
        engine = LLMEngine(config, create_plugin_manager(extra_plugins=plugins))
        ids = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        tokens[label] = [done[i] for i in ids]
    assert tokens[backend_cls.name] == tokens["cpu"], (
        f"{backend_cls.name}: greedy tokens on a tiny Llama differ from the CPU backend's: "
        f"{tokens[backend_cls.name]} vs {tokens['cpu']}"
    )
