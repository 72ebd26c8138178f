"""Native MD engine on one process against independent oracles: ASE's VelocityVerlet,
NoseHooverChainNVT, IsotropicMTKNPT and MTKNPT with ASE's LennardJones; energy conservation;
thermostats and barostats reaching their targets; the counter-based random numbers."""
import numpy as np
import pytest
import torch
from ase import units
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLJ
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.nose_hoover_chain import IsotropicMTKNPT, MTKNPT, NoseHooverChainNVT
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

import mlip_parallel
import potentials
from comparison import assert_beyond, assert_close
from md.engine import MDSystem, run
from md.integrators import MTK, Bussi, Langevin, NoseHoover, VelocityVerlet, gaussian, uniforms

torch.set_num_threads(1)
LJ = dict(epsilon=0.0104, sigma=3.4, cutoff=8.0)


def argon(temperature=300, seed=0):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    thermalize_momenta(atoms, temperature_K=temperature, rng=np.random.default_rng(seed))
    return atoms


def test_velocity_verlet_matches_ase():
    atoms = argon()
    reference = atoms.copy()
    reference.calc = AseLJ(epsilon=LJ["epsilon"], sigma=LJ["sigma"], rc=LJ["cutoff"], smooth=False)
    AseVelocityVerlet(reference, timestep=5 * units.fs).run(100)
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), atoms, skin=1.0)
    rows = run(system, VelocityVerlet(5.0), 100, thermo_every=100)
    unwrapped = system.gather("positions") + system.gather("image") @ atoms.cell[:]
    assert system.rebuilds > 2  # atoms moved past the skin: migration and rebuilds were exercised
    assert_close(unwrapped, reference.positions, 1e-8, scale="absolute", label="positions")
    assert_close(system.gather("velocities"), reference.get_velocities(), 1e-8, scale="absolute", label="velocities")
    assert_close(rows[-1]["epot_eV"], reference.get_potential_energy(), 1e-9, scale="absolute", label="epot")
    assert_close(rows[-1]["temperature_K"], reference.get_temperature(), 1e-6, scale="absolute", label="temperature")


def test_nve_energy_drift_is_bounded():
    system = MDSystem.from_atoms(potentials.LennardJones(epsilon=0.0104, sigma=3.4, cutoff=6.5), argon(120, seed=1),
                                 skin=1.0)
    rows = run(system, VelocityVerlet(4.0), 2000, thermo_every=50)
    etot = np.array([r["etot_eV"] for r in rows])
    ekin = np.array([r["ekin_eV"] for r in rows])
    assert_close(etot, np.full_like(etot, etot[0]), 0.01 * ekin.mean(), scale="absolute",
                 label=f"etot drift (mean ekin {ekin.mean():.3e})")


