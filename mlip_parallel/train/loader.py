"""The global batches of an ``mlip-train`` run, step by step, and the structures a rank reads for them.

An epoch's order is a permutation drawn from the seed and the epoch alone, cut into batches of ``batch_size``
structures or of at most ``batch_atoms`` atoms (``StepBatches``), so any step's batch is known from the data and the
seed: a resumed run picks up mid-epoch, and every rank count sees the same global batches.

With ``data.workers: W`` > 0 (a streamed set) ``W`` worker processes per rank read the structures this rank will
use (``strategy.reads``) and build their neighbour lists (vesin, as ``Structure.edges``), ``PREFETCH`` steps per
worker ahead of the model (torch's ``DataLoader``, in order); the model's process then finds them read
(``ReadAhead``). With none, the structures are read when the step uses them.
"""
from __future__ import annotations

import numpy as np

from .sources import take
from .structures import DataError

PREFETCH = 2  # steps each worker prepares ahead
DRAWS = 0x5A3D  # the seed word of a sampled file's draws (an epoch's order: [seed, epoch])


class StepBatches:
    """The training set's positions in each step's global batch.

    An epoch's members: every position of the training set, or, with ``mixture`` (a list of ``(start, stop,
    share)``: the positions start..stop-1 are a file sampled at that share), every position outside those ranges
    and ``epoch_draws`` of each sampled range's. Epoch e's order is those members permuted by ``default_rng([seed,
    e])``, cut into batches of ``batch_size`` structures (an epoch's last may be smaller), or, with ``batch_atoms`` >
    0, greedily into batches of at most ``batch_atoms`` atoms (``atoms`` [size]: each structure's count; a larger
    structure is a batch of its own), each batch's positions then ordered by atom count, largest first, so that the
    ranks' shares (rank, rank + P, ...) hold about as many atoms."""

    def __init__(self, size: int, batch_size: int, seed: int, atoms=None, batch_atoms: int = 0, mixture=()):
        self.size, self.batch_size, self.seed, self.batch_atoms = size, batch_size, seed, batch_atoms
        self.atoms = None if atoms is None else np.asarray(atoms, dtype=np.int64)
        self.mixture = [(int(a), int(b), float(share)) for a, b, share in mixture]
        sampled = np.zeros(size, dtype=bool)
        for start, stop, _ in self.mixture:
            sampled[start:stop] = True
        self.whole = np.flatnonzero(~sampled)  # positions every epoch holds once
        rest = 1.0 - sum(share for _, _, share in self.mixture)
        # structures drawn from each sampled range per epoch: share s of the epoch, whose other structures are whole
        self.draws = [max(1, int(round(share * len(self.whole) / rest))) for _, _, share in self.mixture]
        self.epoch_size = len(self.whole) + sum(self.draws)
        self._epoch, self._order, self._cuts = None, None, None
        self._starts = [0]  # first step of each epoch counted so far

    def members(self, epoch: int) -> np.ndarray:
        """[epoch_size] the positions epoch ``epoch`` trains on, before shuffling: the whole ranges' positions, then
        each sampled range's draws — epoch e takes draws e·n .. (e+1)·n - 1 of the range's endless sequence of
        permutations (``default_rng([seed, DRAWS, range, cycle])``), so each structure of a sampled file is drawn
        once before any is drawn again."""
        if not self.mixture:
            return np.arange(self.size)
        parts = [self.whole]
        for g, ((start, stop, _), n) in enumerate(zip(self.mixture, self.draws)):
            size, first = stop - start, epoch * n
            cycles = range(first // size, (first + n - 1) // size + 1)
            sequence = np.concatenate([np.random.default_rng([self.seed, DRAWS, g, c]).permutation(size)
                                       for c in cycles])
            offset = first - cycles[0] * size
            parts.append(start + sequence[offset:offset + n])
        return np.concatenate(parts)

    def _epoch_batches(self, epoch: int):
        """(order [epoch_size], cuts [batches + 1]) of ``epoch``."""
        if epoch != self._epoch:
            members = self.members(epoch)
            order = members[np.random.default_rng([self.seed, epoch]).permutation(len(members))]
            if self.batch_atoms:
                total = np.cumsum(self.atoms[order])
                cuts, start = [0], 0
                while start < len(order):  # the furthest end that keeps the batch within batch_atoms (at least one)
                    below = total[start - 1] if start else 0
                    start = max(start + 1, int(np.searchsorted(total, below + self.batch_atoms, side="right")))
                    cuts.append(min(start, len(order)))
            else:
                cuts = list(range(0, len(order), self.batch_size)) + [len(order)]
            self._epoch, self._order, self._cuts = epoch, order, np.asarray(cuts)
        return self._order, self._cuts

    def batches_in(self, epoch: int) -> int:
        return len(self._epoch_batches(epoch)[1]) - 1

    def first_step(self, epoch: int) -> int:
        """The step that starts ``epoch`` (the steps of the epochs before it)."""
        if not self.batch_atoms:
            return epoch * -(-self.epoch_size // self.batch_size)
        while len(self._starts) <= epoch:
            self._starts.append(self._starts[-1] + self.batches_in(len(self._starts) - 1))
        return self._starts[epoch]

    def total_steps(self, epochs: int, max_steps: int = 0) -> int:
        """The steps of ``epochs`` epochs, or ``max_steps`` where fewer (0: no limit); with batches by atoms, only the
        epochs up to ``max_steps`` are cut."""
        if max_steps:
            epoch = 0
            while epoch < epochs and self.first_step(epoch + 1) < max_steps:
                epoch += 1
            return min(self.first_step(min(epoch + 1, epochs)), max_steps)
        return self.first_step(epochs)

    def locate(self, step: int) -> tuple:
        """(epoch, batch within it) of ``step``."""
        if not self.batch_atoms:
            return divmod(step, -(-self.epoch_size // self.batch_size))
        epoch = 0
        while self.first_step(epoch + 1) <= step:
            epoch += 1
        return epoch, step - self.first_step(epoch)

    def epochs_done(self, step: int):
        """The epochs ``step`` steps make: an int at an epoch's end, else a fraction rounded to 4 decimals."""
        epoch, b = self.locate(step)
        return epoch if b == 0 else round(epoch + b / self.batches_in(epoch), 4)

    def __call__(self, step: int) -> np.ndarray:
        """[≤ batch_size] positions of step ``step``'s global batch."""
        epoch, b = self.locate(step)
        order, cuts = self._epoch_batches(epoch)
        positions = order[cuts[b]:cuts[b + 1]]
        if self.batch_atoms:
            positions = positions[np.argsort(-self.atoms[positions], kind="stable")]
        return positions


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
    if first >= last:  # a resumed run already at its end: no step, no worker started
        return
    if not workers:
        for step in range(first, last):
            yield take(structures, batches(step))
        return
    import torch

    loader = torch.utils.data.DataLoader(
        _StepReads(structures, batches, first, last, reads, cutoff), batch_size=None, shuffle=False,
        num_workers=workers, prefetch_factor=PREFETCH, worker_init_fn=worker_start,
        multiprocessing_context="fork")
    for step, ready in zip(range(first, last), loader):
        if "error" in ready:
            raise DataError(ready["error"])
        yield take(ReadAhead(structures, ready), batches(step))
