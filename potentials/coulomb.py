"""The long-range Coulomb energy of per-atom charges, summed over the whole periodic structure by torch-pme's Ewald,
PME or P3M, exact when the structure is split over ranks (docs/architecture.md §3c).

E = ½ Σ_i Σ_j q_i q_j v(r_ij) over every pair and periodic image, split as Ewald does into a real-space part
(erfc-screened, over the graph's edges: the pairs within the model's cutoff) and a reciprocal-space part (a sum over
k-vectors, or a charge mesh and its FFT). Per atom, E_i = q_i V_i with V_i torch-pme's potential (already halved), so
the owned atoms' energies of every rank add up to E. Under a decomposition each rank spreads only its owned atoms'
charges; the structure factors (Ewald) or the mesh (PME, P3M) and the total charge are summed over the ranks by
``graph.rank_sum`` (differentiable: its gradient is summed back), then each rank interpolates its own atoms; or the
mesh is split over the ranks in slabs (``mesh``; ``potentials.slab_mesh``). One process is the same code with
``rank_sum`` the identity.

The splitting (torch-pme's ``smearing``) and the reciprocal resolution (``lr_wavelength`` for Ewald, ``mesh_spacing``
for the meshes) follow from ``accuracy`` through torch-pme's error bounds, deterministically (torch-pme's own tuners
also time candidates, which ranks would not agree on): the smearing that makes the real-space error accuracy/4 at the
cutoff, then the coarsest reciprocal grid whose total error bound is within ``accuracy``. ``accuracy`` is in the units
of the force between two unit charges 1 Å apart (LAMMPS's kspace accuracy). A net charge is neutralised by a uniform
background (torch-pme's and LAMMPS's convention). Periodic cells only: a slab or a cluster is refused by name.
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from .errors import MLIPError
from .graph import WholeAlltoall, _gather_whole, _whole
from .slab_mesh import mesh_potential

METHODS = ("ewald", "pme", "p3m")
MESHES = ("auto", "replicated", "distributed")
SETTINGS = ("method", "accuracy", "smearing", "resolution", "interpolation_nodes", "mesh")  # Coulomb's keywords
DISTRIBUTED_MESH_FROM = 128**3  # mesh points from which "auto" splits the mesh over the ranks (benchmarks/long_range.py)
COULOMB_EV_A = 14.399645478425667  # e²/(4πε0) in eV·Å (torchpme.prefactors.eV_A)
MAX_EWALD_N = 64  # the finest Ewald grid tried: lr_wavelength = the cell's shortest vector / n
MAX_MESH_EXPONENT = 9  # the finest mesh tried: 2**9 points along a vector
DIRECT_BLOCK = 2048  # atoms per block of a structure periodic in no direction (every pair summed)


class LongRangeError(MLIPError, ValueError):
    """A long-range setting that cannot work: an unknown method, a bad accuracy, a model without charges, a cell
    that is not periodic in three directions, an accuracy the cutoff cannot reach."""




class Coulomb(torch.nn.Module):
    """Per-atom Coulomb energies of charges on a graph: ``forward(charges, graph, cutoff)``.

    ``method``: "ewald", "pme" or "p3m"; ``accuracy``: the error bound (force between unit charges at 1 Å);
    ``smearing`` (Å) and ``resolution`` (Å: Ewald's ``lr_wavelength``, the meshes' ``mesh_spacing``) fix the split
    instead of deriving it from the accuracy (both or neither); ``interpolation_nodes`` of the meshes (3–7);
    ``mesh`` (PME, P3M), how a structure split over ranks holds the mesh: "replicated" (every rank the whole mesh,
    summed over the ranks), "distributed" (each rank a slab: ``potentials.slab_mesh``), "auto" (distributed from
    ``DISTRIBUTED_MESH_FROM`` mesh points on more than one rank)."""

    def __init__(self, method: str = "ewald", accuracy: float = 1e-5, smearing: float | None = None,
                 resolution: float | None = None, interpolation_nodes: int = 4, mesh: str = "auto"):
        super().__init__()
        if method not in METHODS:
            raise LongRangeError(f"long_range.method {method!r}: one of {', '.join(METHODS)}")
        if isinstance(accuracy, bool) or not isinstance(accuracy, Real) or not 0 < accuracy < 1:
            raise LongRangeError(f"long_range.accuracy {accuracy!r}: a number in (0, 1), e.g. 1e-5 (the force error "
                                 "between two unit charges 1 Å apart)")
        if (smearing is None) != (resolution is None):
            raise LongRangeError("long_range: give smearing and resolution together (or neither: both from accuracy)")
        for name, value in (("smearing", smearing), ("resolution", resolution)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, Real)
                                      or not 0 < value < math.inf):
                raise LongRangeError(f"long_range.{name} {value!r}: a length > 0 (Å)")
        if isinstance(interpolation_nodes, bool) or interpolation_nodes not in range(3, 8):
            raise LongRangeError(f"long_range.interpolation_nodes {interpolation_nodes!r}: 3 to 7")
        if mesh not in MESHES:
            raise LongRangeError(f"long_range.mesh {mesh!r}: one of {', '.join(MESHES)}")
        if method == "ewald" and mesh != "auto":
            raise LongRangeError(f"long_range.mesh {mesh!r} is for pme and p3m: ewald has no mesh (its structure "
                                 "factors are summed over the ranks)")
        self.method, self.accuracy = method, float(accuracy)
        self.smearing = None if smearing is None else float(smearing)
        self.resolution = None if resolution is None else float(resolution)
        self.interpolation_nodes, self.mesh = int(interpolation_nodes), mesh
        self.prefactor = COULOMB_EV_A  # e²/(4πε0), eV·Å: a model whose package uses another value of it sets it
        self._calculators: dict = {}  # (smearing, resolution, device) → a torch-pme calculator
        self._splits: dict = {}  # (cutoff, cell, atoms, Σq²) → (smearing, resolution) of the latest structure
        self._checked = None  # the latest structure's key whose memory was checked (_check_memory)

    @property
    def settings(self) -> dict:
        """The constructor's keyword arguments (JSON-able): a checkpoint's ``long_range``."""
        return {name: getattr(self, name) for name in SETTINGS}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings.items() if v is not None and (k, v) != ("mesh", "auto"))

    # ------------------------------------------------------------------ the split
    def split(self, cutoff: float, cell: torch.Tensor, n_atoms: int, sum_q2: float) -> tuple:
        """(smearing, resolution) in Å for a structure of ``n_atoms`` atoms with Σq² = ``sum_q2`` in ``cell``
        [3, 3] and a real-space ``cutoff`` (Å): the given ones, else from the accuracy (the module docstring)."""
        return self._split(self._split_key(cutoff, cell, n_atoms, sum_q2), cutoff, cell, n_atoms, sum_q2)

    def _split(self, key: tuple, cutoff: float, cell: torch.Tensor, n_atoms: int, sum_q2: float) -> tuple:
        """``split`` of the structure whose ``_split_key`` is ``key``."""
        if self.smearing is not None:
            return self.smearing, self.resolution
        if key not in self._splits:  # the latest structure's only (a barostat's cell changes at every step)
            self._splits = {key: split_parameters(self.method, self.accuracy, cutoff, cell.detach().to(
                "cpu", torch.float64), n_atoms, sum_q2, self.interpolation_nodes)}
        return self._splits[key]

    @staticmethod
    def _split_key(cutoff: float, cell: torch.Tensor, n_atoms: int, sum_q2: float) -> tuple:
        return (float(cutoff), tuple(cell.detach().cpu().double().flatten().tolist()), int(n_atoms),
                round(float(sum_q2), 12))

    def reciprocal_bytes(self, cell: torch.Tensor, resolution: float, n_local: int, ranks: int = 1) -> float:
        """Estimated peak bytes of one evaluation's reciprocal part on a rank holding ``n_local`` atoms (forward and
        backward): Ewald ~64 B per k-vector and atom (measured 9.6 GB at 8,000 NaCl ions and 20,500 k-vectors), a mesh
        ~256 B per mesh point it holds (the mesh, its transforms and their gradients: all of a replicated mesh, its
        share of a mesh split over ``ranks``, and as much again for its brick) + 3 KB per atom (its interpolation
        stencils)."""
        from torchpme.lib import get_ns_mesh

        cell = cell.detach().cpu().double()
        if self.method == "ewald":
            k_vectors = 4 / 3 * math.pi * float(abs(torch.det(cell))) / resolution**3  # |k| ≤ 2π/λ, (2π)³/V each
            return 64.0 * k_vectors * max(n_local, 1)
        points = float(torch.prod(get_ns_mesh(cell, resolution)))
        return 256.0 * (points if ranks == 1 else 2 * points / ranks) + 3_000.0 * n_local

    def distributes(self, cell: torch.Tensor, resolution: float, ranks: int) -> bool:
        """Whether a structure in ``cell`` [3, 3] split over ``ranks`` has its mesh split too (``mesh``; the same on
        every rank)."""
        from torchpme.lib import get_ns_mesh

        if self.method == "ewald" or self.mesh == "replicated":
            return False
        points = int(torch.prod(get_ns_mesh(cell.detach(), resolution)))
        return self.mesh == "distributed" or (ranks > 1 and points >= DISTRIBUTED_MESH_FROM)

    def _check_memory(self, cell, resolution: float, n_local: int, n_atoms: int, device, total,
                      ranks: int = 1) -> None:
        """LongRangeError on every rank alike (``total``: a sum over the ranks) when a rank's reciprocal part would
        need more than its device's free memory."""
        from .messages import available_bytes

        need = self.reciprocal_bytes(cell, resolution, n_local, ranks)
        short = float(total(torch.tensor([float(need > available_bytes(device))], dtype=torch.float64,
                                         device=device))[0])
        if short:
            advice = "pme or p3m (a mesh: its cost grows as the mesh, Ewald's as N²)" if self.method == "ewald" \
                else "a looser accuracy or more ranks' memory"
            raise LongRangeError(f"long_range: {self.method} over {n_atoms} atoms would need about {need / 2**30:.1f} "
                                 f"GiB on a rank for its reciprocal part, more than is free on {short:.0f} rank(s): "
                                 f"use {advice}")

    def calculator(self, smearing: float, resolution: float, device):
        """torch-pme's calculator of this method (float64, eV and Å, a full neighbour list), kept per split."""
        import torchpme

        key = (smearing, resolution, str(device), self.prefactor)
        if key not in self._calculators:
            potential = torchpme.CoulombPotential(smearing=smearing, prefactor=self.prefactor)
            if self.method == "ewald":
                made = torchpme.EwaldCalculator(potential, lr_wavelength=resolution, full_neighbor_list=True)
            else:
                kind = torchpme.PMECalculator if self.method == "pme" else torchpme.P3MCalculator
                made = kind(potential, mesh_spacing=resolution, interpolation_nodes=self.interpolation_nodes,
                            full_neighbor_list=True)
            self._calculators = {key: made.to(device=device, dtype=torch.float64)}  # the latest split only
        return self._calculators[key]

    # ------------------------------------------------------------------ the energy
    def forward(self, charges: torch.Tensor, graph, cutoff: float) -> torch.Tensor:
        """Per-atom energies [n_local] float64 (eV) of ``charges`` [n_nodes] (e; the ghost rows' too) on ``graph``,
        whose edges (all pairs within ``cutoff`` Å) carry the real-space part. ``graph.positions`` [≥ n_local, 3],
        ``graph.cell`` and ``graph.pbc`` give the reciprocal part; a graph of several structures is summed structure
        by structure."""
        if graph.positions is None or graph.cell is None:
            raise LongRangeError("this evaluation gives the model no positions and cell, which the long-range "
                                 "Coulomb energy needs")
        q = charges.to(torch.float64).reshape(-1, 1)
        n = graph.n_local
        i, j = graph.edge_index[1], graph.edge_index[0]
        distances = graph.edge_vec.to(torch.float64).norm(dim=1)
        if graph.structure is None:
            return self._structure(q, i, j, distances, graph.positions[:n], graph.cell, graph.pbc, graph, n, cutoff)
        # a batch: rows and edges grouped by structure, in order
        sizes = torch.bincount(graph.structure[:n], minlength=len(graph.cell)).tolist()
        edge_structure = graph.structure[i]
        out, start = [], 0
        for b, size in enumerate(sizes):
            mine = torch.nonzero(edge_structure == b).flatten()
            rows = slice(start, start + size)
            out.append(self._structure(q[rows], i[mine] - start, j[mine] - start, distances[mine],
                                       graph.positions[rows], graph.cell[b], graph.pbc[b], None, size, cutoff))
            start += size
        return torch.cat(out) if out else q.new_zeros(0)

    def _structure(self, q, i, j, distances, positions, cell, pbc, graph, n_local: int, cutoff: float):
        """Per-atom energies [n_local] of one structure (``graph``: a decomposed one's sums over ranks; None: whole)."""
        periodic = [bool(p) for p in pbc] if pbc is not None else None
        if periodic == [False] * 3:
            return self._direct(q[:n_local], positions, graph.rank_gather if graph is not None else _gather_whole)
        if periodic != [True] * 3:
            raise LongRangeError(f"long_range ({self.method}) needs a cell periodic in all three directions, or none "
                                 f"(pbc {periodic}): put a slab in a periodic box with vacuum around it")
        total = graph.total if graph is not None else _whole
        rank_sum = graph.rank_sum if graph is not None else _whole
        alltoall = graph.rank_alltoall if graph is not None else WholeAlltoall()
        counts = total(torch.stack([torch.tensor(float(n_local), dtype=torch.float64, device=q.device),
                                    (q[:n_local].detach() ** 2).sum()]))
        n_atoms = int(round(float(counts[0])))
        key = self._split_key(cutoff, cell, n_atoms, float(counts[1]))
        smearing, resolution = self._split(key, cutoff, cell, n_atoms, float(counts[1]))
        split_mesh = alltoall if self.distributes(cell, resolution, alltoall.size) else None
        if (key, alltoall.size) != self._checked:  # a new structure, or ranks (every rank alike): will it fit?
            self._check_memory(cell, resolution, n_local, n_atoms, q.device, total,
                               alltoall.size if split_mesh is not None else 1)
            self._checked = (key, alltoall.size)
        calculator = self.calculator(smearing, resolution, q.device)
        # real space: V_i = ½ Σ_j q_j erfc-screened 1/r_ij over the edges (a full list: each pair from both ends)
        screened = calculator.potential.sr_from_dist(distances).unsqueeze(-1) * q[j]
        real = torch.zeros_like(q).index_add(0, i, screened)[:n_local] / 2
        if split_mesh is not None:  # the mesh's exchanges before the halo's in the backward pass, on every rank
            positions = positions + 0 * distances[:1].sum()  # (the edges come through the halo: tied, in one order)
        reciprocal = self._reciprocal(calculator, q[:n_local], cell, positions, resolution, rank_sum, split_mesh)
        return (q[:n_local] * (real + reciprocal)).reshape(-1)

    def _direct(self, q, positions, rank_gather):
        """Per-atom energies [n] of a structure periodic in no direction: ½ q_i Σ_{j≠i} q_j / r_ij over every atom j
        (all ranks' atoms, gathered), exactly; ``q`` [n, 1], ``positions`` [n, 3] this rank's. The atoms j go in
        blocks of ``DIRECT_BLOCK``, each recomputed in the backward pass (memory O(n × block), not O(n × N))."""
        from torch.utils.checkpoint import checkpoint

        every, first = rank_gather(torch.cat([positions.to(torch.float64), q], dim=1))
        mine = positions.to(torch.float64)
        potential = q.new_zeros(len(q))
        for start in range(0, len(every), DIRECT_BLOCK):
            block = every[start:start + DIRECT_BLOCK]
            potential = potential + checkpoint(_direct_block, mine, block, first - start, use_reentrant=False)
        return 0.5 * self.prefactor * q.reshape(-1) * potential

    def _reciprocal(self, calculator, q, cell, positions, resolution: float, rank_sum, split_mesh=None):
        """torch-pme's ``_compute_kspace`` of the owned atoms (``q`` [n, 1], ``positions`` [n, 3]) with the sums over
        atoms that every atom's potential reads (the structure factors or the mesh, and the total charge) summed over
        the ranks by ``rank_sum``: [n, 1]. ``split_mesh``: a ``rank_alltoall`` over which the mesh is split in slabs
        instead (``potentials.slab_mesh``)."""
        from torchpme.lib import get_ns_mesh

        potential = calculator.potential
        volume = torch.abs(cell.det())
        ns = get_ns_mesh(cell.detach(), resolution) if self.method != "ewald" else None  # the mesh's points per axis
        if self.method == "ewald":
            kvectors = ewald_kvectors(cell, resolution)
            green = potential.lr_from_k_sq(torch.sum(kvectors**2, dim=-1))
            phase = kvectors @ positions.T  # [k, n]
            trig = torch.stack([torch.cos(phase), torch.sin(phase)])  # [2, k, n]
            local = torch.einsum("fki,ic,k->fkc", trig, q, green)
            summed = rank_sum(torch.cat([local.reshape(-1), q.sum(dim=0)]))
            factors, charge = summed[:-1].reshape(local.shape), summed[-1:]
            values = torch.einsum("fkc,fki->ic", factors, trig) / volume
        elif split_mesh is not None:
            values = mesh_potential(calculator, q, positions, cell, ns, split_mesh) / volume
            charge = rank_sum(q.sum(dim=0))
        else:
            calculator.mesh_interpolator.update(cell, ns)
            calculator.kspace_filter.update(cell, ns)
            calculator.mesh_interpolator.compute_weights(positions)
            local = calculator.mesh_interpolator.points_to_mesh(particle_weights=q)
            summed = rank_sum(torch.cat([local.reshape(-1), q.sum(dim=0)]))
            mesh, charge = summed[:-1].reshape(local.shape), summed[-1:]
            values = calculator.mesh_interpolator.mesh_to_points(calculator.kspace_filter.forward(mesh)) / volume
        values = values - q * potential.self_contribution() - 2 * potential.background_correction() * charge / volume
        return values / 2


