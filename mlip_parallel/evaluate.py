"""Distributed evaluation of a potential over a spatial decomposition (docs/architecture.md §3)."""
from __future__ import annotations

import math
import time
import weakref
import zlib
from typing import NamedTuple

import numpy as np
import torch

from potentials.batch import graph_results
from potentials.committee import Committee, committee_result, deviations
from potentials.graph import (MIN_DISTANCE, AtomGraph, NoHalo, check_positions, check_structure, edge_vectors,
                              neighbour_pairs, strained_coordinates, system_of)
from potentials.messages import memory_budget_bytes
from potentials.predict import periodic_graph, voigt_stress

from .backend import get_backend, rank_device
from .comm import FeatureHalo, RankAlltoall, RankGather, RankSum
from .domain import Domain
from .errors import LostAtomsError, RanksDisagreeError, SimulationError
from .grid import Grid
from .preflight import HOST_MEMORY_REFRESH_S, check_rank_memory
from .subdomain import Subdomain

MODES = ("layerwise", "wide")


class Decomposition(Subdomain):
    """The ``Subdomain`` of this rank in a structure ``atoms`` that every rank holds alike (ghosts within
    ``r_ghost`` Å; no skin, no candidates); ``owned`` [n_local] indices of its atoms in ``atoms``. With
    ``model``, the memory pre-flight runs first (``preflight.check_rank_memory``: MemoryLimitError on every
    rank when the fullest rank would not fit; ``layerwise`` as the evaluation runs) and ``memory_budget_gb`` becomes
    the budget the evaluation runs with (given, or the automatic choice: inf where one pass fits)."""

    def __init__(self, atoms, r_ghost: float, backend, grid=None, model=None, layerwise: bool = True,
                 memory_budget_gb: float | None = None):
        positions = check_positions(atoms.positions)
        domain = Domain.from_positions(positions, atoms.cell, atoms.pbc)
        super().__init__(backend, domain, Grid.for_ranks(backend.size, domain, grid))
        self.memory_budget_gb = memory_budget_gb
        if model is not None:
            self.memory_budget_gb = check_rank_memory(backend, model, len(positions), domain, self.grid.dims, r_ghost,
                                                      0.0, layerwise, memory_budget_gb)
        wrapped, _ = domain.wrap(positions)
        self.owned = np.flatnonzero(self.grid.owner(domain.wrapped_fractional(wrapped)) == backend.rank)
        self.build(wrapped[self.owned], self.owned, np.asarray(atoms.numbers)[self.owned], r_ghost)


def ghost_reach(model, mode: str) -> float:
    """The ghost shell (Å) a rank needs beyond its subdomain: one cutoff in layerwise mode (ghost
    features are refreshed between layers), layers × cutoff in wide mode (no communication inside)."""
    return model.cutoff * (model.layers if mode == "wide" else 1)


class GlobalSums(NamedTuple):
    """A decomposed evaluation's totals over every rank: ``energy`` (eV) and ``virial`` = dE/dε [3, 3]."""

    energy: float
    virial: np.ndarray


def rank_totals(backend, energies, dE_dstrain, forces=None) -> tuple:
    """This rank's owned energies [K, n_local] and dE/dstrain [K, 3, 3] of K models summed over all ranks in one
    device → host copy and one allreduce: (energies [K] eV, dE/dε [K, 3, 3], the non-finite rows of ``forces``
    [n_local, 3] counted over every rank, 0 without ``forces``)."""
    k = energies.shape[0]
    local = [energies.detach().sum(dim=1).double(), dE_dstrain.detach().reshape(k * 9).double()]
    if forces is not None:
        local.append((~torch.isfinite(forces)).any(dim=1).sum().reshape(1).double())
    totals = backend.allreduce(torch.cat(local).cpu().numpy())
    return totals[:k], totals[k:10 * k].reshape(k, 3, 3), int(totals[10 * k]) if forces is not None else 0


def global_sums(backend, energies, dE_dstrain, forces=None) -> GlobalSums:
    """Sum this rank's owned energies [n_local] and dE/dstrain [3, 3] over all ranks (``rank_totals``). With
    ``forces`` [n_local, 3], the same copy and allreduce count the non-finite ones: SimulationError on every rank
    alike when there are any."""
    energy, virial, bad = rank_totals(backend, energies[None], dE_dstrain[None], forces)
    if bad:
        raise SimulationError(f"non-finite forces on {bad} atom(s) (energy {energy[0]:.6g} eV)")
    return GlobalSums(float(energy[0]), virial[0])


