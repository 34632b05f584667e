"""Who this process is among the ranks of a parallel engine, and its process groups.

Ranks are laid out stage-major: global rank ``pp_rank * tp_size + tp_rank``. The
ranks of one pipeline stage form its tensor-parallel group (all-reduces of the
row-parallel layers, the vocabulary all-gather); the ranks with the same
``tp_rank`` across stages form a pipeline group (hidden states sent stage to
stage, logits broadcast from the last stage). A third group, the command group
(every rank, no timeout), carries the driver's scheduler output to the workers:
a worker waits in it for as long as the server is idle, whereas the compute groups
time out (``timeout_s``) so that a hung peer is an error, never a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# an idle server can leave its workers waiting for a step for this long
_COMMAND_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """The shape of a parallel engine: ``tensor_parallel_size * pipeline_parallel_size`` ranks."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True)
class ParallelContext:
    """This process's place: ranks, sizes and groups (``None`` groups in a test that
    builds a context by hand for one rank)."""

    rank: int
    tp_size: int
    pp_size: int
    tp_group: object = None
    pp_group: object = None
    command_group: object = None
    # global ranks of this rank's pipeline group, stage by stage
    pp_ranks: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """This stage's contiguous layers ``[start, end)``: as even as it divides, the
        first stages taking one more when it does not."""
        if num_layers < self.pp_size:
            raise ValueError(
                f"pipeline_parallel_size {self.pp_size} is more than the model's {num_layers} layers"
            )
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return start, start + base + (1 if self.pp_rank < extra else 0)


def torchrun_environment() -> dict[str, str] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT when this process was
    started by ``torchrun`` (or anything that sets them), else None."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(os.environ.get(n) for n in names):
        return None
    env = {n: os.environ[n] for n in names}
    env["LOCAL_RANK"] = os.environ.get("LOCAL_RANK", "0")
    return env


def init_parallel(
    backend: str, rank: int, config: ParallelConfig, master_addr: str, master_port: int, timeout_s: float,
) -> ParallelContext:
    """Join the process group (``backend``: the hardware backend's ``distributed_backend``)
    and create the tensor, pipeline and command groups. Every rank calls this with
    the same arguments but its rank; RuntimeError names what failed."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process: one parallel engine per process "
            "(close the previous LLM first)"
        )
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    timeout = datetime.timedelta(seconds=timeout_s)
    # under torchrun its agent already serves the rendezvous store on MASTER_PORT:
    # env:// joins it (TORCHELASTIC_USE_AGENT_STORE) where tcp:// would try to host it
    init_method = "env://" if torchrun_environment() is not None else f"tcp://{master_addr}:{master_port}"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.world_size,
                            timeout=timeout)
    ctx = ParallelContext(rank, tp, pp)
    # every rank creates every group, in the same order (torch.distributed's rule)
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            ctx.tp_group = group
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, config.world_size, tp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            ctx.pp_group, ctx.pp_ranks = group, ranks
    # host-side values (scheduler outputs, agreed sizes) travel over gloo whatever the
    # device's backend is, as vLLM's CPU group does
    ctx.command_group = dist.new_group(list(range(config.world_size)), timeout=_COMMAND_TIMEOUT, backend="gloo")
    return ctx


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_min(value: int, group=None) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())
