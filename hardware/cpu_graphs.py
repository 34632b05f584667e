"""CPU graphs: a decode step's forward recorded as the native kernel calls it makes,
then replayed by one C call (``ember_replay`` in ``csrc/ember_cpu.c``).

Once the weights are read fast, a small decode batch on a CPU is mostly Python:
SmolLM2's forward makes about 330 native calls (per layer: norm, qkv, two ropes, the
KV write, attention, o_proj, norm, gate_up, silu, down), and each comes wrapped in
argument checks, tensor allocations, ctypes conversions and module calls that took
longer than many of the kernels themselves. A graph keeps the calls and drops the rest,
as a CUDA graph keeps a forward's kernel launches.

Capture (:func:`capture`, the CPU backend's ``graph_capture``) runs ``fn`` once,
eagerly, while

* this thread's native calls are recorded (``ember.hardware.cpu_kernels.NativeFunction``: each
  kernel's arguments, through its ``__packed`` twin), and
* every PyTorch op is watched (a ``TorchDispatchMode``): an allocation (``torch.empty``)
  or a view passes; anything else (a copy, an ``index_copy_``, a GEMM, an op that
  writes a tensor) refuses the graph with ``ember.plugin.backend.GraphCaptureRefused`` naming
  the op, since its work would be missing from the record. So would a native call
  without a recordable form. A refused batch size runs eagerly.

Then the plan. Every tensor allocated during the capture lives from its allocation to
the last recorded call that reads or writes it (the forward's output: to the end).
Those live ranges are packed first-fit into one arena, and every recorded pointer into
a capture-time tensor moves to its place in the arena (at the same offset within it):
a decode batch of 8 needs a few hundred KiB where the capture allocated megabytes.
Pointers to anything else (the static inputs and metadata the graph reads, weights, the
KV cache, rope tables) stay as recorded: those tensors outlive the graph (ember.worker.graphs
keeps the static ones; the model and runner own the rest). A replay runs the records in
order, so each buffer is reused only as the eager forward would have reused its memory,
and gives the eager forward's numbers bit for bit (the same kernels, arguments and
order; tests/test_cpu_graphs.py). A kernel's error code stops the replay and raises,
naming the kernel.
"""

from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ember.hardware import cpu_kernels
from ember.hardware.cpu_kernels import POINTER, NativeFunction, set_recorder
from ember.plugin.backend import GraphCaptureRefused

ALIGNMENT = 64  # bytes: each buffer's place in the arena (PyTorch's CPU allocations are 64-aligned too)
# the PyTorch ops that only allocate (their tensors' contents are what the kernels write)
_ALLOCATIONS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
})


@dataclass(slots=True)
class _Buffer:
    """A tensor's storage allocated while capturing, and where it lives."""

    base: int  # its address during the capture
    nbytes: int
    first_call: int  # index of the first call recorded after its allocation
    last_call: int = -1  # the last recorded call that points into it (-1: none)
    offset: int = -1  # its place in the arena
    storage: object = None  # held until planned: no two buffers share an address