class CommitteeStep(NamedTuple):
    """A committee's evaluation of this rank's share (``committee_step``): the committee's per-atom ``energies``
    [n_local] and ``forces`` [n_local, 3] (torch float64), its global ``energy`` (eV) and ``dE_dstrain`` [3, 3]
    (numpy, summed over ranks), the owned atoms' ``devi_f`` σ_F and ``devi_energies`` [n_local] (torch), and
    ``member_energies`` [K] (numpy, global)."""

    energies: torch.Tensor
    forces: torch.Tensor
    energy: float
    dE_dstrain: np.ndarray
    devi_f: torch.Tensor
    devi_energies: torch.Tensor
    member_energies: np.ndarray


def committee_step(committee, sub: Subdomain, mode: str = "layerwise",
                   memory_budget_gb: float | None = None, system: dict | None = None) -> CommitteeStep:
    """``members_decomposed`` combined (``Committee.combine``: the members' mean, or the first's) and summed over
    the ranks, with the model deviation of the owned atoms (collective; SimulationError on non-finite forces)."""
    energies, forces, dE_dstrain = members_decomposed(committee, sub, mode, memory_budget_gb, system)
    combined = committee.combine(forces)
    totals, virials, bad = rank_totals(sub.comm.backend, energies, dE_dstrain, combined)
    if bad:
        raise SimulationError(f"non-finite forces on {bad} atom(s)")
    devi_f, devi_energies = deviations(forces, energies)
    return CommitteeStep(committee.combine(energies), combined, float(committee.combine(torch.as_tensor(totals))),
                         committee.combine(torch.as_tensor(virials)).numpy(), devi_f, devi_energies, totals)


def deviation_summary(backend, devi_f, member_energies, n_atoms: int) -> dict:
    """DeePMD's model deviation of a frame from this rank's owned atoms' σ_F ``devi_f`` [n_local] and the members'
    global energies [K] (collective): "max_devi_f", "min_devi_f", "avg_devi_f" (over every atom, eV/Å) and
    "devi_e" (the members' standard deviation of the total energy over ``n_atoms``, eV); 0 for no atom. One process's
    data: ``SerialBackend()``."""
    local = np.asarray(torch.as_tensor(devi_f).detach().cpu(), dtype=np.float64)
    top, low = backend.allreduce(np.array([local.max(initial=0.0), -local.min(initial=np.inf)]), op="max")
    total = float(backend.allreduce(np.array([local.sum()]))[0])
    n = max(int(n_atoms), 1)
    return {"max_devi_f": float(top), "min_devi_f": float(-low) if np.isfinite(low) else 0.0,
            "avg_devi_f": total / n, "devi_e": float(np.std(member_energies)) / n}


class RankTotal:
    """``AtomGraph.total`` over a decomposition: one allreduce (host-staged float64; exact for counts < 2^53)."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        summed = self.backend.allreduce(x.detach().double().cpu().numpy())
        return torch.as_tensor(summed, device=x.device).to(x.dtype)


def decomposed_graph(model, sub: Subdomain, mode: str = "layerwise", create_graph: bool = False,
                     memory_budget_gb: float | None = None, system: dict | None = None) -> tuple:
    """(the strained coordinates, the AtomGraph) of this rank's share ``sub`` for ``model`` (its cutoff, layers,
    species and device; ``forward_decomposed`` says the rest; ``system``: the structure's ``AtomGraph.system``).
    Collective only in what the model then exchanges."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    halo, device = sub.comm, model.device
    x = strained_coordinates(sub.positions, sub.domain.cell, device)
    all_pos = torch.cat([x.positions, halo.ghost_positions(x.positions, x.cell)])

    rows = all_pos.detach()  # pairs are chosen where the positions are (on the GPU for a CUDA model)
    if sub.candidates is None:
        i, j = neighbour_pairs(rows, model.cutoff)
    else:
        i, j = sub.candidates
        delta = rows[j] - rows[i]
        near = (delta * delta).sum(dim=1) < model.cutoff**2
        i, j = i[near], j[near]
    if mode == "layerwise":
        keep = i < halo.n_local
    else:  # atoms farther than (layers - 1) cutoffs (+ skin) from the subdomain only ever send
        receives = sub.within(rows.cpu().numpy(), (model.layers - 1) * model.cutoff + sub.skin)
        keep = torch.as_tensor(receives, device=device)[i]
    i_t, j_t = i[keep], j[keep]
    graph = AtomGraph(
        species=sub.species(model),
        edge_index=torch.stack([j_t, i_t]),
        edge_vec=edge_vectors(all_pos, i_t, j_t),
        n_local=halo.n_local,
        halo=FeatureHalo(halo) if mode == "layerwise" else NoHalo(),
        n_receivers=halo.n_local if mode == "layerwise" else None,
        memory_budget=None if create_graph else memory_budget_bytes(memory_budget_gb, device),
        total=RankTotal(halo.backend),
        system=system,
        positions=x.positions,
        cell=x.cell,
        pbc=tuple(bool(p) for p in sub.domain.pbc),
        rank_sum=RankSum(halo.backend),
        rank_gather=RankGather(halo.backend),
        rank_alltoall=RankAlltoall(halo.backend),
    )
    return x, graph


