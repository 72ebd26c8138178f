"""Training through the halo: parameter gradients of an energy + force + stress loss computed on a
decomposed structure equal the single-process ones (float64, 1e-9). Run under mpiexec -n P or torchrun
--nproc-per-node P (the job's halo backend, see mlip_parallel.backend.backend_kind).

Two losses: a hand-written one on ``forward_decomposed`` directly, and the training code's own
``graph_parallel_loss`` (what ``mlip-train`` with ``parallel: graph`` runs) against its single-process
``loss_terms(predict_batch(...))``."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mlip_parallel  # noqa: E402
from mlip_parallel.evaluate import Decomposition, forward_decomposed  # noqa: E402
from mlip_parallel.train import training  # noqa: E402
from potentials.graph import complete_cell  # noqa: E402
from potentials.predict import energy_forces  # noqa: E402
from comparison import compare  # noqa: E402
from systems import GEOMETRIES, schnet, shared_out  # noqa: E402

torch.set_num_threads(1)
backend = mlip_parallel.get_backend()
E_WEIGHT = 0.37                     # d loss / d E, a constant (as after the allreduce of E)
STRAIN_WEIGHT = torch.tensor([[0.3, 0.1, -0.2], [0.1, -0.5, 0.05], [-0.2, 0.05, 0.8]], dtype=torch.float64)


def loss_terms(energies, forces, dE_dstrain, reference_forces):
    return (E_WEIGHT * energies.sum() + ((forces - reference_forces) ** 2).sum()
            + (dE_dstrain * STRAIN_WEIGHT).sum())


failures, worst = [], 0.0


def compare_gradients(label, serial, local, model):
    """Sum this rank's parameter gradients (None: zero) over ranks; compare with the serial ones (1e-9)."""
    global worst
    names = [pname for pname, _ in model.named_parameters()]
    if not len(serial) == len(local) == len(names) > 0:
        failures.append(f"{label}: {len(serial)} serial vs {len(local)} local gradients for {len(names)} parameters")
        worst = float("nan")
        return
    for p_serial, p_local, pname in zip(serial, local, names, strict=True):
        p_local = torch.zeros_like(p_serial) if p_local is None else p_local
        total = backend.allreduce(p_local.numpy())
        c = compare(total, p_serial.numpy(), 1e-9)
        worst = float(np.max([worst, c.error]))  # a NaN propagates
        if not c.ok:
            failures.append(c.message(f"{label} {pname}"))


for name in ("fcc_bulk", "sheared", "clusters", "small_cell"):
    atoms = GEOMETRIES[name]()
    rng = np.random.default_rng(0)
    reference_forces = torch.tensor(rng.normal(scale=0.3, size=(len(atoms), 3)))
    for mode in ("layerwise", "wide"):
        model = schnet(torch.float64)
        params = list(model.parameters())
        serial = torch.autograd.grad(loss_terms(*energy_forces(model, atoms, create_graph=True),
                                                reference_forces), params)
        part = Decomposition(atoms, model.cutoff * (model.layers if mode == "wide" else 1), backend)
        e, f, s = forward_decomposed(model, part, mode, create_graph=True)
        local = torch.autograd.grad(loss_terms(e, f, s, reference_forces[part.owned]), params)
        compare_gradients(f"{name} {mode}", serial, local, model)
        owned = backend.allgather(len(part.owned))
        if not shared_out(owned, len(atoms)):
            failures.append(f"{name} {mode}: owned atoms per rank {owned} of {len(atoms)}")
        if backend.rank == 0:
            print(f"{name:12s} {mode:9s} owned per rank {owned} failures so far {len(failures)}", flush=True)

# the training code's graph-parallel loss (energy + forces + stress labels) vs its single-process loss
WEIGHTS = training.LossRule(energy=1.0, forces=10.0, stress=5.0)
for name in ("fcc_bulk", "sheared", "small_cell"):
    atoms = GEOMETRIES[name]()
    rng = np.random.default_rng(1)
    structure = training.Structure(atoms.numbers, atoms.positions, complete_cell(atoms.cell[:], atoms.pbc), atoms.pbc,
                          energy=float(rng.normal()), forces=rng.normal(scale=0.3, size=(len(atoms), 3)),
                          stress=np.diag(rng.normal(scale=0.01, size=3)), source=name)
    model = schnet(torch.float64)
    params = list(model.parameters())
    counts = training.Counts.of([structure])
    batch = training.Batch([structure], model, model.device)
    serial_loss = training.total_loss(training.loss_terms(*training.predict_batch(model, batch), batch, counts),
                                      WEIGHTS)
    serial = torch.autograd.grad(serial_loss, params)
    surrogate, terms = training.graph_parallel_loss(model, structure, WEIGHTS, counts, backend)
    local = torch.autograd.grad(surrogate, params, allow_unused=True)
    c = compare(training.total_loss(terms, WEIGHTS), serial_loss.item(), 1e-10, scale="each")
    loss_err = c.error
    if not c.ok:
        failures.append(c.message(f"graph_parallel_loss {name}: loss"))
    compare_gradients(f"graph_parallel_loss {name}", serial, local, model)
    if backend.rank == 0:
        print(f"graph_parallel_loss {name:12s} loss rel err {loss_err:.1e}, failures so far {len(failures)}", flush=True)

failures = backend.allgather(failures)
if backend.rank == 0:
    flat = [f for fs in failures for f in fs]
    print(f"P={backend.size}: {len(flat)} parameter-gradient mismatches, max rel err {worst:.2e}; "
          f"communication: {backend.library}")
    for f in flat:
        print("FAIL", f)
sys.exit(1 if any(failures) else 0)
