"""Single-process contracts: geometry and grid, models against independent oracles (ASE, finite
differences), the serial halo (self-images) and its autograd, bad input."""
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, fcc111

import mlip_parallel
import potentials
from mlip_parallel import Decomposition, Domain, Grid, SerialBackend, Subdomain, forward_decomposed
from mlip_parallel.evaluate import ghost_reach
from potentials.predict import voigt_stress
from comparison import assert_close
from conftest import needs
from systems import GEOMETRIES, SPECIES, ase_lj_results, lennard_jones, schnet

DATA = Path(__file__).parent / "data"

torch.set_num_threads(1)


# ------------------------------------------------------------------------ domain and grid
def test_choose_dims_minimises_surface():
    cube = Domain.from_positions(np.zeros((1, 3)), np.eye(3) * 20, True)
    assert mlip_parallel.choose_dims(8, cube) == (2, 2, 2)
    long_box = Domain.from_positions(np.zeros((1, 3)), np.diag([80.0, 20.0, 20.0]), True)
    assert mlip_parallel.choose_dims(4, long_box) == (4, 1, 1)
    slab = fcc111("Cu", size=(8, 8, 3), vacuum=20.0)
    slab.pbc = (True, True, False)
    domain = Domain.from_positions(slab.positions, slab.cell, slab.pbc)
    assert domain.hi[2] - domain.lo[2] < 0.3  # the vacuum is not decomposed
    assert mlip_parallel.choose_dims(4, domain) == (2, 2, 1)


def test_grid_neighbours_and_owner():
    domain = Domain.from_positions(np.zeros((1, 3)), np.eye(3) * 10, (True, True, False))
    domain.lo[2], domain.hi[2] = 0.0, 1.0
    grid = Grid.uniform((2, 3, 2), domain)
    assert [grid.rank_of(grid.coords(r)) for r in range(12)] == list(range(12))
    assert grid.neighbour(0, 0, -1) == grid.rank_of((1, 0, 0))  # periodic wrap
    assert grid.neighbour(0, 2, -1) is None and grid.neighbour(1, 2, 1) is None  # non-periodic ends
    # points on a cut plane belong to the upper subdomain; past the ends to the end subdomain
    frac = np.array([[0.5, 1 / 3, 0.5], [0.0, 0.0, -0.2], [0.999, 0.999, 1.5]])
    assert grid.owner(frac).tolist() == [grid.rank_of((1, 1, 1)), 0, grid.rank_of((1, 2, 1))]


def test_hops_cover_the_ghost_cut():
    domain = Domain.from_positions(np.zeros((1, 3)), np.eye(3) * 10, True)
    grid = Grid.uniform((4, 1, 1), domain)
    assert grid.hops(0, 0.2) == 1 and grid.hops(0, 0.25) == 1 and grid.hops(0, 0.26) == 2
    assert grid.hops(1, 2.5) == 3  # one rank, cutoff 2.5 cells: three periodic self-images
    domain.pbc[:] = False
    assert Grid.uniform((4, 1, 1), domain).hops(0, 5.0) == 3 and Grid.uniform((1, 1, 1), domain).hops(0, 5.0) == 0


def test_wrap_images_and_rounding():
    domain = Domain.from_positions(np.zeros((1, 3)), [[4.0, 0, 0], [1.0, 4.0, 0], [0, 0, 5.0]], (True, True, False))
    positions = np.array([[-1e-17, 0.5, 0.5], [9.0, -3.0, 12.0], [2.0, 2.0, -7.0]])
    wrapped, image = domain.wrap(positions)
    assert_close(wrapped + image @ domain.cell, positions, 1e-8, scale="absolute", label="unwrapped")
    frac = domain.fractional(wrapped)
    assert np.all(frac[:, :2] >= 0) and np.all(frac[:, :2] < 1)
    assert np.all(image[:, 2] == 0)  # non-periodic: never wrapped


def test_plan_is_printable():
    atoms = GEOMETRIES["small_cell"]()
    part = Decomposition(atoms, 5.0, SerialBackend())
    text = part.comm.describe()
    assert "rank 0" in text and "swap 0: dim x up" in text and "image [-1, 0, 0]" in text