def _direct_block(mine: torch.Tensor, block: torch.Tensor, offset: int) -> torch.Tensor:
    """[n] Σ_j q_j / |r_i − r_j| over the atoms j of ``block`` [b, 4] (positions, charge) for the rows i of ``mine``
    [n, 3], whose own rows in ``block`` are i + ``offset`` (excluded; a unit vector keeps the gradient finite)."""
    delta = mine[:, None, :] - block[None, :, :3]  # [n, b, 3]
    own = torch.arange(len(mine), device=mine.device)
    inside = (own + offset >= 0) & (own + offset < len(block))
    itself = torch.zeros(delta.shape[:2], dtype=torch.bool, device=mine.device)
    itself[own[inside], own[inside] + offset] = True
    delta = torch.where(itself[..., None], torch.ones_like(delta), delta)
    inverse = torch.where(itself, 0.0, 1.0 / delta.norm(dim=2))
    return inverse @ block[:, 3]


def ewald_kvectors(cell: torch.Tensor, lr_wavelength: float) -> torch.Tensor:
    """[K, 3] the reciprocal vectors k ≠ 0 with |k| ≤ 2π/``lr_wavelength`` of ``cell`` [3, 3] (differentiable in the
    cell; which vectors, from its values): the sphere torch-pme's Ewald error bound assumes. (torch-pme's own
    EwaldCalculator takes ``ceil(|a|/λ)`` points of an FFT frequency grid per axis, |n| < |a|/2λ: half that radius.)"""
    from torchpme.lib import generate_kvectors_for_ewald

    k_cut = 2 * math.pi / lr_wavelength
    largest = torch.floor(torch.linalg.norm(cell.detach(), dim=1) / lr_wavelength).long()  # |n_a| ≤ |a_a| k_cut / 2π
    kvectors = generate_kvectors_for_ewald(ns=2 * largest + 1, cell=cell)
    k2 = (kvectors.detach() ** 2).sum(dim=1)
    return kvectors[(k2 > 0) & (k2 <= k_cut**2)]


