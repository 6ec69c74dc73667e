"""Collectives among the workers of one training: sums, a shared flag, gathered
objects, a barrier; each a no-op for a training of one process."""

from __future__ import annotations

from typing import Any

import torch


class WorkerGroup:
    """The workers of one training (torch.distributed), or just this process."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device("cpu")  # where a tensor must be to be reduced
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("a distributed training needs torch.distributed set up "
                                   "(Ray Train does it for train_distributed)")
            if dist.get_rank() != rank or dist.get_world_size() != world:
                raise RuntimeError(f"rank {rank}/{world} differs from torch.distributed's "
                                   f"{dist.get_rank()}/{dist.get_world_size()}")
            # NCCL reduces only tensors on this worker's GPU; gloo those on the CPU.
            if dist.get_backend() == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
            return on_device.to(t.device)
        return t

    def any(self, flag: bool) -> bool:
        return bool(self.sum(torch.tensor([1.0 if flag else 0.0])).item() > 0)

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