def forward_decomposed(model, sub: Subdomain, mode: str = "layerwise", create_graph: bool = False,
                       memory_budget_gb: float | None = None, system: dict | None = None):
    """Differentiable evaluation of this rank's share ``sub`` (collective: every rank calls it together;
    ``sub``'s ghost shell must reach ``ghost_reach(model, mode)``).

    Returns torch float64 (energies [n_local], forces [n_local, 3], dE/dstrain [3, 3]) for the owned
    atoms, on the model's device. Forces are those of the *total* energy (ghost gradients come home
    through the reverse exchange); dE/dstrain is this rank's part — sum it over ranks. With
    ``create_graph`` the results stay differentiable w.r.t. the parameters: a loss on them
    backpropagates through the halo (training on decomposed structures). Without it the blocks' edge
    steps run in chunks of at most ``memory_budget_gb`` (None: chosen from the device's free memory).
    """
    x, graph = decomposed_graph(model, sub, mode, create_graph, memory_budget_gb, system)
    energies = model(graph).to(torch.float64)
    # Every rank differentiates the same op sequence, so the reverse exchanges run in lock-step.
    dE_dpos, dE_dstrain = torch.autograd.grad(energies.sum(), [x.pos, x.strain], create_graph=create_graph)
    return energies, -dE_dpos, dE_dstrain


def members_decomposed(committee, sub: Subdomain, mode: str = "layerwise",
                       memory_budget_gb: float | None = None, system: dict | None = None) -> tuple:
    """Each member of ``committee`` (``potentials.Committee``) on one graph of ``sub`` (one decomposition, one set
    of ghosts and pairs; each member its own halo exchanges, one after another on every rank): torch float64
    (energies [K, n_local], forces [K, n_local, 3], dE/dstrain [K, 3, 3]) of the owned atoms (collective)."""
    return graph_results(committee, *decomposed_graph(committee, sub, mode, False, memory_budget_gb, system))


STRUCTURE_PARTS = ("number of atoms", "elements", "positions", "cell", "periodicity", "charge and spin")


def structure_digest(atoms) -> np.ndarray:
    """[6] float64: the number of atoms and a CRC-32 of each of the elements, positions, cell, periodicity and
    ``atoms.info``'s "charge" and "spin" (as given: nothing here is validated, so nothing raises on one rank alone):
    equal exactly where the structures are equal bit for bit (whole numbers below 2**32, exact in float64)."""
    def crc(array, dtype) -> float:
        return float(zlib.crc32(np.ascontiguousarray(array, dtype=dtype).tobytes()))

    charge_spin = repr([atoms.info.get(name) for name in ("charge", "spin")]).encode()
    return np.array([len(atoms), crc(atoms.numbers, np.int64), crc(atoms.positions, np.float64),
                     crc(atoms.cell[:], np.float64), crc(atoms.pbc, np.bool_), float(zlib.crc32(charge_spin))])


