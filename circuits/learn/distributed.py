"""Data-parallel learning under ``torchrun``: the process group, data shards and collectives.

When ``torchrun`` launched the process (``RANK`` and ``WORLD_SIZE > 1`` in the environment),
:func:`learning_context` initialises the default process group (``gloo`` on the CPU, ``nccl`` on
CUDA) and keeps it until the process exits, so later ``fit`` calls join it; when a group is
already initialised it joins it; otherwise it is a one-process context in which every collective
is a no-op, so :func:`circuits.learn.fit` runs unchanged either way. (A group destroyed after each
``fit`` would race the next one: rank 0 serves the rendezvous store, and a faster rank could reach
the old store just before rank 0 closes it.)

Every rank draws the same shuffled order from an identically seeded generator and keeps its
contiguous share of every batch (:meth:`LearningContext.shard`); EM statistics (expected counts)
and gradients are summed over ranks before each step, so every rank takes the same step, the one
a single process would take on the whole batch (up to the order of floating-point sums).

This is the one implementation of the rank / world / shard context: the training loop of
``circuits_llm`` (:mod:`circuits_llm.training.distributed`) subclasses :class:`LearningContext`
and joins the group through :func:`join_process_group`, adding only what training needs (its own
error type, DDP wrapping, destroying the group it made when training ends).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from circuits.errors import InvalidInputError


def collective_device(backend: str, device: torch.device, cuda_index: int = 0) -> torch.device:
    """Where a tensor on ``device`` must be for a collective of ``backend``: nccl moves only CUDA
    tensors, so a CPU tensor (a loss total, a row count) goes to this rank's GPU ``cuda_index``;
    gloo takes tensors where they are."""
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", cuda_index)
    return device


def _wire(tensor: Tensor) -> Tensor:
    """``tensor`` on the device the process group's backend moves (a copy only when it must)."""
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return tensor.to(collective_device(str(dist.get_backend()), tensor.device, index))


@dataclass
class LearningContext:
    """This process's place in the job.

    Attributes:
        rank: global rank (0 alone).
        world_size: number of processes (1 alone).
        owns_group: whether this context initialised the process group (:func:`fit` keeps it
            until the process exits; the training context of ``circuits_llm`` destroys it in
            ``close``).
    """

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Only rank 0 writes checkpoints and shows progress."""
        return self.rank == 0

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's contiguous share of ``rows`` (uneven shares differ by at most one row)."""
        if not self.enabled:
            return rows
        return torch.tensor_split(rows, self.world_size)[self.rank]

    def all_sum(self, value: Tensor) -> Tensor:
        """Sum ``value`` over ranks (a copy; the input is untouched)."""
        if not self.enabled:
            return value.detach().clone()
        total = _wire(value.detach()).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(value.device)

    def all_sum_(self, tensors: list[Tensor]) -> None:
        """Sum every tensor over ranks, in place (one collective for all of them)."""
        if not self.enabled or not tensors:
            return
        flat = _wire(torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for tensor in tensors:
            size = tensor.numel()
            tensor.copy_(flat[offset:offset + size].view_as(tensor))
            offset += size

    def gather_rows(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` (n_r, ...) concatenated in rank order (sizes may differ)."""
        if not self.enabled:
            return tensor
        size = _wire(torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device))
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        largest = max(int(s) for s in sizes)
        padded = tensor.new_zeros((largest, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        # gloo gathers no bool tensors: send bytes
        wire = _wire(padded.to(torch.uint8) if padded.dtype == torch.bool else padded)
        parts = [torch.empty_like(wire) for _ in range(self.world_size)]
        dist.all_gather(parts, wire.contiguous())
        rows = torch.cat([part[:int(n)] for part, n in zip(parts, sizes, strict=True)]).to(tensor.device)
        return rows.to(torch.bool) if tensor.dtype == torch.bool else rows

    def replica_difference(self, parameters: list[Tensor]) -> float:
        """Largest ``|p - p_rank0|`` over all ranks and ``parameters`` (0.0 = identical replicas).

        Collective: every rank must call it. Returns 0.0 without a process group.
        """
        if not self.enabled or not parameters:
            return 0.0
        mine = _wire(torch.cat([p.detach().reshape(-1).float() for p in parameters]))
        reference = mine.clone()
        dist.broadcast(reference, src=0)
        largest = (mine - reference).abs().max().reshape(1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return float(largest)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        """End this context's use of the group: wait for every rank, so that no rank starts
        another collective job while a slower one is still in this one."""
        self.barrier()


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def join_process_group(device: torch.device,
                       error: type[Exception] = InvalidInputError) -> tuple[int, int, bool]:
    """``(rank, world_size, created)`` of this process: the initialised default group's, else one
    initialised from torchrun's environment (``nccl`` on CUDA, ``gloo`` otherwise; ``created``),
    else ``(0, 1, False)``: a single process.

    Raises:
        error: ``WORLD_SIZE > 1`` but this torch build has no ``torch.distributed``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        if not dist.is_available():
            raise error("WORLD_SIZE > 1 but torch.distributed is not available in this torch "
                        "build; run a single process")
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def learning_context(device: torch.device) -> LearningContext:
    """The context of this process; initialises the process group from torchrun's environment
    (kept until the process exits)."""
    rank, world_size, created = join_process_group(device)
    if created:
        atexit.register(_destroy_group)
    return LearningContext(rank, world_size, owns_group=created)


__all__ = ["LearningContext", "join_process_group", "learning_context"]
