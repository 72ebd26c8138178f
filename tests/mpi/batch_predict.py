"""mlip_parallel.predict_many under mpiexec -n P: ragged structures (1-108 atoms, periodic and not, Cu-Ag; SchNet
and a SchNet + PaiNN committee, float64) shared by the ranks equal potentials.predict of each structure alone in this
process (1e-12), on every rank; a bad structure in one rank's share is a BatchError naming it on every rank; ranks
given different lists are a RanksDisagreeError on every rank."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402
from comparison import compare  # noqa: E402
from ase import Atoms  # noqa: E402
from mlip_parallel.errors import RanksDisagreeError  # noqa: E402
from potentials.batch import BatchError  # noqa: E402
from systems import exit_with_verdict  # noqa: E402
from test_batch import ragged  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
failures = []
structures = ragged(["Ag", "Cu"], large=False)
models = {"SchNet": potentials.SchNet(["Ag", "Cu"], cutoff=4.0, seed=0).double(),
          "committee": potentials.Committee([potentials.SchNet(["Ag", "Cu"], cutoff=4.0, seed=0).double(),
                                             potentials.PaiNN(["Ag", "Cu"], cutoff=3.5, seed=1).double()])}
for name, model in models.items():
    results, worst = mlip_parallel.predict_many(model, structures, max_atoms=64), 0.0
    for k, (result, atoms) in enumerate(zip(results, structures)):
        alone = mlip_parallel.evaluate(model, atoms, comm=MPI.COMM_SELF) if name == "committee" else \
            potentials.predict(model, atoms)
        if set(result) != set(alone):
            failures.append(f"{name} structure {k}: keys {sorted(set(result) ^ set(alone))}")
            continue
        for key, value in alone.items():
            comparison = compare(result[key], value, 1e-12)
            worst = max(worst, comparison.error)
            if not comparison.ok:
                failures.append(f"{name} structure {k} {key}: {comparison.message('')}")
    if world.rank == 0:
        print(f"{name}: {len(results)} structures over {world.size} ranks, max rel err {worst:.1e}", flush=True)
close = structures[:6] + [Atoms("Cu2", positions=[[0, 0, 0], [0.2, 0, 0]])]  # held by one rank only
try:
    mlip_parallel.predict_many(models["SchNet"], close)
    failures.append("atoms too close: no error")
except BatchError as exc:  # on every rank, not only the one whose share held it (no rank left waiting)
    if "structure 6: atoms 0 and 1 are 0.2 Å apart" not in str(exc):
        failures.append(f"atoms too close: {exc}")
try:
    mlip_parallel.predict_many(models["SchNet"], structures[: 3 + world.rank])
    failures.append("different lists on the ranks: no error")
except RanksDisagreeError as exc:
    if "different lists of structures" not in str(exc):
        failures.append(f"different lists: {exc}")
exit_with_verdict(world, failures, lambda n: f"batch_predict on {world.size} ranks: {n} failure(s)")
