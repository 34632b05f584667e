"""The transformers fallback (``--model-impl transformers``): any decoder-only causal LM
that transformers implements, run through transformers' own modeling code with Ember's
paged attention plugged in through transformers' attention-interface registry.

How a step runs. The model runner's flat batch (every request's tokens, no padding) goes
into the transformers base model as one sequence of batch 1, with Ember's positions as
``position_ids`` (so the rotary embedding rotates each token by its own request's
position). The attention implementation is ``"ember_paged"`` (`ATTENTION_NAME`): for each
layer transformers hands `paged_attention_forward` the layer's q/k/v, ``(1, heads,
tokens, head_dim)``, after its own projections, norms and rotary embedding; it reshapes
them to Ember's ``(tokens, heads, head_dim)`` and calls the backend's
`BaseAttention.forward` with that layer's KV cache (``module.layer_idx``) and the step's
metadata. Those travel as one keyword argument (`PagedStep`) that transformers passes
from the base model's forward down to every attention call, so no state outlives the
call. No causal mask is built (a custom implementation gets none), and the KV cache,
continuous batching, prefix caching, chunked prefill and preemption are Ember's as for
a native model.

Logits come from the causal LM's own forward run on the hidden states (its base model
swapped for a pass-through), so whatever it does after its last norm (Granite's
``logits_scaling``, Cohere's ``logit_scale``, Gemma 2's soft-capping) is done as
transformers does it.

Not supported (a ValueError naming the architecture): classes transformers does not
have, classes that are not causal LMs (encoders, encoder-decoders, vision-language
models), classes without attention-interface support (``_supports_attention_backend``
false: their attention ignores a registered function), layers whose K and V differ in
head size or count from the config, and sliding windows or logit soft-capping on a
backend attention without them. Quantized checkpoints and tensor/pipeline parallelism are
refused by the loader and the engine config.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.models.base import BaseCausalLM, KVCacheSpec
from ember.plugin.backend import BaseAttention

logger = logging.getLogger(__name__)

#: the name of Ember's paged attention in transformers' attention-interface registry
ATTENTION_NAME = "ember_paged"
#: the keyword argument that carries a step's `PagedStep` through the transformers model
STEP_KWARG = "ember_step"


@dataclass(frozen=True, slots=True)
class PagedStep:
    """What every attention layer of one forward needs: the backend's attention, the
    per-layer KV caches and the step's metadata (``BaseAttention.prepare``)."""

    attention: BaseAttention
    kv_caches: list[torch.Tensor]
    metadata: Any
    num_kv_heads: int
    head_dim: int


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over Ember's paged attention:
    ``query`` ``(1, heads, tokens, head_dim)``, ``key``/``value`` ``(1, kv_heads, tokens,
    head_dim)`` -> ``((1, tokens, heads, head_dim), None)``. The mask is ignored: the
    backend's attention is causal within each request of the flat batch."""
    step: PagedStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention runs only inside Ember's TransformersCausalLM.forward "
                           f"({type(module).__name__} got no {STEP_KWARG!r} argument)")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx: the transformers fallback cannot tell which "
                         "layer's KV cache it reads")
    if query.shape[0] != 1:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention takes one flat sequence, got a batch of {query.shape[0]}")
    expected = (step.num_kv_heads, step.head_dim)
    for name, tensor in (("key", key), ("value", value)):
        if (tensor.shape[1], tensor.shape[3]) != expected:
            raise ValueError(
                f"{type(module).__name__} (layer {layer}) gives {name}s of {tensor.shape[1]} heads x "
                f"{tensor.shape[3]}, but the KV cache holds {expected[0]} heads x {expected[1]} (from the config): "
                "the transformers fallback supports one KV shape for every layer"
            )
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    extra = {}
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is not None:
        extra["window"] = int(window)
    if softcap is not None:
        extra["softcap"] = float(softcap)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.attention.forward(q, k, v, step.kv_caches[layer], step.metadata, scale, **extra)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Put `paged_attention_forward` into transformers' registry under `ATTENTION_NAME`
    (idempotent; called when a fallback model is built, never at import). No mask
    function is registered: transformers then builds no mask for it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS.get(ATTENTION_NAME) is not paged_attention_forward:
        ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, paged_attention_forward)


def _architecture_names(hf_config) -> list[str]:
    return list(getattr(hf_config, "architectures", None) or [])


def transformers_class(hf_config) -> type:
    """The transformers causal-LM class the config names (its ``architectures``, else the
    one transformers maps its model type to); ValueError naming the architecture when
    transformers has none, it is not a decoder-only causal LM, or its attention does not
    go through the attention interface."""
    import transformers
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = _architecture_names(hf_config)
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if not names:
        mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
        if mapped is None:
            raise ValueError(f"config.json names no architecture and transformers {transformers.__version__} has no "
                             f"causal LM for model type {getattr(hf_config, 'model_type', None)!r}")
        names = [mapped]
    name = names[0]
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(f"model architecture {name!r} is unknown to transformers {transformers.__version__}: "
                         "the transformers fallback cannot run it")
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"model architecture {name!r} is an encoder-decoder model; Ember runs decoder-only causal "
                         "LMs only")
    if name not in causal_names:
        raise ValueError(f"model architecture {name!r} is not a causal language model (transformers lists it under "
                         "no AutoModelForCausalLM entry): Ember runs decoder-only causal LMs only")
    if not cls.is_backend_compatible():
        raise ValueError(
            f"model architecture {name!r} does not support transformers' attention interface "
            "(_supports_attention_backend is false): the transformers fallback cannot plug Ember's paged "
            "attention into it"
        )
    return cls