# ---------------------------------------------------------------------- models vs oracles
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_lennard_jones_matches_ase(name):
    atoms = GEOMETRIES[name]()
    assert_close(potentials.predict(lennard_jones(), atoms), ase_lj_results(atoms), 1e-10, label=name)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_serial_decomposition_matches_predict(name):
    """One rank, every model, both modes: every neighbour comes through the halo's periodic self-images.
    (float32 runs with SchNet and PaiNN; NequIP, the slowest, in float64 only.)"""
    atoms = GEOMETRIES[name]()
    backend = SerialBackend()
    reference_lj = ase_lj_results(atoms)
    assert_close(mlip_parallel.evaluate(lennard_jones(), atoms, comm=backend, decompose=True), reference_lj, 1e-10, label="LJ")
    for cls in (potentials.SchNet, potentials.PaiNN, potentials.NequIP):
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5))[: 1 if cls is potentials.NequIP else 2]:
            torch.manual_seed(2)
            model = schnet(dtype) if cls is potentials.SchNet else cls(SPECIES, cutoff=4.0, features=8).to(dtype)
            reference = potentials.predict(model, atoms)
            for mode in ("layerwise", "wide"):
                assert_close(mlip_parallel.evaluate(model, atoms, mode=mode, comm=backend, decompose=True), reference, tol,
                             label=f"{cls.__name__} {dtype} {mode}")


@pytest.mark.parametrize("mode", mlip_parallel.MODES)
def test_subdomain_pairs_and_ghosts_hold_until_atoms_moved_half_the_skin(mode):
    """The Subdomain contract MD and the LAMMPS bridge rely on: built once with a skin, its ghost shell
    and candidate pairs still give the one-process result after every atom moved (just under) skin/2."""
    atoms, model, skin = GEOMETRIES["sheared"](), schnet(), 1.0
    domain = Domain.from_positions(atoms.positions, atoms.cell, atoms.pbc)
    wrapped, _ = domain.wrap(atoms.positions)
    sub = Subdomain(SerialBackend(), domain, Grid.for_ranks(1, domain)).build(
        wrapped, np.arange(len(atoms)), atoms.numbers, ghost_reach(model, mode), skin, model.cutoff + skin,
        layerwise=mode == "layerwise")
    step = np.random.default_rng(0).normal(size=wrapped.shape)
    sub.positions = wrapped + 0.499 * skin * step / np.linalg.norm(step, axis=1, keepdims=True)
    assert sub.displacement(sub.positions)[0] < 0.5 * skin
    moved = atoms.copy()
    moved.positions = sub.positions
    energies, forces, dE_dstrain = forward_decomposed(model, sub, mode)
    assert_close({"energy": energies.sum().item(), "energies": energies.detach().numpy(),
                  "forces": forces.numpy(), "stress": voigt_stress(dE_dstrain.numpy(), moved.cell.volume)},
                 potentials.predict(model, moved), 1e-10, label=mode)


def test_batched_strain_and_edges_equal_one_structure_at_a_time():
    """potentials.graph's strained coordinates and edge vectors, batched (training) and for one
    structure (predict, forward_decomposed): the same energies, forces and stress."""
    from mlip_parallel.train.training import Batch, predict_batch
    from mlip_parallel.train.structures import Structure
    from potentials.graph import complete_cell
    from potentials.predict import energy_forces

    model = schnet()
    structures = [GEOMETRIES[name]() for name in ("fcc_bulk", "sheared", "small_cell", "clusters")]
    batch = Batch([Structure(a.numbers, a.positions, complete_cell(a.cell, a.pbc), a.pbc, None, None, None, "")
                   for a in structures], model, model.device)
    energy, forces, stress = predict_batch(model, batch, create_graph=False)
    start = 0
    for b, atoms in enumerate(structures):
        e, f, dE_dstrain = energy_forces(model, atoms)
        volume = abs(np.linalg.det(complete_cell(atoms.cell, atoms.pbc)))
        assert_close(energy[b].item(), e.sum().item(), 1e-10, scale="each", label=f"energy {b}")
        assert_close(forces[start:start + len(atoms)], f, 1e-10, scale="absolute", label=f"forces {b}")
        assert_close(stress[b], 0.5 * (dE_dstrain + dE_dstrain.T) / volume, 1e-12, scale="absolute",
                     label=f"stress {b}")
        start += len(atoms)


def _energy(model, atoms):
    return potentials.predict(model, atoms, stress=False)["energy"]