def split_parameters(method: str, accuracy: float, cutoff: float, cell: torch.Tensor, n_atoms: int, sum_q2: float,
                     interpolation_nodes: int = 4) -> tuple:
    """(smearing, resolution) Å from torch-pme's error bounds (the module docstring): they read the structure only
    through its atom count, Σq² and cell, so stand-in charges of equal Σq² serve for a structure spread over ranks.
    LongRangeError when no grid up to the finest tried reaches ``accuracy`` at this cutoff."""
    from torchpme.tuning.ewald import EwaldErrorBounds
    from torchpme.tuning.p3m import P3MErrorBounds
    from torchpme.tuning.pme import PMEErrorBounds

    n_atoms = max(int(n_atoms), 1)
    charges = torch.full((n_atoms, 1), math.sqrt(max(sum_q2, 1e-300) / n_atoms), dtype=torch.float64)
    positions = torch.zeros((n_atoms, 3), dtype=torch.float64)
    volume = float(torch.abs(cell.det()))
    # torch-pme's estimate_smearing: the real-space error accuracy/4 at the cutoff (any smearing, if it is met at ∞)
    prefactor = 2 * max(sum_q2, 1e-300) / math.sqrt(n_atoms)
    argument = accuracy / 2 / prefactor * math.sqrt(cutoff * volume)
    smearing = cutoff / math.sqrt(-2 * math.log(argument)) if argument < 1 else cutoff / 3
    shortest = float(torch.linalg.norm(cell, dim=1).min())
    if method == "ewald":
        bounds = EwaldErrorBounds(charges, cell, positions)
        candidates = [shortest / n for n in range(1, MAX_EWALD_N + 1)]
        error = lambda r: float(bounds(smearing=smearing, lr_wavelength=r, cutoff=cutoff))  # noqa: E731
    else:
        bounds = (PMEErrorBounds if method == "pme" else P3MErrorBounds)(charges, cell, positions)
        candidates = [2 * shortest / (2**n - 1) for n in range(1, MAX_MESH_EXPONENT + 1)]
        error = lambda r: float(bounds(smearing=smearing, mesh_spacing=r, cutoff=cutoff,  # noqa: E731
                                       interpolation_nodes=interpolation_nodes))
    for resolution in candidates:
        if error(resolution) <= accuracy:
            return smearing, resolution
    raise LongRangeError(f"long_range: {method} cannot reach accuracy {accuracy:g} with a {cutoff:g} Å real-space "
                         f"cutoff in this cell (the finest grid tried gives {error(candidates[-1]):.2g}); raise the "
                         "accuracy or the model's cutoff")


