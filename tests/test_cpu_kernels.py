"""The CPU backend's native kernels (ember.hardware.cpu_kernels) and the bf16
small-batch linear built on them: built from source here, checked against PyTorch."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.hardware import cpu_kernels, trusted_library
from ember.hardware.cpu import CPUBackend
from ember.hardware.cpu_linear import FewRowLinear, SmallBatchLinear


@pytest.fixture
def kernels(native_kernels):
    return native_kernels


@pytest.mark.parametrize("M", [1, 2, 3, 5])
@pytest.mark.parametrize("N,K", [(4, 8), (7, 13), (96, 64), (130, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_bf16_matches_the_float32_product_of_the_rounded_weights(kernels, M, N, K, with_bias):
    torch.manual_seed(M * 1000 + N + K)
    weight = torch.randn(N, K).to(torch.bfloat16)
    x = torch.randn(M, K)
    bias = torch.randn(N) if with_bias else None
    got = kernels.gemv_bf16(x, weight, bias)
    want = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    # float32 accumulation of K products, only the summation order differs
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K**0.5)


def test_gemv_bf16_takes_non_contiguous_rows(kernels):
    weight = torch.randn(32, 16).to(torch.bfloat16)
    x = torch.randn(16, 6)[:, :3].t()  # (3, 16) view, not contiguous
    torch.testing.assert_close(kernels.gemv_bf16(x, weight), F.linear(x, weight.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x,weight,bias,match",
    [
        (torch.randn(2, 8).double(), torch.randn(4, 8).bfloat16(), None, "float32 or bfloat16 x"),
        (torch.randn(2, 8), torch.randn(4, 8), None, "bfloat16 weight"),
        (torch.randn(2, 8), torch.randn(4, 9).bfloat16(), None, "x has 8 columns, weight has 9"),
        (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), torch.randn(5), r"bias must be torch.float32 \(4,\)"),
    ],
)
def test_gemv_bf16_names_bad_arguments(kernels, x, weight, bias, match):
    with pytest.raises(ValueError, match=match):
        kernels.gemv_bf16(x, weight, bias)


@pytest.mark.parametrize("N,K", [(4, 8), (7, 13), (96, 64), (130, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_f32_matches_the_product_and_gives_each_row_what_it_gets_alone(kernels, N, K, with_bias):
    torch.manual_seed(N + K)
    weight, x = torch.randn(N, K), torch.randn(8, K)
    bias = torch.randn(N) if with_bias else None
    got = kernels.gemv_f32(x, weight, bias)
    want = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    assert got.dtype == torch.float32 and got.shape == (8, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K**0.5)
    # bit for bit, whatever the other rows: a speculative verification's rows are its plain steps'
    for rows in (1, 3, 8):
        alone = torch.cat([kernels.gemv_f32(x[i : i + 1], weight, bias) for i in range(rows)])
        assert torch.equal(kernels.gemv_f32(x[:rows], weight, bias), alone)


@pytest.mark.parametrize(
    "x,weight,bias,match",
    [
        (torch.randn(2, 8).double(), torch.randn(4, 8), None, "float32 x"),
        (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, "float32 x .* and weight"),
        (torch.randn(2, 8), torch.randn(4, 9), None, "x has 8 columns, weight has 9"),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), r"bias must be torch.float32 \(4,\)"),
    ],
)
def test_gemv_f32_names_bad_arguments(kernels, x, weight, bias, match):
    with pytest.raises(ValueError, match=match):
        kernels.gemv_f32(x, weight, bias)


needs_bf16_dot = pytest.mark.skipif(not {"avx512_bf16", "avx512bw", "avx512f"} <= cpu_kernels.cpu_flags(),
                                    reason="the bf16 dot-product kernel needs a CPU with avx512_bf16")


@needs_bf16_dot
@pytest.mark.parametrize("N,K", [(4, 8), (7, 13), (96, 64), (130, 300), (33, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_bf16_dot_rounds_the_product_once_and_gives_each_row_what_it_gets_alone(kernels, N, K, with_bias):
    torch.manual_seed(N * 7 + K)
    weight, x = torch.randn(N, K).bfloat16(), torch.randn(8, K).bfloat16()
    bias = torch.randn(N).bfloat16() if with_bias else None
    got = kernels.gemv_bf16_dot(x, weight, bias)
    want = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    assert got.dtype == torch.bfloat16 and got.shape == (8, N)
    # one rounding to bf16 (half an ulp: 2^-9 relative) of a float32 sum
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-4 * K**0.5).all()
    for rows in (1, 3, 8):
        alone = torch.cat([kernels.gemv_bf16_dot(x[i : i + 1], weight, bias) for i in range(rows)])
        assert torch.equal(kernels.gemv_bf16_dot(x[:rows], weight, bias), alone)


def test_gemv_bf16_dot_names_bad_arguments_and_a_cpu_without_the_instruction(kernels, monkeypatch):
    if kernels.has_bf16_dot:
        with pytest.raises(ValueError, match="bfloat16 x"):
            kernels.gemv_bf16_dot(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
        with pytest.raises(ValueError, match="x has 8 columns, weight has 9"):
            kernels.gemv_bf16_dot(torch.randn(2, 8).bfloat16(), torch.randn(4, 9).bfloat16())
    monkeypatch.setattr(kernels, "has_bf16_dot", False)
    with pytest.raises(RuntimeError, match="avx512_bf16"):
        kernels.gemv_bf16_dot(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16())


def test_a_forced_bf16_dot_kernel_is_refused_where_the_cpu_lacks_it(kernels, monkeypatch):
    monkeypatch.setattr(kernels, "has_bf16_dot", False)
    backend = CPUBackend(CPUBackend.parse_options({"bf16_gemv": "dot"}))
    with pytest.raises(ValueError, match="bf16_gemv=dot needs a CPU with avx512_bf16"):
        backend._bf16_dot(kernels)
    assert CPUBackend()._bf16_dot(kernels) is False  # auto: the widening kernel
    with pytest.raises(ValueError, match="bf16_gemv"):
        CPUBackend.parse_options({"bf16_gemv": "fast"})


def test_few_row_linear_takes_its_own_weights_for_few_rows(kernels):
    calls = []

    def base(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    weight, other = torch.randn(24, 16), torch.randn(24, 16)
    op = FewRowLinear(base, kernels, max_rows=2)
    op.add(weight)
    assert len(op) == 1 and op.weight_read(weight, 1) is weight
    x = torch.randn(2, 16)
    torch.testing.assert_close(op(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == []  # the kernel answered
    op(torch.randn(3, 16), weight)
    op(x, other)
    op(x.double(), weight.double())
    assert calls == [3, 2, 2]
    with pytest.raises(ValueError, match="contiguous float32"):
        op.add(torch.randn(16, 24).t())


def test_build_reuses_the_cached_library_and_names_a_failing_compiler(tmp_path, monkeypatch):
    first = trusted_library.build(cpu_kernels.SOURCE, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert trusted_library.build(cpu_kernels.SOURCE, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    # no temporary files left; the library's sha256 is recorded beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]
    assert (tmp_path / (first.name + ".sha256")).read_text().split()[0] == _sha256(first)
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    with pytest.raises(RuntimeError, match="failed"):
        trusted_library.build(cpu_kernels.SOURCE, tmp_path / "other")


def test_load_is_off_when_asked_or_when_nothing_compiles(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_TRIED", False)
    monkeypatch.setattr(cpu_kernels, "_LOADED", None)
    monkeypatch.setattr(cpu_kernels, "_SAID_OFF", False)
    with caplog.at_level("INFO", logger="ember.hardware.cpu_kernels"):
        assert cpu_kernels.load(enabled=False) is None
    assert "native=false" in caplog.text
    assert not cpu_kernels._TRIED  # nothing built or loaded: a later load() still tries
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    caplog.clear()
    with caplog.at_level("INFO", logger="ember.hardware.cpu_kernels"):
        assert cpu_kernels.load() is None
    assert "failed" in caplog.text


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def first_load(tmp_path, monkeypatch):
    """`cpu_kernels.load` as on a process's first call, with the Ember cache in `tmp_path/cache`."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))

    def load():
        monkeypatch.setattr(cpu_kernels, "_TRIED", False)
        monkeypatch.setattr(cpu_kernels, "_LOADED", None)
        return cpu_kernels.load()

    return load


