"""Training potentials on energies, forces and stress: data, batched prediction, the loss, and the
three ways to run it — one process, data parallel (every rank a share of each global batch, gradients
summed with torch.distributed), and graph parallel (every structure spatially decomposed over the
ranks with ``forward_decomposed``; the force loss back-propagates through the halo). The steps a job takes, not the
job: ``trainer.py`` runs an ``mlip-train`` job with them, ``pipeline/trainer.py`` a pipeline-parallel one.

Conventions: energies eV, forces eV/Å, stress eV/Å³ as a [3, 3] tensor in ASE's sign ((1/V) dE/dε).
The loss of a global batch is a mean over that whole batch, so summing the ranks' gradients gives
exactly the single-process gradient (up to summation order).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from potentials.errors import UnknownSpeciesError
from potentials.graph import SYSTEM_RANGES, AtomGraph, edge_vectors, strained_coordinates

from ..errors import MLIPError
from ..evaluate import Decomposition, forward_decomposed, ghost_reach, global_sums
from .structures import DataError, Structure

QUANTITIES = ("energy", "forces", "stress")


# ----------------------------------------------------------------------------- batches
class Labels:
    """The labels of ``structures`` on ``device``, as ``loss_terms`` reads them: energy [B] eV,
    ``atoms_per_structure`` [B], forces [N, 3] eV/Å, stress [B, 3, 3] eV/Å³ (NaN where absent) and the
    masks ``has_energy`` [B], ``has_forces`` [N], ``has_stress`` [B] (bool), ``row_structure`` [N] the structure of
    each force row, ``config_types`` [B] (str or None). ``rows``: of one structure, only these atoms' forces (a
    rank's owned atoms in graph-parallel training)."""

    def __init__(self, structures, device, rows=None):
        f64 = dict(dtype=torch.float64, device=device)
        self.atoms_per_structure = torch.as_tensor([len(s.numbers) for s in structures], **f64)
        self.energy = torch.tensor([np.nan if s.energy is None else s.energy for s in structures], **f64)
        forces = np.concatenate([np.full((len(s.numbers), 3), np.nan) if s.forces is None else s.forces
                                 for s in structures])
        sizes = [len(s.numbers) for s in structures]
        has_forces = np.repeat([s.forces is not None for s in structures], sizes)
        row_structure = np.repeat(np.arange(len(structures)), sizes)
        if rows is not None:
            forces, has_forces, row_structure = forces[rows], has_forces[rows], row_structure[rows]
        self.row_structure = torch.as_tensor(row_structure, device=device)
        self.config_types = [s.config_type for s in structures]
        self.forces = torch.as_tensor(forces, **f64)
        self.stress = torch.as_tensor(np.stack(
            [np.full((3, 3), np.nan) if s.stress is None else s.stress for s in structures]), **f64)
        as_mask = lambda flags: torch.as_tensor(np.asarray(flags, dtype=bool), device=device)  # noqa: E731
        self.has_energy = as_mask([s.energy is not None for s in structures])
        self.has_forces = as_mask(has_forces)
        self.has_stress = as_mask([s.stress is not None for s in structures])


class Batch(Labels):
    """Several structures as one disjoint graph on ``device``: species [N], edges, ``batch`` [N]
    structure index of each atom, ``system`` their charges and spins (``AtomGraph.system``), and their ``Labels``."""

    def __init__(self, structures, model, device):
        super().__init__(structures, device)
        self.size = len(structures)
        self.n_atoms = np.array([len(s.numbers) for s in structures])
        offsets = np.concatenate([[0], np.cumsum(self.n_atoms)[:-1]])
        i, j, shifts, edge_batch = [], [], [], []
        for b, (s, offset) in enumerate(zip(structures, offsets)):
            ii, jj, ss = s.edges(model.cutoff)
            i.append(ii + offset), j.append(jj + offset), shifts.append(ss), edge_batch.append(np.full(len(ii), b))
        as_long = lambda parts: torch.as_tensor(np.concatenate(parts), dtype=torch.long, device=device)  # noqa: E731
        self.i, self.j, self.edge_batch = as_long(i), as_long(j), as_long(edge_batch)
        self.shifts = torch.as_tensor(np.concatenate(shifts), dtype=torch.float64, device=device)
        numbers = np.concatenate([s.numbers for s in structures])
        self.species = torch.as_tensor(model.species_index(numbers), device=device)
        self.batch = torch.as_tensor(np.repeat(np.arange(self.size), self.n_atoms), device=device)
        self.positions = torch.as_tensor(np.concatenate([s.positions for s in structures]), device=device)
        self.cells = torch.as_tensor(np.stack([s.cell for s in structures]), device=device)
        self.volumes = torch.linalg.det(self.cells).abs()
        self.pbc = np.stack([np.broadcast_to(np.asarray(s.pbc, dtype=bool), (3,)) for s in structures])
        self.sources = [s.source for s in structures]
        self.system = {name: [getattr(s, name) for s in structures] for name in SYSTEM_RANGES}


