"""SevenNet-0 through mlip_parallel (evaluate and the ASE calculator) == sevenn's own calculator on
one process: energy, forces, stress to 1e-5 relative (float32). Run under mpiexec -n P."""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
from md import MLIPCalculator  # noqa: E402
from potentials.adapters.sevennet import SevenNet  # noqa: E402
from comparison import compare  # noqa: E402
from faults import caught, tally  # noqa: E402
from systems import SEVENNET_STRUCTURES, exit_with_verdict, sevennet_reference  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
model = SevenNet("7net-0")
failures, worst = [], 0.0
# sevenn's references, each structure's computed by one rank (no rank repeats another's work)
names = list(SEVENNET_STRUCTURES)
mine = {n: sevennet_reference(SEVENNET_STRUCTURES[n]()) for k, n in enumerate(names) if k % world.size == world.rank}
references = {n: r for part in world.allgather(mine) for n, r in part.items()}
for name, build in SEVENNET_STRUCTURES.items():
    atoms = build()
    reference = references[name]
    # wide mode needs a 5 x 5 A ghost shell: affordable for the cluster, not for small periodic cells
    for mode in ("layerwise", "wide") if name == "silicon_cluster" else ("layerwise",):
        result = mlip_parallel.evaluate(model, atoms, mode=mode)
        result.pop("energies")
        comparison = compare(result, reference, 1e-5)
        calc_atoms = atoms.copy()
        calc_atoms.calc = MLIPCalculator(model, mode=mode)
        via_calculator = {"energy": calc_atoms.get_potential_energy(), "forces": calc_atoms.get_forces()}
        if "stress" in reference:
            via_calculator["stress"] = calc_atoms.get_stress()
        via = compare(via_calculator, reference, 1e-5)
        for what, c in (("evaluate", comparison), ("calculator", via)):
            if not c.ok:
                failures.append(c.message(f"{name} {mode} {what}"))
        case_worst = np.max([comparison.error, via.error])
        worst = np.max([worst, case_worst])
        if world.rank == 0:
            print(f"{name:16s} {mode:9s} max rel err vs SevenNetCalculator {case_worst:.2e}", flush=True)
if world.size in (2, 3):  # the halo's faults, planted: each caught by the comparison above
    atoms, grid = SEVENNET_STRUCTURES["silicon_diamond"](), (world.size, 1, 1)
    failures += caught(world, f"silicon_diamond grid={grid}", lambda: mlip_parallel.evaluate(model, atoms, grid=grid),
                       references["silicon_diamond"], 1e-5)
exit_with_verdict(world, failures, lambda count: f"P={world.Get_size()}: SevenNet-0 {count} failures, max rel err "
                                                 f"{worst:.2e}; {tally()}")