@pytest.fixture
def planted_library(native_kernels, tmp_path):
    """A shared library whose constructor, if it is ever loaded, creates `<tmp_path>/constructor-ran`."""
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void planted(void) {{ FILE *f = fopen("{tmp_path}/constructor-ran", "w");'
        " if (f) fclose(f); }\n"
    )
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(tmp_path / "planted.so")], check=True)
    return tmp_path / "planted.so"


@pytest.mark.parametrize("record", ["kept", "removed"])
def test_a_replaced_cached_library_is_not_loaded_but_rebuilt(tmp_path, first_load, planted_library, caplog, record):
    """Someone swaps the cached .so (keeping or removing its sha256 record): its code never runs."""
    target = trusted_library.build(cpu_kernels.SOURCE, tmp_path / "cache" / "kernels")
    sidecar = target.with_name(target.name + ".sha256")
    if record == "removed":
        sidecar.unlink()
    os.replace(shutil.copy(planted_library, tmp_path / "swap.so"), target)
    with caplog.at_level("INFO", logger="ember.hardware.cpu_kernels"):
        kernels = first_load()
    assert not (tmp_path / "constructor-ran").exists()
    assert kernels is not None and kernels.path == target
    assert _sha256(target) == sidecar.read_text().split()[0] != _sha256(planted_library)
    assert "rebuilding" in caplog.text and str(target) in caplog.text