class BatchGeometry(NamedTuple):
    """Leaves ``pos`` [N, 3] and ``strain`` [B, 3, 3] (float64, requiring grad) and the graph a model
    reads, built from them: dE/dpos and dE/dstrain give forces and stress."""

    pos: torch.Tensor
    strain: torch.Tensor
    graph: AtomGraph


def batch_geometry(batch: Batch) -> BatchGeometry:
    """Fresh leaves and the graph of ``batch`` (each structure strained by its own ε)."""
    x = strained_coordinates(batch.positions, batch.cells, batch=batch.batch)
    edge_vec = edge_vectors(x.positions, batch.i, batch.j, batch.shifts, x.cell, batch.edge_batch)
    alone = batch.size == 1
    graph = AtomGraph(species=batch.species, edge_index=torch.stack([batch.j, batch.i]), edge_vec=edge_vec,
                      n_local=len(x.pos), structure=None if alone else batch.batch, system=batch.system,
                      positions=x.positions, cell=x.cell[0] if alone else x.cell,
                      pbc=tuple(bool(p) for p in batch.pbc[0]) if alone else batch.pbc)
    return BatchGeometry(x.pos, x.strain, graph)


def structure_energies(batch: Batch, atom_energies: torch.Tensor) -> torch.Tensor:
    """Per-atom energies [N] → per-structure energies [B] (float64)."""
    return torch.zeros(batch.size, dtype=torch.float64, device=atom_energies.device).index_add(
        0, batch.batch, atom_energies.to(torch.float64))


def predict_batch(model, batch: Batch, create_graph: bool = True):
    """Energies [B], forces [N, 3] and stress [B, 3, 3] (torch float64), differentiable w.r.t. the
    model's parameters when ``create_graph`` (a force loss needs it)."""
    pos, strain, graph = batch_geometry(batch)
    energy = structure_energies(batch, model(graph))
    dE_dpos, dE_dstrain = torch.autograd.grad(energy.sum(), [pos, strain], create_graph=create_graph)
    return energy, -dE_dpos, symmetric_stress(dE_dstrain, batch.volumes)


def symmetric_stress(dE_dstrain: torch.Tensor, volumes: torch.Tensor) -> torch.Tensor:
    """dE/dε [B, 3, 3] and cell volumes [B] Å³ → stress [B, 3, 3] = sym(dE/dε) / V (ASE's sign)."""
    return 0.5 * (dE_dstrain + dE_dstrain.transpose(1, 2)) / volumes[:, None, None]


@dataclass
class Counts:
    """Sizes of the *global* batch that normalise the loss: structures with an energy label, force
    components, stressed structures."""

    energies: float
    force_components: float
    stresses: float

    @classmethod
    def of(cls, structures):
        return cls.of_sums(cls.sums(structures))

    @staticmethod
    def sums(structures) -> np.ndarray:
        """[3] the labelled energies, force components and stresses of ``structures`` (to sum over ranks' shares)."""
        return np.array([float(sum(s.energy is not None for s in structures)),
                         float(sum(3 * len(s.numbers) for s in structures if s.forces is not None)),
                         float(sum(s.stress is not None for s in structures))])

    @classmethod
    def of_sums(cls, sums):
        return cls(*(max(1.0, float(x)) for x in sums))


LOSS_TYPES = ("mse", "huber", "universal")
UNIVERSAL_BANDS = (100.0, 200.0, 300.0)  # eV/Å: the reference force norms where universal's threshold shrinks ...
UNIVERSAL_FACTORS = (1.0, 0.7, 0.4, 0.1)  # ... to these fractions of huber_delta (MACE's conditional_huber_forces)


