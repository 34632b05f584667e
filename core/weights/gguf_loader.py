"""Convert a GGUF file (llama.cpp's format) into a Hugging Face style directory.

The result holds `config.json`, `generation_config.json`, the tokenizer files
(chat template included) and `model.safetensors`, so the rest of Ember only
ever reads safetensors. Two forms:

* float (`keep_quantized=False`): every tensor dequantized to one dtype with the
  `gguf` package; transformers loads this directory as it is.
* quantized (`keep_quantized=True`): the weights of linear layers in a GGUF
  quant type (`ember.weights.gguf_quants.QUANT_TYPES`) keep their bytes, as
  uint8 `(out_features, row bytes)` under the linear's Hugging Face name, with a
  `<linear>.gguf_type` int32 tensor holding ggml's type id beside it; config.json
  carries `quantization_config = {"quant_method": "gguf", "types": [...]}`, which
  the `gguf` quantizer (`ember.plugins.quantizers.gguf`) reads. Float tensors
  stay float. A tied LM head becomes an untied `lm_head` holding the quantized
  `token_embd` bytes, multiplied natively, and the token embedding reads its rows
  from that weight (`quantization_config["embedding"] = "lm_head"`: no float table
  is stored or kept); an untied model's own `token_embd` is stored dequantized.
  A sparse MoE's experts (stacked `ffn_*_exps` or one tensor per expert) are split
  by rows into one quantized linear per expert and projection, under the per-expert
  Hugging Face names (`...experts.E.w1` for Mixtral, `...experts.E.gate_proj` for
  Qwen3-MoE); the router stays float.

Config and tokenizer come from the GGUF metadata through transformers' own GGUF
support, which keeps them identical to what `from_pretrained(..., gguf_file=...)`
would build.

A damaged file raises `InvalidCheckpointError` naming it. The header's counts
are checked against the file's size first (`check_gguf_header`), so that no
reader sizes anything by a count the file cannot hold.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .errors import InvalidCheckpointError, UnsupportedArchitectureError
from .gguf_names import (
    IGNORED_TENSORS, expert_tensor_names, fused_parts, hf_tensor_name, is_router, is_stacked_experts, rotary_heads,
    unpermute_rotary,
)
from .gguf_quants import FLOAT_TYPES, QUANT_TYPES
from .staging import publish_staging_dir, staging_dir

logger = logging.getLogger(__name__)

# 2: a tied quantized LM head's rows serve as the token embedding (no float table stored)
MARKER_FORMAT = 2
QUANT_METHOD = "gguf"  # quantization_config["quant_method"] of a quantized conversion
EMBEDDING_SOURCE = "lm_head"  # quantization_config["embedding"]: the linear whose rows are the embedding
TYPE_SUFFIX = "gguf_type"  # <linear>.gguf_type: ggml's type id of <linear>.weight
EMBEDDING = "token_embd.weight"

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)  # those gguf.GGUFReader reads
GGUF_HEADER_BYTES = 24  # magic, uint32 version, uint64 tensor count, uint64 metadata count
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name (its uint64 length), n_dims 0, type, offset
MIN_KV_BYTES = 8 + 4 + 1  # empty key (its uint64 length), value type, a one-byte value
# What the gguf reader and its numpy views raise on a file that is not what its header says.
GGUF_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, struct.error)


class GGUFHeader(NamedTuple):
    version: int
    num_tensors: int
    num_kv: int


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one `general.architecture` value is converted."""

    hf_class: str
    is_rotary_permuted: bool  # llama.cpp permuted q/k rows for its rope layout
    # llama.cpp stores Gemma's norm weights w of (1 + w) as 1 + w: this much is taken off
    # again (as transformers' GGUF loader does), so the checkpoint holds Hugging Face's w
    norm_offset: float = 0.0


