"""Many structures at once: several structures as one disjoint graph (edges never cross structures), evaluated in one
pass of the model — ``predict_many``, the batched counterpart of ``predict`` — sized by the family's memory model
(``leading_group``) and by the throughput measured while running (``BatchSizer``).

Each structure keeps its own cell, periodicity, charge and spin; its energy, forces and stress equal ``predict`` of
that structure alone up to floating-point summation order (each structure is strained by its own ε, so dE/dε of the
batch is every structure's own). No MPI here: ``mlip_parallel`` spreads batches over ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import nnls

from .committee import Committee, committee_result
from .errors import InvalidStructureError, MLIPError
from .graph import (MIN_DISTANCE, SYSTEM_RANGES, AtomGraph, check_min_distance, check_positions, complete_cell,
                    edge_vectors, strained_coordinates, system_value)
from .messages import available_bytes, evaluation_budget, one_pass_fits
from .predict import model_pairs, voigt_stress


class BatchError(MLIPError, ValueError):
    """A batch that cannot be evaluated: no structure, or a structure that cannot be read (named by its index)."""


@dataclass
class StructureBatch:
    """Structures prepared for one graph (numpy): ``numbers`` [N], ``positions`` [N, 3] Å, ``cells`` [B, 3, 3]
    (complete: non-periodic directions filled in), ``volumes`` [B] Å³ (None where the structure's own cell has no
    volume: no stress), ``sizes`` [B] atoms per structure; the pairs within the model's cutoff ``i``, ``j`` [E],
    ``shifts`` [E, 3] image counts and ``edge_batch`` [E] each edge's structure; ``system`` {charge, spin: [B]};
    ``pbc`` [B, 3] bool."""

    numbers: np.ndarray
    positions: np.ndarray
    cells: np.ndarray
    volumes: list
    sizes: np.ndarray
    i: np.ndarray
    j: np.ndarray
    shifts: np.ndarray
    edge_batch: np.ndarray
    system: dict
    pbc: np.ndarray

    @property
    def size(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> np.ndarray:
        """[B + 1] the first row of each structure, then N."""
        return np.concatenate([[0], np.cumsum(self.sizes)])


def structure_pairs(model, atoms, min_distance: float = MIN_DISTANCE) -> tuple:
    """(positions [n, 3], complete cell [3, 3], i, j, shifts) of one structure for ``model``, checked as the calculator
    checks it: finite positions, a cell with a volume along its periodic directions, elements the model knows, no two
    atoms closer than ``min_distance`` Å (0: unchecked; the binning first, then the model's own neighbour list)."""
    if len(atoms) == 0:
        raise InvalidStructureError("no atoms")
    positions = check_positions(atoms.positions)
    cell = complete_cell(atoms.cell, atoms.pbc)
    model.species_index(atoms.numbers)
    check_min_distance(positions, cell, atoms.pbc, min_distance, search=False)  # (the binning: bounds the list)
    return (positions, cell, *model_pairs(model, positions, cell, atoms.pbc, min_distance))


def prepare_batch(model, structures, min_distance: float = MIN_DISTANCE, names=None) -> StructureBatch:
    """A ``StructureBatch`` of ``structures`` (ASE Atoms, at least one); BatchError naming the first structure that
    is not usable (by ``names[k]``, default its position k in ``structures``), and why."""
    structures = list(structures)
    if not structures:
        raise BatchError("no structures to evaluate")
    parts = []
    for k, atoms in enumerate(structures):
        try:
            parts.append(structure_pairs(model, atoms, min_distance))
            system = {name: system_value(atoms.info, name) for name in SYSTEM_RANGES}
        except MLIPError as exc:
            raise BatchError(f"structure {k if names is None else names[k]}: {exc}") from None
        parts[-1] += (system,)
    sizes = np.array([len(p[0]) for p in parts])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return StructureBatch(
        numbers=np.concatenate([np.asarray(a.numbers) for a in structures]),
        positions=np.concatenate([p[0] for p in parts]), cells=np.stack([p[1] for p in parts]),
        volumes=[a.cell.volume if a.cell.rank == 3 else None for a in structures], sizes=sizes,
        i=np.concatenate([p[2] + o for p, o in zip(parts, offsets)]),
        j=np.concatenate([p[3] + o for p, o in zip(parts, offsets)]),
        shifts=np.concatenate([p[4] for p in parts]).astype(np.float64),
        edge_batch=np.repeat(np.arange(len(parts)), [len(p[2]) for p in parts]),
        system={name: [p[5][name] for p in parts] for name in SYSTEM_RANGES},
        pbc=np.stack([np.broadcast_to(np.asarray(a.pbc, dtype=bool), (3,)) for a in structures]))


def batch_graph(model, batch: StructureBatch, create_graph: bool = False, memory_budget_gb: float | None = None,
                free_bytes: float | None = None):
    """(the strained coordinates, the AtomGraph) of ``batch`` for ``model`` on its device: every structure strained
    by its own ε ([B, 3, 3]; one structure: [3, 3], its graph as ``predict`` builds it); ``memory_budget_gb`` as in
    ``predict.energy_forces`` (over the whole batch; ``free_bytes``: the device's free memory, None: read now)."""
    device, alone = model.device, batch.size == 1
    structure = None if alone else torch.as_tensor(np.repeat(np.arange(batch.size), batch.sizes), device=device)
    x = strained_coordinates(batch.positions, batch.cells[0] if alone else batch.cells, device, batch=structure)
    as_long = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
    i, j = as_long(batch.i), as_long(batch.j)
    edge_vec = edge_vectors(x.positions, i, j, torch.as_tensor(batch.shifts, device=device), x.cell,
                            None if alone else as_long(batch.edge_batch))
    n = len(batch.positions)
    budget = None if create_graph else evaluation_budget(model, memory_budget_gb, n, len(i), device, free_bytes)
    graph = AtomGraph(species=torch.as_tensor(model.species_index(batch.numbers), device=device),
                      edge_index=torch.stack([j, i]), edge_vec=edge_vec, n_local=n, memory_budget=budget,
                      structure=structure, system=batch.system, positions=x.positions, cell=x.cell,
                      pbc=tuple(bool(p) for p in batch.pbc[0]) if alone else batch.pbc)
    return x, graph


def graph_results(model, x, graph) -> tuple:
    """torch float64 (energies [K, n_local], forces [K, n_local, 3], dE/dstrain [K, *strain's shape]) of the graph's
    owned atoms, for each of the K members of a committee (one after another on ``graph``) or for a model (K = 1);
    ``x``: the strained coordinates ``graph``'s edge vectors were computed from."""
    members = [(model.member_graph(k, graph), member) for k, member in enumerate(model.members)] \
        if isinstance(model, Committee) else [(graph, model)]
    results = []
    for k, (member_graph, member) in enumerate(members):
        energies = member(member_graph).to(torch.float64)
        dE_dpos, dE_dstrain = torch.autograd.grad(energies.sum(), [x.pos, x.strain], retain_graph=k < len(members) - 1)
        results.append((energies.detach(), -dE_dpos, dE_dstrain))
    return tuple(torch.stack(values) for values in zip(*results))


def evaluate_batch(model, batch: StructureBatch, stress: bool = True, memory_budget_gb: float | None = None,
                   free_bytes: float | None = None, strain_derivative: bool = False) -> list:
    """``predict_many`` of a prepared batch, in one pass of the model; ``strain_derivative``: each result also holds
    "dE_dstrain" [3, 3] (the unsymmetrised derivative a barostat reads; a committee's combined)."""
    x, graph = batch_graph(model, batch, memory_budget_gb=memory_budget_gb, free_bytes=free_bytes)
    energies, forces, virials = (value.detach().cpu().numpy() for value in graph_results(model, x, graph))
    virials = virials.reshape(len(virials), batch.size, 3, 3)  # (one structure: its strain is [3, 3])
    results = []
    for b, (start, end) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:])):
        volume = batch.volumes[b] if stress else None
        if isinstance(model, Committee):
            result = committee_result(model, energies[:, start:end], forces[:, start:end],
                                      virials[:, b] if volume else None, volume)
        else:
            result = {"energy": float(energies[0, start:end].sum()), "energies": energies[0, start:end],
                      "forces": forces[0, start:end]}
            if volume:
                result["stress"] = voigt_stress(virials[0, b], volume)
        if strain_derivative:
            result["dE_dstrain"] = model.combine(torch.as_tensor(virials[:, b])).numpy() \
                if isinstance(model, Committee) else virials[0, b]
        results.append(result)
    return results


