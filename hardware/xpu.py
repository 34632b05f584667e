"""Intel GPUs, through PyTorch's ``torch.xpu`` (built into PyTorch since 2.4; an XPU
build of torch and Intel's GPU driver are needed). Everything but the device checks
lives in ``ember.hardware.torch_device``."""

from __future__ import annotations

import torch

from ember.hardware.torch_device import TorchDeviceBackend
from ember.plugin import hookimpl


class XPUBackend(TorchDeviceBackend):
    name = "xpu"
    distributed_backend = "xccl"  # oneCCL, built into PyTorch >= 2.7 (older: "ccl" from oneccl_bindings_for_pytorch)
    device_type = "xpu"

    @classmethod
    def device_module(cls):
        return torch.xpu

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not hasattr(torch, "xpu"):
            return f"this torch ({torch.__version__}) has no torch.xpu"
        if not torch.xpu.is_available():
            return f"no Intel GPU is visible (torch.xpu.is_available() is False with torch {torch.__version__})"
        return None

    def describe(self) -> str:
        return f"xpu ({self.device}, {torch.xpu.get_device_name(self.device)})"


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("xpu", XPUBackend)
