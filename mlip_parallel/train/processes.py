"""The ranks of an ``mlip-train`` run: rank, size and sums over ranks through the job's halo backend, and the
torch.distributed backend where data-parallel gradients and the pipeline's messages travel on the device."""
from __future__ import annotations

import numpy as np


class Processes:
    """Rank, size and sums over ranks, through the job's halo backend (``backend_kind``: MPI under
    mpiexec, torch.distributed under torchrun or ``MLIP_PARALLEL_BACKEND=torch``). Pipeline and
    data-parallel training also talk through the torch.distributed backend (``device_backend``: gradients summed
    where they are), on the process group that the torch halo backend uses too (``backend.init_process_group``)."""

    def __init__(self, parallel: str):
        from ..backend import get_backend, init_process_group  # (torch: at first use)

        self.parallel, self.device_backend = parallel, None
        self.backend = get_backend()
        self.rank, self.size = self.backend.rank, self.backend.size
        if parallel == "pipeline" or (parallel == "data" and self.size > 1):
            init_process_group()
            self.device_backend = get_backend("torch")

    def bcast(self, obj):
        """Rank 0's ``obj`` on every rank (a decision rank 0 takes alone, e.g. from its disk)."""
        return self.backend.bcast(obj)

    def allgather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        return self.backend.allgather(obj)

    def barrier(self) -> None:
        self.backend.barrier()

    def sum(self, array: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks (numpy float64)."""
        return self.backend.allreduce(np.asarray(array, dtype=np.float64))

    def sum_gradients(self, parameters) -> None:
        """Add every rank's parameter gradients (one flat message; on the device through
        torch.distributed in data-parallel training)."""
        if self.size == 1:
            return
        import torch

        from .training import sum_gradients  # (torch: at first use)

        def reduce(flat):
            if self.device_backend is not None:
                return self.device_backend.allreduce_(flat)
            return torch.as_tensor(self.backend.allreduce(flat.cpu().numpy()), dtype=flat.dtype, device=flat.device)

        sum_gradients(parameters, reduce)
