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

The context itself (rank, world size, shards, sums, the replica check) is
:class:`circuits.learn.distributed.LearningContext`; this module adds what training needs: DDP
wrapping, destroying the group it created when training ends, the global batch's divisibility and
:class:`~circuits_llm.training.config.TrainingConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from circuits.learn.distributed import LearningContext, join_process_group
from circuits_llm.training.config import TrainingConfigError


@dataclass
class DistributedContext(LearningContext):
    """This process's place in the job (:class:`~circuits.learn.distributed.LearningContext`:
    ``rank``, ``world_size``, ``owns_group``, ``shard``, ``all_sum``, ``replica_difference``,
    ``barrier``...), plus DDP wrapping; :meth:`close` destroys the group this context created."""

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
        TrainingConfigError: ``batch_size`` is not a multiple of the world size, or
            ``WORLD_SIZE > 1`` without ``torch.distributed``.
    """
    context = DistributedContext(*join_process_group(device, TrainingConfigError))
    if batch_size % context.world_size:
        context.close()
        raise TrainingConfigError(
            f"batch_size {batch_size} is the global batch and must be a multiple of the world "
            f"size {context.world_size}")
    return context


__all__ = ["DistributedContext", "distributed_context"]