SUPPORTED_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", is_rotary_permuted=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", is_rotary_permuted=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", is_rotary_permuted=False),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", is_rotary_permuted=False, norm_offset=1.0),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", is_rotary_permuted=False, norm_offset=1.0),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", is_rotary_permuted=False),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", is_rotary_permuted=False),
}
# a `llama` file with experts (`llama.expert_count`) is Mixtral
MIXTRAL = GGUFArchitecture("MixtralForCausalLM", is_rotary_permuted=True)


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    keep_quantized: bool = False,
) -> Path:
    """Convert `gguf_path` into a Hugging Face style directory at `out_dir`; return `out_dir`.

    `keep_quantized`: the quantized form (see the module docstring); a linear
    weight in a GGUF type Ember does not run raises ValueError naming the tensor
    and its type.

    Every tensor is dequantized and cast to `dtype`; the saved config records
    that dtype (`"dtype"` in config.json), not the dtype the model was trained
    in, which a GGUF does not state. A model without an `output` tensor gets
    `tie_word_embeddings=True` and no `lm_head.weight`.

    The directory is built beside `out_dir` and renamed into place when
    complete, with a completion marker (`staging.COMPLETE_MARKER`) written
    last, so an interrupted conversion leaves no `out_dir`. If another
    process publishes a complete `out_dir` first, that one is returned.

    Raises `FileNotFoundError` if `gguf_path` is missing, `FileExistsError`
    if `out_dir` exists and is not empty, `UnsupportedArchitectureError`
    (a `ValueError`) for architectures other than `SUPPORTED_ARCHITECTURES`,
    `InvalidCheckpointError` (a `ValueError`) for a damaged or truncated file,
    and `ValueError` for a non-floating `dtype` or a GGUF without tokenizer.
    """
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"Output directory {str(out_dir)!r} already exists and is not empty")

    check_gguf_header(gguf_path)
    with _reading(gguf_path, "reading its metadata and tensor index"):
        reader = gguf.GGUFReader(gguf_path)
        arch_name = _read_string(gguf_path, reader, "general.architecture")
    arch = SUPPORTED_ARCHITECTURES.get(arch_name)
    if arch_name in ("clip", "mmproj"):  # llama.cpp's vision projector files
        raise UnsupportedArchitectureError(
            f"GGUF file {str(gguf_path)!r} is a vision projector (llama.cpp's mmproj, architecture {arch_name!r}): "
            "Ember does not read mmproj files yet, and transformers' GGUF loader maps no vision tower "
            "(docs/multimodal.md); for images serve the model's Hugging Face checkpoint (safetensors); "
            "its language model's GGUF alone serves text"
        )
    if arch is None:
        raise UnsupportedArchitectureError(
            f"GGUF file {str(gguf_path)!r} has architecture {arch_name!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if arch_name == "phi3" and any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise UnsupportedArchitectureError(
            f"GGUF file {str(gguf_path)!r} is a Phi-3 with LongRoPE (rope_factors_long/short tensors), which "
            "transformers' GGUF config reading drops; load its safetensors checkpoint instead (LongRoPE runs there)"
        )
    if "tokenizer.ggml.model" not in reader.fields:
        raise ValueError(f"GGUF file {str(gguf_path)!r} has no tokenizer metadata (tokenizer.ggml.*)")

    num_experts = _read_int(reader, f"{arch_name}.expert_count")
    if num_experts and arch_name == "llama":
        arch = MIXTRAL
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    quantized_head = keep_quantized and not has_output and _is_quantized(reader, EMBEDDING)
    with _reading(gguf_path, "building the model config from its metadata"):
        config = _build_config(
            gguf_path, arch, dtype=dtype, tie_word_embeddings=not has_output and not quantized_head
        )
        # a head size other than hidden / heads (Qwen3's 128) is `<arch>.attention.key_length`,
        # which transformers' GGUF config mapping does not read for every architecture
        key_length = reader.fields.get(f"{arch_name}.attention.key_length")
        if key_length is not None:
            config.head_dim = int(key_length.contents())
        if num_experts:
            config = _moe_config(reader, arch_name, arch, config, num_experts)
    if keep_quantized:
        for t in reader.tensors:  # an unsupported type is refused before any work
            _keeps_bytes(gguf_path, t, quantized_head)
        types = sorted({t.tensor_type.name for t in reader.tensors
                        if _is_quantized(reader, t.name) and not is_router(t.name)})
        config.quantization_config = {"quant_method": QUANT_METHOD, "types": types}
        if quantized_head:
            config.quantization_config["embedding"] = EMBEDDING_SOURCE

    with staging_dir(out_dir) as staging:
        config.save_pretrained(staging)
        _save_generation_config(config, staging)
        with _reading(gguf_path, "building the tokenizer from its metadata"):
            _save_tokenizer(gguf_path, staging)

        tensors: dict[str, torch.Tensor] = {}
        bar = tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor", disable=not progress)
        for t in bar:
            if t.name in IGNORED_TENSORS:
                continue
            heads = rotary_heads(t.name, config.num_attention_heads, config.num_key_value_heads)
            permuted = arch.is_rotary_permuted and heads is not None
            experts = expert_tensor_names(t.name, num_experts, mixtral_names=arch is MIXTRAL) if num_experts else None
            if experts is not None and keep_quantized and _keeps_bytes(gguf_path, t, quantized_head):
                # stacked (E, out, in) values are (E * out, row bytes): each expert's rows in turn
                with _reading(gguf_path, f"reading tensor {t.name!r}"):
                    data = torch.from_numpy(np.array(t.data)).reshape(len(experts) * int(t.shape[1]), -1)
                type_id = torch.tensor([int(t.tensor_type)], dtype=torch.int32)
                for name, part in zip(experts, data.split(int(t.shape[1]))):
                    linear = name.removesuffix(".weight")
                    tensors[f"{linear}.weight"] = part.contiguous()
                    tensors[f"{linear}.{TYPE_SUFFIX}"] = type_id.clone()
                continue
            if experts is not None:  # stacked (E, out, in), or one expert's (out, in)
                with _reading(gguf_path, f"reading tensor {t.name!r}"):
                    stacked = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
                stacked = stacked.reshape(len(experts), *stacked.shape[-2:])
                tensors.update((name, part.to(dtype).contiguous()) for name, part in zip(experts, stacked))
                continue
            name = hf_tensor_name(t.name, arch_name)
            if arch is MIXTRAL:
                name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            if keep_quantized and _keeps_bytes(gguf_path, t, quantized_head):
                # rows of blocks: undoing the permutation of rows moves whole rows of bytes
                with _reading(gguf_path, f"reading tensor {t.name!r}"):
                    data = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1)
                data = unpermute_rotary(data, heads) if permuted else data
                # a fused weight's rows split into its projections (whole rows of blocks each)
                parts = fused_parts(name, config) or [(name, data.shape[0])]
                for (part_name, rows), part in zip(parts, data.split([r for _, r in parts])):
                    linear = EMBEDDING_SOURCE if t.name == EMBEDDING else part_name.removesuffix(".weight")
                    tensors[f"{linear}.weight"] = part.contiguous()
                    tensors[f"{linear}.{TYPE_SUFFIX}"] = torch.tensor([int(t.tensor_type)], dtype=torch.int32)
                continue  # a tied token_embd: the embedding reads the LM head's rows
            with _reading(gguf_path, f"reading tensor {t.name!r}"):
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            if not array.flags.writeable:  # F32 data is a view of the read-only memory map
                array = np.array(array)
            tensor = torch.from_numpy(array)
            if permuted:
                tensor = unpermute_rotary(tensor, heads)
            if arch.norm_offset and name.endswith("norm.weight"):
                tensor = tensor - arch.norm_offset  # float32, as transformers computes it
            tensors[name] = tensor.to(dtype).contiguous()
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

        marker = {
            "format": MARKER_FORMAT,
            "source": str(gguf_path.resolve()),
            "source_size": gguf_path.stat().st_size,
            "architecture": arch_name,
            "dtype": str(dtype).removeprefix("torch."),
            "num_tensors": len(tensors),
            "quantized": keep_quantized,
        }
        published = publish_staging_dir(staging, out_dir, marker)
    logger.info("Converted %s into %s (%d tensors, %s)", gguf_path, published, len(tensors), dtype)
    return published


