"""The ``gguf`` quantizer: GGUF quant types (llama.cpp's) kept quantized.

A GGUF file is converted into a directory whose linear weights keep their GGUF bytes
(``ember.weights.gguf_loader``, ``keep_quantized=True``): ``<linear>.weight`` as uint8
``(out_features, row bytes)`` and ``<linear>.gguf_type`` holding ggml's type id, with
``quantization_config = {"quant_method": "gguf", "types": [...]}`` in config.json.
This quantizer reads that directory: each such linear becomes a :class:`GGUFWeight`
(format ``"gguf"``), which the CPU backend multiplies natively
(``ember.hardware.cpu_quant``). With ``"embedding": "lm_head"`` (a tied LM head kept
quantized) the token embedding reads its rows from the LM head's weight. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K with integer kernels; Q2_K and Q3_K dequantized per product.

One format for every type: the parts of a fused linear may differ in type (llama.cpp's
Q4_K_M files keep some ``attn_v`` in Q6_K beside Q4_K ``attn_q``/``attn_k``), so a
joined weight is a list of segments, each of one type, multiplied one after another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ember.plugin import hookimpl
from ember.plugin.quantizer import BaseQuantizer, QuantizedWeight, check_parts
from ember.weights.gguf_loader import EMBEDDING_SOURCE, QUANT_METHOD, TYPE_SUFFIX
from ember.weights.gguf_quants import QUANT_TYPES, quant_type

FORMAT = "gguf"
_TYPE_NAMES = {t.type_id: t.name for t in QUANT_TYPES.values()}


class GGUFWeight(QuantizedWeight):
    """Rows of GGUF blocks: ``segments`` is ``[(type name, uint8 (rows, row bytes))]``
    stacked along the output dimension; ``dequantize`` is ``gguf.quants.dequantize``'s
    numbers, bit for bit."""

    format = FORMAT

    def __init__(self, segments: Sequence[tuple[str, torch.Tensor]], in_features: int) -> None:
        if not segments:
            raise ValueError("a GGUF weight needs at least one segment")
        checked = []
        for type_name, data in segments:
            row_bytes = quant_type(type_name).row_bytes(in_features)
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes:
                raise ValueError(
                    f"{type_name} rows of {in_features} values are uint8 (rows, {row_bytes}), "
                    f"got {data.dtype} {tuple(data.shape)}"
                )
            checked.append((quant_type(type_name).name, data.contiguous()))
        super().__init__((sum(d.shape[0] for _, d in checked), in_features))
        self.segments = checked

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.segments)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{t.lower()}_{i}": d for i, (t, d) in enumerate(self.segments)}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([quant_type(t).dequantize(d) for t, d in self.segments]).to(dtype)

    @classmethod
    def concat(cls, parts: Sequence[QuantizedWeight]) -> GGUFWeight | None:
        if not all(isinstance(p, GGUFWeight) for p in parts):
            return None
        _, in_features = check_parts(parts)
        segments: list[tuple[str, torch.Tensor]] = []
        for part in parts:
            for type_name, data in part.segments:
                if segments and segments[-1][0] == type_name:  # one kernel call for same-type neighbours
                    segments[-1] = (type_name, torch.cat((segments[-1][1], data)))
                else:
                    segments.append((type_name, data))
        return cls(segments, in_features)

    def __repr__(self) -> str:
        return f"GGUFWeight(types={'+'.join(self.types)}, shape={self.shape}, nbytes={self.nbytes})"


class GGUFQuantizer(BaseQuantizer):
    """Reads the quantized conversion of a GGUF file (``quant_method`` ``"gguf"``)."""

    name = "gguf"
    quant_methods = (QUANT_METHOD,)
    tensor_suffixes = ("weight", TYPE_SUFFIX)
    required_suffixes = ("weight", TYPE_SUFFIX)

    def __init__(self, quantization_config: Mapping | None = None) -> None:
        super().__init__(quantization_config)
        if not quantization_config:
            raise ValueError(
                "--quantize gguf reads GGUF files (pass a .gguf file, or the default model); "
                "to quantize a float checkpoint at load use int8 or int4"
            )
        types = self.quantization_config.get("types", [])
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"quantization_config 'types' must be a list of GGUF type names, got {types!r}")
        for type_name in types:
            quant_type(type_name)  # an unsupported one is named
        self.types = tuple(types)
        embedding = self.quantization_config.get("embedding")
        if embedding not in (None, EMBEDDING_SOURCE):
            raise ValueError(f"quantization_config 'embedding' must be {EMBEDDING_SOURCE!r} (a tied LM head's rows) "
                             f"or absent, got {embedding!r}")
        self.embedding = embedding

    def embedding_source(self) -> str | None:
        return self.embedding

    def weight_formats(self) -> tuple[str, ...]:
        return (FORMAT,)

    def create_weight(self, prefix: str, tensors: Mapping[str, torch.Tensor], dtype=None) -> GGUFWeight | None:
        weight = tensors.get("weight")
        if TYPE_SUFFIX not in tensors:
            return None  # a float linear of the GGUF (F32/F16/BF16): loaded as float
        if weight is None:
            raise ValueError(f"{prefix}.{TYPE_SUFFIX} has no {prefix}.weight beside it")
        type_id = tensors[TYPE_SUFFIX]
        if type_id.numel() != 1 or int(type_id.item()) not in _TYPE_NAMES:
            raise ValueError(f"{prefix}.{TYPE_SUFFIX} holds {type_id.tolist()}, not the ggml id of a supported type "
                             f"({', '.join(f'{n} = {i}' for i, n in _TYPE_NAMES.items())})")
        type_name = _TYPE_NAMES[int(type_id.item())]
        qtype = quant_type(type_name)
        if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] % qtype.type_size:
            raise ValueError(f"{prefix}.weight: {type_name} bytes must be uint8 (out_features, whole blocks of "
                             f"{qtype.type_size} bytes), got {weight.dtype} {tuple(weight.shape)}")
        in_features = weight.shape[1] // qtype.type_size * qtype.block_size
        # a copy: the packed bytes must not keep the checkpoint's file mapping alive
        return GGUFWeight([(type_name, weight.clone())], in_features)

    def describe(self) -> str:
        return f"gguf ({', '.join(self.types) or 'no quantized tensors'})"


@hookimpl
def ember_register_quantizers(registry) -> None:
    registry.register(GGUFQuantizer.name, GGUFQuantizer)