@dataclass
class _Recorder:
    calls: list[tuple[NativeFunction, list[int]]] = field(default_factory=list)
    buffers: list[_Buffer] = field(default_factory=list)

    def record(self, function: NativeFunction, args) -> None:
        if function.packed is None:
            raise GraphCaptureRefused(f"the forward calls {function.name}, which a CPU graph cannot record")
        self.calls.append((function, function.pack(args)))

    def allocate(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            self.buffers.append(_Buffer(storage.data_ptr(), storage.nbytes(), len(self.calls), storage=storage))


class _OnlyViewsAndAllocations(TorchDispatchMode):
    """Lets a PyTorch op through only if it allocates (recorded) or returns views of
    its inputs; anything that computes would be missing from the graph."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ so that torch.compile
        # skips it, which imports torch._dynamo (and Triton, where installed: seconds,
        # and leak reports on stderr at exit) at the first op; nothing compiles here
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            raise GraphCaptureRefused(f"the forward runs {func} (it writes a tensor) outside the native kernels")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in _ALLOCATIONS:
            for tensor in outputs:
                self.recorder.allocate(tensor)
            return out
        inputs = {_storage_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if any(_storage_address(t) not in inputs - {None} for t in outputs):
            raise GraphCaptureRefused(f"the forward computes {func} outside the native kernels")
        return out


def _storage_address(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage lies; None for one without a storage (oneDNN's packed weights)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


class CPUGraph:
    """A recorded forward: ``graph()`` replays it and returns its output (a tensor in
    the arena, the same object every time, overwritten by the next replay)."""

    def __init__(self, replay: NativeFunction, records: torch.Tensor, names: list[str], arena: torch.Tensor,
                 output: torch.Tensor) -> None:
        self._replay = replay.function  # the ctypes function: nothing to record here
        self.records = records
        self.names = names
        self.arena = arena
        self.output = output
        self._failed = ctypes.c_int64(-1)
        self._args = (records.data_ptr(), len(names), ctypes.addressof(self._failed))

    @property
    def num_calls(self) -> int:
        return len(self.names)

    def __call__(self) -> torch.Tensor:
        rc = self._replay(*self._args)
        if rc:
            raise RuntimeError(f"CPU graph: {self.names[self._failed.value]} (call {self._failed.value} of "
                               f"{len(self.names)}) failed with code {rc}")
        return self.output


def capture(fn) -> CPUGraph:
    """Run ``fn`` (a forward over static tensors) once while recording it; its
    :class:`CPUGraph`. ``GraphCaptureRefused`` when the forward does work outside the
    recordable native kernels, or they are off."""
    kernels = cpu_kernels.load()
    if kernels is None:
        raise GraphCaptureRefused("the native CPU kernels are off")
    recorder = _Recorder()
    set_recorder(recorder)
    try:
        with _OnlyViewsAndAllocations(recorder):
            output = fn()
    finally:
        set_recorder(None)
    if not isinstance(output, torch.Tensor):
        raise GraphCaptureRefused(f"the forward returned {type(output).__name__}, not a tensor")
    return _plan(recorder, output, kernels.replay)


def _plan(recorder: _Recorder, output: torch.Tensor, replay: NativeFunction) -> CPUGraph:
    buffers = sorted(recorder.buffers, key=lambda b: b.base)
    bases = [b.base for b in buffers]

    def buffer_of(address: int) -> _Buffer | None:
        i = bisect.bisect_right(bases, address) - 1
        return buffers[i] if i >= 0 and address < buffers[i].base + buffers[i].nbytes else None

    moves: list[tuple[int, int, _Buffer, int]] = []  # (call, argument, buffer, byte offset in it)
    for index, (function, args) in enumerate(recorder.calls):
        for position, kind in enumerate(function.kinds):
            if kind == POINTER and args[position]:
                buffer = buffer_of(args[position])
                if buffer is not None:
                    buffer.last_call = index
                    moves.append((index, position, buffer, args[position] - buffer.base))
    out_buffer = buffer_of(output.data_ptr())
    if out_buffer is None:
        raise GraphCaptureRefused("the forward's output was not written by a recorded call")
    out_buffer.last_call = len(recorder.calls)
    size = _pack([b for b in recorder.buffers if b.last_call >= 0])
    arena = torch.empty(max(size, ALIGNMENT), dtype=torch.uint8)
    if arena.data_ptr() % ALIGNMENT:
        raise RuntimeError("the CPU graph's arena is not 64-byte aligned")
    base = arena.data_ptr()
    for index, position, buffer, delta in moves:
        recorder.calls[index][1][position] = base + buffer.offset + delta
    records: list[int] = []
    for function, args in recorder.calls:
        records += [function.packed, len(args), *args]
    element = output.element_size()
    start = out_buffer.offset + output.data_ptr() - out_buffer.base
    out = arena.view(-1)[: arena.numel() // element * element].view(output.dtype).as_strided(
        output.shape, output.stride(), start // element)
    for buffer in recorder.buffers:
        buffer.storage = None  # the capture's memory goes back; the arena replaces it
    return CPUGraph(replay, torch.tensor(records, dtype=torch.int64), [f.name for f, _ in recorder.calls], arena, out)


def _pack(buffers: list[_Buffer]) -> int:
    """Give each buffer an arena offset (first fit, ALIGNMENT apart) such that no two
    whose live ranges ``[first_call, last_call]`` meet share a byte; the arena's size."""
    active: list[_Buffer] = []  # by offset
    size = 0
    for buffer in sorted(buffers, key=lambda b: (b.first_call, b.base)):
        active = [b for b in active if b.last_call >= buffer.first_call]
        need = -(-buffer.nbytes // ALIGNMENT) * ALIGNMENT
        offset = 0
        for other in active:  # sorted by offset: the first gap that fits
            if offset + need <= other.offset:
                break
            offset = max(offset, other.offset + -(-other.nbytes // ALIGNMENT) * ALIGNMENT)
        buffer.offset = offset
        bisect.insort(active, buffer, key=lambda b: b.offset)
        size = max(size, offset + need)
    return size