@pytest.mark.parametrize("model_name", ["LennardJones", "SchNet"])
@pytest.mark.parametrize("name", ["sheared", "slab", "small_cell"])
def test_forces_and_stress_are_finite_differences(model_name, name):
    atoms = GEOMETRIES[name]()
    model = lennard_jones() if model_name == "LennardJones" else schnet(torch.float64)
    result = mlip_parallel.evaluate(model, atoms, comm=SerialBackend())
    h = 1e-5
    rng = np.random.default_rng(0)
    for index in rng.choice(len(atoms), size=min(4, len(atoms)), replace=False):
        for d in range(3):
            plus, minus = atoms.copy(), atoms.copy()
            plus.positions[index, d] += h
            minus.positions[index, d] -= h
            fd = -(_energy(model, plus) - _energy(model, minus)) / (2 * h)
            assert_close(result["forces"][index, d], fd, 1e-6 * max(1.0, abs(fd)), scale="absolute",
                         label=f"forces[{index}, {d}]")
    if "stress" in result:
        voigt = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]
        for k, (a, b) in enumerate(voigt):
            strain = np.zeros((3, 3))
            strain[a, b] = strain[b, a] = h  # symmetric: an off-diagonal pair moves E by 2·(dE/dε_ab)·h
            values = []
            for sign in (1, -1):
                deformed = atoms.copy()
                deformed.set_cell(atoms.cell[:] @ (np.eye(3) + sign * strain), scale_atoms=True)
                values.append(_energy(model, deformed))
            dE = (values[0] - values[1]) / (2 * h) / (1 if a == b else 2)
            assert_close(result["stress"][k], dE / atoms.get_volume(), 1e-8, scale="absolute", label=f"stress[{k}]")