def splitmix_uniforms(seed, step, ids):
    """The counter-based uniforms written with numpy's uint64 arithmetic: an oracle for the int64 torch
    version (which relies on two's-complement wrap-around and emulated logical shifts)."""
    def mix(x):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        base = mix(mix(np.uint64(seed)) ^ np.uint64(step))
        keys = mix(base ^ np.asarray(ids, dtype=np.uint64))[:, None] * np.uint64(8) + np.arange(6, dtype=np.uint64)
        return (mix(keys) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def test_gaussian_depends_only_on_seed_step_and_id():
    ids = torch.arange(20000)
    for seed, step in ((3, 17), (2**40 + 5, 123456789)):
        assert np.array_equal(uniforms(seed, step, ids).numpy(), splitmix_uniforms(seed, step, ids.numpy()))
    z = gaussian(3, 17, ids)
    perm = torch.as_tensor(np.random.default_rng(0).permutation(20000))
    assert torch.equal(gaussian(3, 17, perm), z[perm])  # not on which rank, or in which order
    assert not torch.equal(gaussian(3, 18, ids), z) and not torch.equal(gaussian(4, 17, ids), z)
    assert_close([z.mean().item(), z.var().item()], [0.0, 1.0], 0.02, scale="absolute", label="mean, variance")


def block_error(x, blocks=10):
    """Standard error of the mean of a correlated series, from ``blocks`` block means."""
    means = x[: len(x) // blocks * blocks].reshape(blocks, -1).mean(axis=1)
    return means.std(ddof=1) / np.sqrt(blocks)


@pytest.mark.parametrize("thermostat", ["langevin", "bussi", "nose-hoover"])
def test_thermostat_reaches_and_holds_temperature(thermostat):
    """500 atoms started at twice the target: the mean over the second half is within 2 %."""
    target = 80.0
    integrator = {"langevin": lambda: Langevin(6.0, target, friction=0.02, seed=1),
                  "bussi": lambda: Bussi(6.0, target, tau_fs=100.0, seed=2),
                  "nose-hoover": lambda: NoseHoover(6.0, target, tdamp_fs=200.0)}[thermostat]()
    atoms = bulk("Ar", "fcc", a=5.30, cubic=True).repeat(5)
    thermalize_momenta(atoms, temperature_K=2 * target, rng=np.random.default_rng(3))
    system = MDSystem.from_atoms(potentials.LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5), atoms, skin=1.0)
    rows = run(system, integrator, 1200, thermo_every=5)
    temperatures = np.array([r["temperature_K"] for r in rows[len(rows) // 2:]])
    assert_close(temperatures.mean(), target, 0.02, scale="each",
                 label=f"mean temperature (block error {block_error(temperatures):.3e})")


ASE_LJ = dict(epsilon=LJ["epsilon"], sigma=LJ["sigma"], rc=LJ["cutoff"], smooth=False)


@pytest.mark.parametrize("ensemble", ["nose-hoover", "npt-isotropic", "npt-anisotropic"])
def test_nose_hoover_and_mtk_match_ase(ensemble):
    """Same start, same parameters: our trajectory (positions, velocities, cell, conserved energy) equals
    ASE's integrators to 1e-8 after 60 steps, through rebuilds and (NPT) a changing cell."""
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((3, 2, 2))
    atoms.rattle(0.05, seed=1)
    thermalize_momenta(atoms, temperature_K=150, rng=np.random.default_rng(0))
    reference = atoms.copy()
    reference.calc = AseLJ(**ASE_LJ)
    common = dict(timestep=5 * units.fs, temperature_K=100.0, tdamp=100 * units.fs)
    if ensemble == "nose-hoover":
        ase_md, ours = NoseHooverChainNVT(reference, **common), NoseHoover(5.0, 100.0, tdamp_fs=100.0)
    else:
        isotropic = ensemble == "npt-isotropic"
        ase_md = (IsotropicMTKNPT if isotropic else MTKNPT)(reference, pressure_au=0.05 * units.GPa,
                                                             pdamp=300 * units.fs, **common)
        ours = MTK(5.0, 100.0, 0.05, tdamp_fs=100.0, pdamp_fs=300.0, isotropic=isotropic)
    ase_md.run(60)
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), atoms, skin=1.0)
    run(system, ours, 60, thermo_every=60)
    unwrapped = system.gather("positions") + system.gather("image") @ system.cell
    assert system.rebuilds > 1
    assert_close(unwrapped, reference.positions, 1e-8, scale="absolute", label="positions")
    assert_close(system.gather("velocities"), reference.get_velocities(), 1e-8, scale="absolute", label="velocities")
    assert_close(system.cell, reference.cell[:], 1e-8, scale="absolute", label="cell")
    if ensemble != "nose-hoover":  # the cell did change
        assert_beyond(reference.get_volume(), atoms.get_volume(), 1e-3, scale="each", label="volume")
    assert_close(ours.conserved_energy(system), ase_md.get_conserved_energy(), 1e-8, scale="absolute",
                 label="conserved energy")


@pytest.mark.parametrize("isotropic", [True, False], ids=["isotropic", "anisotropic"])
def test_npt_reaches_target_pressure(isotropic):
    """MTK barostat from a start ~0.2 GPa off the target: the mean pressure over the second half equals
    the target within three block-average standard errors."""
    target = 0.2
    atoms = bulk("Ar", "fcc", a=5.30, cubic=True).repeat(3)
    thermalize_momenta(atoms, temperature_K=120, rng=np.random.default_rng(0))
    system = MDSystem.from_atoms(potentials.LennardJones(epsilon=0.0104, sigma=3.4, cutoff=6.5), atoms, skin=1.0)
    rows = run(system, MTK(5.0, 60.0, target, tdamp_fs=100.0, pdamp_fs=250.0, isotropic=isotropic), 1600,
               thermo_every=2)
    pressure = np.array([r["pressure_GPa"] for r in rows])
    second = pressure[len(pressure) // 2:]
    error = block_error(second)
    assert_beyond(pressure[0], target, 0.15, scale="absolute", label="starting pressure")
    assert error < 0.01, (pressure[0], error)
    assert_close(second.mean(), target, 3 * error, scale="absolute", label=f"mean pressure (block error {error:.3e})")


def test_bad_md_input():
    with pytest.raises(ValueError, match="skin"):
        MDSystem.from_atoms(potentials.LennardJones(**LJ), argon(), skin=-1.0)
    with pytest.raises(ValueError, match="time step"):
        VelocityVerlet(0.0)
    with pytest.raises(ValueError, match="Nose-Hoover chain"):
        NoseHoover(1.0, 300.0, tdamp_fs=0.0)
    slab = argon()
    slab.pbc = (True, True, False)
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), slab, skin=1.0)
    with pytest.raises(potentials.InvalidStructureError, match="fully periodic"):
        run(system, MTK(2.0, 100.0, 0.0, 100.0, 1000.0), 1)


def test_exploding_dynamics_ends_the_run_with_a_message():
    atoms = argon(300)
    atoms.set_velocities(atoms.get_velocities() * 1e4)  # ~ 0.5 Å/fs × 1e4: crosses the box in one step
    system = MDSystem.from_atoms(potentials.LennardJones(**LJ), atoms, skin=1.0)
    with pytest.raises(mlip_parallel.SimulationError, match="in one step"):
        run(system, VelocityVerlet(5.0), 10)


class HostTransfers:
    """Records every per-atom-sized copy between torch and numpy (either way) while active: tensor →
    host (``numpy``, ``cpu``, ``tolist``, ``__array__``) and host → tensor
    (``torch.as_tensor`` / ``tensor`` / ``from_numpy`` of an array). Arrays of ≤ ``small`` numbers
    (global sums, 3 × 3 matrices) are allowed."""

    def __init__(self, monkeypatch, small=16):
        self.seen = []

        def watch_tensor(name):
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, **kwargs):
                if t.numel() > small:
                    self.seen.append(f"Tensor.{name} of {tuple(t.shape)}")
                return original(t, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, wrapper)

        def watch_factory(name):
            original = getattr(torch, name)

            def wrapper(data, *args, **kwargs):
                if isinstance(data, np.ndarray) and data.size > small:
                    self.seen.append(f"torch.{name} of {data.shape}")
                return original(data, *args, **kwargs)
            monkeypatch.setattr(torch, name, wrapper)

        for name in ("numpy", "cpu", "tolist", "__array__"):
            watch_tensor(name)
        for name in ("as_tensor", "tensor", "from_numpy"):
            watch_factory(name)


