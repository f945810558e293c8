"""Data-parallel training under ``torchrun``: process group, data shards, collectives.

When ``torchrun`` (``python -m torch.distributed.run``) launched the process, the environment
holds ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... and :func:`distributed_context` initialises the
default process group from it (``gloo`` on CPU, ``nccl`` on CUDA). Without those variables it
returns a single-process context and every collective is a no-op, so the same training code runs
unchanged in both settings.

Every rank draws the same global batch of ``batch_size`` rows from an identically seeded
generator and keeps its contiguous shard of ``batch_size / world_size`` rows; DDP averages the
gradients, so a step equals a single-process step on the whole global batch up to the order of
floating-point sums (the loss is a mean over sequences of equal weight).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from circuits_llm.training.config import TrainingConfigError


@dataclass
class DistributedContext:
    """This process's place in the job.

    Attributes:
        rank: global rank (0 when not distributed).
        world_size: number of processes (1 when not distributed).
        owns_group: whether this context initialised the process group (and must destroy it).
    """

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Only rank 0 writes files and shows progress."""
        return self.rank == 0

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's contiguous slice of a global batch ``rows`` (B, ...), B % world_size == 0."""
        size = rows.shape[0] // self.world_size
        return rows[self.rank * size:(self.rank + 1) * size]

    def all_sum(self, value: Tensor) -> Tensor:
        """Sum ``value`` over ranks (a copy; the input is untouched)."""
        total = value.detach().clone()
        if self.enabled:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def replica_difference(self, parameters: list[Tensor]) -> float:
        """Largest ``|p - p_rank0|`` over all ranks and ``parameters`` (0.0 = identical replicas).

        Collective: every rank must call it. Returns 0.0 without a process group.
        """
        if not self.enabled or not parameters:
            return 0.0
        mine = torch.cat([p.detach().reshape(-1).float() for p in parameters])
        reference = mine.clone()
        dist.broadcast(reference, src=0)
        largest = (mine - reference).abs().max().reshape(1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return float(largest)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``module`` in :class:`DistributedDataParallel` (frozen parameters and buffers ignored)."""
        if not self.enabled:
            return module
        frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
        frozen += [name for name, _ in module.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)

    def close(self) -> None:
        """Destroy the process group if this context created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def distributed_context(device: torch.device, batch_size: int) -> DistributedContext:
    """The context of this process; initialises the process group from torchrun's environment.

    Raises:
        TrainingConfigError: ``batch_size`` is not a multiple of the world size.
    """
    if dist.is_available() and dist.is_initialized():
        context = DistributedContext(dist.get_rank(), dist.get_world_size(), owns_group=False)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        if not dist.is_available():
            raise TrainingConfigError("WORLD_SIZE > 1 but torch.distributed is not available")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        context = DistributedContext(dist.get_rank(), dist.get_world_size(), owns_group=True)
    else:
        return DistributedContext()
    if batch_size % context.world_size:
        context.close()
        raise TrainingConfigError(
            f"batch_size {batch_size} is the global batch and must be a multiple of the world "
            f"size {context.world_size}")
    return context
