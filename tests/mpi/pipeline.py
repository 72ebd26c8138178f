"""Pipeline-parallel training (run under mpiexec -n P; P = 2, 3: S = P stages; P = 4: 2 replicas × 2
stages). Energy + force + stress loss, float64, SchNet (6 blocks), PaiNN and NequIP (4 blocks each) on
EMT-labelled copper; each rank builds only its stage's parts (seeded part by part) and is compared with
the one-process model built from the same seed:

* every rank's parameters are exactly its stage's parts (names checked against the whole model's);
  no step leaves a tensor with an autograd graph alive (checked in every gradient case);
* gradients of every stage equal the single-process double backward (1e-9), and the loss equals it:
  SchNet with GPipe and 1F1B, four sweeps and two (energy only), and with activation recomputation;
  A's parameter part merged into B (the default: A computes only the cotangent the next stage waits
  for) and not (SchNet 1F1B);
  PaiNN and NequIP with 1F1B; ragged global batches: 7 structures in 4 micro-batches, fewer structures
  than replicas × micro-batches, and (P = 4) a replica with no structure at all;
* split sweeps (A's and B's parameter gradients deferred to WA, WB) and ``auto``: the timed warm-up
  (1F1B on plain and split sweeps in turn, five steps) and the schedule auto then chooses, for SchNet (four sweeps, energy only, recomputation),
  PaiNN and NequIP (P = 4: SchNet and PaiNN), whose measured costs time stage 0's sends in F and A
  (each within its sweep); auto under given costs with a dear W (a split list
  schedule); GPipe and 1F1B on B-split and A+B-split sweeps as given orders (P = 3); 1F1B with B split for
  the last two micro-batches only (``defer_tail``; four sweeps and energy only, P = 4: four sweeps);
  AdamW steps and evaluation with auto (SchNet). These lines print "largest relative difference";
* AdamW steps over two epochs of 7 structures in global batches of 3 (a ragged last batch of 1; auto:
  three epochs, its warm-up timing only the full global batches): parameters equal the single-process run
  (1e-9), for every model;
* PipeDream-2BW: parameters after 4 steps equal a single-process reference that applies the same
  one-step-delayed update rule;
* pipelined evaluation (F and B1 through the stages) gives the single-process error sums;
* the merged checkpoint written part by part loads with ``potentials.load`` and equals the whole model.
"""
import gc
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.calculators.emt import EMT  # noqa: E402
from mpi4py import MPI  # noqa: E402

import potentials  # noqa: E402
import mlip_parallel  # noqa: E402
from mlip_parallel.train.pipeline import WARM_UP_STEPS, PipelineTrainer  # noqa: E402
from mlip_parallel.train.pipeline.schedule import (SWEEPS, Costs, check, defer_tail, gpipe, one_f_one_b,  # noqa: E402
                                          split, sweeps_of)
from mlip_parallel.train.processes import Processes  # noqa: E402
from mlip_parallel.train.structures import Structure  # noqa: E402
from mlip_parallel.train.training import Batch, Counts, LossRule, error_sums, loss_terms, predict_batch, \
    total_loss  # noqa: E402
from comparison import compare  # noqa: E402

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


MODELS = {"SchNet": lambda parts=None: potentials.SchNet(["Cu"], cutoff=4.0, features=8, layers=6, rbf=8,
                                                         parts=parts, seed=3).double(),
          "PaiNN": lambda parts=None: potentials.PaiNN(["Cu"], cutoff=4.0, features=4, layers=4, rbf=8,
                                                       parts=parts, seed=3).double(),
          "NequIP": lambda parts=None: potentials.NequIP(["Cu"], cutoff=4.0, l_max=1, features=2, layers=4, radial=4,
                                                         radial_hidden=8, parts=parts, seed=3).double()}
DATA = structures()
WEIGHTS = LossRule(energy=1.0, forces=10.0, stress=5.0)
ENERGY_ONLY = LossRule(energy=1.0, forces=0.0, stress=0.0)
REFERENCES = {name: build() for name, build in MODELS.items()}  # the whole models, for comparison only


def reference_gradients(net, weights, data):
    batch = Batch(data, net, net.device)
    loss = total_loss(loss_terms(*predict_batch(net, batch), batch, Counts.of(data)), weights)
    return loss.item(), torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)


failures = []


