"""Faults planted in the halo exchange, for the tests that must fail on them (a test-only hook: nothing in the
package changes; the context manager patches the two places every exchange passes through and puts them back).

* ``"stale ghost features"``: each refresh of the ghost rows (``FeatureHalo``) leaves them as they were — what this
  rank itself holds for them where the model hands its ghost rows over, else what the previous refresh of the same
  width delivered, one layer behind (zeros at the first);
* ``"zeroed ghost rows"``: each refresh hands back zeros in the ghost rows;
* ``"ghost gradients not sent home"``: the reverse exchange (the forward exchange's backward: features and positions
  alike, ``FeatureHalo.adjoint`` too) adds nothing into the owners.

The exchanges themselves still run on every rank (their results are then discarded), so a faulty run keeps the
lock-step of a correct one and fails its comparison instead of hanging. Works under mpiexec, torchrun and in one
process (``SerialBackend``, where a periodic cell's images are ghost rows)."""
from __future__ import annotations

import contextlib

import torch

from mlip_parallel.comm import Comm, FeatureHalo

FAULTS = ("stale ghost features", "zeroed ghost rows", "ghost gradients not sent home")
FEATURE_FAULTS = FAULTS[:2]  # those a model that exchanges no node features (Lennard-Jones, Allegro) cannot meet


@contextlib.contextmanager
def planted(fault: str, calls: list | None = None):
    """Within it, ``fault`` (one of ``FAULTS``) in every halo exchange; ``calls`` (a list) collects the row count of
    each ghost-row refresh, faulty or not (``planted("none", calls)`` only counts)."""
    if fault not in FAULTS + ("none",):
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
    refresh, reverse = FeatureHalo.__call__, Comm._reverse

    def faulty_refresh(self, h):
        fresh = refresh(self, h)  # (the exchange runs: lock-step)
        if calls is not None:
            calls.append(h.shape[0])
        n = self.comm.n_local
        if fault == "zeroed ghost rows":
            return torch.cat([fresh[:n], torch.zeros_like(fresh[n:])])
        if fault == "stale ghost features":
            held = self.__dict__.setdefault("_stale_rows", {})
            width = tuple(h.shape[1:])
            if h.shape[0] == fresh.shape[0]:
                ghosts = h[n:]  # the ghost rows as this rank left them
            else:
                ghosts = held.get(width, torch.zeros_like(fresh[n:]))
            held[width] = fresh[n:].detach()
            return torch.cat([fresh[:n], ghosts])
        return fresh

    def dropped_reverse(self, g):
        return torch.zeros_like(reverse(self, g))

    FeatureHalo.__call__ = faulty_refresh
    if fault == "ghost gradients not sent home":
        Comm._reverse = dropped_reverse
    try:
        yield
    finally:
        FeatureHalo.__call__, Comm._reverse = refresh, reverse


MESH_FAULTS = ("mesh's ghost planes not summed", "mesh's ghost planes not refreshed")


@contextlib.contextmanager
def mesh_fault(fault: str):
    """Within it, ``fault`` (one of ``MESH_FAULTS``) in the halo of a mesh split over ranks (potentials.slab_mesh): a
    brick's planes that other ranks own are not added into their slabs, or the potential's planes come back from
    other ranks as zeros. The exchanges still run (lock-step)."""
    from potentials.slab_mesh import _BrickRemap

    if fault not in MESH_FAULTS:
        raise ValueError(f"unknown mesh fault {fault!r}; one of {MESH_FAULTS}")
    saved = _BrickRemap.to_slab if fault == MESH_FAULTS[0] else _BrickRemap.to_brick

    def only_own(self, values):
        exchange, rank = self.alltoall, self.alltoall.rank
        if fault == MESH_FAULTS[0]:  # the pieces for other ranks sent as zeros
            self.alltoall = lambda pieces: exchange([p if r == rank else torch.zeros_like(p)
                                                     for r, p in enumerate(pieces)])
        else:  # the pieces from other ranks received as zeros
            self.alltoall = lambda pieces: [p if r == rank else torch.zeros_like(p)
                                            for r, p in enumerate(exchange(pieces))]
        try:
            return saved(self, values)
        finally:
            self.alltoall = exchange

    setattr(_BrickRemap, saved.__name__, only_own)
    try:
        yield
    finally:
        setattr(_BrickRemap, saved.__name__, saved)


TALLY = {"planted": 0, "caught": 0}  # this process's fault checks, for a script's summary line


def caught(world, label: str, evaluate, reference: dict, tolerance: float, faults=FAULTS, factor: float = 1e3) -> list:
    """Each of ``faults`` planted while ``evaluate()`` runs (collective: every rank of ``world`` calls it) must move
    its result beyond ``factor`` × ``tolerance`` from ``reference`` (the comparison the equality test makes, on the
    keys of ``reference``). Rank 0 prints a line per fault; returns the failures (a fault the comparison would
    let pass, or a faulty run that is not even comparable)."""
    from comparison import compare

    failures = []
    for fault in faults:
        with planted(fault):
            result = evaluate()
        comparison = compare({k: result[k] for k in reference}, reference)
        ok = comparison.beyond(factor * tolerance)
        TALLY["planted"] += 1
        TALLY["caught"] += ok
        line = (f"fault {'caught' if ok else 'MISSED'}: {label}, {fault}: error {comparison.error:.1e}, the test's "
                f"tolerance {tolerance:.0e}" + ("" if comparison.problem is None else f" ({comparison.problem})"))
        if world.rank == 0:
            print(line, flush=True)
        if not ok:
            failures.append(line)
    return failures


def tally(reset: bool = False) -> str:
    """"faults caught C of P" for this process's ``caught`` checks (since the last reset; ``reset``: start anew
    after this one, as a launch running several families does)."""
    text = f"faults caught {TALLY['caught']} of {TALLY['planted']}"
    if reset:
        TALLY.update(planted=0, caught=0)
    return text