@dataclass(frozen=True)
class LossRule:
    """The loss section, as the loss reads it: each quantity's weight (``rule[q]``); ``type``, each error's
    penalty: ``mse`` its square, ``huber`` torch's Huber loss (x²/2 within ``huber_delta``, delta (|x| − delta/2)
    beyond), ``universal`` MACE's: Huber's, with the force threshold shrunk where the reference force is large
    (``UNIVERSAL_BANDS``, ``UNIVERSAL_FACTORS``); ``config_type_weights``: a structure's factor on each of its
    penalties by its ``config_type`` (others 1)."""

    energy: float = 1.0
    forces: float = 10.0
    stress: float = 0.0
    type: str = "mse"
    huber_delta: float = 0.01
    config_type_weights: dict = field(default_factory=dict)

    def __getitem__(self, quantity: str) -> float:
        return getattr(self, quantity)

    def weighted(self, **weights) -> "LossRule":
        """The same rule with other quantity weights (``stage_two``)."""
        return replace(self, **weights)

    def penalty(self, errors, reference=None):
        """Each error's penalty (tensor of the errors' shape); ``reference`` [n, 3]: the labelled forces of
        force errors [n, 3] (``universal`` reads their norms)."""
        if self.type == "mse":
            return errors ** 2
        if self.type == "huber" or reference is None:
            return torch.nn.functional.huber_loss(errors, torch.zeros_like(errors), reduction="none",
                                                  delta=self.huber_delta)
        bands = torch.tensor(UNIVERSAL_BANDS, dtype=reference.dtype, device=reference.device)
        band = torch.bucketize(torch.linalg.vector_norm(reference, dim=-1), bands, right=True)
        delta = self.huber_delta * torch.tensor(UNIVERSAL_FACTORS, dtype=errors.dtype, device=errors.device)[band, None]
        size = errors.abs()
        return torch.where(size < delta, 0.5 * errors ** 2, delta * (size - 0.5 * delta))

    def structure_weights(self, config_types) -> np.ndarray | None:
        """[B] each structure's factor by its config_type (None: no config_type_weights, every factor 1)."""
        if not self.config_type_weights:
            return None
        return np.array([float(self.config_type_weights.get(c, 1.0)) for c in config_types])


def loss_terms(energy, forces, stress, batch: Labels, counts: Counts, rule: LossRule = LossRule()) -> dict:
    """Summed penalties (``rule.penalty``) of this batch's errors, each times its structure's config_type weight,
    divided by the global counts: energy per atom, force components, stress components (/9). Unlabelled entries are
    left out (label masks); a non-finite prediction of a labelled entry makes the loss non-finite."""
    de = ((energy - batch.energy) / batch.atoms_per_structure)[batch.has_energy]
    df = (forces - batch.forces)[batch.has_forces]
    ds = (stress - batch.stress)[batch.has_stress]
    penalties = (rule.penalty(de), rule.penalty(df, batch.forces[batch.has_forces]), rule.penalty(ds))
    factors = rule.structure_weights(batch.config_types)
    if factors is not None:
        w = torch.as_tensor(factors, dtype=torch.float64, device=de.device)
        penalties = (penalties[0] * w[batch.has_energy], penalties[1] * w[batch.row_structure][batch.has_forces, None],
                     penalties[2] * w[batch.has_stress][:, None, None])
    return {"energy": penalties[0].sum() / counts.energies,
            "forces": penalties[1].sum() / counts.force_components,
            "stress": penalties[2].sum() / (9 * counts.stresses)}


def total_loss(terms: dict, weights):
    """Σ weight × term over the quantities (tensors or floats); ``weights``: a LossRule or {quantity: weight}."""
    return sum(weights[q] * terms[q] for q in QUANTITIES)


def batch_gradients(model, batch: Batch, counts: Counts, rule: LossRule, parameters):
    """One process's training step on ``batch``: the loss (``loss_terms`` under ``rule`` over the global ``counts``)
    back-propagated into ``parameters`` only, adding to their ``.grad``. Not into the positions and strain,
    which require grad: the force loss's second derivatives in them are read by nobody (9 % of a SchNet
    step). Returns (loss, (energy, forces, stress))."""
    predictions = predict_batch(model, batch)
    loss = total_loss(loss_terms(*predictions, batch, counts, rule), rule)
    loss.backward(inputs=list(parameters))
    return loss, predictions


def sum_gradients(parameters, reduce) -> None:
    """Replace the parameters' gradients (None: zeros) by ``reduce(flat)`` of all of them as one flat
    tensor (one message per step; ``reduce`` returns the summed tensor)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = reduce(torch.nn.utils.parameters_to_vector(grads))
    for p, chunk in zip(parameters, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p).clone()


def check_species(model, structures, role: str, error=DataError) -> None:
    """Every structure's elements are known to ``model``; otherwise ``error`` naming the structure."""
    for s in structures:
        try:
            model.species_index(s.numbers)
        except UnknownSpeciesError as exc:
            raise error(f"{s.source} ({role}): {exc}") from None


