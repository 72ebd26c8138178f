"""The global batches of an ``mlip-train`` run, step by step, and the structures a rank reads for them.

Step s is batch b = s mod E of epoch e = s div E (E batches an epoch); an epoch's order is a permutation drawn from
the seed and the epoch alone (``StepBatches``), so any step's batch is known without the steps before it: a resumed
run picks up mid-epoch, and every rank count sees the same global batches.

With ``data.workers: W`` > 0 (a streamed set) ``W`` worker processes per rank read the structures this rank will
use (``strategy.reads``) and build their neighbour lists (vesin, as ``Structure.edges``), ``PREFETCH`` steps per
worker ahead of the model (torch's ``DataLoader``, in order); the model's process then finds them read
(``ReadAhead``). With none, the structures are read when the step uses them.
"""
from __future__ import annotations

import numpy as np

from .sources import take

PREFETCH = 2  # steps each worker prepares ahead


class StepBatches:
    """The training set's positions in each step's global batch: ``len(self)`` structures, ``batch_size`` a batch
    (an epoch's last may be smaller), epoch e ordered by ``default_rng([seed, e]).permutation``."""

    def __init__(self, size: int, batch_size: int, seed: int):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.per_epoch = -(-size // batch_size)
        self._epoch, self._order = None, None

    def __call__(self, step: int) -> np.ndarray:
        """[≤ batch_size] positions of step ``step``'s global batch."""
        epoch, b = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return self._order[b * self.batch_size:(b + 1) * self.batch_size]


class ReadAhead:
    """The training set with one step's structures already read (``ready``: {position: Structure}): [k] gives
    the one read ahead, else reads it."""

    def __init__(self, structures, ready: dict):
        self.structures, self.ready = structures, ready

    def __len__(self) -> int:
        return len(self.structures)

    def __getitem__(self, k):
        found = self.ready.get(int(k))
        return found if found is not None else self.structures[int(k)]


class _StepReads:
    """Step ``first + i``'s structures that this rank reads, with their neighbour lists (a worker's item)."""

    def __init__(self, structures, batches: StepBatches, first: int, last: int, reads, cutoff):
        self.structures, self.batches, self.first, self.last = structures, batches, first, last
        self.reads, self.cutoff = reads, cutoff

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, i: int) -> dict:
        from .training import DataError

        ready = {}
        try:
            for k in self.reads(self.batches(self.first + i)):
                s = self.structures[int(k)]
                if self.cutoff is not None:
                    s.edges(self.cutoff)  # built here, kept on the structure that goes back to the model's process
                ready[int(k)] = s
        except DataError as exc:  # back as a value: the model's process raises it (one line, not a worker's trace)
            return {"error": str(exc)}
        return ready


def worker_start(_) -> None:
    import torch

    torch.set_num_threads(1)


def global_batches(structures, batches: StepBatches, first: int, last: int, workers: int, reads, cutoff):
    """Steps ``first`` .. ``last - 1``'s global batches (``sources.take`` views of ``structures``), each with this
    rank's structures (``reads(positions)``) read ahead by ``workers`` processes, their neighbour lists built at
    ``cutoff`` (None: none); ``workers`` 0: read when used."""
    if not workers:
        for step in range(first, last):
            yield take(structures, batches(step))
        return
    import torch

    from .training import DataError

    loader = torch.utils.data.DataLoader(
        _StepReads(structures, batches, first, last, reads, cutoff), batch_size=None, shuffle=False,
        num_workers=workers, prefetch_factor=PREFETCH, worker_init_fn=worker_start,
        multiprocessing_context="fork")
    for step, ready in zip(range(first, last), loader):
        if "error" in ready:
            raise DataError(ready["error"])
        yield take(ReadAhead(structures, ready), batches(step))
