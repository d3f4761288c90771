"""The tensor-parallel group a model is built for, and the collectives its layers call.

A model shard captures its group when it is built (``building(group)`` around the
constructor, as ``torch.set_default_dtype`` is used for the dtype), so two engines in one
process (a tensor-parallel one beside a single-device one, as the tests run them) never read
each other's group: there is no process-wide "current rank" at forward time.

The collectives go through torch.distributed (gloo on the CPU, NCCL on GPUs) on the default
process group, which the executor initialises once per engine with an init method on a free
port. The group also counts the time spent in collectives (``comm_seconds``), which the
tensor-parallel benchmark reports separately from the step time.
"""
from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import torch


class TensorParallelGroup:
    """``rank`` of ``world_size`` ranks. Invariant: ``world_size == 1`` never communicates
    (every collective returns its input), so a single-device model runs the code it always
    ran."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.comm_seconds = 0.0
        self.num_collectives = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(tensor)
        self._count(start)
        return tensor

    def all_reduce_min(self, value: int) -> int:
        """The minimum of an integer over the ranks (the KV cache sizing)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` [rows, n] along the last dimension on rank 0
        ([rows, world_size * n]); the other ranks get an empty [rows, 0] tensor."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        start = time.perf_counter()
        tensor = tensor.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.gather(tensor, parts, dst=0)
            result = torch.cat(parts, dim=-1)
        else:
            dist.gather(tensor, None, dst=0)
            result = tensor.new_empty(*tensor.shape[:-1], 0)
        self._count(start)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _count(self, start: float) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, world_size={self.world_size})"


_SINGLE = TensorParallelGroup()
_building: TensorParallelGroup | None = None


def single_device_group() -> TensorParallelGroup:
    return _SINGLE


def current_group() -> TensorParallelGroup:
    """The group of the model being built (a single device outside ``building``)."""
    return _building or _SINGLE


@contextlib.contextmanager
def building(group: TensorParallelGroup) -> Iterator[None]:
    """Layers constructed inside take ``group`` (their rank's shard of every weight)."""
    global _building
    previous, _building = _building, group
    try:
        yield
    finally:
        _building = previous


def _collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it), for the ranks' rendezvous: never a
    fixed one, so that two engines on one host do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float) -> TensorParallelGroup:
    """Join the ranks' process group (gloo on the CPU, NCCL on CUDA)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this "
                           "process: shut the other tensor-parallel engine down first "
                           "(LLMEngine.shutdown)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, world_size)


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