def check_same_structure(backend, atoms) -> None:
    """Every rank of ``backend`` must evaluate the same structure: one all-reduce of 12 numbers (the maximum of
    ``structure_digest`` and of its negative), before any check a rank makes of its atoms alone. RanksDisagreeError
    on every rank, naming what differs and the way out, where the ranks were given different structures (ASE's
    NEB(parallel=True) gives each rank its own image; velocities drawn on each rank alone make every rank's positions
    its own after one step)."""
    if backend.size == 1:
        return
    digest = structure_digest(atoms)
    extremes = backend.allreduce(np.concatenate([digest, -digest]), op="max")
    highest, lowest = extremes[:len(digest)], -extremes[len(digest):]
    differ = [part for part, a, b in zip(STRUCTURE_PARTS, highest, lowest, strict=True) if a != b]
    if differ:
        raise RanksDisagreeError(
            f"the {backend.size} ranks of this communicator were given different structures ({', '.join(differ)} "
            f"differ): each evaluation splits one structure over the ranks that call it together, so every rank of "
            f"a calculator's communicator must pass the same atoms. Images of ASE's NEB(parallel=True) each need "
            f"their own communicator: MLIPCalculator(model, comm=world.Split(image)) (examples/neb_parallel.py); "
            f"velocities or rattles drawn on each rank must be drawn alike (a seeded generator, or comm=world)")


