"""The CPU backend's options (``ember backends options cpu``): every knob its modules
read, set by the user as ``--backend-option key=value`` (``EMBER_BACKEND_OPTIONS``,
``EngineConfig.backend_options``) and handed down from ``CPUBackend.options``. Nothing
here reads the environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ember.plugin.backend_options import BackendOptions, option

DEFAULT_DECODE_GROUP_BYTES = 4 << 20
# products of at most this many rows read plain bf16 weights through the native kernel,
# by path: SmallBatchLinear (fp32 path) and PackedLinear (bf16 path). SmolLM2's weights
# (30 layers' projections and the LM head, read from memory), AVX-512/avx512_bf16 EPYC,
# 2026-12-06, ms per forward's products: on the fp32 path the kernel over the bf16
# copies beat oneDNN over the float32 weights up to 8 rows (1 row 9.5 against 24.6, 6
# rows 21.6 against 34.7, 8 rows 29.2 against 34.5; 12 rows even), and 8 rows cover a
# default speculative verification (1 + 5 drafts), whose rows the kernel computes each
# as it would alone, so greedy speculation reproduces plain decoding there. On the bf16
# path oneDNN's packed product ties at 3 rows and wins from 4 (1 row 9.7 against 13.1,
# 4 rows 16.0 against 11.6). The bf16 path's dot-product kernel (option bf16_gemv=dot):
# 4 rows 9.7 against oneDNN's 10.4, 6 rows 11.6 against 10.2, 8 rows 14.9 against 12.8;
# it takes up to 8 rows, covering a verification, so greedy speculation is exact there too.
DEFAULT_SMALL_BATCH_ROWS = {"fp32": 8, "bf16": 2, "bf16_dot": 8}


@dataclass(frozen=True)
class CPUOptions(BackendOptions):
    """The CPU backend's knobs. Each default is what runs when nothing is set."""

    path: Literal["auto", "bf16", "fp32"] = option(
        "auto",
        "How a bfloat16 model computes (ember.hardware.cpu_paths). auto: bf16 on CPUs with AMX or "
        "AVX512-BF16 (bf16 math on oneDNN-packed weights, a bf16 KV cache), else fp32 (bf16 is a storage "
        "dtype; products, activations and the KV cache in float32, PyTorch's bf16 GEMM being slower there). "
        "Forcing bf16 on a CPU without native bf16 is slow; fp32 on one with it costs speed, not accuracy.",
    )
    native: bool = option(
        True,
        "Use the native C kernels (compiled at first use: attention on the paged cache, small-batch bf16 "
        "products, fused RMSNorm/RoPE/SiLU, greedy sampling, the GGUF kernels, CPU graphs). false: PyTorch "
        "runs everything (slower; a check that the kernels change nothing but speed).",
    )
    linear: Literal["onednn", "plain"] = option(
        "onednn",
        "The dense matrix product. onednn: oneDNN's linear (faster than F.linear at every batch size measured) "
        "and, on the bf16 path, weights repacked into oneDNN's blocked layout at load. plain: F.linear on "
        "weights as loaded (no packed copies; less memory, slower).",
    )
    small_batch_rows: int | None = option(
        None,
        "Products of at most this many rows run the native few-row kernel (decode of a small batch, a "
        "speculative verification: bound by reading the weights): over plain bf16 weight copies in a bf16 "
        "model, over the weights themselves in a float32 model. auto: 8 on the fp32 path (and for float32 "
        "models), 8 on the bf16 path with its dot-product kernel, else 2; 0 turns the kernel off and keeps "
        "no copies (saves their memory: half the float32 weights' bytes on the fp32 path, the bf16 weights' "
        "bytes again on the bf16 path).",
    )
    bf16_gemv: Literal["auto", "dot", "widen"] = option(
        "auto",
        "The few-row kernel of the bf16 path. dot: the CPU's bf16 dot-product instruction (AVX512-BF16), "
        "up to 8 rows by default, so a speculative verification's rows come out as its plain steps' "
        "(greedy speculation exact); widen: bf16 widened to float32 and FMA (AVX2), up to 2 rows, about 5% "
        "faster at one row, the verification then runs oneDNN and may round differently. auto: dot where "
        "the CPU has avx512_bf16. A forced dot the CPU lacks is refused.",
    )
    decode_group_bytes: int = option(
        DEFAULT_DECODE_GROUP_BYTES,
        "Without the native decode kernel, decodes gather their K and V in groups of about this many bytes "
        "so that a group stays in the CPU's cache (default 4 MiB). Larger: fewer, bigger gathers that spill "
        "the cache; smaller: more calls.",
    )
    batch_invariant: bool = option(
        False,
        "Every token's numbers independent of what shares its step (batch mates, chunking, draft tokens, "
        "recomputation after preemption): row-by-row products and decode-style attention for every token. "
        "Slower; for checking that scheduling and speculation never change outputs (docs/speculative.md).",
    )
    quant_isa: Literal["auto", "amx", "avx512vnni", "avx2", "ref"] = option(
        "auto",
        "The instruction set of the GGUF kernels (ember.hardware.cpu_quant). auto: the best the CPU runs. "
        "A forced one the CPU lacks is refused, naming the missing flags; ref is plain C (the check for the others).",
    )
    gguf_x8: bool = option(
        True,
        "Repack Q4_0/Q4_1/Q8_0 GGUF weights (rows a multiple of 8) into the x8 layout at load: 8 rows per "
        "product, the integer kernel up to 256 rows. false: every weight as read, one-row kernels.",
    )
    gguf_prefill: Literal["auto", "int8", "bf16", "float32"] = option(
        "auto",
        "How GGUF products of more than 256 rows (long prompts) run. auto: bf16 where the CPU multiplies "
        "bfloat16 natively (the bf16 path), else int8. int8: the integer kernel (llama.cpp's way); bf16: "
        "dequantized bfloat16 tiles through oneDNN; float32: dequantized float32 tiles (exact: the "
        "dequantized model's numbers, slowest).",
    )
    gguf_q5_0_x8: bool = option(
        True,
        "Re-encode Q5_0 GGUF weights as Q8_0 at load (lossless: the same values; 34/22 of their bytes) so the x8 "
        "kernels run them (Gemma 3 270M's q/k/gate/up: about 2.3x the one-row Q5_0 kernel's speed per byte). "
        "false: Q5_0 as read, one-row kernels.",
    )
    gguf_activations: Literal["auto", "int8", "int8x2", "float"] = option(
        "auto",
        "How activations enter the GGUF integer kernels (docs/quantization.md). int8: 8 bits per block of 32 "
        "(llama.cpp's; fastest, but near ties of the float model's next token flip); int8x2: two stages, x = d q "
        "+ d' q' (the second quantizes what the first leaves: about 15 bits), twice the integer products on one "
        "read of the weights; float: every product on dequantized float32 tiles (the dequantized model's "
        "numbers; slowest). auto: int8x2. Products of more than 256 rows in gguf_prefill=bf16 keep bf16 tiles.",
    )

    def __post_init__(self) -> None:
        if self.small_batch_rows is not None and self.small_batch_rows < 0:
            raise ValueError(f"small_batch_rows must be >= 0 or auto, got {self.small_batch_rows}")
        if self.decode_group_bytes < 1:
            raise ValueError(f"decode_group_bytes must be >= 1, got {self.decode_group_bytes}")

    def small_batch_rows_for(self, path: str) -> int:
        """``small_batch_rows`` on ``path`` (``fp32``, ``bf16``, or ``bf16_dot``: the
        bf16 path with its dot-product kernel)."""
        return DEFAULT_SMALL_BATCH_ROWS[path] if self.small_batch_rows is None else self.small_batch_rows