class _PassThroughModel(nn.Module):
    """Stands in for the base model inside the logits head: returns its input embeddings
    as the last hidden state, so the causal LM's forward computes logits from them."""

    def forward(self, inputs_embeds: torch.Tensor | None = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


class TransformersCausalLM(BaseCausalLM):
    """A transformers causal LM behind Ember's model contract (``BaseCausalLM``).

    Built from the config with transformers' weight initialisation skipped, in the
    compute dtype on ``device`` (the meta device for sizing): the weights are converted
    to the compute dtype at load, so a bf16 checkpoint on a CPU without bf16 arithmetic
    takes float32 memory here (a native model keeps bf16 weights)."""

    supports_parallel = False

    def __init__(
        self,
        hf_config,
        attention: BaseAttention,
        compute_dtype: torch.dtype,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        parallel=None,
    ) -> None:
        super().__init__()
        if parallel is not None:
            raise ValueError("the transformers fallback (--model-impl transformers) does not support tensor or "
                             "pipeline parallelism")
        import transformers.initialization as hf_init

        cls = transformers_class(hf_config)
        self.architecture = cls.__name__
        register_attention()
        config = copy.deepcopy(hf_config)
        with torch.device(device or "cpu"), hf_init.no_init_weights():
            self.hf_model = cls._from_config(config, dtype=compute_dtype, attn_implementation=ATTENTION_NAME)
            self.hf_model.tie_weights()  # part of the initialisation skipped above
        self.hf_model.eval()
        self.config = self.hf_model.config
        self.compute_dtype = compute_dtype
        self.attention = attention
        prefix = self.hf_model.base_model_prefix
        base = getattr(self.hf_model, prefix, None) if prefix else None
        if not isinstance(base, nn.Module):
            raise ValueError(f"{self.architecture} has no base model at {prefix!r}: the transformers fallback cannot "
                             "separate its hidden states from its logits")
        self.base_model_name = prefix
        # the causal LM with a pass-through in place of its base model (shares every other
        # submodule, lm_head included; kept out of this module's registered children)
        head = copy.copy(self.hf_model)
        head._modules = dict(self.hf_model._modules)
        head._modules[prefix] = _PassThroughModel()
        self.__dict__["_logits_head"] = head
        self._check_attention_features(attention)
        text = self.config.get_text_config()
        heads = int(text.num_attention_heads)
        self._spec = KVCacheSpec(
            int(text.num_hidden_layers),
            int(getattr(text, "num_key_value_heads", None) or heads),
            int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        )

    def _check_attention_features(self, attention: BaseAttention) -> None:
        text = self.config.get_text_config()
        windows = {getattr(m, "sliding_window", None) for m in self.hf_model.modules() if hasattr(m, "layer_idx")}
        needs = []
        if any(w is not None for w in windows) and not getattr(attention, "supports_sliding_window", False):
            needs.append("sliding-window attention")
        if getattr(text, "attn_logit_softcapping", None) is not None and not getattr(attention, "supports_softcap",
                                                                                    False):
            needs.append("attention logit soft-capping")
        if needs:
            raise ValueError(f"{self.architecture} needs {' and '.join(needs)}, which the attention "
                             f"{attention.name!r} ({type(attention).__name__}) does not support; choose another backend")

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._spec

    def forward(self, input_ids, positions, kv_caches, attn_metadata: Any) -> torch.Tensor:
        spec = self._spec
        step = PagedStep(self.attention, kv_caches, attn_metadata, spec.num_kv_heads, spec.head_dim)
        base = self.hf_model._modules[self.base_model_name]
        out = base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, **{STEP_KWARG: step})
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.__dict__["_logits_head"](inputs_embeds=hidden_states[None], use_cache=False)
        return out.logits[0].float()

    def linear_parts(self):
        raise NotImplementedError(f"the transformers fallback ({self.architecture}) does not support quantized weights")

    # -- weights ------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint names as transformers loads them (its renamings of older names, the
        base model's prefix added or stripped); a tied weight's second copy is skipped.
        ValueError naming any unexpected, misshapen or missing tensor, or one that needs
        transformers' weight conversions (merging several tensors into one)."""
        from transformers.core_model_loading import WeightRenaming, rename_source_key
        from transformers.conversion_mapping import get_model_conversion_mapping

        model = self.hf_model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        # every name of every parameter (tied ones share a tensor under several names)
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(dict(model.named_buffers(remove_duplicate=False)))
        ignored = [str(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        loaded: set[int] = set()
        for name, tensor in weights:
            target, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, targets)
            if converted is not None:
                raise ValueError(f"checkpoint tensor {name!r} needs transformers' weight conversion ({converted!r}), "
                                 f"which the transformers fallback does not do for {self.architecture}")
            param = targets.get(target)
            if param is None:
                if target.endswith("rotary_emb.inv_freq") or any(_matches(p, target) for p in ignored):
                    continue
                raise ValueError(f"unexpected tensor {name!r} in checkpoint for {self.architecture}")
            if param.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, {self.architecture} expects "
                                 f"{tuple(param.shape)}")
            if id(param) in loaded:
                continue  # a tied weight stored twice
            param.data.copy_(tensor)
            loaded.add(id(param))
        missing = sorted(n for n, p in model.named_parameters() if id(p) not in loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) of {self.architecture}: {shown}")


def _matches(pattern: str, name: str) -> bool:
    return re.search(pattern, name) is not None