def check_close(label, values, reference, tolerance=1e-9, word="max rel err"):
    """Largest relative difference (max |Δ| / max |reference| per tensor) of matching tensors (``values``,
    ``reference``: name → tensor, the same names), over every rank; a failure above ``tolerance``, on a NaN, on
    names that differ or on nothing to compare, on any rank. ``word`` heads the printed number (tests/test_mpi.py
    counts the "max rel err" lines of the fixed schedules)."""
    c = compare(values, reference, tolerance)
    verdicts = world.allgather((c.ok, c.error, c.message(f"{label} (rank {world.rank})")))
    err = float(np.max([error for _, error, _ in verdicts]))  # a NaN on any rank propagates
    if world.rank == 0:
        print(f"{label:72s} {word} {err:.2e}", flush=True)
    if not all(ok for ok, _, _ in verdicts):
        failures.append("; ".join(message for ok, _, message in verdicts if not ok))


def check_parts(name, trainer):
    """This rank's model holds exactly its stage's parts: every parameter name of the whole model whose
    part is this stage's, and no other."""
    model, whole = trainer.model, REFERENCES[name]
    expected = {n for n, _ in whole.named_parameters() if whole.part_of(n) in trainer.model.parts}
    held = {n for n, _ in model.named_parameters()}
    ok = held == expected and model.parts == potentials.stage_parts(whole.layers, trainer.boundaries, trainer.stage.stage)
    if not all(world.allgather(ok)):
        failures.append(f"{name}: a rank holds parameters outside its stage (rank {world.rank}: {sorted(held ^ expected)})")


def owned_pairs(trainer, values, reference_values):
    """({name: value}, {name: reference}) of this stage's parameters; ``values`` / ``reference_values``: name →
    tensor (a name missing from either: a KeyError, no silent skip)."""
    names = [n for n, _ in trainer.model.named_parameters()]
    return {n: values[n] for n in names}, {n: reference_values[n] for n in names}


