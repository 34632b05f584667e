"""Intel Gaudi, through its PyTorch bridge (``habana_frameworks.torch``), whose ``hpu``
device module documents is_available, synchronize, memory_stats,
reset_peak_memory_stats, memory_allocated and max_memory_allocated, and whose
``HPUGraph`` captures decode steps. Everything but the device checks, the memory
query and the graph capture lives in ``ember.hardware.torch_device``.
Written against Intel's documentation; no Gaudi has run it."""

from __future__ import annotations

import importlib

from ember.hardware.torch_device import TorchDeviceBackend
from ember.plugin import hookimpl


def _hpu():
    """``habana_frameworks.torch.hpu``, importing the bridge (which registers the
    ``hpu`` device with torch); ImportError where it is not installed."""
    importlib.import_module("habana_frameworks.torch.core")
    return importlib.import_module("habana_frameworks.torch.hpu")


class GaudiBackend(TorchDeviceBackend):
    name = "gaudi"
    distributed_backend = "hccl"  # habana_frameworks.torch.distributed.hccl
    device_type = "hpu"
    uses_triton = False  # Gaudi has no Triton: PyTorch's attention ops, lowered by the bridge

    @classmethod
    def device_module(cls):
        return _hpu()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            hpu = _hpu()
        except ImportError as exc:
            return f"Intel Gaudi's PyTorch bridge (habana_frameworks.torch) is not installed ({exc})"
        if not hpu.is_available():
            return "no Gaudi device is visible (habana_frameworks.torch.hpu.is_available() is False)"
        return None

    def memory_info(self) -> tuple[int, int]:
        stats = self.device_module().memory_stats(self.device)  # "Limit": usable bytes, "InUse"
        return stats["Limit"] - stats["InUse"], stats["Limit"]

    def synchronize(self) -> None:
        self.device_module().synchronize()

    def graph_capture(self):
        return HPUGraphCapture()


class HPUGraphCapture:
    """HPU graphs as Intel documents them for inference: ``fn`` runs once eagerly
    (the bridge compiles its ops), then between ``capture_begin`` and ``capture_end``
    of an ``HPUGraph`` on a side stream; ``replay`` reruns the captured work. The
    attention it captures is the PyTorch-ops form over fixed-width block tables
    (``CPUAttention.graph_metadata``)."""

    def __call__(self, fn):
        ht = importlib.import_module("habana_frameworks.torch")
        fn()
        graph, stream = ht.hpu.HPUGraph(), ht.hpu.Stream()
        with ht.hpu.stream(stream):
            graph.capture_begin()
            out = fn()
            graph.capture_end()

        def replay():
            graph.replay()
            return out

        return replay


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("gaudi", GaudiBackend)