class BatchSizer:
    """How many atoms one graph of a batch holds: ``max_atoms`` when given, else found while running — the size that
    evaluates the structures fastest on this device and model. The cost per atom of a graph is not constant: on a
    CPU it grows with the graph once the model's temporaries leave the cache (SevenNet-0 on one thread: 7 ms per atom
    at 8 atoms, 12 at 288), while a small graph pays the per-call overhead; which wins depends on the model.
    Candidates from one structure per graph up (``CANDIDATES``; on a CPU up to ``CPU_MAX_ATOMS``; the memory model
    bounds every graph, ``leading_group``) are timed in turn until one costs more than ``TOLERANCE`` times the best
    before it (a near tie goes on, and so does a candidate whose graphs held about one structure each, as the
    first's); the fastest is kept.

    A candidate's cost is the median of its graphs' seconds over the seconds the same structures take alone, as
    the first trial (one structure per graph) measured them: seconds = a + b · atoms, fitted to its evaluations
    (non-negative least squares). Candidates see different structures (a relaxation's first ones, then the next),
    and alone a 4-atom cell costs 2.7 times a 32-atom one per atom (cu-emt: 3 ms a call + 0.25 ms an atom), so
    seconds per atom would favour one structure per graph. A trial is at least ``rounds`` evaluations after a
    warm-up call, ``trial_atoms`` atoms, ``trial_structures`` different structures (a relaxation evaluates each
    many times) and ``trial_seconds``. ``record`` takes each graph's structure sizes, seconds (its share of the
    preparation included) and structures' names; ``has_room`` tells a task runner how many structures to hold."""

    CANDIDATES = (1, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # 1: a structure alone
    CPU_MAX_ATOMS = 2048
    TOLERANCE = 1.1  # the search ends at a candidate more than 10 % slower than the best so far,
    ALONE = 1.5  # unless its graphs held fewer structures than this on average (as alone: only noise can tell them)

    def __init__(self, model, max_atoms: float | None = None, rounds: int = 3, trial_atoms: int = 256,
                 trial_structures: int = 8, trial_seconds: float = 0.2):
        self.rounds, self.trial_atoms, self.trial_structures = rounds, trial_atoms, trial_structures
        self.trial_seconds = trial_seconds
        self.trials, self.warm, self.alone = {}, False, None  # trials: {max_atoms: [(sizes, seconds, ids), ...]}
        if max_atoms is not None:
            self.candidates, self.chosen = [max_atoms], max_atoms
            return
        top = self.CPU_MAX_ATOMS if model.device.type == "cpu" else float("inf")
        self.candidates, self.chosen, self.k = [c for c in self.CANDIDATES if c <= top], None, 0

    @property
    def max_atoms(self) -> float:
        """The atoms the next graph may hold (a structure larger than this is a graph of its own)."""
        return self.chosen if self.chosen is not None else self.candidates[self.k]

    def has_room(self, atoms: int, structures: int, size: int, plenty: bool = True) -> bool:
        """Whether a task runner holding ``structures`` structures of ``atoms`` atoms in all takes one more of
        ``size`` atoms: when none is held, up to ``max_atoms`` in all, and while its queue has ``plenty`` (enough
        left for every rank: near the end the ranks share what is left) up to a trial's ``trial_atoms`` in all, while
        searching also up to ``trial_structures`` structures (its evaluations split into graphs of ``max_atoms``).
        Each round then evaluates several structures, one graph after another: as a trial needs them (different
        structures in one round: a relaxation keeps its structures for many rounds), and graphs run back to back,
        which is faster (cu-emt's 8-32-atom cells alone: 5.9 ms each back to back, 8 ms between optimizer steps)."""
        if not structures or atoms + size <= self.max_atoms:
            return True
        return plenty and (atoms + size <= self.trial_atoms or (self.chosen is None and
                                                                structures < self.trial_structures))

    def cost(self, size) -> float:
        """The median over the graphs of at most ``size`` atoms of a graph's seconds over what its structures take
        alone (the median: one graph slowed by this host's noise does not decide)."""
        a, b = self.alone
        return float(np.median([seconds / max(a * len(sizes) + b * sum(sizes), 1e-12)
                                for sizes, seconds, _ in self.trials[size]]))

    def record(self, sizes, seconds: float, ids=(), made_at: float | None = None) -> None:
        """One graph of structures of ``sizes`` atoms (``ids``: the structures' names, as a task's index; none: each
        new), made at ``made_at`` atoms (default: ``max_atoms``), took ``seconds``. Not counted: the first graph (the
        model's warm-up), and one made at an earlier candidate (the rest of a call the search moved on in). (A
        candidate's first graph may take up to twice the next, the allocator growing to its temporaries: the median
        of its cost passes over it.)"""
        if self.chosen is not None or (made_at is not None and made_at != self.max_atoms):
            return
        if not self.warm:
            self.warm = True
            return
        trial = self.trials.setdefault(self.max_atoms, [])
        trial.append((list(map(int, sizes)), seconds, list(ids) or [object() for _ in sizes]))
        if len(trial) < self.rounds or sum(sum(n) for n, _, _ in trial) < self.trial_atoms or \
                len({i for _, _, ids in trial for i in ids}) < self.trial_structures or \
                sum(t for _, t, _ in trial) < self.trial_seconds:
            return
        if self.alone is None:  # the first trial (a structure alone): seconds = a + b * atoms
            rows = np.array([(1.0, float(sum(n))) for n, _, _ in trial])
            self.alone = tuple(nnls(rows, np.array([t for _, t, _ in trial]))[0])
        best = min(self.trials, key=self.cost)
        alone = len(trial) >= sum(len(n) for n, _, _ in trial) / self.ALONE  # (graphs as one structure each makes)
        if (self.cost(self.max_atoms) > self.TOLERANCE * self.cost(best) and not alone) or \
                self.k == len(self.candidates) - 1:
            self.chosen = best
        else:
            self.k += 1


def leading_group(model, sizes, edges, max_atoms: float, free_bytes: float) -> int:
    """How many of the structures (``sizes`` [B] atoms, ``edges`` [B] pairs within the cutoff), from the first, form
    one batch: as many as fit both ``max_atoms`` and the memory pre-flight's one-pass rule (the family's
    ``evaluation_bytes`` of the batch within ``free_bytes``); at least one (a structure that fits neither alone runs
    alone, its edge steps then in chunks, as ``predict`` runs it)."""
    rows = pairs = 0
    for k, (n, e) in enumerate(zip(sizes, edges)):
        rows, pairs = rows + int(n), pairs + int(e)
        if k and (rows > max_atoms or not one_pass_fits(model.evaluation_bytes(rows, pairs, chunked=False),
                                                         free_bytes)):
            return k
    return len(sizes)


def predict_many(model, structures, stress: bool = True, memory_budget_gb: float | None = None,
                 max_atoms: float | None = None, min_distance: float = MIN_DISTANCE, names=None,
                 sizer: BatchSizer | None = None, strain_derivative: bool = False) -> list:
    """``predict`` of each of ``structures`` (ASE Atoms: any sizes, periodic or not, ``info`` charge and spin read
    as ``predict`` reads them), evaluated as graphs of many structures: consecutive structures up to ``max_atoms``
    atoms per graph (None: the size the ``sizer`` finds fastest, ``BatchSizer``) and within the device's free memory
    (``leading_group``). Returns one dict per structure, in order: "energy" (eV), "energies" (n,), "forces" (n, 3)
    eV/Å, "stress" (6,) eV/Å³ where asked and the cell has a volume; a committee's also its model deviation
    (``committee_result``). ``memory_budget_gb`` bounds one chunk of a block's edge temporaries as in ``predict``;
    ``min_distance``: atoms closer are a BatchError naming the structure (``names[k]``, default k) and the pair (0:
    unchecked). ``strain_derivative``: each result also holds "dE_dstrain" [3, 3] (``evaluate_batch``)."""
    start = time.perf_counter()
    batch = prepare_batch(model, structures, min_distance, names)
    sizer = sizer if sizer is not None else BatchSizer(model, max_atoms)
    edges = np.bincount(batch.edge_batch, minlength=batch.size)
    free = available_bytes(model.device)
    preparation = (time.perf_counter() - start) / batch.offsets[-1]  # seconds per atom, counted with each graph
    results, first = [], 0
    while first < batch.size:
        start = time.perf_counter()
        limit = sizer.max_atoms
        last = first + leading_group(model, batch.sizes[first:], edges[first:], limit, free)
        results += evaluate_batch(model, select(batch, range(first, last)), stress, memory_budget_gb, free,
                                  strain_derivative)
        seconds = time.perf_counter() - start + preparation * batch.sizes[first:last].sum()
        sizer.record(batch.sizes[first:last], seconds, () if names is None else names[first:last], limit)
        first = last
    return results


def select(batch: StructureBatch, group) -> StructureBatch:
    """The structures ``group`` (consecutive indices into ``batch``) as a batch of their own."""
    first, last = group[0], group[-1] + 1
    if first == 0 and last == batch.size:
        return batch
    start, end = batch.offsets[first], batch.offsets[last]
    edges = (batch.edge_batch >= first) & (batch.edge_batch < last)
    return StructureBatch(
        numbers=batch.numbers[start:end], positions=batch.positions[start:end], cells=batch.cells[first:last],
        volumes=batch.volumes[first:last], sizes=batch.sizes[first:last], i=batch.i[edges] - start,
        j=batch.j[edges] - start, shifts=batch.shifts[edges], edge_batch=batch.edge_batch[edges] - first,
        system={name: values[first:last] for name, values in batch.system.items()}, pbc=batch.pbc[first:last])