def tensors_with_graph() -> int:
    """Live tensors that carry an autograd graph, among the objects made since the last call (after a garbage
    collection of those). Each call then freezes every live object (``gc.freeze``), so the next looks only at what the
    steps between made: a tensor that outlives them is new and counted, and no collection walks the modules, e3nn's
    generated code and the models again (two full collections per case were a third of this script's time)."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes
        count = sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None)
    gc.freeze()
    return count


def gradient_case(name, schedule, sweeps, recompute, microbatches, data, boundaries=None, steps=1, costs=None,
                  lists=None, merge=True, given=None, comm=None):
    """``steps`` gradient computations of one trainer (auto: the first five are the timed warm-up, 1F1B on
    plain and split sweeps in turn; the later ones auto's choice), each compared with one process.
    ``lists``: run this schedule (named ``given``). ``merge``: A's parameter part runs in B (the default; False: A runs
    through the forward graph itself, as with A split). ``comm``: the backend the stages talk through (None: the
    torch.distributed one)."""
    weights = WEIGHTS if sweeps == "forces" else ENERGY_ONLY
    trainer = PipelineTrainer(MODELS[name], STAGES, microbatches=microbatches, schedule=schedule, sweeps=sweeps,
                              sample=data[:2], recompute=recompute, boundaries=boundaries, costs=costs, merge=merge,
                              comm=comm)
    check_parts(name, trainer)
    if lists is not None:  # a given order (e.g. split GPipe: every W after every B, the longest deferral)
        kind = sweeps_of(lists)
        trainer._actions[microbatches, sweeps, 0] = (given or f"{schedule} on {'/'.join(kind)} (given)", lists,
                                                     check(lists, STAGES, microbatches, kind))
    reference = REFERENCES[name]
    ref_loss, ref_grads = reference_gradients(reference, weights, data)
    tensors_with_graph()  # (what the trainer and the reference made is frozen: only the steps' tensors are counted)
    for _ in range(steps):  # auto: the warm-up (plain, split, plain, split, plain), then its choice
        loss = trainer.gradients(data, weights)
        grads = {n: p.grad for n, p in trainer.model.named_parameters()}
        mine, theirs = owned_pairs(trainer, grads, {n: g for (n, _), g in zip(reference.named_parameters(), ref_grads,
                                                                               strict=True)})
        label = (f"{name} {schedule}{' recompute' if recompute else ''} {sweeps}, {len(data)} structures, "
                 f"M={microbatches}: gradients")
        if schedule == "auto" or lists is not None:
            label = f"{name} {trainer.schedule_name}{' recompute' if recompute else ''} {sweeps}, M={microbatches}"
        label += ("" if merge else " (A not merged into B)") + (" (MPI backend)" if comm is not None else "")
        fixed = schedule != "auto" and lists is None and merge
        check_close(label, mine, theirs, word="max rel err" if fixed else "largest relative difference")
        c = compare(loss, ref_loss, 1e-10, scale="each")
        if not c.ok:
            failures.append(c.message(f"{label}: loss {loss} vs {ref_loss}"))
    left = tensors_with_graph()
    if left:  # e.g. a saved-tensor hook that kept a saved output (with its grad_fn: a cycle gc cannot free)
        failures.append(f"{name} {schedule}, {steps} step(s): {left} tensors with an autograd graph outlive the steps")
    if schedule == "auto" and steps > WARM_UP_STEPS[True] and trainer.costs is None:
        failures.append(f"{name} auto: no measured costs after {steps} steps (the warm-up is {WARM_UP_STEPS[True]})")
    if schedule == "auto" and costs is None and trainer.costs is not None and STAGES > 1:  # stage 0 sends in F (A)
        row = trainer.costs.seconds[0]
        sent = {k for k in row if k.endswith(".sent")}
        expected = {"F.sent", "A.sent"} if sweeps == "forces" else {"F.sent"}
        if sent != expected or any(row[k] > row[k.removesuffix(".sent")] for k in sent):
            failures.append(f"{name} auto: stage 0's send times {({k: row[k] for k in sent})} are not those of "
                            f"{sorted(expected)} within their sweeps ({row})")
    return trainer


# ------------------------------------------------------------------- gradients
CASES = [("SchNet", "gpipe", "forces", False), ("SchNet", "gpipe", "energy", False),
         ("SchNet", "1f1b", "forces", False), ("SchNet", "1f1b", "energy", False),
         ("SchNet", "1f1b", "forces", True), ("PaiNN", "1f1b", "forces", False), ("NequIP", "1f1b", "forces", False)]
if P == 4:  # data x pipeline: the schedule variants already ran on a single pipeline (P = 2, 3)
    CASES = [c for c in CASES if c[1:] == ("1f1b", "forces", False)]
for name, schedule, sweeps, recompute in CASES:
    gradient_case(name, schedule, sweeps, recompute, microbatches=4, data=DATA[:7])  # ragged micro-batches
# the stages (and, P = 4, the replicas) talking through the MPI backend instead of torch.distributed
gradient_case("SchNet", "1f1b", "forces", False, microbatches=4, data=DATA[:7], comm=mlip_parallel.get_backend("mpi"))
# A running through the forward graph itself (not merged into B), as before the merge and with A split
gradient_case("SchNet", "1f1b", "forces", False, microbatches=4, data=DATA[:7], merge=False)
# fewer structures than replicas × micro-batches (P = 4: replica 1 gets 1 structure; then none)
gradient_case("SchNet", "1f1b", "forces", False, microbatches=4, data=DATA[:3])
if P == 4:
    gradient_case("PaiNN", "1f1b", "forces", False, microbatches=2, data=DATA[:1])

# ----------------------- split sweeps (B's parameter part deferred to W) and cost-aware schedules (auto)
# auto: the timed warm-up, then the schedule chosen under the measured costs; given costs that make the
# deferred W dear, a split list schedule; split GPipe (every W after every B) and split 1F1B as given orders
AUTO_CASES = [("SchNet", "forces", False), ("SchNet", "energy", False), ("SchNet", "forces", True),
              ("PaiNN", "forces", False), ("NequIP", "forces", False)]
for name, sweeps, recompute in AUTO_CASES if P != 4 else AUTO_CASES[:1] + AUTO_CASES[3:4]:
    gradient_case(name, "auto", sweeps, recompute, microbatches=4, data=DATA[:7], steps=6)
DEAR_W = Costs(tuple({"F": 1.0, "B1": 1.0, "A": 3.0, "A.in": 1.0, "WA": 2.0, "B": 3.0, "B.in": 0.5, "WB": 2.5}
                     for _ in range(STAGES)), latency=0.1)
trainer = gradient_case("SchNet", "auto", "forces", False, microbatches=4, data=DATA[:7], costs=DEAR_W)
if "split" not in trainer.schedule_name:
    failures.append(f"auto under costs with a dear W chose {trainer.schedule_name}, not a split schedule")
if P != 4:
    for schedule, order in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        for parts in (("B",), ("A", "B")):
            lists = order(STAGES, 4, split(SWEEPS["forces"], parts))
            gradient_case("SchNet", schedule, "forces", False, microbatches=4, data=DATA[:7], lists=lists)
    gradient_case("NequIP", "gpipe", "energy", False, microbatches=4, data=DATA[:7],
                  lists=gpipe(STAGES, 4, split(SWEEPS["energy"])))
# B split for the last two micro-batches only (every stage but the first; P = 4: in both replicas)
for sweeps in ("forces", "energy") if P != 4 else ("forces",):
    gradient_case("SchNet", "1f1b", sweeps, False, microbatches=4, data=DATA[:7] if P != 4 else DATA[:8],
                  lists=defer_tail(one_f_one_b(STAGES, 4, SWEEPS[sweeps]), 2), given="1f1b, B split for the last 2")

# --------------------------------------------- optimizer steps with a ragged last batch; evaluation
for name, schedule in [(name, "1f1b") for name in MODELS] + [("SchNet", "auto")]:
    word = "max rel err" if schedule == "1f1b" else "largest relative difference"
    reference = MODELS[name]()
    trainer = PipelineTrainer(MODELS[name], STAGES, microbatches=2, schedule=schedule, sample=DATA[:2])
    optimizer = torch.optim.AdamW(trainer.parameters, lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    data, steps = DATA[:7], 0
    for epoch in range(3 if schedule == "auto" else 2):  # global batches of 3, 3, 1 structures
        order = np.random.default_rng(epoch).permutation(len(data))
        for start in range(0, len(data), 3):
            batch = [data[k] for k in order[start:start + 3]]
            trainer.step(batch, WEIGHTS, optimizer, clip_norm=1.0)
            _, grads = reference_gradients(reference, WEIGHTS, batch)
            for p, g in zip(reference.parameters(), grads, strict=True):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
            ref_optimizer.step()
            steps += 1
    if trainer.costs is None:
        failures.append(f"{name} {schedule}: the warm-up did not end in {steps} steps")
    mine, theirs = owned_pairs(trainer, dict(trainer.model.named_parameters()), dict(reference.named_parameters()))
    check_close(f"{name} {schedule.upper()}: parameters after {steps} AdamW steps (ragged last batch)",
                {n: a.detach() for n, a in mine.items()}, {n: b.detach() for n, b in theirs.items()}, word=word)
    sums = trainer.error_sums(DATA, batch_size=3)
    expected = error_sums(reference, DATA, 3, reference.device)
    check_close(f"{name}{' auto' if schedule == 'auto' else ''}: pipelined evaluation error sums",
                {"error sums": torch.as_tensor(sums)}, {"error sums": torch.as_tensor(expected)}, word=word)
    if name == "NequIP":  # the merged checkpoint, written part by part, is the whole model
        directory = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None)
        trainer.save_merged(os.path.join(directory, "merged.pt"))
        if world.rank == 0:
            merged = potentials.load(os.path.join(directory, "merged.pt"))
            state, ref_state = merged.state_dict(), reference.state_dict()
            if set(state) != set(ref_state) or not merged.complete:
                failures.append(f"merged checkpoint keys differ: {sorted(set(state) ^ set(ref_state))}")
            atoms = DATA[0].to_atoms()
            got, want = potentials.predict(merged, atoms), potentials.predict(reference, atoms)
            c = compare({"weights": dict(state), "forces": got["forces"]},  # empty weight tensors: nothing to differ
                        {"weights": dict(ref_state), "forces": want["forces"]}, 1e-12, scale="absolute")
            print(f"{'NequIP merged checkpoint vs whole model (weights, forces)':72s} max abs err {c.error:.2e}",
                  flush=True)
            if not c.ok:
                failures.append(c.message("merged checkpoint"))

# ------------------------------------------- 2BW against the same delayed rule in one process
net_build, reference = MODELS["SchNet"], MODELS["SchNet"]()
trainer = PipelineTrainer(net_build, STAGES, microbatches=2, schedule="1f1b",
                          boundaries=[6 * s // STAGES for s in range(STAGES + 1)], two_bw=True)
optimizer = torch.optim.AdamW(trainer.parameters, lr=1e-3)
ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
stale = [p.detach().clone() for p in reference.parameters()]
for step in range(4):
    batch_data = DATA[(2 * step) % 8:] + DATA[:(2 * step) % 8]  # a different order each step
    trainer.step(batch_data, WEIGHTS, optimizer)
    current = [p.detach().clone() for p in reference.parameters()]
    with torch.no_grad():  # gradient at W_{t-1}, applied to W_t
        for p, old in zip(reference.parameters(), stale, strict=True):
            p.copy_(old)
    _, grads = reference_gradients(reference, WEIGHTS, batch_data)
    with torch.no_grad():
        for p, now, g in zip(reference.parameters(), current, grads, strict=True):
            p.copy_(now)
            p.grad = g
    ref_optimizer.step()
    stale = current
mine, theirs = owned_pairs(trainer, dict(trainer.model.named_parameters()), dict(reference.named_parameters()))
check_close("SchNet 2BW: parameters after 4 AdamW steps", {n: a.detach() for n, a in mine.items()},
            {n: b.detach() for n, b in theirs.items()})

if world.rank == 0:
    layout = f"{P // STAGES} replica(s) x {STAGES} stages"
    print(f"P={P} ({layout}): pipeline {len(failures)} failures {failures}", flush=True)
sys.exit(1 if world.allreduce(len(failures)) else 0)
