"""What Ember's accelerator backends share, written once against PyTorch's device
APIs: the device, dtypes, memory accounting and KV sizing, peak-memory profiling,
synchronization and the attention (Triton). Each vendor file (``cuda``, ``rocm``,
``xpu``, ``gaudi``) says only which torch device module it drives and why it is
unavailable on a machine without its device.

The device module is ``torch.cuda`` (NVIDIA, and AMD under PyTorch's HIP build),
``torch.xpu`` (Intel GPUs) or ``habana_frameworks.torch.hpu`` (Intel Gaudi); each
documents ``is_available``, ``device_count``, ``synchronize``,
``reset_peak_memory_stats``, ``memory_allocated`` and ``max_memory_allocated``, and
``mem_get_info`` (free, total) where the device has it (Gaudi reports its total in
``memory_stats``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ember.plugin.backend import BaseAttention, BaseBackend, eager_capture
from ember.plugin.backend_options import BackendOptions, option

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}
# the share of the device's memory Ember may fill (weights, activations and the KV cache
# together), as vLLM's --gpu-memory-utilization (option gpu_memory_utilization)
DEFAULT_MEMORY_UTILIZATION = 0.9
INTERPRETED_MEMORY = 1 << 30  # the device an interpreted backend (checks only) pretends to have


_logged_choices: set[tuple[str, str]] = set()


def _log_choice(backend: str, what: str) -> None:
    if (backend, what) not in _logged_choices:
        _logged_choices.add((backend, what))
        logger.info("%s backend: attention by %s (the backend option attention overrides)", backend, what)


def kv_budget_bytes(free: int, total: int, utilization: float, activation_bytes: int) -> int:
    """The KV cache's share of a device with ``free`` of ``total`` bytes free once the
    weights are loaded: ``utilization * total`` minus what is in use (weights, other
    processes) minus the profiled activation peak; 0 when nothing is left."""
    in_use = total - free
    return max(0, int(total * utilization) - in_use - activation_bytes)


class CUDAGraphCapture:
    """Captures with ``torch.cuda.CUDAGraph`` as PyTorch documents it: ``fn`` runs
    once on a side stream (lazy initialisation, Triton's compilation), then once under
    ``torch.cuda.graph``; every graph shares one memory pool (captured largest first,
    the smaller ones fit in its memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def __call__(self, fn):
        cuda = torch.cuda
        with cuda.device(self.device):
            side = cuda.Stream()
            side.wait_stream(cuda.current_stream())
            with cuda.stream(side):
                fn()
            cuda.current_stream().wait_stream(side)
            graph = cuda.CUDAGraph()
            with cuda.graph(graph, pool=self.pool):
                out = fn()
            if self.pool is None:
                self.pool = graph.pool()

        def replay():
            graph.replay()
            return out

        return replay


@dataclass(frozen=True)
class TorchDeviceOptions(BackendOptions):
    """The knobs of the accelerator backends (cuda, rocm, xpu, gaudi)."""

    attention: Literal["auto", "flash-attn", "triton", "torch"] = option(
        "auto",
        "The paged attention. auto: flash-attn where the backend runs it (cuda, rocm) and it is installed "
        "(256-token KV blocks), else the Triton kernels, else (gaudi) PyTorch's ops. triton: the Triton "
        "kernels even where flash-attn is installed; torch: gather + SDPA, slowest, no Triton needed. A "
        "choice the backend does not have is refused when the engine starts.",
    )
    gpu_memory_utilization: float = option(
        DEFAULT_MEMORY_UTILIZATION,
        "The share of the device's memory Ember may fill: weights, activations and the KV cache together "
        "(vLLM's --gpu-memory-utilization), in (0, 1]. Higher: a larger KV cache (more requests at once); "
        "lower: room for other processes on the device. Ignored when --kv-cache-memory is given.",
    )
    device_index: int = option(
        0,
        "The device this process runs on among those visible (torch's device index). Parallel ranks on "
        "one machine take this index plus their local rank.",
    )

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.device_index < 0:
            raise ValueError(f"device_index must be >= 0, got {self.device_index}")


class TorchDeviceBackend(BaseBackend):
    """An accelerator driven through a torch device module. Subclasses set
    ``device_type`` and implement ``device_module`` and ``unavailable_reason``.
    Construction touches no device (the contract), so tests build one anywhere."""

    device_type: ClassVar[str]
    options_class = TorchDeviceOptions
    options: TorchDeviceOptions
    priority = 10  # over the CPU backend when available
    #: attention by the Triton kernels (GPUs); False: PyTorch's ops (Gaudi runs no Triton)
    uses_triton: ClassVar[bool] = True
    #: flash-attn has builds for this device (NVIDIA's CUDA, AMD's ROCm)
    runs_flash_attn: ClassVar[bool] = False

    @classmethod
    def device_module(cls) -> Any:
        """The torch module driving this device (``torch.cuda``, ``torch.xpu``, ...)."""
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls) -> str | None:
        raise NotImplementedError

    @classmethod
    def is_available(cls) -> bool:
        try:
            return cls.unavailable_reason() is None
        except Exception:  # is_available never raises (the contract)
            return False

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.options.device_index)

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype | None) -> torch.dtype:
        if requested == "auto":  # the checkpoint's half-precision dtype, else bf16
            return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        dtype = _DTYPES.get(requested)
        if dtype is None:
            raise ValueError(
                f"dtype {requested!r} is not supported by the {self.name} backend; "
                f"choose one of: auto, {', '.join(sorted(_DTYPES))}"
            )
        return dtype

    def kv_cache_memory_bytes(self, model_bytes: int, activation_bytes: int = 0) -> int:
        free, total = self.memory_info()
        return kv_budget_bytes(free, total, self.options.gpu_memory_utilization, activation_bytes)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of this backend's device."""
        return self.device_module().mem_get_info(self.device)

    def peak_memory_of(self, run) -> int | None:
        module = self.device_module()
        self.synchronize()
        module.reset_peak_memory_stats(self.device)
        before = module.memory_allocated(self.device)
        run()
        self.synchronize()
        return max(0, module.max_memory_allocated(self.device) - before)

    def synchronize(self) -> None:
        self.device_module().synchronize(self.device)

    def create_attention(self) -> BaseAttention:
        """The attention the option ``attention`` names (``flash-attn``, ``triton``,
        ``torch``), or by default: flash-attn where this backend runs it and it is
        installed, else Triton (``torch`` where the device has no Triton). The choice
        is logged once per process. All three honour sliding windows and logit
        soft-caps (``supports_sliding_window`` / ``supports_softcap``), so no choice
        refuses Gemma 2/3 or Mistral."""
        choices = self.attention_choices()
        requested = self.options.attention
        if requested != "auto" and requested not in choices:
            raise ValueError(
                f"attention={requested!r} is not an attention of the {self.name} backend; "
                f"choose auto or one of: {', '.join(choices)}"
            )
        flash_missing = None
        if "flash-attn" in choices and requested in ("auto", "flash-attn"):
            try:
                from ember.hardware.flash_attention import FlashAttention

                attention = FlashAttention()
            except ImportError as exc:
                if requested == "flash-attn":
                    raise ValueError(
                        f"attention=flash-attn, but flash-attn is not installed ({exc}); "
                        "pip install 'ember-serve[flash-attn]'"
                    ) from exc
                flash_missing = f"flash-attn is not installed ({exc})"
            else:
                _log_choice(self.name, "flash-attn (varlen and paged-KV entry points, 256-token KV blocks)")
                return attention
        if requested == "torch" or (requested == "auto" and not self.uses_triton):
            from ember.hardware.cpu_attention import CPUAttention

            _log_choice(self.name, "PyTorch ops (index_copy_ into the cache, gather, SDPA)")
            # the CPU backend's reference attention without its native kernels: device-agnostic
            return CPUAttention(None)
        from ember.hardware.triton_attention import TritonAttention

        _log_choice(self.name, "Triton paged-attention kernels" + (f"; {flash_missing}" if flash_missing else ""))
        return TritonAttention()

    def lora_op(self) -> Callable[..., None] | None:
        """The Triton BGMV shrink/expand kernels (``ember.hardware.triton_lora``) where this
        backend runs Triton; None on Gaudi (no Triton: PyTorch's products, ``ember.models.lora``)."""
        if not self.uses_triton:
            return None
        from ember.hardware.triton_lora import lora_op

        return lora_op

    def graph_capture(self):
        """CUDA graphs where the device module has them (``torch.cuda``: NVIDIA, and
        AMD under PyTorch's HIP build, where they are HIP graphs); None elsewhere."""
        if self.device_type != "cuda":
            return None
        return CUDAGraphCapture(self.device)

    @classmethod
    def attention_choices(cls) -> tuple[str, ...]:
        """The attentions the option ``attention`` may name for this backend, best first."""
        if not cls.uses_triton:
            return ("torch",)
        return ("flash-attn", "triton", "torch") if cls.runs_flash_attn else ("triton", "torch")

    @classmethod
    def interpreted(cls) -> type[TorchDeviceBackend]:
        """This backend on CPU tensors, its Triton kernels run by Triton's interpreter:
        what a machine without the device can check of it (``ember backends check
        NAME --interpret``). ``TRITON_INTERPRET=1`` must be set before the kernels are
        first imported. It sizes its KV pool as a device of ``INTERPRETED_MEMORY``."""
        return type(f"{cls.__name__}Interpreted", (cls,), {
            "__doc__": f"{cls.__name__} on CPU tensors under Triton's interpreter.",
            "is_available": classmethod(lambda c: True),
            "unavailable_reason": classmethod(lambda c: None),
            "device": property(lambda self: torch.device("cpu")),
            "memory_info": lambda self: (INTERPRETED_MEMORY, INTERPRETED_MEMORY),
            "peak_memory_of": BaseBackend.peak_memory_of,
            "synchronize": lambda self: None,
            # no graphs on CPU tensors: each replay runs the forward again, through the
            # same static tensors and padding a device graph would read
            "graph_capture": lambda self: eager_capture,
            "describe": lambda self: f"{cls.name} (cpu tensors, Triton interpreter)",
        })
