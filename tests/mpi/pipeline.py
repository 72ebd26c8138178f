"""Pipeline-parallel training (run under mpiexec -n P; P = 2, 3: S = P stages; P = 4: 2 replicas × 2
stages). Energy + force + stress loss, float64, a SchNet of 6 blocks on EMT-labelled copper:

* GPipe and 1F1B, four sweeps (and two sweeps for an energy-only loss; and 1F1B with activation
  recomputation): every stage's parameter gradients equal the single-process double backward (1e-9),
  and the loss equals it;
* 5 AdamW steps: parameters equal the single-process run (1e-9);
* PipeDream-2BW: parameters after 4 steps equal a single-process reference that applies the same
  one-step-delayed update rule.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.calculators.emt import EMT  # noqa: E402
from mpi4py import MPI  # noqa: E402

import potentials  # noqa: E402
from mlip_parallel.pipeline import PipelineTrainer  # noqa: E402
from mlip_parallel.train_cli import Processes  # noqa: E402
from mlip_parallel.training import Batch, Counts, Structure, loss_terms, predict_batch, total_loss  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
P = world.Get_size()
Processes("data")  # torch.distributed over the MPI world (gloo)
STAGES = 2 if P == 4 else P


def structures(n=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        atoms = bulk("Cu", "fcc", a=3.61 * (1 + 0.01 * rng.normal()), cubic=True).repeat((2 - k % 2, 1, 1))
        atoms.rattle(0.08, seed=int(rng.integers(1 << 30)))
        atoms.calc = EMT()
        out.append(Structure(atoms.numbers, atoms.positions, atoms.cell[:], atoms.pbc, atoms.get_potential_energy(),
                             atoms.get_forces(), atoms.get_stress(voigt=False),
                             f"emt:{k}"))
    return out


def model():
    torch.manual_seed(3)
    return potentials.SchNet(["Cu"], cutoff=4.0, features=8, layers=6, rbf=8).double()


DATA = structures()
WEIGHTS = {"energy": 1.0, "forces": 10.0, "stress": 5.0}
ENERGY_ONLY = {"energy": 1.0, "forces": 0.0, "stress": 0.0}


def reference_gradients(net, weights, data=DATA):
    batch = Batch(data, net, net.device)
    loss = total_loss(loss_terms(*predict_batch(net, batch), batch, Counts.of(data)), weights)
    return loss.item(), torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)


failures = []


def compare(label, values, reference, tolerance=1e-9):
    err = max(float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300) for a, b in zip(values, reference))
    err = world.allreduce(err, op=MPI.MAX)
    if world.rank == 0:
        print(f"{label:44s} max rel err {err:.2e}", flush=True)
    if err > tolerance:
        failures.append(label)


VARIANTS = (("gpipe", "forces", False), ("gpipe", "energy", False), ("1f1b", "forces", False),
            ("1f1b", "energy", False), ("1f1b", "forces", True))
if P == 4:  # data x pipeline: the schedule variants already ran on a single pipeline (P = 2, 3)
    VARIANTS = (("1f1b", "forces", False),)
for schedule, sweeps, recompute in VARIANTS:
    weights = WEIGHTS if sweeps == "forces" else ENERGY_ONLY
    net = model()
    trainer = PipelineTrainer(net, STAGES, microbatches=4 if P != 4 else 2, schedule=schedule, sweeps=sweeps,
                              sample=Batch(DATA[:2], net, net.device), recompute=recompute)
    loss = trainer.gradients(DATA, weights)
    ref_loss, ref_grads = reference_gradients(model(), weights)
    owned = {id(p) for p in trainer.parameters}
    mine = [(p.grad, g) for p, g in zip(net.parameters(), ref_grads) if id(p) in owned]
    label = f"{schedule}{' recompute' if recompute else ''} {sweeps}: gradients, boundaries {trainer.boundaries}"
    compare(label, [a for a, _ in mine], [b for _, b in mine])
    if abs(loss - ref_loss) > 1e-10 * abs(ref_loss):
        failures.append(f"{label}: loss {loss} vs {ref_loss}")

# 5 optimizer steps (1F1B, forces), then 2BW against the same delayed rule in one process
for two_bw in (False, True):
    net, reference = model(), model()
    trainer = PipelineTrainer(net, STAGES, microbatches=2, schedule="1f1b", boundaries=None if not two_bw else
                              [0] + [6 * (s + 1) // STAGES for s in range(STAGES)], sample=Batch(DATA[:2], net, net.device),
                              two_bw=two_bw)
    optimizer = torch.optim.AdamW(trainer.parameters, lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    stale = [p.detach().clone() for p in reference.parameters()]
    for step in range(5 if not two_bw else 4):
        batch_data = DATA[(2 * step) % 8:] + DATA[:(2 * step) % 8]  # a different order each step
        trainer.step(batch_data, WEIGHTS, optimizer)
        current = [p.detach().clone() for p in reference.parameters()]
        if two_bw:  # gradient at W_{t-1}, applied to W_t
            with torch.no_grad():
                for p, old in zip(reference.parameters(), stale):
                    p.copy_(old)
        _, grads = reference_gradients(reference, WEIGHTS, batch_data)
        with torch.no_grad():
            for p, now, g in zip(reference.parameters(), current, grads):
                p.copy_(now)
                p.grad = g
        ref_optimizer.step()
        stale = current
    owned = {id(p) for p in trainer.parameters}
    pairs = [(p.detach(), q.detach()) for p, q in zip(net.parameters(), reference.parameters()) if id(p) in owned]
    compare(f"{'2BW' if two_bw else '1F1B'}: parameters after {4 if two_bw else 5} AdamW steps",
            [a for a, _ in pairs], [b for _, b in pairs])

if world.rank == 0:
    layout = f"{P // STAGES} replica(s) x {STAGES} stages"
    print(f"P={P} ({layout}): pipeline {len(failures)} failures {failures}", flush=True)
sys.exit(1 if world.allreduce(len(failures)) else 0)