@pytest.mark.parametrize("integrator", ["langevin", "mtk-anisotropic"])
def test_steps_between_rebuilds_keep_atoms_on_the_device(monkeypatch, integrator):
    """Device residency: positions, velocities and forces stay tensors on the model's device, and a
    step that does not rebuild copies no per-atom array between host and device (only the skin
    check's distances, energy, virial and kinetic tensor: ≤ 16 numbers each). Checked on CPU by
    recording every torch ↔ numpy conversion of the step."""
    torch.manual_seed(0)
    model = potentials.SchNet(["Ar"], cutoff=5.0, features=8, layers=2).double()
    make = {"langevin": lambda: Langevin(2.0, 100.0, friction=0.02, seed=1),
            "mtk-anisotropic": lambda: MTK(2.0, 100.0, 0.1, tdamp_fs=100.0, pdamp_fs=500.0, isotropic=False)}
    system = MDSystem.from_atoms(model, argon(100), skin=2.0)
    steps = make[integrator]()
    run(system, steps, 2)
    rebuilds = system.rebuilds
    transfers = HostTransfers(monkeypatch)
    run(system, steps, 5, thermo_every=5, start_step=2)
    monkeypatch.undo()
    assert system.rebuilds == rebuilds  # no rebuild: the skin is wide and the atoms slow
    assert transfers.seen == [], transfers.seen
    for value in (*system.atoms.values(), system.forces):
        assert isinstance(value, torch.Tensor) and value.device == model.device


def md_force_call_saved_bytes(model, atoms) -> dict:
    """{"chunks" (the automatic chunk budget, what the default takes where one pass would not fit) and inf (one pass
    over all edges): (peak saved-tensor bytes of one MD force call after a first one, the budget in GB)}."""
    from md.engine import MDSystem
    from potentials.messages import memory_budget_bytes

    saved = {}
    for name, budget in (("chunks", memory_budget_bytes(None, "cpu") / 1e9), (float("inf"), float("inf"))):
        system = MDSystem.from_atoms(model, atoms, skin=1.0, memory_budget_gb=budget)
        system.compute_forces()
        saved[name] = (peak_saved_bytes(system.compute_forces), system.memory_budget_gb)
    return saved


