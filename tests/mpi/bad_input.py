"""Bad input under MPI (run under mpiexec -n P).

``caught``: each bad input raises the same named error on every rank (no hang); prints one line each.
``uncaught``: NaN positions, not caught: every rank prints ``rank N: ...`` and the job aborts.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
from systems import GEOMETRIES, lennard_jones, schnet  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD


def nan_atoms():
    atoms = GEOMETRIES["fcc_bulk"]()
    positions = atoms.positions
    positions[7, 1] = np.nan
    atoms.positions = positions
    return atoms


def zero_volume():
    atoms = GEOMETRIES["fcc_bulk"]()
    atoms.set_cell(np.zeros((3, 3)))
    atoms.pbc = True
    return atoms


def unknown_element():
    atoms = GEOMETRIES["fcc_bulk"]()
    atoms.numbers[[3, 4]] = [26, 8]  # Fe, O
    return atoms


if sys.argv[1:] == ["uncaught"]:
    mlip_parallel.evaluate(lennard_jones(), nan_atoms())
    sys.exit(0)  # not reached

cases = [
    ("unknown element", lambda: mlip_parallel.evaluate(schnet(), unknown_element()),
     mlip_parallel.UnknownSpeciesError, ["Fe", "O", "Ag", "Cu"]),
    ("NaN position", lambda: mlip_parallel.evaluate(lennard_jones(), nan_atoms()),
     mlip_parallel.InvalidStructureError, ["non-finite", "7"]),
    ("zero-volume cell", lambda: mlip_parallel.evaluate(lennard_jones(), zero_volume()),
     mlip_parallel.InvalidStructureError, ["zero-volume"]),
    ("grid/rank mismatch", lambda: mlip_parallel.evaluate(lennard_jones(), GEOMETRIES["fcc_bulk"](),
                                                           grid=(world.size + 1, 1, 1)),
     mlip_parallel.DecompositionError, [f"{world.size} rank"]),
    ("unknown mode", lambda: mlip_parallel.evaluate(lennard_jones(), GEOMETRIES["fcc_bulk"](), mode="deep"),
     ValueError, ["layerwise", "wide"]),
]
ok = True
for label, call, error, words in cases:
    try:
        call()
        message = None
    except error as exc:
        message = str(exc)
    good = message is not None and all(w in message for w in words)
    agreed = all(world.allgather(good))
    ok &= agreed
    if world.rank == 0:
        print(f"{'OK' if agreed else 'FAIL'} {label}: {message}", flush=True)
# the job is still healthy: a normal evaluation works after the errors
mlip_parallel.evaluate(lennard_jones(), GEOMETRIES["fcc_bulk"]())
sys.exit(0 if ok else 1)