def evaluate(model, atoms, *, mode: str = "layerwise", grid=None, comm=None, stress: bool = True,
             device=None, memory_budget_gb: float | None = None, min_distance: float = MIN_DISTANCE,
             decompose: bool | None = None) -> dict:
    """Energy, forces, per-atom energies and stress of ``atoms``, computed spatially decomposed.

    Every rank calls this with the same ``atoms`` (checked on every call: RanksDisagreeError otherwise). ``mode``:
    "layerwise" (ghost shell = cutoff, ghost node features refreshed between layers) or "wide" (ghost shell =
    layers × cutoff, no communication inside the model). ``grid``: (px, py, pz) or None for the minimum-surface
    grid. ``comm``: an mpi4py communicator, a backend, or None (MPI.COMM_WORLD under mpiexec, serial otherwise).
    ``device``: None puts each rank's model on ``cuda:<local rank>`` where CUDA exists, else CPU (the model is
    moved).
    ``memory_budget_gb``: the most one chunk of a block's per-edge temporaries may take on a rank
    (None: every edge at once where the memory pre-flight predicts that fits, else a share of the device's free
    memory); it bounds memory and leaves the results unchanged. ``decompose``: split the structure into
    subdomains with ghost atoms (None: where there are several ranks or a ``grid``); one process otherwise
    evaluates the whole structure with periodic images as edge shifts, as the packages' own calculators do
    (True on one rank: the images come through the halo as ghost atoms, the decomposed code path in one process).
    ``min_distance``: atoms closer than this (Å; 0: unchecked) are an error (``check_structure``). The
    structure's ``atoms.info`` "charge" and "spin" (whole numbers) go to a model that reads them (fairchem's omol
    task, as FAIRChemCalculator reads them); without them the model's own.
    Before any ghost exists, the memory pre-flight stops every rank with MemoryLimitError when the
    fullest rank would not fit (``mlip_parallel.preflight``).

    Returns numpy float64 in the caller's atom order, identical on every rank: "energy" (eV),
    "energies" (N,), "forces" (N, 3) eV/Å, and "stress" (6,) eV/Å³ in ASE's Voigt order and sign when
    ``stress`` and the cell has a volume.

    A committee (``potentials.Committee``, or a list of models: one with ``forces="mean"``) runs its members on one
    decomposition; its energy, forces and stress are their mean (or its first member's), and the result also holds
    the model deviation (``potentials.committee.committee_result``): "devi_f" (N,) σ_F per atom, "devi_energies"
    (N,) the per-atom energy deviation, "max_devi_f", "min_devi_f", "avg_devi_f" (eV/Å), "devi_e" (the members'
    standard deviation of the energy per atom, eV) and "member_energies" (K,).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(model, (list, tuple)):
        model = Committee(model)
    backend = get_backend(comm)
    check_same_structure(backend, atoms)  # first: the checks below assume every rank holds these atoms
    device = torch.device(device) if device is not None else rank_device(backend)
    if model.device != device:
        model.to(device)
    model.species_index(atoms.numbers)  # unknown elements and bad structures raise here, on every rank alike
    if not 0 <= min_distance < math.inf:
        raise ValueError(f"min_distance must be a finite number >= 0 (Å), got {min_distance}")
    decomposed = bool(decompose or (decompose is None and (backend.size > 1 or grid is not None)))
    # one process: the binning here, the closest pair from the periodic graph's own neighbour list
    checked = check_structure(atoms.positions, atoms.cell, atoms.pbc, min_distance, search=decomposed)
    system = system_of(atoms.info)
    if decompose is False and backend.size > 1:
        raise ValueError(f"decompose=False evaluates the whole structure in one process, but the communicator has "
                         f"{backend.size} ranks: leave decompose at None (or pass a one-rank comm)")
    n = len(atoms)
    if decomposed:
        part = Decomposition(atoms, ghost_reach(model, mode), backend, grid, model, mode == "layerwise",
                             memory_budget_gb)
        x, graph = decomposed_graph(model, part, mode, False, part.memory_budget_gb, system)
        energies, forces, virials = gathered(backend, part.owned, *graph_results(model, x, graph), n)
    else:  # one process, the whole structure: the pre-flight of one rank without ghosts, then the periodic graph
        budget_gb = one_process_budget(backend, model, atoms, memory_budget_gb, checked)
        x, graph = periodic_graph(model, atoms, False, budget_gb, min_distance, checked)
        energies, forces, virials = (value.cpu().numpy() for value in graph_results(model, x, graph))
    # the cell's volume where it has three vectors (ASE's cell.rank == 3; then the complete cell is the cell)
    volume = abs(float(np.linalg.det(checked[1]))) if atoms.cell.array.any(axis=1).all() else None
    if isinstance(model, Committee):
        return committee_result(model, energies, forces, virials if stress and volume else None, volume)
    result = {"energy": float(energies[0].sum()), "energies": energies[0], "forces": forces[0]}
    if stress and volume:
        result["stress"] = voigt_stress(virials[0], volume)
    return result


_last_budget: dict = {}  # one_process_budget's last (key, when, GB)


def one_process_budget(backend, model, atoms, memory_budget_gb: float | None, checked: tuple) -> float:
    """``check_rank_memory`` of one process that holds the whole structure ``atoms`` (no ghosts): the chunk budget
    (GB; inf: one pass) or MemoryLimitError. Its estimate reads only the atom count and the region, so within the
    host memory's refresh time (``preflight.HOST_MEMORY_REFRESH_S``) the last answer stands for the same model, count,
    region and ``memory_budget_gb`` (an optimizer's or integrator's steps in a fixed periodic cell: there the region
    is the cell, and the positions are not read). ``checked``: ``check_structure``'s (positions, complete cell)."""
    positions, cell = checked
    pbc = np.broadcast_to(np.asarray(atoms.pbc, dtype=bool), (3,))
    domain = None if pbc.all() else Domain.from_positions(positions, cell, pbc)
    region = (cell, pbc) if domain is None else (domain.cell, domain.pbc, domain.lo, domain.hi)
    key = (weakref.ref(model), str(model.device), model.dtype, len(atoms), memory_budget_gb,
           *(np.asarray(array).tobytes() for array in region))
    last = _last_budget.get("key")
    if last == key and time.monotonic() - _last_budget["when"] <= HOST_MEMORY_REFRESH_S:
        return _last_budget["budget_gb"]
    domain = domain or Domain.from_positions(positions, cell, pbc)
    budget_gb = check_rank_memory(backend, model, len(atoms), domain, (1, 1, 1), 0.0, 0.0, True, memory_budget_gb)
    _last_budget.update(key=key, when=time.monotonic(), budget_gb=budget_gb)
    return budget_gb


def gathered(backend, owned: np.ndarray, energies, forces, dE_dstrain, n: int) -> tuple:
    """numpy float64 (energies [K, n], forces [K, n, 3], dE/dstrain [K, 3, 3]) of the whole structure, on every rank
    (collective), from each rank's ``graph_results`` of its ``owned`` atoms (indices [n_local]): LostAtomsError
    unless every atom is owned by exactly one rank."""
    parts = backend.allgather((owned, energies.cpu().numpy(), forces.cpu().numpy(), dE_dstrain.cpu().numpy()))
    k = energies.shape[0]
    counts = np.zeros(n, dtype=np.int64)
    all_energies, all_forces = np.zeros((k, n)), np.zeros((k, n, 3))
    for ids, e, f, _ in parts:
        counts[ids] += 1
        all_energies[:, ids], all_forces[:, ids] = e, f
    if np.any(counts != 1):
        raise LostAtomsError(f"{int((counts == 0).sum())} atom(s) owned by no rank and "
                             f"{int((counts > 1).sum())} by several")
    return all_energies, all_forces, sum(p[3] for p in parts)