class ChargeModel:
    """Mixin of a model that predicts per-atom charges (or has fixed ones), and ``long_range``, the ``Coulomb`` term its
    ``forward`` adds (None: none) to the charges of every row (e; ghost rows included: a predicted charge reaches the
    ghosts through ``graph.halo``): fixed charges through ``charges(graph)`` and ``coulomb_energies``, predicted ones
    by calling ``long_range`` itself. ``set_long_range`` attaches one (``load_model``'s ``long_range``)."""

    predicts_charges = True  # False: a model of a class that may have charges, built without (PaiNN without its head)
    needs_long_range = False  # a model whose Coulomb part is its long-range term (born_coulomb): refused without one

    def set_long_range(self, settings) -> None:
        """Attach ``Coulomb(**settings)`` (a mapping of its keyword arguments, or a ``Coulomb``; None: detach)."""
        if settings is None or isinstance(settings, Coulomb):
            coulomb = settings
        elif isinstance(settings, dict):
            unknown = sorted(set(settings) - set(SETTINGS))
            if unknown:
                raise LongRangeError(f"long_range: unknown key(s) {unknown}; it takes {', '.join(SETTINGS[:-1])} and "
                                     f"{SETTINGS[-1]}")
            coulomb = Coulomb(**settings)
        else:
            raise LongRangeError(f"long_range: a mapping such as {{method: ewald, accuracy: 1.0e-6}}, got {settings!r}")
        self.long_range = coulomb.to(self.device) if coulomb is not None else None
        self.hyperparameters = {**self.hyperparameters, "long_range": None if coulomb is None else coulomb.settings}

    def coulomb_energies(self, graph) -> torch.Tensor:
        """The ``long_range`` term's per-atom energies [n_local] of this model's charges on ``graph``."""
        if getattr(self, "long_range", None) is None:
            raise LongRangeError(f"{type(self).__name__} needs long_range: {{method: ewald | pme | p3m, accuracy: "
                                 "1.0e-6} (its Coulomb energy is the long-range term)")
        return self.long_range(self.charges(graph), graph, self.cutoff)
