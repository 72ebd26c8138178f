"""Distributed == reference, for every geometry × grid × model × mode (run under mpiexec -n P, or
torchrun --nproc-per-node P: the job's halo backend, see mlip_parallel.backend.backend_kind). ``--lean`` (another
backend than the one that runs it all): every geometry, the automatic grid and the last explicit one, the float64
models.

Lennard-Jones is compared with ASE's LennardJones, SchNet with potentials.predict. Prints one line per
case on rank 0 and exits non-zero if any case misses its tolerance; reports how many ranks owned no
atoms so that the empty-rank path is known to have run.
"""
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from comparison import compare  # noqa: E402
from faults import FEATURE_FAULTS, FAULTS, caught, tally  # noqa: E402
from systems import (GEOMETRIES, GRIDS, SPECIES, ase_lj_results, exit_with_verdict, lennard_jones,  # noqa: E402
                     schnet, shared_out)

torch.set_num_threads(1)
world = mlip_parallel.get_backend()  # MPI, or torch.distributed under torchrun / MLIP_PARALLEL_BACKEND=torch
P = world.size
LEAN = "--lean" in sys.argv  # (another backend: the automatic grid and the last explicit one, the float64 models)
GRIDS = [GRIDS[P][0], GRIDS[P][-1]] if LEAN else GRIDS[P]


def small(cls, dtype):
    torch.manual_seed(1)
    return cls(SPECIES, cutoff=4.0, features=8, layers=3).to(dtype)


models = {"LJ": lennard_jones(), "SchNet64": schnet(torch.float64), "SchNet32": schnet(torch.float32),
          "PaiNN64": small(potentials.PaiNN, torch.float64), "PaiNN32": small(potentials.PaiNN, torch.float32),
          "NequIP64": small(potentials.NequIP, torch.float64), "NequIP32": small(potentials.NequIP, torch.float32)}
tolerance = {label: 1e-5 if label.endswith("32") else 1e-10 for label in models}


def grids_for(label):
    """Lennard-Jones and float64 SchNet run on every grid, float64 PaiNN (and NequIP on 2 ranks) on the
    automatic grid and the first explicit one, float32 NequIP on 2 ranks only (the float32 path runs
    with SchNet and PaiNN on every P), the rest on the automatic grid (keeps the suite short)."""
    if LEAN:
        return GRIDS if label.endswith(("J", "64")) else []
    if label in ("LJ", "SchNet64"):
        return GRIDS
    if label == "NequIP32" and P > 2:
        return []
    if label.endswith("32") or (label == "NequIP64" and P > 2):
        return GRIDS[:1]
    return GRIDS[:2]


def modes_for(label, grid):
    """Both modes, except Lennard-Jones (one layer) and NequIP (its wide mode, a 12 Å shell, is the slowest case; the
    wide path is model-agnostic and runs with SchNet and PaiNN on every grid), which runs wide on 2 ranks' automatic
    grid alone (MPI)."""
    if label == "LJ" or (label.startswith("NequIP") and (P > 2 or LEAN or grid is not None)):
        return ("layerwise",)
    return ("layerwise", "wide")


def reference(name):
    atoms = GEOMETRIES[name]()
    out = {"LJ": ase_lj_results(atoms)}
    out.update({label: potentials.predict(model, atoms) for label, model in models.items()
                if label != "LJ" and grids_for(label)})
    return out


# the serial references, each geometry's computed by one rank (no rank idles while another works)
names = list(GEOMETRIES)
mine = {name: reference(name) for k, name in enumerate(names) if k % P == world.rank}
all_references = {name: refs for part in world.allgather(mine) for name, refs in part.items()}

failures, cases, empty_cases = [], 0, 0
seconds = {label: 0.0 for label in models}
for name, build in GEOMETRIES.items():
    atoms = build()
    references = all_references[name]
    for grid in GRIDS:
        for label, model in models.items():
            if grid not in grids_for(label):
                continue
            for mode in modes_for(label, grid):
                start = time.perf_counter()
                result = mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid)
                seconds[label] += time.perf_counter() - start
                comparison = compare(result, references[label], tolerance[label])
                cases += 1
                if not comparison.ok:
                    failures.append(comparison.message(f"{name} grid={grid} {label} {mode}"))
                digest = hashlib.sha256(b"".join(np.ascontiguousarray(result[k]).tobytes()
                                                 for k in sorted(result))).hexdigest()
                if len(set(world.allgather(digest))) != 1:
                    failures.append(f"{name} grid={grid} {label} {mode}: results differ between ranks")
                if world.rank == 0:
                    print(f"{name:14s} grid={str(grid):10s} {label:9s} {mode:9s} max rel err {comparison.error:.2e}",
                          flush=True)
    # Each rank evaluates only its share; record whether some rank owned nothing (the empty-rank path).
    for grid in GRIDS:
        part = mlip_parallel.Decomposition(atoms, 4.0, world, grid)
        owned = world.allgather(len(part.owned))
        empty_cases += sum(n == 0 for n in owned)
        if not shared_out(owned, len(atoms)):
            failures.append(f"{name} grid={grid}: owned atoms per rank {owned} of {len(atoms)}")

# The faults a halo could have, planted (tests/faults.py) on 2 ranks and a 3-rank grid: each moves every float64
# model's result far beyond its tolerance (Lennard-Jones exchanges no features: only its ghost gradients)
if P in (2, 3):
    atoms, grid = GEOMETRIES["fcc_bulk"](), GRIDS[1]
    for label in ("LJ", "SchNet64", "PaiNN64", "NequIP64"):
        failures += caught(world, f"{label} fcc_bulk grid={grid}",
                           lambda: mlip_parallel.evaluate(models[label], atoms, grid=grid),
                           all_references["fcc_bulk"][label], tolerance[label],
                           [f for f in FAULTS if label != "LJ" or f not in FEATURE_FAULTS])

if world.rank == 0:
    print("seconds per model:", {label: round(t, 1) for label, t in seconds.items()})
exit_with_verdict(world, failures, lambda count: f"P={P}: {cases} cases, {count} failures, {empty_cases} (geometry, "
                                                 f"grid, rank) with no atoms; {tally()}; communication: "
                                                 f"{world.library}")