def _is_quantized(reader, name: str) -> bool:
    return any(t.name == name and t.tensor_type.name not in FLOAT_TYPES for t in reader.tensors)


def _keeps_bytes(gguf_path: Path, tensor, quantized_head: bool) -> bool:
    """Whether a quantized conversion keeps this tensor's bytes: the 2-D weights of
    linears (and `token_embd` as a tied LM head) and the 3-D stacked experts in a quant
    type; a sparse block's router (`ffn_gate_inp`) is stored float. ValueError naming
    the tensor and its type for a linear weight in a type Ember does not run."""
    type_name = tensor.tensor_type.name
    dims = 3 if is_stacked_experts(tensor.name) else 2
    if type_name in FLOAT_TYPES or len(tensor.shape) != dims or is_router(tensor.name):
        return False
    if tensor.name == EMBEDDING:
        return quantized_head
    if type_name not in QUANT_TYPES:
        raise ValueError(
            f"GGUF file {str(gguf_path)!r}: tensor {tensor.name!r} has type {type_name}, which Ember does not run "
            f"quantized (supported: {', '.join(QUANT_TYPES)}); load it dequantized instead (EMBER_GGUF_NATIVE=0)"
        )
    return True


def check_gguf_header(gguf_path: Path) -> GGUFHeader:
    """The header of `gguf_path`; `InvalidCheckpointError` naming the file unless it starts
    with the GGUF magic and a supported version, and its tensor and metadata counts fit in
    its size (each entry takes some bytes, so absurd counts cannot)."""
    def invalid(problem: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"GGUF file {str(gguf_path)!r} {problem}")

    with open(gguf_path, "rb") as f:
        head = f.read(GGUF_HEADER_BYTES)
        size = f.seek(0, 2)
    if size == 0:
        raise invalid("is empty (0 bytes)")
    if head[:4] != GGUF_MAGIC:
        raise invalid(f"is not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
    if len(head) < GGUF_HEADER_BYTES:
        raise invalid(f"is truncated: it has {size} bytes, fewer than the {GGUF_HEADER_BYTES} of a GGUF header")
    (version,) = struct.unpack_from("<I", head, 4)
    order = ">" if version & 0xFFFF == 0 else "<"  # a big-endian file, as gguf.GGUFReader detects it
    version, num_tensors, num_kv = struct.unpack_from(f"{order}IQQ", head, 4)
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise invalid(f"has GGUF version {version}; supported: {', '.join(map(str, SUPPORTED_GGUF_VERSIONS))}")
    needed = GGUF_HEADER_BYTES + num_tensors * MIN_TENSOR_INFO_BYTES + num_kv * MIN_KV_BYTES
    if needed > size:
        raise invalid(
            f"declares {num_tensors} tensors and {num_kv} metadata entries, which cannot fit in its {size} bytes "
            f"(at least {needed} needed): it is truncated or damaged"
        )
    return GGUFHeader(version, num_tensors, num_kv)


@contextmanager
def _reading(gguf_path: Path, step: str) -> Iterator[None]:
    """Turn what the gguf reader (or transformers' GGUF parser) raises on a damaged file into
    `InvalidCheckpointError` naming the file and the step."""
    try:
        yield
    except (InvalidCheckpointError, UnsupportedArchitectureError):
        raise
    except GGUF_READ_ERRORS as exc:
        raise InvalidCheckpointError(
            f"GGUF file {str(gguf_path)!r} is damaged or truncated ({step}: {type(exc).__name__}: {exc})"
        ) from exc


def _read_string(gguf_path: Path, reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise InvalidCheckpointError(f"GGUF file {str(gguf_path)!r} has no {key!r} metadata")
    return str(field.contents())


def _read_int(reader, key: str) -> int:
    field = reader.fields.get(key)
    return int(field.contents()) if field is not None else 0


def _moe_config(reader, arch_name: str, arch: GGUFArchitecture, config, num_experts: int):
    """The sparse-MoE settings transformers' GGUF config mapping leaves out: Mixtral's
    whole config (a `llama` file with experts), an expert's width
    (`<arch>.expert_feed_forward_length`, Qwen3-MoE's moe_intermediate_size)."""
    from transformers import AutoConfig

    top_k = _read_int(reader, f"{arch_name}.expert_used_count")
    if not top_k:
        raise InvalidCheckpointError(f"GGUF metadata has {arch_name}.expert_count {num_experts} "
                                     f"but no {arch_name}.expert_used_count")
    if arch.hf_class == "MixtralForCausalLM":
        values = config.to_dict()
        for key in ("model_type", "architectures", "transformers_version", "mlp_bias", "attention_bias",
                    "pretraining_tp"):
            values.pop(key, None)
        config = AutoConfig.for_model("mixtral", **values)
        config.architectures = [arch.hf_class]
        config.num_local_experts = num_experts
    expert_width = _read_int(reader, f"{arch_name}.expert_feed_forward_length")
    if expert_width and arch.hf_class == "Qwen3MoeForCausalLM":
        config.moe_intermediate_size = expert_width
    config.num_experts_per_tok = top_k
    return config


def _build_config(gguf_path: Path, arch: GGUFArchitecture, *, dtype: torch.dtype, tie_word_embeddings: bool):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    values = dict(load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"])
    values.pop("_model_name_or_path", None)  # GGUF's free-text `general.name`, not a path
    model_type = values.pop("model_type")
    values["tie_word_embeddings"] = tie_word_embeddings
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = [arch.hf_class]
    config.dtype = dtype
    return config


def _save_generation_config(config, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
