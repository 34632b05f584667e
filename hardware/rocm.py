"""AMD GPUs, through PyTorch's ROCm (HIP) build, which keeps the ``torch.cuda`` API
and the ``cuda`` device type. Everything but the device checks lives in
``ember.hardware.torch_device``."""

from __future__ import annotations

import torch

from ember.hardware.torch_device import TorchDeviceBackend
from ember.plugin import hookimpl


class ROCmBackend(TorchDeviceBackend):
    name = "rocm"
    distributed_backend = "nccl"  # RCCL, under NCCL's name in ROCm builds of PyTorch
    device_type = "cuda"  # PyTorch's HIP build names AMD GPUs "cuda"
    runs_flash_attn = True  # flash-attn's ROCm build (composable kernels)

    @classmethod
    def device_module(cls):
        return torch.cuda

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.hip is None:
            return f"this torch ({torch.__version__}) is not a ROCm (HIP) build"
        if not torch.cuda.is_available():
            return "no AMD GPU is visible (torch.cuda.is_available() is False under ROCm)"
        return None

    def describe(self) -> str:
        return f"rocm ({self.device}, {torch.cuda.get_device_name(self.device)}, HIP {torch.version.hip})"


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("rocm", ROCmBackend)
