"""The CPU backend: the reference implementation every other backend is checked against.

Attention (``ember.hardware.cpu_attention``) writes each step's K/V into the paged
cache and runs PyTorch's SDPA or the native decode kernel. Native kernels
(``ember.hardware.cpu_kernels``, compiled at first use) also serve small-batch linears
over bf16 weight copies, fused RMSNorm/RoPE/SiLU and greedy sampling; with the option
``native=false``, or where they cannot be built, PyTorch runs everything. Every knob is
an option (``CPUOptions``, ``ember backends options cpu``).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ember.hardware import cpu_gguf, cpu_graphs, cpu_int_quant, cpu_kernels
from ember.hardware.cpu_attention import CPUAttention
from ember.hardware.cpu_linear import (
    FewRowLinear,
    PackedLinear,
    RowInvariantLinear,
    SmallBatchLinear,
    onednn_linear,
    onednn_linear_works,
    packing_works,
)
from ember.hardware.cpu_options import CPUOptions
from ember.hardware.cpu_paths import select_path
from ember.models.layers import Linear
from ember.plugin import hookimpl
from ember.plugin.backend import BaseAttention, BaseBackend

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float": torch.float32}
_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the largest activation a prompts-only step should make (CPUBackend.prefill_step_tokens):
# glibc's largest mmap threshold, past which every allocation is paged in anew
PREFILL_ACTIVATION_BYTES = 32 << 20


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes(field: str) -> int | None:
    """VmRSS / VmHWM of this process from /proc/self/status, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class CPUBackend(BaseBackend):
    """Always available. dtype ``auto`` is float32.

    A bfloat16 model runs on one of two paths (``ember.hardware.cpu_paths``), chosen
    at startup from the CPU's flags and logged: ``bf16`` (AMX or AVX512-BF16: bf16
    math on weights prepacked for oneDNN, a bf16 KV cache) or ``fp32`` (elsewhere:
    bf16 is a storage dtype, and matrix multiplies, activations and the KV cache use
    float32, since PyTorch's bf16 GEMM is several times slower than its fp32 GEMM
    there). The option ``path=bf16|fp32`` forces one.
    """

    name = "cpu"
    priority = 0
    distributed_backend = "gloo"
    # a 512-token chunk already runs the GEMMs near their peak here, and keeps a long
    # prompt from stalling running streams for seconds (benchmarks/bench_scheduler.py)
    default_step_tokens = 512
    # with no stream decoding, a prompt computes in chunks of up to 4096 tokens: on
    # SmolLM2 bf16 (AVX512-BF16 EPYC) 2048-token prompts ran 20% faster than in
    # 512-token chunks, 4096-token ones 14% (benchmarks/bench_prefill.py); fewer
    # where the widest activation would outgrow PREFILL_ACTIVATION_BYTES (prefill_step_tokens)
    default_prefill_step_tokens = 4096

    options_class = CPUOptions
    options: CPUOptions
    device = torch.device("cpu")  # a plain attribute: the runner reads it every step

    def __init__(self, options: CPUOptions | None = None) -> None:
        super().__init__(options)
        self._path: str | None = None

    def _kernels(self):
        """The native kernels (``cpu_kernels.load``), None with the option native=false."""
        return cpu_kernels.load(self.options.native)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def prefill_step_tokens(self, hf_config, compute_dtype: torch.dtype) -> int:
        # glibc maps every allocation over 32 MiB (its largest mmap threshold) afresh
        # and unmaps it when freed, so a step whose activations are that large pays a
        # page fault per 4 KiB of each, every layer: SmolLM2 in float32 at 4096 tokens
        # (gate|up: 50 MB) spent 2.5 of 10.2 s of a 7808-token prefill casting into such
        # buffers. Halve the step (down to 1024 tokens) until the widest activation, the
        # MLP's gate|up product, fits: SmolLM2 then prefills 4096 tokens a step in
        # bfloat16, 2048 in float32 (offline, 128 prompts, Q4_1: 548 against 422 tok/s)
        width = 2 * (getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size)
        per_token = width * compute_dtype.itemsize
        tokens = self.default_prefill_step_tokens
        while tokens > 1024 and tokens * per_token > PREFILL_ACTIVATION_BYTES:
            tokens //= 2
        return tokens

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype | None) -> torch.dtype:
        if requested == "auto":
            return torch.float32
        dtype = _DTYPES.get(requested)
        if dtype is None:
            raise ValueError(
                f"dtype {requested!r} is not supported by the cpu backend; choose one of: auto, float32, bfloat16"
            )
        return dtype

    @property
    def path(self) -> str:
        """``bf16`` or ``fp32``: how this backend runs a bf16 model (chosen once, logged)."""
        if self._path is None:
            self._path, why = select_path(forced=self.options.path)
            logger.info("cpu backend: %s path for bf16 models (%s)", self._path, why)
        return self._path

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype != torch.bfloat16:
            return dtype
        return torch.bfloat16 if self.path == "bf16" else torch.float32

    def linear_op(self):
        if self.batch_invariant:
            return RowInvariantLinear(self._kernels())
        # oneDNN's linear beat F.linear (MKL sgemm) at every batch size measured on a
        # 2-core AVX2 EPYC: 1 row 30 vs 38 ms, 32 rows 105 vs 139 ms, 128 rows 258 vs
        # 307 ms per SmolLM2 forward's projections. Private op: F.linear where absent.
        if self.options.linear == "onednn" and onednn_linear_works():
            return onednn_linear
        return F.linear

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        if self.batch_invariant:
            return
        if dtype == torch.float32:
            self._few_row_float32(model)
            return
        if dtype != torch.bfloat16:
            return
        if self.compute_dtype(dtype) == torch.bfloat16:
            self._pack_weights(model)
            return
        # A bf16 model computed in fp32 keeps a bf16 copy of each matmul weight for
        # products of few rows (decode of a small batch), which are bound by reading
        # the weights: see SmallBatchLinear and ember.hardware.cpu_kernels. Costs
        # half the weights' fp32 bytes again.
        op = self._few_row_op(model, SmallBatchLinear)
        if op is not None:
            model.set_linear_op(op)

    def _few_row_op(self, model, op_class):
        """``op_class(model.linear_op, kernels, rows)`` (SmallBatchLinear or
        FewRowLinear) holding the model's float32 matmul weights, for products of up to
        small_batch_rows rows (the fp32 path's); None where the options native=false or
        small_batch_rows=0 turn the few-row kernel off."""
        rows = self.options.small_batch_rows_for("fp32")
        kernels = self._kernels() if rows > 0 else None
        if kernels is None:
            return None
        op = op_class(model.linear_op, kernels, rows)
        for weight in model.matmul_weights():
            if weight.dtype == torch.float32 and weight.dim() == 2 and not weight.is_mkldnn and weight.is_contiguous():
                op.add(weight)
        return op

    def _bf16_dot(self, kernels) -> bool:
        """Whether the bf16 path's few-row kernel is the bf16 dot-product one (option
        bf16_gemv; logged). ValueError for a forced dot the CPU cannot run."""
        choice = self.options.bf16_gemv
        if choice == "widen" or kernels is None:
            return False
        if not kernels.has_bf16_dot:
            if choice == "dot":
                raise ValueError("backend option bf16_gemv=dot needs a CPU with avx512_bf16; this one has none "
                                 "(use bf16_gemv=widen or auto)")
            return False
        logger.info("cpu backend: bf16 few-row products on the CPU's bf16 dot-product instruction (%s)",
                    "forced by bf16_gemv=dot" if choice == "dot" else "avx512_bf16")
        return True

    def _few_row_float32(self, model) -> None:
        # A float32 model: products of few rows (decode of a small batch, a speculative
        # verification) read the float32 weights through the native GEMV (FewRowLinear),
        # which reads them faster than oneDNN's and computes each row as it would alone.
        op = self._few_row_op(model, FewRowLinear)
        if op is not None and len(op):
            model.set_linear_op(op)
            logger.info("cpu backend: products of up to %d rows over %d float32 weights take the native GEMV",
                        op.max_rows, len(op))

    def _pack_weights(self, model) -> None:
        # The bf16 path: every Linear's weight is replaced by its oneDNN-packed form; a
        # weight read elsewhere too (a tied LM head) gets a packed copy. Products of up
        # to small_batch_rows rows read plain bf16 weights kept beside the packed ones
        # (PackedLinear; twice the weights' bytes, as the fp32 path's float32 weights
        # and bf16 copies take three times). The option small_batch_rows=0 keeps the
        # packed weights only; linear=plain keeps plain weights only (F.linear).
        if self.options.linear != "onednn" or not packing_works():
            logger.info("cpu backend: bf16 weights kept in plain layout (F.linear)")
            return
        kernels = self._kernels()
        dot = self._bf16_dot(kernels)
        rows = self.options.small_batch_rows_for("bf16_dot" if dot else "bf16")
        op = PackedLinear(model.linear_op, kernels if rows > 0 else None, rows, dot=dot)
        packed = 0
        for module in model.modules():
            if isinstance(module, Linear) and not module.is_quantized and module.weight.dtype == torch.bfloat16:
                module.set_packed_weight(op.pack(module.weight))
                packed += 1
        copies = [w for w in model.matmul_weights() if not w.is_mkldnn and w.dtype == torch.bfloat16]
        for weight in copies:
            op.add(weight)
        model.set_linear_op(op)
        logger.info(
            "cpu backend: %d bf16 weights packed for oneDNN, %d packed copies; plain weights kept for products "
            "of up to %d rows: %.1f MiB", packed, len(copies), op.max_rows, op.plain_bytes / 2**20,
        )

    def quantized_linear_op(self, format: str, compute_dtype: torch.dtype):
        op = quantized_ops(self.options).get(format)
        return op() if op is not None else None

    def quantized_formats(self, compute_dtype: torch.dtype) -> tuple[str, ...]:
        return tuple(sorted(quantized_ops(self.options)))

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # Converting every bf16 weight to fp32 on every forward read and wrote three
        # times the weights' bytes per step: at batch 1 that was most of a decode
        # step. Weights rounded to bf16 are kept in fp32 (twice the memory of bf16).
        return self.compute_dtype(dtype)

    def kv_cache_dtype(self, dtype: torch.dtype, requested: str = "auto", quantized: bool = False) -> torch.dtype:
        # K and V are produced in the compute dtype. A float32 model may keep them in
        # 16 bits (bfloat16 or float16): the native kernels widen them in registers, and
        # a batch's decode attention, which streams every cached token from memory, reads
        # half the bytes (128 requests x 100 tokens, SmolLM2's heads, AVX-512 EPYC: 1.58
        # ms a layer over float32, 0.52 over bfloat16). "auto" does so for quantized
        # weights, in float16 (llama.cpp's default cache type beside float32
        # activations; 3 more mantissa bits than bfloat16), and keeps a float model's
        # numbers (the compute dtype) otherwise; the bf16 path stores bfloat16.
        compute = self.compute_dtype(dtype)
        if requested == "auto":
            if quantized and compute == torch.float32 and self._kernels() is not None:
                return torch.float16
            return compute
        chosen = _KV_DTYPES.get(requested)
        if chosen is None:
            raise ValueError(f"kv_cache_dtype {requested!r} is not one of: auto, {', '.join(_KV_DTYPES)}")
        if chosen != compute and not (compute == torch.float32 and chosen in (torch.bfloat16, torch.float16)):
            raise ValueError(f"kv_cache_dtype {requested!r}: this model computes in "
                             f"{str(compute).removeprefix('torch.')} on the cpu backend, whose KV cache is then "
                             f"{str(compute).removeprefix('torch.')} (a 16-bit cache goes beside float32 compute)")
        return chosen

    def kv_cache_memory_bytes(self, model_bytes: int, activation_bytes: int = 0) -> int:
        # A quarter of the RAM still available (weights are loaded by now) once the
        # largest step's activations are set aside, capped at 2 GiB: the CPU shares
        # memory with everything else on the host, and the cache is zeroed at start.
        free = max(0, available_memory_bytes() - activation_bytes)
        return int(max(256 << 20, min(2 << 30, free // 4)))

    def peak_memory_of(self, run) -> int | None:
        # The process's resident-set peak (VmHWM), reset first through clear_refs
        # (Linux); None where /proc does not allow it.
        if not _reset_peak_rss():
            run()
            return None
        before = _rss_bytes("VmRSS")
        run()
        peak = _rss_bytes("VmHWM")
        return None if before is None or peak is None else max(0, peak - before)

    def configure_threads(self, num_threads: int | None) -> int:
        # PyTorch's default is every core of the host: in a container limited to 2
        # CPUs of a 64-core machine that is 64 threads fighting over 2 CPUs. Ember
        # takes the physical cores it may run on, within the cgroup's CPU quota,
        # unless the user said otherwise (num_threads, else OMP_NUM_THREADS).
        source = "asked"
        if num_threads is None:
            if os.environ.get("OMP_NUM_THREADS"):
                source = "OMP_NUM_THREADS"
            else:
                num_threads, source = cpu_thread_count(), "physical cores available"
        if num_threads is not None and num_threads != torch.get_num_threads():
            torch.set_num_threads(num_threads)
        try:
            # Ember runs no inter-op parallel work; a second pool only adds threads.
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # only settable before the first inter-op work; then it stays
        logger.info("cpu backend: %d threads (%s)", torch.get_num_threads(), source)
        return torch.get_num_threads()

    def layer_ops(self, compute_dtype: torch.dtype) -> dict:
        # each replaces 3 to 12 small PyTorch ops, whose per-op cost was most of a
        # one-request decode step once the weights were read fast (fp32 and bf16 paths)
        kernels = self._kernels()
        if kernels is None or compute_dtype not in cpu_kernels.KERNEL_DTYPES:
            return {}
        return {"rms_norm": kernels.rms_norm, "rope_": kernels.rope_, "silu_mul": kernels.silu_mul,
                "embedding": kernels.embedding, "gelu_tanh_mul": kernels.gelu_tanh_mul,
                "head_rms_norm_": kernels.head_rms_norm_, "scale_": kernels.scale_}

    # decode batch sizes captured as CPU graphs when the user names none: a graph saves
    # the Python around a forward's native calls, which matters while the kernels are
    # quick (few rows); past 32 rows a step's products take far longer than that Python
    graph_batch_sizes = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)

    def graph_capture(self):
        # CPU graphs (ember.hardware.cpu_graphs): a forward that runs on the native
        # kernels only (GGUF weights, bf16 weights at few rows) replays as one C call;
        # one that runs PyTorch's ops (a float32 GEMM) is refused and runs eagerly
        if self._kernels() is None:
            return None
        return cpu_graphs.capture

    def greedy_op(self):
        kernels = self._kernels()
        return kernels.greedy if kernels is not None else None

    # the native LoRA kernel reads the step's slots from the engine's buffer: CPU graphs record it
    lora_op_in_graphs = True

    def lora_op(self):
        """The native kernel (every adapter of a step in one call per linear, recorded in CPU
        graphs); None with native=false: PyTorch's products per run of tokens."""
        kernels = self._kernels()
        return kernels.lora if kernels is not None else None

    def create_attention(self) -> BaseAttention:
        return CPUAttention(self._kernels(), row_invariant=self.batch_invariant,
                            decode_group_bytes=self.options.decode_group_bytes)

    @property
    def batch_invariant(self) -> bool:
        """The option ``batch_invariant``: every token's numbers independent of what
        shares its step (its batch mates, its prompt's chunking, draft positions beside
        it, a recomputation after preemption): row-by-row products and decode-style
        attention for every token. Slower; for checking that scheduling and
        speculation never change outputs (docs/speculative.md)."""
        return self.options.batch_invariant


def quantized_ops(options: CPUOptions | None = None) -> dict:
    """The quantized formats the CPU backend runs (docs/quantization.md), by format, as
    zero-argument factories of their ops: the integer grids through PyTorch's
    weight-only kernels (ember.hardware.cpu_int_quant), GGUF through the native kernels
    with the backend's ``options`` (ember.hardware.cpu_gguf)."""
    ops = dict(cpu_int_quant.linear_ops())
    ops.update(cpu_gguf.linear_ops(options))
    return ops


def cpu_thread_count(sys_root: str = "/sys") -> int:
    """Physical cores this process may run on (its affinity mask, SMT siblings counted
    once), capped by a cgroup CPU quota (v2 ``cpu.max`` or v1 ``cfs_quota_us``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{sys_root}/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    count = len(cores) or 1
    quota = cgroup_cpu_quota(sys_root)
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return count


def cgroup_cpu_quota(sys_root: str = "/sys") -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None without a limit."""
    try:
        with open(f"{sys_root}/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{sys_root}/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open(f"{sys_root}/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_memory_bytes() -> int:
    """Memory the kernel can hand out without swapping: /proc/meminfo's MemAvailable
    (free pages plus reclaimable cache), else free pages, else 8 GiB."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("cpu", CPUBackend)
