"""NVIDIA GPUs, through PyTorch's CUDA build (``torch.cuda``). Everything but the
device checks lives in ``ember.hardware.torch_device``."""

from __future__ import annotations

import torch

from ember.hardware.torch_device import TorchDeviceBackend
from ember.plugin import hookimpl


class CUDABackend(TorchDeviceBackend):
    name = "cuda"
    distributed_backend = "nccl"
    device_type = "cuda"
    runs_flash_attn = True

    @classmethod
    def device_module(cls):
        return torch.cuda

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None:
            hint = " (a ROCm build: the rocm backend drives it)" if torch.version.hip else ""
            return f"this torch ({torch.__version__}) is not built with CUDA{hint}"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return None

    def describe(self) -> str:
        return f"cuda ({self.device}, {torch.cuda.get_device_name(self.device)}, CUDA {torch.version.cuda})"


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("cuda", CUDABackend)
