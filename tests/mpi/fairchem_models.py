"""fairchem models (the random-weight fixtures of tests/data/fairchem) through mlip_parallel.evaluate == fairchem's
own FAIRChemCalculator on the same checkpoint (its results saved in tests/data/fairchem/references.npz, checked
against the calculator in tests/test_fairchem.py): every geometry × grid for the UMA-S-shaped model (experts routed by
composition; two grids under torch.distributed), every geometry for the UMA-S-1.2 one (omol task with a charge and a spin; max_neighbors cuts every
metal's edges) and the eSEN one, layerwise and, where its shell stays small, wide; float32 once; the ASE calculator
once per model. Float64 to 1e-9 relative, float32 to 1e-5. Every evaluation runs the edge steps in many chunks
(500-edge chunks, a 1-byte budget: several per block on every rank); with the default grid it is also compared with one pass over all edges
(``memory_budget_gb=inf``) to 1e-12. Run under mpiexec -n P or torchrun."""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials.messages as messages  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from comparison import compare  # noqa: E402
from faults import caught  # noqa: E402
from systems import (FAIRCHEM_FIXTURES, GEOMETRIES, cached_fairchem_reference, fairchem_model,  # noqa: E402
                     finish_adapter_run, in_many_chunks, shared_out)

torch.set_num_threads(1)
chunks = in_many_chunks()
messages.MIN_CHUNK_EDGES = 500  # fairchem's edge step costs much per chunk: 500-edge chunks, still several per block
TINY, PLAIN = 1e-9, float("inf")
world = mlip_parallel.get_backend()
P = world.size
GRIDS = {1: [None], 2: [None, (2, 1, 1), (1, 1, 2)], 3: [None, (3, 1, 1), (1, 3, 1), (1, 1, 3)],
         4: [None, (1, 1, 4), (2, 2, 1), (4, 1, 1), (1, 2, 2)]}[P]
# every grid for the UMA fixture under MPI; under torch.distributed (the same halo over another backend) the default
# one and the last (a split along z: the clusters' middle rank owns nothing)
if world.library.startswith("torch"):
    GRIDS = [GRIDS[0], GRIDS[-1]]
WIDE = ("clusters", "small_cell")  # wide mode's shell ((layers + 1) × cutoff) stays affordable here


def against(result, reference, tolerance):
    """``compare`` on the reference's keys (FAIRChemCalculator's: energy, forces, stress where periodic)."""
    return compare({k: result[k] for k in reference}, reference, tolerance)


failures, cases, empty, worst = [], 0, 0, {}
for name in FAIRCHEM_FIXTURES:
    model = fairchem_model(name)
    for geometry, build in GEOMETRIES.items():
        atoms = build()
        reference = cached_fairchem_reference(name, geometry)
        if geometry == "fcc_bulk":
            faults_reference = reference
        for grid in GRIDS if name == "uma-moe" else GRIDS[:1]:
            for mode in ("layerwise", "wide") if geometry in WIDE and grid is None else ("layerwise",):
                result = mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid, memory_budget_gb=TINY)
                label = f"{name} {geometry} grid={grid} {mode}"
                if grid is None and mode == "layerwise":
                    plain = mlip_parallel.evaluate(model, atoms, mode=mode, memory_budget_gb=PLAIN)
                    chunked = compare(result, plain, 1e-12)
                    if not chunked.ok:
                        failures.append(chunked.message(f"{label}: chunked vs plain"))
                comparison = against(result, reference, 1e-9)
                cases += 1
                worst[name] = np.max([worst.get(name, 0.0), comparison.error])
                if not comparison.ok:
                    failures.append(comparison.message(label))
                if grid is not None:
                    owned = world.allgather(len(mlip_parallel.Decomposition(atoms, model.cutoff, world, grid).owned))
                    empty += sum(n == 0 for n in owned)
                    if not shared_out(owned, len(atoms)):
                        failures.append(f"{geometry} grid={grid}: owned atoms per rank {owned}")
    atoms = GEOMETRIES["hcp_triclinic"]()
    atoms.calc = MLIPCalculator(model)
    via = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "stress": atoms.get_stress()}
    comparison = against(via, cached_fairchem_reference(name, "hcp_triclinic"), 1e-9)
    if not comparison.ok:
        failures.append(comparison.message(f"{name} MLIPCalculator hcp_triclinic"))
    if world.rank == 0:
        print(f"{name}: max rel err vs FAIRChemCalculator {worst[name]:.2e} (evaluate), "
              f"{comparison.error:.2e} (MLIPCalculator)", flush=True)
    if name == "uma-moe" and P in (2, 3):  # the halo's faults, planted: each caught by the comparison above
        atoms, grid = GEOMETRIES["fcc_bulk"](), (P, 1, 1)
        failures += caught(world, f"{name} fcc_bulk grid={grid}", lambda: mlip_parallel.evaluate(model, atoms, grid=grid),
                           faults_reference, 1e-9)

single = fairchem_model("uma-moe", dtype=torch.float32)
for geometry in ("sheared", "slab"):
    atoms = GEOMETRIES[geometry]()
    comparison = against(mlip_parallel.evaluate(single, atoms, memory_budget_gb=TINY),
                         cached_fairchem_reference("uma-moe", geometry, torch.float32), 1e-5)
    cases += 1
    if not comparison.ok:
        failures.append(comparison.message(f"uma-moe float32 {geometry}"))

expected = 7 * len(GRIDS) + len(WIDE) + 2 * (7 + len(WIDE)) + 2
finish_adapter_run(world, "fairchem", failures, cases, expected, empty, chunks)
