"""A committee of models: K members evaluated on one graph, for the uncertainty of their prediction.

As a ``Potential`` a committee's per-atom energies are its members' mean (``forces="mean"``) or its first member's
(``forces="first"``, DeePMD's convention for the trajectory), so every tool runs it as any model. The evaluations
that need each member's forces (``mlip_parallel.evaluate``, the MD engine, the ASE calculator, the LAMMPS bridge)
run the members one after another on the graph of one decomposition (``member_graph``: each member's own edges and
species), and ``deviations`` gives DeePMD's model deviation from their results: per atom
σ_i = sqrt(mean_k |F_i^k − F̄_i|²), and the per-atom energy deviation std_k e_i^k.

Members may differ in family, cutoff and layer count: the committee's cutoff is the largest, and its ``layers``
enough for its reach (layers × cutoff) to cover every member's, so a ghost shell built for the committee serves
them all; a member with a shorter cutoff reads only its own edges.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from ase.data import chemical_symbols

from .base import Potential
from .errors import MLIPError, UnknownSpeciesError
from .families import ModelSpecError, load_model, split_spec
from .graph import AtomGraph
from .predict import voigt_stress

FORCES = ("mean", "first")


class CommitteeError(MLIPError, ValueError):
    """A committee that cannot be built: no member, members that share no element, an unknown ``forces``."""


class Committee(Potential):
    """``members``: potentials models (at least one). ``forces``: "mean" (the members' mean energy, hence mean
    forces and stress) or "first" (the first member's). The species are those every member knows (in the first
    member's order; an element-agnostic member knows all); a structure with another element is refused naming the
    member that does not know it. dtype: float32 where a member runs in float32, else float64."""

    def __init__(self, members, forces: str = "mean"):
        members = list(members)
        if not members:
            raise CommitteeError("a committee needs at least one member")
        if forces not in FORCES:
            raise CommitteeError(f"committee forces must be one of {FORCES}, got {forces!r}")
        known = [m.species for m in members if m.species is not None]
        species = None if not known else [s for s in known[0] if all(s in k for k in known[1:])]
        if species is not None and not species:
            raise CommitteeError("the committee's members share no element: "
                                 + "; ".join(f"member {k + 1} ({type(m).__name__}) knows {m.species}"
                                             for k, m in enumerate(members)))
        super().__init__(species)
        self.members = torch.nn.ModuleList(members)
        self.forces = forces
        self.cutoff = max(float(m.cutoff) for m in members)
        self.layers = max(math.ceil(m.layers * m.cutoff / self.cutoff - 1e-9) for m in members)
        self.hyperparameters = {"forces": forces, "members": [type(m).__name__ for m in members]}
        # committee species index -> each member's own (element-agnostic members: 0)
        numbers = [chemical_symbols.index(s) for s in species] if species is not None else None
        for k, member in enumerate(members):
            index = torch.as_tensor(member.species_index(numbers) if numbers is not None else [0], dtype=torch.long)
            self.register_buffer(f"_species_{k}", index, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The least precise of the members' dtypes (the tolerance a comparison of the committee allows)."""
        return torch.float32 if any(m.dtype == torch.float32 for m in self.members) else torch.float64

    def species_index(self, numbers) -> np.ndarray:
        """As ``Potential.species_index``, the message naming the member that does not know an element."""
        try:
            return super().species_index(numbers)
        except UnknownSpeciesError:
            for k, member in enumerate(self.members):
                try:
                    member.species_index(numbers)
                except UnknownSpeciesError as exc:
                    raise UnknownSpeciesError(f"committee member {k + 1}: {exc}") from None
            raise

    def member_graph(self, k: int, graph: AtomGraph) -> AtomGraph:
        """``graph`` as member k reads it: its species indices, and only the edges within its cutoff."""
        member = self.members[k]
        species = getattr(self, f"_species_{k}")
        species = species[graph.species] if self.species is not None else graph.species * 0
        if member.cutoff >= self.cutoff:
            return dataclasses.replace(graph, species=species, edge_features_cache={})
        near = (graph.edge_vec.detach() ** 2).sum(dim=1) < member.cutoff ** 2
        return dataclasses.replace(graph, species=species, edge_index=graph.edge_index[:, near],
                                   edge_vec=graph.edge_vec[near], edge_features_cache={})

    def forward(self, graph: AtomGraph) -> torch.Tensor:
        if self.forces == "first":
            return self.members[0](self.member_graph(0, graph)).to(torch.float64)
        return torch.stack([member(self.member_graph(k, graph)).to(torch.float64)
                            for k, member in enumerate(self.members)]).mean(dim=0)

    def combine(self, values: torch.Tensor) -> torch.Tensor:
        """The committee's value of per-member ``values`` [K, ...]: their mean, or the first member's."""
        return values[0] if self.forces == "first" else values.mean(dim=0)

    def evaluation_bytes(self, rows: float, edges: float, chunked: bool = True) -> float:
        return sum(m.evaluation_bytes(rows, edges, chunked) for m in self.members)

    def training_bytes(self, rows: float, edges: float) -> float:
        return sum(m.training_bytes(rows, edges) for m in self.members)

    def named_weights(self) -> list:
        return []  # a committee is evaluated, not trained: its members are trained one by one


def deviations(forces: torch.Tensor, energies: torch.Tensor) -> tuple:
    """DeePMD's model deviation of K members' predictions: ``forces`` [K, n, 3], per-atom ``energies`` [K, n] →
    (σ_F per atom [n] = sqrt(mean_k |F_i^k − F̄_i|²), the per-atom energy deviation [n] = std_k e_i^k)."""
    devi_f = ((forces - forces.mean(dim=0)) ** 2).sum(dim=2).mean(dim=0).sqrt()
    devi_e = energies.std(dim=0, unbiased=False) if energies.shape[0] > 1 else torch.zeros_like(energies[0])
    return devi_f, devi_e


def committee_result(committee, energies: np.ndarray, forces: np.ndarray, virials=None, volume=None) -> dict:
    """A committee's result of one whole structure from its members' per-atom ``energies`` [K, N], ``forces``
    [K, N, 3] and, with a ``volume``, ``virials`` [K, 3, 3] (dE/dstrain): the combined "energy", "energies", "forces"
    and "stress" (``combine``), and the model deviation: "devi_f" (N,) σ_F per atom, "devi_energies" (N,),
    "max_devi_f", "min_devi_f", "avg_devi_f" (over the atoms, eV/Å; 0 for none), "devi_e" (the members' standard
    deviation of the energy per atom, eV) and "member_energies" (K,)."""
    pick = committee.combine
    devi_f, devi_energies = (d.numpy() for d in deviations(torch.as_tensor(forces), torch.as_tensor(energies)))
    totals = energies.sum(axis=1)
    n = max(len(devi_f), 1)
    result = {"energy": float(pick(torch.as_tensor(totals))), "energies": pick(torch.as_tensor(energies)).numpy(),
              "forces": pick(torch.as_tensor(forces)).numpy(), "devi_f": devi_f, "devi_energies": devi_energies,
              "max_devi_f": float(devi_f.max(initial=0.0)), "min_devi_f": float(devi_f.min(initial=np.inf))
              if len(devi_f) else 0.0, "avg_devi_f": float(devi_f.sum()) / n,
              "devi_e": float(np.std(totals)) / n, "member_energies": totals}
    if virials is not None:
        result["stress"] = voigt_stress(pick(torch.as_tensor(virials)).numpy(), volume)
    return result


def load_committee(specs, dtype: str | None = None, *, forces: str = "mean", checkpoint_dtype: str | None = None,
                   **options) -> Committee:
    """The committee of the model ``specs`` (each what ``potentials.load_model`` takes: "cu-emt", "best.pt",
    "mace:FILE.model", ...), with ``forces`` as ``Committee`` takes it. Each family option in ``options`` (``head``,
    ``task``, ...) goes to the members whose family takes it; ModelSpecError for one no member takes, and any
    member's error names the member (``member k (SPEC): ...``)."""
    specs = list(specs)
    if not specs:
        raise CommitteeError("a committee needs at least one member")
    families = [split_spec(str(spec))[0] for spec in specs]
    unused = [key for key in options if not any(key in record.options for record in families)]
    if unused:
        raise ModelSpecError(f"no member of the committee takes the option {unused[0]!r} "
                             f"(its members are {', '.join(record.name for record in families)} models)")
    members = []
    for k, (spec, record) in enumerate(zip(specs, families), start=1):
        try:
            members.append(load_model(spec, dtype, checkpoint_dtype=checkpoint_dtype,
                                      **{key: value for key, value in options.items() if key in record.options}))
        except MLIPError as exc:
            raise CommitteeError(f"member {k} ({spec}): {exc}") from None
        except ImportError as exc:
            raise ImportError(f"member {k} ({spec}): {exc}") from None
    return Committee(members, forces=forces)