def graph_parallel_loss(model, structure: Structure, rule: LossRule, counts: Counts, backend, mode="layerwise"):
    """This rank's share of one structure's loss, decomposed over ``backend``'s ranks (collective).

    Returns (surrogate, terms). The loss is ``loss_terms``'s, on this rank's owned atoms' forces and on
    the global energy and stress (allreduced values whose gradient flows through this rank's share
    only), so the sum over ranks of ``surrogate``'s parameter gradients equals the gradient of the
    structure's loss. ``terms``: the loss values (floats, identical on every rank)."""
    part = Decomposition(structure.to_atoms(), ghost_reach(model, mode), backend)
    energies, forces, dE_dstrain = forward_decomposed(model, part, mode, create_graph=True, system=structure.system())
    totals = global_sums(backend, energies, dE_dstrain)
    mine = energies.sum()
    energy = mine + (totals.energy - mine.detach())  # the global value; d/dθ of this rank's share
    virial = dE_dstrain + (torch.as_tensor(totals.virial, device=dE_dstrain.device) - dE_dstrain.detach())
    volume = torch.tensor([abs(np.linalg.det(structure.cell))], dtype=torch.float64, device=virial.device)
    labels = Labels([structure], forces.device, rows=part.owned)
    local = loss_terms(energy[None], forces, symmetric_stress(virial[None], volume), labels, counts, rule)
    terms = {q: float(local[q]) for q in QUANTITIES}
    terms["forces"] = float(backend.allreduce(np.array([terms["forces"]]))[0])  # force rows are split
    return total_loss(local, rule), terms


# ----------------------------------------------------------------------------- errors
def prediction_errors(batch: Batch, energy=None, forces=None, stress=None) -> np.ndarray:
    """[9] error sums of the given predictions against ``batch``'s labels: |ΔE/n|, (ΔE/n)², count;
    |ΔF|, ΔF², count; |Δσ|, Δσ², count (zeros for a quantity not given; unlabelled entries left out by
    the label masks, non-finite predictions kept: they make the sums non-finite).
    energy [B] eV, forces [N, 3] eV/Å, stress [B, 3, 3] eV/Å³."""
    sums = np.zeros(9)
    pairs = ((energy, batch.energy, batch.atoms_per_structure, batch.has_energy),
             (forces, batch.forces, None, batch.has_forces), (stress, batch.stress, None, batch.has_stress))
    for k, (pred, ref, per, mask) in enumerate(pairs):
        if pred is None:
            continue
        diff = pred.detach() - ref if per is None else (pred.detach() - ref) / per
        diff = diff[mask].flatten().cpu().numpy()
        sums[3 * k: 3 * k + 3] = [np.abs(diff).sum(), (diff**2).sum(), len(diff)]
    return sums


def predicted_energies(model, structures, batch_size: int, device) -> np.ndarray:
    """The model's energies (eV) of ``structures`` [len(structures)], float64 (no derivatives)."""
    out = []
    with torch.no_grad():
        for start in range(0, len(structures), batch_size):
            batch = Batch(structures[start:start + batch_size], model, device)
            out.append(structure_energies(batch, model(batch_geometry(batch).graph)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def error_sums(model, structures, batch_size: int, device) -> np.ndarray:
    """[9] ``prediction_errors`` summed over ``structures`` — add them over ranks, then ``error_table``."""
    sums = np.zeros(9)
    for start in range(0, len(structures), batch_size):
        batch = Batch(structures[start:start + batch_size], model, device)
        energy, forces, stress = predict_batch(model, batch, create_graph=False)
        sums += prediction_errors(batch, energy, forces, stress)
    return sums


def nonfinite_structures(batch: Batch, energy, forces, stress) -> list:
    """Sources of the structures of ``batch`` whose predicted energy, forces or stress are not finite."""
    bad = ~torch.isfinite(energy.detach()) | ~torch.isfinite(stress.detach()).reshape(batch.size, -1).all(dim=1)
    atoms_bad = (~torch.isfinite(forces.detach()).all(dim=1)).long()
    bad = bad | (torch.zeros(batch.size, dtype=torch.long, device=bad.device).index_add(0, batch.batch, atoms_bad) > 0)
    return [batch.sources[k] for k in torch.nonzero(bad).flatten().tolist()]


class TrainingError(MLIPError, RuntimeError):
    """Training cannot go on: a non-finite loss, prediction or gradient (the message names the epoch
    and the structures)."""


def error_table(sums: np.ndarray) -> dict:
    """MAE and RMSE per quantity (energy per atom eV, forces eV/Å, stress eV/Å³; NaN when unlabelled)."""
    out = {}
    for k, q in enumerate(QUANTITIES):
        total, squares, count = sums[3 * k: 3 * k + 3]
        out[f"{q}_mae"] = total / count if count else float("nan")
        out[f"{q}_rmse"] = float(np.sqrt(squares / count)) if count else float("nan")
    return out
