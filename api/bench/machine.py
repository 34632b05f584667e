"""The machine a figure was measured on: CPU model, the SIMD flags that matter for the
kernels, core counts (every benchmark writes it beside its figures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MACHINE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_info() -> dict[str, Any]:
    """CPU model (lscpu's "Model name", else /proc/cpuinfo), the SIMD flags that matter
    for the kernels, core counts."""
    from ember.hardware.cpu_kernels import cpu_flags

    model = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False,
                             env={**os.environ, "LC_ALL": "C"})
        for line in out.stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
                break
    except (OSError, subprocess.TimeoutExpired):
        pass
    if model is None:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    flags = cpu_flags()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": model,
        "flags": {flag: flag in flags for flag in MACHINE_FLAGS},
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "python": sys.version.split()[0],
    }