def test_a_library_writable_by_others_is_rebuilt(tmp_path, first_load, native_kernels, caplog):
    target = trusted_library.build(cpu_kernels.SOURCE, tmp_path / "cache" / "kernels")
    target.chmod(0o777)
    with caplog.at_level("INFO", logger="ember.hardware.cpu_kernels"):
        assert first_load() is not None
    assert "writable by group or others" in caplog.text
    assert target.stat().st_mode & 0o022 == 0


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_kernel_directory_writable_by_others_is_refused(tmp_path, first_load, planted_library, caplog, mode):
    """A directory others can write to could have anything swapped in: PyTorch's kernels are used instead."""
    directory = tmp_path / "cache" / "kernels"
    target = trusted_library.build(cpu_kernels.SOURCE, directory)
    directory.chmod(mode)
    os.replace(shutil.copy(planted_library, tmp_path / "swap.so"), target)
    with caplog.at_level("INFO", logger="ember.hardware.cpu_kernels"):
        assert first_load() is None
    assert not (tmp_path / "constructor-ran").exists()
    [record] = [r for r in caplog.records if "native CPU kernels off" in r.getMessage()]
    assert record.levelname == "WARNING" and str(directory) in record.getMessage()
    assert "writable by group or others" in record.getMessage()


def test_a_kernel_cache_owned_by_another_user_is_refused(tmp_path, first_load, native_kernels, monkeypatch, caplog):
    trusted_library.build(cpu_kernels.SOURCE, tmp_path / "cache" / "kernels")
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with caplog.at_level("INFO", logger="ember.hardware.cpu_kernels"):
        assert first_load() is None
    assert f"owned by uid {real_uid}" in caplog.text


def test_a_new_kernel_directory_is_private(tmp_path, first_load, native_kernels, monkeypatch):
    """Built under a umask that lets the group write (0002): the directory and files still are not."""
    old = os.umask(0o002)
    try:
        assert first_load() is not None
    finally:
        os.umask(old)
    directory = tmp_path / "cache" / "kernels"
    assert directory.stat().st_mode & 0o077 == 0
    assert all(p.stat().st_mode & 0o022 == 0 for p in directory.iterdir())


