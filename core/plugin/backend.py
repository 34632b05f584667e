"""The hardware backend contract. Each device kind (cpu, cuda, rocm, xpu, gaudi) is one
subclass, registered by a plugin; core never names a vendor.

Tensor layout shared by every backend:

* ``q``: ``(num_tokens, num_heads, head_dim)``; ``k``, ``v``:
  ``(num_tokens, num_kv_heads, head_dim)`` — one flat batch, no padding across
  requests, tokens of a request contiguous and in position order.
* ``kv_cache`` (one per layer): ``(2, num_blocks, block_size, num_kv_heads, head_dim)``;
  index 0 holds keys, 1 values. The token at position ``p`` of a request lives at
  block ``block_table[p // block_size]``, offset ``p % block_size``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ember.plugin.backend_options import BackendOptions, OptionInfo, option  # noqa: F401  (part of this contract)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One request's part of a flat batch, in plain Python (tests, hand-built batches)."""

    num_query_tokens: int  # tokens of this request in the batch
    start_position: int  # position of its first query token (= tokens already cached)
    block_table: list[int]

    @property
    def context_len(self) -> int:
        return self.start_position + self.num_query_tokens


@dataclass(slots=True)
class AttentionBatch:
    """One step's flat batch as attention sees it, built by the model runner from its
    persistent batch without touching each request's history.

    Request ``i`` has ``query_lens[i]`` query tokens at positions
    ``start_positions[i] ...`` (``start_positions[i]`` tokens are already cached),
    flat rows ``query_start_loc[i] ... query_start_loc[i + 1]``, and ``seq_lens[i]``
    tokens of context in all.
    Row ``i`` of ``block_table`` holds its block ids; entries past its last block are
    valid block ids or 0, never read. ``slot_mapping[t]`` is the flat cache slot
    (``block * block_size + offset``) of flat token ``t``.
    """

    query_lens: list[int]
    start_positions: list[int]
    block_table: torch.Tensor  # (num_requests, max_blocks) int64, on the device
    slot_mapping: torch.Tensor  # (num_tokens,) int64, on the device
    block_size: int
    seq_lens: torch.Tensor  # (num_requests,) int64 context lengths (cached + new), on the device
    query_start_loc: torch.Tensor  # (num_requests + 1,) int64 flat index of each request's first token
    # per request, the position spans ``(start, end)`` whose tokens attend to each other both
    # ways (an image's tokens in Gemma 3; plugin API 1.6); None: every request is causal. A
    # span a request's queries touch lies wholly in its context (cached + this step's).
    bidirectional_spans: list[tuple[tuple[int, int], ...]] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def context_len(self, i: int) -> int:
        return self.start_positions[i] + self.query_lens[i]

    def context_slots(self, i: int) -> torch.Tensor:
        """Flat cache slots of request ``i``'s whole context (cached and new), in order."""
        positions = torch.arange(self.context_len(i), device=self.device)
        return self.block_table[i, positions // self.block_size] * self.block_size + positions % self.block_size

    @classmethod
    def from_slices(cls, slices: list[SequenceSlice], block_size: int, device: torch.device) -> AttentionBatch:
        """Build a batch from plain Python slices (tests and third-party harnesses)."""
        width = max([len(s.block_table) for s in slices] + [1])
        table = torch.zeros(len(slices), width, dtype=torch.int64)
        slots: list[int] = []
        for i, s in enumerate(slices):
            table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
            t = s.block_table
            slots.extend(t[p // block_size] * block_size + p % block_size for p in range(s.start_position, s.context_len))
        starts = [0]
        for s in slices:
            starts.append(starts[-1] + s.num_query_tokens)
        return cls(
            [s.num_query_tokens for s in slices], [s.start_position for s in slices], table.to(device),
            torch.tensor(slots, dtype=torch.int64, device=device), block_size,
            torch.tensor([s.context_len for s in slices], dtype=torch.int64, device=device),
            torch.tensor(starts, dtype=torch.int64, device=device),
        )


class BaseAttention(ABC):
    """Paged attention for one step. Built once per step, used by every layer."""

    #: what logs and errors call it
    name: ClassVar[str] = "paged"
    #: tokens per KV block when the user gives no block size
    default_block_size: ClassVar[int] = 16
    #: the KV block sizes it runs are multiples of this (flash-attn's paged KV: 256)
    block_size_multiple: ClassVar[int] = 1

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> Any:
        """Build the backend's metadata for one flat batch (gather indices, masks,
        kernel arguments) from ``batch``. Called once per step; the result is passed
        to `forward` of every layer unchanged. Work here should be O(requests), not
        O(context): a decode step must not walk each request's history."""

    #: whether `forward` honours ``window`` (sliding-window layers: Mistral, Gemma 2/3)
    supports_sliding_window: ClassVar[bool] = False
    #: whether `forward` honours ``softcap`` (attention logit soft-capping: Gemma 2)
    supports_softcap: ClassVar[bool] = False
    #: whether `prepare`/`forward` honour ``AttentionBatch.bidirectional_spans`` (Gemma 3's images)
    supports_bidirectional_spans: ClassVar[bool] = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's ``k``/``v`` into ``kv_cache`` at each token's slot, then
        return causal attention of every query over its own request's context
        (cached tokens plus this step's), shape ``(num_tokens, num_heads, head_dim)``,
        dtype of ``q``. Must not read or write slots of other requests.

        ``window`` (only passed when ``supports_sliding_window``; plugin API 1.1): the
        query at position ``p`` attends only to keys at positions ``p - window < j <= p``
        (transformers' ``sliding_window``; flash-attn's ``window_size=(window - 1, 0)``).
        ``softcap`` (only passed when ``supports_softcap``): every score ``s`` (already
        multiplied by ``scale``) becomes ``softcap * tanh(s / softcap)`` before the mask
        and the softmax. Bidirectional spans (``AttentionBatch.bidirectional_spans``, only
        when ``supports_bidirectional_spans``; plugin API 1.6): a query inside a span also
        attends to the span's later keys (with a window: a later key is always within it).
        A model that needs any of these on an attention without it is refused at load,
        naming the attention and the model (`require_attention_features`)."""

    #: whether ``graph_metadata`` / ``fill_graph_metadata`` are implemented (decode
    #: steps can then be captured in device graphs, ``ember.worker.graphs``)
    supports_graphs: ClassVar[bool] = False

    def graph_metadata(self, batch_size: int, max_blocks: int, block_size: int, device: torch.device) -> Any:
        """Metadata for a decode-only step of exactly ``batch_size`` requests (one
        query token each, at most ``max_blocks`` blocks of ``block_size`` tokens of
        context) held in static tensors: the same objects on every step, so
        that a captured forward reads each step's values. Until filled, every row
        writes nothing (slot -1) and reads only valid cache slots."""
        raise NotImplementedError(f"{type(self).__name__} does not support device graphs")

    def fill_graph_metadata(self, metadata: Any, batch: AttentionBatch) -> None:
        """Write the decode-only ``batch`` (``n <= batch_size`` requests, at most
        ``max_blocks`` blocks each) into ``metadata`` from `graph_metadata`, in place;
        rows ``n ..`` become padding: their slot -1, their reads valid cache slots."""
        raise NotImplementedError(f"{type(self).__name__} does not support device graphs")


def require_attention_features(attention: BaseAttention, model: str, *, window: bool = False,
                               softcap: bool = False, bidirectional: bool = False) -> None:
    """ValueError naming ``attention`` and ``model`` unless the attention honours what the
    model's layers need (sliding windows, logit soft-capping): run without them, such a
    model's answers would be silently wrong past the window or wherever a score is large."""
    missing = [what for what, needed, has in (
        ("sliding-window attention", window, attention.supports_sliding_window),
        ("attention logit soft-capping", softcap, attention.supports_softcap),
        ("bidirectional attention within an image", bidirectional, attention.supports_bidirectional_spans),
    ) if needed and not has]
    if missing:
        raise ValueError(f"{model} needs {' and '.join(missing)}, which the attention {attention.name!r} "
                         f"({type(attention).__name__}) does not support; choose another backend")


class BaseBackend(ABC):
    """A device kind. Subclasses are registered through the `ember_register_backends` hook.

    Invariants: construction is cheap and touches no device; `is_available` never
    raises; a backend that is not available is never constructed by the engine.

    Options: a backend with tuning knobs sets ``options_class`` to its `BackendOptions`
    subclass and reads ``self.options``; `select_backend` builds them from the user's
    strings and passes them to the constructor (``cls(options)``). ``cls()`` is the
    defaults. A backend without knobs keeps the empty base and is constructed ``cls()``.
    """

    name: ClassVar[str]
    #: its options' dataclass (`BackendOptions`: fields with defaults and docs)
    options_class: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions | Mapping[str, Any] | None = None) -> None:
        self._options = self.parse_options(options)

    @property
    def options(self) -> BackendOptions:
        """This instance's options (``options_class``; the defaults where none were given)."""
        options = self.__dict__.get("_options")
        if options is None:  # a subclass whose __init__ did not call ours
            options = self._options = self.options_class()
        return options

    @classmethod
    def parse_options(cls, values: BackendOptions | Mapping[str, Any] | None) -> BackendOptions:
        """``options_class`` from ``{name: text}`` (or an instance of it, kept);
        ValueError naming this backend, the key, the value and what is allowed."""
        if isinstance(values, BackendOptions):
            if not isinstance(values, cls.options_class):
                raise TypeError(f"the {cls.name} backend takes {cls.options_class.__name__}, "
                                f"got {type(values).__name__}")
            return values
        return cls.options_class.parse(values, getattr(cls, "name", cls.__name__))
    #: Higher wins when the user does not name a backend and several are available.
    priority: ClassVar[int] = 0
    #: Tokens one engine step computes when chunked prefill is on and the user gave
    #: no budget: smaller bounds the gap a long prompt puts between other requests'
    #: tokens, larger computes prompts in fewer, more efficient steps.
    default_step_tokens: ClassVar[int] = 2048
    #: The budget of a step in which no request decodes (prompts only; nobody waits
    #: between steps), when the user gave no budget; None: ``default_step_tokens``.
    #: ``prefill_step_tokens`` may choose it per model.
    default_prefill_step_tokens: ClassVar[int | None] = None
    #: The ``torch.distributed`` backend its ranks communicate over when the model is
    #: split across processes (``ember.parallel``): "gloo" (host memory), "nccl"
    #: (NVIDIA, and AMD, where PyTorch's RCCL build keeps the name), "xccl" (Intel),
    #: "hccl" (Gaudi).
    distributed_backend: ClassVar[str] = "gloo"

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this machine has the device (and its vendor library)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this machine cannot run the backend (a missing vendor library, no
        device visible, ...), or None when it can: ``ember plugins`` shows it, and
        asking for the backend by name fails with it. Never raises. Default: a
        generic reason whenever ``is_available()`` is False."""
        return None if cls.is_available() else "not available on this machine"

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The torch device weights, activations and the KV cache live on."""

    @property
    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Model dtypes this backend runs."""

    @abstractmethod
    def resolve_dtype(self, requested: str, model_dtype: torch.dtype | None) -> torch.dtype:
        """Turn a user's dtype string (``"auto"``, ``"float32"``, ``"bfloat16"``, ...)
        into a supported dtype; raise ValueError naming an unsupported one."""

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype matrix multiplies run in for weights stored in ``dtype``. The
        default is ``dtype`` itself; a backend whose hardware lacks fast kernels for
        a storage dtype may upcast (and must document it)."""
        return dtype

    def linear_op(self) -> Callable[..., torch.Tensor]:
        """``op(x, weight, bias=None) -> x @ weight.T + bias``, as ``F.linear``: the
        matrix product every ``Linear`` layer runs (default ``F.linear``). A backend
        may return a faster kernel for its device; it must agree with ``F.linear``
        to float rounding (the conformance check compares them)."""
        return F.linear

    # whether ``lora_op`` may run inside this backend's graphs (``graph_capture``): it then
    # reads each step's token slots from a buffer the engine keeps in place (CPU graphs
    # record the native kernel); False: steps with adapter tokens run eagerly
    lora_op_in_graphs: ClassVar[bool] = False

    def lora_op(self) -> Callable[..., None] | None:
        """A batched LoRA product for the adapter slots of one step, or None (the
        default: PyTorch's matrix products per run of tokens of one adapter,
        ``ember.models.lora``). ``op(y, x, a, bt, token_slots, rank, slot_ranks)`` adds in
        place, for every token ``t`` whose ``s = token_slots[t]`` is not -1::

            y[t] += (x[t] @ a[s * rank : (s + 1) * rank].T) @ bt[s * rank : (s + 1) * rank]

        ``y`` (T, out) and ``x`` (T, in) in the compute dtype (row-strided views allowed),
        ``a`` (slots * rank, in) and ``bt`` (slots * rank, out) in the compute dtype (the
        scale is folded into ``bt``), ``token_slots`` (T,) int64 on the device,
        ``slot_ranks`` (slots,) int64: the rows of each slot in use (the rest are zero; an
        op may skip them). It must agree with those products to float rounding (Punica's
        BGMV, vLLM's LoRA shrink/expand kernels)."""
        return None

    def quantized_linear_op(self, format: str, compute_dtype: torch.dtype):
        """The op (``ember.plugin.quantizer.QuantizedLinearOp``) that multiplies by weights of
        ``format`` (``QuantizedWeight.format``: ``"int8"``, ``"int4"``, ``"gguf_q4_1"``, ...)
        for activations in ``compute_dtype``, or None where this backend has no kernel for
        it (the weights are then refused, or dequantized at load when the user asks).
        Default: None for every format."""

    def quantized_formats(self, compute_dtype: torch.dtype) -> tuple[str, ...]:
        """The formats ``quantized_linear_op`` runs for ``compute_dtype`` (listed in
        errors and ``ember plugins``). Default: none."""
        return ()

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        """Called once after the weights are loaded and ``model.linear_op`` is set,
        with the dtype the model was loaded in. A backend may keep device-specific
        copies or layouts of the matmul weights (``model.matmul_weights()``) and
        install an op that uses them (``model.set_linear_op``); the results must
        agree with ``linear_op`` to float rounding. Default: nothing."""

    def configure_threads(self, num_threads: int | None) -> int:
        """Set the host threads this backend computes with before the model loads:
        ``num_threads`` when given, else the backend's choice. Returns the number in
        use. The default sets PyTorch's intra-op threads only when asked."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        return torch.get_num_threads()

    def layer_ops(self, compute_dtype: torch.dtype) -> dict[str, Callable]:
        """Fused kernels for layers that would otherwise run several PyTorch ops, by
        the ``op_name`` of :class:`ember.models.layers.FusableOp` subclasses
        (``rms_norm``, ``rope_``, ``silu_mul``), for a model computing in
        ``compute_dtype``. Each must agree with the layer's PyTorch code to float
        rounding. Default: none."""
        return {}

    def greedy_op(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """A fused greedy step, ``op(logits) -> (ids, logprobs)`` for float32 logits
        ``(rows, vocab)`` on the host: each row's first argmax (int64) and its
        log-softmax (float32), as ``argmax`` and ``logit - logsumexp`` give them.
        The op may reuse its output tensors on the next call (the sampler reads them
        at once). None (the default) leaves it to PyTorch."""
        return None

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype weights are kept in on the device for a model loaded in ``dtype``.
        They are always rounded to ``dtype`` first, so the numbers are the model's;
        the default keeps them there. A backend whose compute dtype differs may keep
        them in the compute dtype instead, when converting them on every forward
        costs more than the memory it saves."""
        return dtype

    def prefill_step_tokens(self, hf_config, compute_dtype: torch.dtype) -> int | None:
        """The budget of a prompts-only step for this model (its Hugging Face config)
        computed in ``compute_dtype``, when the user gave none; the default:
        ``default_prefill_step_tokens``."""
        return self.default_prefill_step_tokens

    def kv_cache_dtype(self, dtype: torch.dtype, requested: str = "auto", quantized: bool = False) -> torch.dtype:
        """The dtype the KV cache is stored in for a model loaded in ``dtype``:
        ``requested`` (``EngineConfig.kv_cache_dtype``: ``auto`` or a dtype's name) and
        whether the model's weights are ``quantized`` may inform the choice. The
        default: ``dtype``, and ValueError naming the request for any other."""
        if requested not in ("auto", str(dtype).removeprefix("torch.")):
            raise ValueError(f"kv_cache_dtype {requested!r}: the {self.name} backend stores the KV cache in the "
                             f"model's dtype ({str(dtype).removeprefix('torch.')}) only")
        return dtype

    @abstractmethod
    def kv_cache_memory_bytes(self, model_bytes: int, activation_bytes: int = 0) -> int:
        """Memory budget for the KV cache when the user gave none: what the device
        has left after the loaded weights (``model_bytes``) and the peak a profiling
        forward pass at the largest step added (``activation_bytes``, 0 if unknown)."""

    def peak_memory_of(self, run: Callable[[], None]) -> int | None:
        """Run ``run()`` (the engine's profiling forward pass at the largest step) and
        return how many bytes the device's memory peak rose above its level before;
        None (the default) where the backend cannot measure it."""
        run()
        return None

    @abstractmethod
    def create_attention(self) -> BaseAttention:
        """The paged attention implementation for this device."""

    def graph_capture(self) -> Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]] | None:
        """Device graphs for decode steps (``ember.worker.graphs``): a callable that captures
        ``fn`` (a forward pass over static tensors, run once or more while capturing)
        and returns ``replay() -> the captured output``, refreshed by each replay, or
        raises ``ember.plugin.backend.GraphCaptureRefused`` for a forward its graphs cannot
        hold (that batch size runs eagerly). None (the default): the device has no
        graphs and every step runs eagerly."""
        return None

    #: the decode batch sizes captured when the user names none (``--cuda-graphs``,
    #: ``EngineConfig.graph_sizes``); None: ``ember.worker.graphs.default_graph_sizes``
    graph_batch_sizes: ClassVar[tuple[int, ...] | None] = None

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def describe(self) -> str:
        return f"{self.name} ({self.device})"


class GraphCaptureRefused(Exception):
    """A backend's capture cannot record this forward (the message says what in it);
    the batch size is left to eager steps."""


def eager_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A capture for a device without graphs: each replay runs ``fn`` again. It keeps
    the graph path's static tensors and padding, so a machine without a GPU checks
    them (``ember backends check NAME --interpret``); it saves no launch."""
    fn()
    return fn


def select_backend(
    registry, name: str | None, options: Mapping[str, Any] | None = None, *, device_index: int | None = None,
) -> BaseBackend:
    """An instance of the backend ``name`` from the ``backends`` registry, or (None) of
    the available one with the highest priority, built with ``options`` (``{name:
    text}``, `BaseBackend.parse_options`); ValueError / RuntimeError say why not.
    ``device_index``: this process's device on its machine (a parallel rank's local
    rank), set as the ``device_index`` option of a backend that has one. Each option
    given a value other than its default is logged once, here."""
    if name is not None:
        cls = registry.get(name)
        if not cls.is_available():
            raise ValueError(f"backend {name!r} is not available on this machine: {cls.unavailable_reason()}")
    else:
        available = [cls for _, cls in registry.items() if cls.is_available()]
        if not available:
            raise RuntimeError(f"no hardware backend is available; registered: {registry.names()}")
        cls = max(available, key=lambda c: c.priority)
    return create_backend(cls, options, device_index=device_index)


def create_backend(cls: type[BaseBackend], options: Mapping[str, Any] | None = None, *,
                   device_index: int | None = None) -> BaseBackend:
    """``cls`` built with its options parsed from ``options``; a backend whose
    ``options_class`` is the empty base is built ``cls()`` (third-party backends
    written before options). Logs each non-default option once (INFO)."""
    values = dict(options or {})
    if device_index is not None and "device_index" in cls.options_class.field_types():
        values["device_index"] = device_index
    parsed = cls.parse_options(values)
    backend = cls() if cls.options_class is BackendOptions else cls(parsed)
    for key, value in parsed.non_default().items():
        logger.info("%s backend: option %s=%s", cls.name, key, value)
    return backend
