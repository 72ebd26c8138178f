"""Errors of the distributed layer (the family's base types live in ``potentials.errors``)."""
from potentials.errors import InvalidStructureError, MLIPError, UnknownSpeciesError


class DecompositionError(MLIPError, ValueError):
    """The system cannot be split as asked: a grid that does not match the ranks, no atoms, ..."""


class BackendError(MLIPError, RuntimeError):
    """No such communication backend, or the ranks cannot meet (e.g. no reachable rendezvous address)."""


class MemoryLimitError(MLIPError, MemoryError):
    """The estimated memory of a rank's atoms, ghosts and pairs exceeds what the rank has (raised on every
    rank before they are built; ``mlip_parallel.preflight``)."""


class SimulationError(MLIPError, RuntimeError):
    """The run cannot go on: non-finite forces or positions, an atom jumping farther than a subdomain in one
    step (raised alike on every rank)."""


class RanksDisagreeError(MLIPError, ValueError):
    """The ranks of one communicator were given different structures to evaluate together (raised alike on every
    rank, before any message about the atoms)."""


class LostAtomsError(MLIPError, RuntimeError):
    """Atoms went missing or were duplicated while moving between ranks."""


class LammpsBridgeError(MLIPError, RuntimeError):
    """Bad input to the LAMMPS bridge (``mlip-lammps``). ``everywhere``: raised alike on every rank (from data
    every rank holds, before any message of the current step), so the job can stop cleanly with status 2."""

    def __init__(self, message: str, everywhere: bool = True):
        super().__init__(message)
        self.everywhere = everywhere


__all__ = ["BackendError", "DecompositionError", "InvalidStructureError", "LammpsBridgeError", "LostAtomsError",
           "MemoryLimitError", "MLIPError", "SimulationError", "UnknownSpeciesError"]