def peak_saved_bytes(call) -> int:
    """The most bytes autograd held in saved tensors at once while ``call()`` ran (forward and backward;
    a tensor saved twice counts twice, so this bounds the true figure from above)."""
    import weakref

    live = peak = 0

    class Held:
        __slots__ = ("tensor", "__weakref__")

    def release(nbytes):
        nonlocal live
        live -= nbytes

    def pack(tensor):
        nonlocal live, peak
        held, nbytes = Held(), tensor.numel() * tensor.element_size()
        held.tensor = tensor
        live += nbytes
        peak = max(peak, live)
        weakref.finalize(held, release, nbytes)
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        call()
    return peak


def test_md_force_call_chunks_where_one_pass_would_not_fit(monkeypatch):
    """One MD force call on 864 Cu atoms (SchNet F=64, 3 layers, cutoff 5 Å, ~42 edges per atom): by default one
    pass over all edges where the pre-flight predicts that fits (here), and the automatic chunks where it does not
    (a host with 1e-9 of its memory free, as ``one_pass_fits`` sees it), which keep at most their chunk budget +
    25 KB per atom in saved tensors, as an explicit budget does; one pass (``memory_budget_gb=inf``) keeps ~10×
    more. Guards against a change that silently drops the bound where memory is short."""
    import potentials.messages as messages

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((6, 6, 6))
    atoms.rattle(0.05, seed=0)
    model = potentials.SchNet(["Cu"], cutoff=5.0, features=64, layers=3, seed=0)
    n = len(atoms)
    assert MDSystem.from_atoms(model, atoms, skin=1.0).memory_budget_gb == float("inf")
    monkeypatch.setattr(messages, "ONE_PASS_SHARE", 1e-9)
    per_atom = {}
    for budget in (None, 0.004, float("inf")):
        system = MDSystem.from_atoms(model, atoms, skin=1.0, memory_budget_gb=budget)
        system.compute_forces()  # the first call builds the neighbour list
        per_atom[budget] = (peak_saved_bytes(system.compute_forces), system.memory_budget_gb)
    assert per_atom[None][1] == messages.memory_budget_bytes(None, "cpu") / 1e9, per_atom
    for budget in (None, 0.004):
        saved, budget_gb = per_atom[budget]
        assert budget_gb < 1, budget_gb
        assert saved <= budget_gb * 1e9 + 25e3 * n, (budget, saved / n, budget_gb)
    assert per_atom[float("inf")][0] > 100e3 * n, per_atom



def test_the_calculators_check_of_the_atoms_answers_as_ases():
    """MLIPCalculator and the batch's single-point results (ExactStateCheck) say what changed since their results
    exactly as ASE's own check does: nothing for a copy of the atoms, nothing for a position one ulp off (within
    ASE's tolerance: ASE's answer, not the exact comparison's), and each change — positions by 1e-12 Å, cell, pbc,
    numbers, initial charges and magnetic moments added — as ASE names it; a moved atom is evaluated again."""
    from ase.calculators.calculator import Calculator

    from md import MLIPCalculator
    from md.batch import BatchResults

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True)
    atoms.rattle(0.05, seed=2)
    calc = MLIPCalculator(potentials.LennardJones(0.4, 2.3, 5.0))
    atoms.calc = calc
    energy = atoms.get_potential_energy()
    single = BatchResults(atoms, energy=energy, forces=atoms.get_forces())
    changes = {"same": lambda a: None, "positions 1e-12": lambda a: a.positions.__iadd__(1e-12),
               "positions 1e-16": lambda a: a.positions.__setitem__((0, 0), np.nextafter(a.positions[0, 0], 9)),
               "cell": lambda a: a.set_cell(a.cell[:] * 1.001), "pbc": lambda a: a.set_pbc([True, True, False]),
               "numbers": lambda a: a.numbers.__setitem__(0, 47),
               "charges": lambda a: a.set_initial_charges([0.1] * len(a)),
               "magmoms": lambda a: a.set_initial_magnetic_moments([1.0] * len(a))}
    for name, change in changes.items():
        changed = atoms.copy()
        change(changed)
        for checker in (calc, single):
            ases = Calculator.check_state(checker, changed)
            assert checker.check_state(changed) == ases, (name, type(checker).__name__, ases)
            assert (ases == []) == (name in ("same", "positions 1e-16")), (name, ases)
    moved = atoms.copy()
    moved.positions[0, 0] += 0.01
    moved.calc = calc
    assert moved.get_potential_energy() != energy