def test_schnet_seeded_float64_and_translation_rotation_invariant():
    a, b = schnet(torch.float32, seed=3), schnet(torch.float32, seed=3)
    params_a, params_b = list(a.parameters()), list(b.parameters())
    assert len(params_a) == len(params_b) and all(torch.equal(p, q) for p, q in zip(params_a, params_b))
    model = schnet(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    atoms = GEOMETRIES["clusters"]()
    ref = potentials.predict(model, atoms)
    moved = atoms.copy()
    rotation = np.linalg.qr(np.random.default_rng(1).normal(size=(3, 3)))[0]
    moved.positions = atoms.positions @ rotation.T + [3.0, -1.0, 2.0]
    out = potentials.predict(model, moved)
    assert_close(out["energy"], ref["energy"], 1e-10, scale="each", label="energy")
    assert_close(out["forces"], ref["forces"] @ rotation.T, 1e-10, scale="absolute", label="forces")


# ------------------------------------------------------------------- halo autograd, serial
def _small_cell_comm():
    atoms = GEOMETRIES["small_cell"]()
    return Decomposition(atoms, 6.0, SerialBackend()).comm


def test_halo_forward_and_reverse_are_adjoint_and_twice_differentiable():
    comm = _small_cell_comm()
    assert comm.n_ghost > 50  # many self-images
    x = torch.randn(comm.n_local, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(comm.n_ghost, 2, dtype=torch.float64, requires_grad=True)
    assert_close((comm.forward_comm(x) * y).sum(), (x * comm.reverse_comm(y)).sum(), 1e-8, scale="absolute",
                 label="adjoint")
    assert torch.autograd.gradcheck(comm.forward_comm, (x,))
    assert torch.autograd.gradcheck(comm.reverse_comm, (y,))
    assert torch.autograd.gradgradcheck(lambda v: comm.forward_comm(v) ** 2, (x,))
    assert torch.autograd.gradgradcheck(lambda v: comm.reverse_comm(v) ** 2, (y,))


# ------------------------------------------------------------------------------ bad input
def test_unknown_element_names_it_and_the_known_species():
    atoms = GEOMETRIES["fcc_bulk"]()
    atoms.numbers[0] = 26
    with pytest.raises(potentials.UnknownSpeciesError, match=r"\['Fe'\].*\['Ag', 'Cu'\]"):
        mlip_parallel.evaluate(schnet(), atoms)
    with pytest.raises(potentials.UnknownSpeciesError, match="Fe"):
        potentials.predict(schnet(), atoms)


def test_non_finite_positions_and_degenerate_cells():
    atoms = GEOMETRIES["fcc_bulk"]()
    atoms.positions[4, 2] = np.inf
    with pytest.raises(potentials.InvalidStructureError, match="non-finite"):
        mlip_parallel.evaluate(lennard_jones(), atoms)
    with pytest.raises(potentials.InvalidStructureError, match="non-finite"):
        potentials.predict(lennard_jones(), atoms)
    flat = Atoms("Cu2", positions=[[0, 0, 0], [2, 0, 0]], cell=[[4, 0, 0], [8, 0, 0], [0, 0, 4]], pbc=True)
    with pytest.raises(potentials.InvalidStructureError, match="zero-volume"):
        mlip_parallel.evaluate(lennard_jones(), flat)


def test_grid_must_match_ranks():
    with pytest.raises(mlip_parallel.DecompositionError, match=r"grid \(2, 1, 1\).*1 rank"):
        mlip_parallel.evaluate(lennard_jones(), GEOMETRIES["fcc_bulk"](), grid=(2, 1, 1))


def test_molecule_without_cell_has_no_stress_like_ase():
    atoms = GEOMETRIES["clusters"]()
    result = mlip_parallel.evaluate(lennard_jones(), atoms)
    assert "stress" not in result and "stress" not in ase_lj_results(atoms)


@pytest.mark.parametrize("family", ["schnet", "cu-emt", pytest.param("mace", marks=needs("mace")),
                                    pytest.param("allegro", marks=needs("nequip", "allegro"))])
def test_one_pass_costs_bound_the_peak_of_a_crystal(family):
    """Potential.one_pass_costs, measured on a 13-atom probe, bounds what the model's tensors hold at their peak in
    an evaluation of a 108-atom crystal with every edge at once (LiveBytes over the model and its gradient on the
    periodic graph), within 3x: MACE's products (per row) and its interactions (per edge) peak at different moments,
    each counted at its own (the difference of the probes' peaks alone fell below MACE's and Allegro's peaks)."""
    from potentials.messages import LiveBytes
    from potentials.predict import periodic_graph

    model = {"schnet": lambda: potentials.SchNet(["Cu"], cutoff=5.0, features=32, layers=2, seed=0),
             "cu-emt": lambda: potentials.load_model("cu-emt"),
             "mace": lambda: potentials.MACE(DATA / "mace" / "mace-small-f32.model"),
             "allegro": lambda: potentials.load_model(f"nequip:{DATA / 'nequip' / 'allegro.nequip.zip'}")}
    model = model[family]()
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    atoms.rattle(0.05, seed=1)
    potentials.predict(model, atoms, memory_budget_gb=float("inf"))  # (first calls)
    x, graph = periodic_graph(model, atoms, memory_budget_gb=float("inf"))
    with LiveBytes() as live:
        torch.autograd.grad(model(graph).sum(), [x.pos, x.strain])
    fixed, per_row, per_edge = model.one_pass_costs()
    edges = graph.edge_index.shape[1]
    bound = fixed + per_row * len(atoms) + per_edge * edges
    assert live.peak <= bound <= 3 * live.peak, (live.peak, bound)
    assert model.evaluation_bytes(len(atoms), edges, chunked=False) >= model.ONE_PASS_MARGIN * bound


def test_memory_budget_knob():
    """The automatic chunk budget is a share of the free memory within its bounds; inf is the plain path; by default
    an evaluation runs every edge at once where its predicted peak fits half the free memory and in the automatic
    chunks where it does not; a budget that is not a positive number is refused by every entry point, naming the
    knob."""
    from md import MLIPCalculator
    from md.engine import MDSystem
    from potentials.messages import AUTO_CAP_BYTES, available_bytes, evaluation_budget, memory_budget_bytes

    auto = memory_budget_bytes(None, "cpu")
    assert 2**20 <= auto <= AUTO_CAP_BYTES["cpu"]
    assert memory_budget_bytes(0.25, "cpu") == 250_000_000 and memory_budget_bytes(float("inf"), "cpu") is None
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True)
    model = potentials.SchNet(["Cu"], cutoff=4.0, features=8, layers=2, seed=0)
    per_edge = model.evaluation_bytes(0, 1, chunked=False) - model.evaluation_bytes(0, 0, chunked=False)
    fits = int(0.4 * available_bytes("cpu") / per_edge)  # edges whose one pass takes 0.4 of it
    assert evaluation_budget(model, None, 100, 1000, "cpu") is None
    assert evaluation_budget(model, None, 0, fits, "cpu") is None
    assert evaluation_budget(model, None, 0, 2 * fits, "cpu") == auto  # 0.8 of the free memory: in chunks
    assert evaluation_budget(model, 0.25, 100, 1000, "cpu") == 250_000_000
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="memory_budget_gb must be a positive number of GB"):
            potentials.predict(model, atoms, memory_budget_gb=bad)
        with pytest.raises(ValueError, match="memory_budget_gb must be a positive number of GB"):
            mlip_parallel.evaluate(model, atoms, memory_budget_gb=bad)
        with pytest.raises(ValueError, match="memory_budget_gb must be a positive number of GB"):
            MLIPCalculator(model, memory_budget_gb=bad)
        with pytest.raises(ValueError, match="memory_budget_gb must be a positive number of GB"):
            MDSystem.from_atoms(model, atoms, memory_budget_gb=bad)