def test_small_batch_linear_uses_the_copy_only_for_its_own_weight_and_few_rows(kernels):
    calls = []

    def base(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    weight = torch.randn(24, 16).to(torch.bfloat16).float()
    other = torch.randn(24, 16)
    op = SmallBatchLinear(base, kernels, max_rows=2)
    op.add(weight)
    assert op.copy_bytes == 24 * 16 * 2
    x = torch.randn(2, 16)
    torch.testing.assert_close(op(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == []  # the kernel answered
    op(torch.randn(3, 16), weight)
    op(x, other)
    op(x, weight.clone())  # equal numbers, another tensor: no copy registered for it
    assert calls == [3, 2, 2]
    # what a product reads (benchmarks count bytes per token by it): the copy for few rows
    copy = op._copies[id(weight)][1]
    assert op.weight_read(weight, 1) is copy and op.weight_read(weight, 2) is copy
    assert op.weight_read(weight, 3) is weight and op.weight_read(other, 1) is other


def _logits(engine, token_ids: list[list[int]]) -> torch.Tensor:
    from ember.plugin.backend import AttentionBatch, SequenceSlice

    runner = engine.runner
    slices, ids, positions = [], [], []
    for i, tokens in enumerate(token_ids):
        table = list(range(i * 4, i * 4 + 4))
        slices.append(SequenceSlice(len(tokens), 0, table))
        ids.extend(tokens)
        positions.extend(range(len(tokens)))
    meta = runner.attention.prepare(AttentionBatch.from_slices(slices, runner.block_size, torch.device("cpu")))
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), torch.tensor(positions), runner.kv_caches, meta)
        return engine.model.compute_logits(hidden)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_decodes_through_the_kernel_with_the_same_logits(kernels, tmp_path, monkeypatch, tied):
    """A bf16 model on a CPU without native bf16: its projections (and a tied LM
    head) get bf16 copies; one-row products take the kernel, and the logits match
    the float32 product of the same bf16-rounded weights."""
    from tiny_models import make_tiny_model

    from ember import LLM, SamplingParams

    monkeypatch.setattr(CPUBackend, "compute_dtype", lambda self, dtype: torch.float32)
    make_tiny_model("llama", tmp_path / "m", tie_word_embeddings=tied)
    engine = LLM(model=str(tmp_path / "m"), dtype="bfloat16", num_kv_blocks=16).engine
    op = engine.model.linear_op
    assert isinstance(op, SmallBatchLinear)
    assert engine.model.layers[0].mlp.down_proj.linear_op is op
    weights = engine.model.matmul_weights()
    assert any(w is engine.model.embed_tokens.weight for w in weights) == tied
    assert op.copy_bytes == sum(w.numel() * 2 for w in weights)

    used = []
    gemv = kernels.gemv_bf16
    monkeypatch.setattr(op.kernels, "gemv_bf16", lambda *a: used.append(1) or gemv(*a), raising=False)
    one_row = _logits(engine, [[5]])
    assert len(used) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
    monkeypatch.setattr(engine.model.linear_op, "max_rows", 0)
    reference = _logits(engine, [[5]])
    torch.testing.assert_close(one_row, reference, rtol=1e-4, atol=1e-4)

    llm = LLM(model=str(tmp_path / "m"), dtype="bfloat16", num_kv_blocks=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_kernel = llm.generate(["hello there", "a"], params)
    llm.engine.model.linear_op.max_rows = 0
    without = llm.generate(["hello there", "a"], params)
    assert [o.outputs[0].token_ids for o in with_kernel] == [o.outputs[0].token_ids for o in without]


def test_float32_model_keeps_pytorchs_linear(tiny_llama_dir):
    from ember import LLM

    engine = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16).engine
    assert not isinstance(engine.model.linear_op, SmallBatchLinear)


# --- paged decode attention ------------------------------------------------------------------


def _reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """SDPA over each request's context gathered token by token."""
    block_size = k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        L = int(lens[b])
        slots = [(int(tables[b, t // block_size]), t % block_size) for t in range(L)]
        k = torch.stack([k_cache[blk, off] for blk, off in slots]).double()  # (L, Hkv, D)
        v = torch.stack([v_cache[blk, off] for blk, off in slots]).double()
        o = F.scaled_dot_product_attention(
            q[b].double()[:, None, :], k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True
        )
        out.append(o[:, 0, :])
    return torch.stack(out).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (9, 3, 64, 16), (8, 8, 8, 1), (6, 1, 32, 3)]
)
def test_paged_decode_attention_matches_sdpa(kernels, heads, kv_heads, head_dim, block_size, dtype):
    """Against float64 SDPA over the gathered context; bf16 (the CPU's bf16 path):
    float32 accumulation, one rounding to bf16 at the end."""
    torch.manual_seed(heads * 100 + head_dim + block_size)
    num_blocks = 64
    lens = torch.tensor([1, 5, block_size, 3 * block_size + 1, 40])
    max_blocks = -(-int(lens.max()) // block_size)
    perm = torch.randperm(num_blocks)  # blocks scattered over the cache, tables padded with 0
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int64)
    used = 0
    for b, L in enumerate(lens.tolist()):
        n = -(-L // block_size)
        tables[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    want = _reference_decode(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == dtype
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 4e-3)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


def test_paged_decode_attention_refuses_tables_outside_the_cache(kernels):
    k_cache = torch.randn(4, 2, 1, 8)
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 4\)"):
        kernels.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[4]]), torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match=r"context lengths must lie in \[1, 2\]"):
        kernels.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[0]]), torch.tensor([3]), 1.0)
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        kernels.paged_decode_attention(q.double(), k_cache, k_cache, torch.tensor([[0]]), torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match="context_lens must be int64"):
        kernels.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[0]]), torch.tensor([1], dtype=torch.int32), 1.0)


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_matches_argmax_and_log_softmax(kernels):
    torch.manual_seed(0)
    logits = torch.randn(7, 1003) * 5
    logits[1, [10, 500]] = 100.0  # a tie: the first index wins, as torch.argmax documents
    logits[2, :] = -math.inf
    logits[2, 42] = 0.0  # everything else banned
    logits[3, ::2] = -math.inf
    ids, lps = kernels.greedy(logits)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()
    assert ids[1] == 10
    want = logits.log_softmax(dim=-1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(lps, want, rtol=1e-6, atol=1e-6)
    assert lps[2] == 0.0


@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 33, 1003, 49152])
def test_greedy_vectorized_argmax_edges(kernels, vocab):
    """Widths around the kernel's 8- and 32-lane steps; NaN (never wins), ties (first
    index), a row banned but for one token, a row of nothing but -inf."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(6):
        x = torch.randn(4, vocab, generator=gen) * 4
        x[0, torch.randint(0, vocab, (max(1, vocab // 10),), generator=gen)] = math.nan
        x[1, :] = -math.inf
        x[1, vocab // 2] = 0.0
        if vocab > 3:
            x[2, 1] = x[2, vocab - 1] = x[2].max() + 1  # a tie: the first index wins
        x[3, :] = -math.inf
        ids, lps = kernels.greedy(x)
        want = x.nan_to_num(nan=-math.inf).argmax(dim=-1)
        want[3] = 0  # nothing above -inf: index 0, and no log-probability
        assert ids.tolist() == want.tolist(), (vocab, trial)
        for r in (1, 2):
            assert lps[r].item() == pytest.approx(x[r].log_softmax(-1)[want[r]].item(), abs=1e-4)
        assert math.isnan(lps[3].item())


def test_sampler_takes_the_backends_greedy_op(kernels):
    from ember import SamplingParams
    from ember.worker.sampler import Sampler, SamplingRow

    logits = torch.randn(5, 300)
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=0.0), [1], [], set()) for i in range(5)]
    fused = Sampler(greedy_op=kernels.greedy)(logits.clone(), rows)
    plain = Sampler()(logits.clone(), rows)
    assert fused.token_ids == plain.token_ids
    assert fused.logprobs == pytest.approx(plain.logprobs, abs=1e-6)
    assert CPUBackend().greedy_op() == kernels.greedy


# --- fused layer ops -------------------------------------------------------------------------


def test_fused_layer_ops_match_the_pytorch_layers(kernels):
    from ember.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul

    torch.manual_seed(3)
    norm = RMSNorm(72, 1e-5, torch.float32)
    norm.weight.data.normal_()
    x, res = torch.randn(5, 72), torch.randn(5, 72)
    plain, plain_sum = norm(x, res)
    plain_alone = norm(x)
    norm.fused = kernels.rms_norm
    fused, fused_sum = norm(x, res)
    assert torch.equal(fused_sum, x + res)
    torch.testing.assert_close(fused, plain, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(norm(x), plain_alone, rtol=2e-6, atol=2e-6)

    rope = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(4, (6 + 2 + 2) * 16)
    positions = torch.tensor([0, 3, 17, 63])
    q, k = qkv[:, : 6 * 16].view(4, 6, 16), qkv[:, 6 * 16 : 8 * 16].view(4, 2, 16)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    v_before = qkv[:, 8 * 16 :].clone()
    rope.fused = kernels.rope_
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the fused projection
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # PyTorch's rounding exactly
    assert torch.equal(qkv[:, 8 * 16 :], v_before)  # v untouched

    act = SiluAndMul()
    gate_up = torch.randn(3, 2 * 40) * 4
    plain = act(gate_up)
    act.fused = kernels.silu_mul
    torch.testing.assert_close(act(gate_up), plain, rtol=2e-6, atol=2e-6)


def test_float32_model_gets_the_fused_ops_and_the_same_tokens(tiny_llama_dir, monkeypatch):
    from ember import LLM, SamplingParams
    from ember.models.layers import FusableOp

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=32)
    fusable = [m for m in llm.engine.model.modules() if isinstance(m, FusableOp)]
    assert fusable and all(m.fused is not None for m in fusable)
    fused = llm.generate(["hello there", "the quick brown fox"], params)
    plain_llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=32,
                    backend_options={"native": "false"})
    assert all(m.fused is None for m in plain_llm.engine.model.modules() if isinstance(m, FusableOp))
    plain = plain_llm.generate(["hello there", "the quick brown fox"], params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
