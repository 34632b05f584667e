"""The CPU backend's instruction-set paths for a bf16 model.

Two paths, chosen once at startup from the CPU's flags (``select_path``, logged):

- ``bf16``: CPUs with AMX or AVX512-BF16 compute a bf16 model in bf16, with a bf16
  KV cache. Each matmul weight is reordered once, at load, into oneDNN's blocked
  layout and multiplied by oneDNN's bf16 inner product (``cpu_linear.PackedLinear``).
  With the weight in plain layout, oneDNN re-lays it out on every call: a 576x1536
  product of one row took 58 us plain and 33 us packed on a 2-core AVX512-BF16 EPYC
  (77 / 33 on a Sapphire Rapids). Attention and the fused layer ops run the native
  kernels' bf16 instantiations.
- ``fp32``: elsewhere (AVX2), bf16 is a storage dtype and products run in float32
  through oneDNN (``cpu_linear.onednn_linear``), small batches reading bf16 weight
  copies through the native kernel (``cpu_linear.SmallBatchLinear``).

The CPU backend's option ``path`` (``--backend-option path=bf16|fp32``) forces a
path; ``auto``, the default, reads the flags.
"""

from __future__ import annotations

PATHS = ("bf16", "fp32")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's flags from /proc/cpuinfo; empty where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def select_path(flags: set[str] | None = None, forced: str = "auto") -> tuple[str, str]:
    """``(path, why)``: ``bf16`` on CPUs with AMX or AVX512-BF16, else ``fp32``, unless
    ``forced`` (the CPU backend's option ``path``) names one."""
    forced = forced.strip().lower() or "auto"
    if forced in PATHS:
        return forced, "forced by the backend option path"
    if forced != "auto":
        raise ValueError(f"path={forced!r} is not a CPU path; choose one of: auto, {', '.join(PATHS)}")
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "bf16", "the CPU has AMX"
    if "avx512_bf16" in flags:
        return "bf16", "the CPU has AVX512-BF16"
    return "fp32", "the CPU has neither AMX nor AVX512-BF16 (PyTorch's bf16 GEMM is slower than fp32 there)"