def test_ranks_given_different_structures_are_named():
    """check_same_structure (on every evaluate call) against a faked second rank: a copy passes; one position moved
    by one unit in the last place, another element, cell, periodicity, charge, or an atom fewer is named, with the way
    out (each NEB image its own communicator)."""
    from mlip_parallel.errors import RanksDisagreeError
    from mlip_parallel.evaluate import check_same_structure, structure_digest

    class TwoRanks:
        """A backend of two ranks whose other rank passed ``other``."""
        size = 2

        def __init__(self, other):
            digest = structure_digest(other)
            self.theirs = np.concatenate([digest, -digest])

        def allreduce(self, value, op="sum"):
            assert op == "max"
            return np.maximum(value, self.theirs)

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=3)
    check_same_structure(TwoRanks(atoms.copy()), atoms)

    def changed(change):
        other = atoms.copy()
        change(other)
        return other

    cases = {"positions": lambda a: a.positions.__setitem__((5, 1), np.nextafter(a.positions[5, 1], 9.0)),
             "elements": lambda a: a.numbers.__setitem__(2, 47), "cell": lambda a: a.set_cell(a.cell * 1.001),
             "periodicity": lambda a: a.set_pbc([True, True, False]),
             "charge and spin": lambda a: a.info.__setitem__("charge", 1), "number of atoms": lambda a: a.pop()}
    for part, change in cases.items():
        with pytest.raises(RanksDisagreeError, match=rf"^the 2 ranks of this communicator were given different "
                                                      rf"structures \({part}.*differ\): .*comm=world\.Split\(image\)"):
            check_same_structure(TwoRanks(changed(change)), atoms)


def test_the_halo_hook_runs_eagerly_under_torch_compile():
    """FeatureHalo's exchange (MPI inside) is a graph break in a torch.compile'd model: run eagerly, never traced
    (``eager_under_compile``, which loads nothing of torch._dynamo until a compile can run)."""
    import torch._dynamo

    from mlip_parallel.comm import eager_under_compile

    traced = []

    @eager_under_compile
    def exchange(h):
        traced.append(torch.compiler.is_compiling())
        return torch.cat([h, h[:1] * 2])

    def model(x):
        return (exchange(x + 1) ** 2).sum()

    x = torch.arange(4.0)
    assert torch.equal(torch.compile(model, backend="eager")(x), model(x))
    assert traced == [False, False], traced  # the compiled call ran it eagerly too
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["sheared", "slab", "clusters"])
def test_one_process_evaluates_the_periodic_graph(name, monkeypatch):
    """One process by default evaluates the whole structure with periodic images as edge shifts (no ghost atoms, no
    halo: what ``potentials.predict`` and the packages' calculators build), bit for bit predict's result;
    ``decompose=True`` takes the ghost-atom path, equal up to summation order. A halo call on the default path
    fails the test."""
    from mlip_parallel import comm

    atoms = GEOMETRIES[name]()
    model = schnet(torch.float64)
    decomposed = mlip_parallel.evaluate(model, atoms, decompose=True)

    def no_halo(*args, **kwargs):
        raise AssertionError("the one-process default built a halo")
    monkeypatch.setattr(comm.FeatureHalo, "__init__", no_halo)
    default, reference = mlip_parallel.evaluate(model, atoms), potentials.predict(model, atoms)
    for key in reference:
        assert np.array_equal(default[key], reference[key]), key
    assert_close(default, decomposed, 1e-12, label="periodic graph vs ghost atoms")


def test_one_process_path_refuses_a_communicator_of_several_ranks():
    """decompose=False on a communicator of two ranks would evaluate the whole structure on each: refused in one line
    (a stand-in backend of size 2 whose collectives echo this rank's values)."""
    class TwoRanks(SerialBackend):
        size = 2

    with pytest.raises(ValueError, match="decompose=False evaluates the whole structure in one process, but the "
                                         "communicator has 2 ranks"):
        mlip_parallel.evaluate(lennard_jones(), GEOMETRIES["fcc_bulk"](), comm=TwoRanks(), decompose=False)
