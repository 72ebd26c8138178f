"""mlip-train's one pass over its data at start-up (mlip_parallel.train.survey), shared by the ranks: the streamed
least squares equals numpy's on all the rows; a new model's reference energies and scale from a streamed set, surveyed
in shares and merged, equal the fit on the whole set held in memory (1e-10); the label, species and memory checks
name the same structures as a look at every structure would."""
import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import read, write

import potentials
from comparison import assert_beyond, assert_close
from systems import emt_labelled
from mlip_parallel.train import survey as survey_module
from mlip_parallel.train.cli import RULES, SCHEMA, validate
from mlip_parallel.train import sources
from mlip_parallel.train.sources import open_source
from mlip_parallel.train.survey import ELEMENTS, LeastSquares, Survey, merged_facts, share_facts
from mlip_parallel.train.trainer import Trainer
from mlip_parallel.train.structures import DataError


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLIP_PARALLEL_CACHE", str(tmp_path / "cache"))


def alloy_frames(count, seed=0):
    """Cu/Ag/Au cells of 4 to 16 atoms, compositions drawn at random, labelled by ASE's EMT."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((1, 1 + k % 2, 1 + (k // 2) % 2))
        atoms.numbers = rng.choice([29, 47, 79], size=len(atoms), p=[0.5, 0.3, 0.2])
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        out.append(emt_labelled(atoms))
    return out


def surveyed(structures, shares):
    """The survey of ``structures`` read in ``shares`` strided shares (as so many ranks) and merged."""
    return Survey(structures, merged_facts([share_facts(structures, r, shares) for r in range(shares)]))


def whole_set_fit(frames, numbers):
    """The in-memory fit, independently: numpy's least squares on every structure's element counts."""
    counts = np.array([[np.sum(a.numbers == z) for z in numbers] for a in frames], dtype=float)
    energies = np.array([a.get_potential_energy() for a in frames])
    forces = np.concatenate([a.get_forces() for a in frames])
    return np.linalg.lstsq(counts, energies, rcond=None)[0], float(np.sqrt(np.mean(forces ** 2)))


@pytest.mark.parametrize("case, rows", [("full rank", 3 * survey_module.CHUNK + 17), ("1:2", 3 * survey_module.CHUNK + 17),
                                        ("2:3", 10 * survey_module.CHUNK + 17)])
def test_least_squares_in_chunks_and_shares_equals_lstsq(case, rows):
    """More rows than a chunk, split over three shares and merged: numpy's solution on all the rows, also its
    minimum-norm one where two elements always come in one ratio (water's 1:2; alumina's 2:3 over 5,000 rows)."""
    rng = np.random.default_rng(3)
    counts = np.zeros((rows, ELEMENTS))
    counts[:, [1, 8, 29, 47]] = rng.integers(0, 20, size=(rows, 4))
    if case == "1:2":
        counts[:, 8] = 2 * counts[:, 1]  # water-like: H always twice O
    elif case == "2:3":
        counts[:, 13] = 2 * rng.integers(1, 10, size=rows)  # Al2O3 units
        counts[:, 8] = 1.5 * counts[:, 13]
    y = counts @ rng.normal(-3, 1, ELEMENTS) + rng.normal(0, 0.01, rows)
    shares = [LeastSquares(ELEMENTS) for _ in range(3)]
    for k in range(rows):
        shares[k % 3].add(counts[k], y[k])
    for other in shares[1:]:
        shares[0].merge(other)
    assert shares[0].rows == rows
    expected = np.linalg.lstsq(counts, y, rcond=None)[0]
    assert_close(shares[0].solve(), expected, 1e-10, label="merged shares")
    one = LeastSquares(ELEMENTS)  # the fault a dropped share makes
    for k in range(0, rows, 3):
        one.add(counts[k], y[k])
    assert_beyond(one.solve(), expected, 1e-6, label="one share")


def test_streamed_fit_equals_the_fit_held_in_memory(tmp_path):
    """A new model's reference energies (its shift) and energy scale (the force RMS): a streamed set surveyed in
    three shares and merged, and mlip-train's runs held and streamed, equal numpy's fit on all the structures."""
    frames = alloy_frames(40)
    path = tmp_path / "alloys.extxyz"
    write(path, frames, format="extxyz")
    numbers = [29, 47, 79]
    shift, scale = whole_set_fit(read(path, ":"), numbers)  # the numbers as the file holds them
    source = open_source(str(path))
    whole = surveyed(source, 3)
    assert whole.size == 40 and whole.elements == numbers and whole.energies.rows == 40
    assert_close(whole.reference_energies(numbers), shift, 1e-10, label="reference energies")
    assert whole.force_rms == pytest.approx(scale, rel=1e-12)
    positions, share, _ = share_facts(source, 0, 2)
    half = Survey(sources.Subset(source, positions), share).reference_energies(numbers)  # a rank's share: another fit
    assert_beyond(half, shift, 1e-6, scale="absolute", label="a rank's share")
    for stream in (False, True):
        config = {"data": {"train": str(path), "validation": str(path), "stream": stream},
                  "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 1},
                            "dtype": "float64"}, "epochs": 1, "output": {"directory": str(tmp_path / f"run{stream}")}}
        model = Trainer(validate(config, SCHEMA, RULES)).model
        assert model.species == ["Cu", "Ag", "Au"]  # ordered by atomic number
        fitted = model.scale_shift.shift.detach().numpy()
        assert_close(fitted, shift, 1e-10, label=f"shift, stream {stream}")
        fitted_scale = model.scale_shift.scale.detach().numpy()
        assert_close(fitted_scale, np.full_like(fitted_scale, scale), 1e-12, scale="each",
                     label=f"scale, stream {stream}")


def test_checks_name_the_first_structure_of_the_part(tmp_path):
    """Label check: the first structure lacking energy by position, counted over every share; species check: the first
    structure holding the unknown element; memory check: the largest structure is among those it weighs."""
    frames = alloy_frames(12)
    for k in (5, 7, 10):
        frames[k].calc = SinglePointCalculator(frames[k], forces=frames[k].get_forces(), stress=frames[k].get_stress())
    big = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((3, 3, 3))
    big.calc = SinglePointCalculator(big, energy=0.0, forces=np.zeros((len(big), 3)), stress=np.zeros(6))
    frames[9] = big
    path = tmp_path / "data.extxyz"
    write(path, frames, format="extxyz")
    whole = surveyed(open_source(str(path)), 2)
    with pytest.raises(DataError, match=r"data.extxyz: structure 5 \(counting from 0\) has no energy, but the energy "
                                        r"weight is 1.0; 3 of these 12 structures lack energy"):
        whole.check_labels({"energy": 1.0, "forces": 1.0, "stress": 0.0})
    whole.check_labels({"energy": 0.0, "forces": 1.0, "stress": 1.0})
    assert any(len(s.numbers) == len(big) for s in whole.memory_candidates)
    copper_only = potentials.SchNet(species=["Cu"], cutoff=4.0, features=4, layers=1)
    first_silver = min(k for k, a in enumerate(frames) if 47 in a.numbers)
    with pytest.raises(DataError, match=rf"data.extxyz:{first_silver} \(training\):"):
        whole.check_species(copper_only, "training")


def test_a_structure_that_cannot_be_read_is_the_same_error_from_every_share(tmp_path):
    """Structure 3 has no atoms: whichever share reads it, the merged survey raises its error (every rank alike)."""
    frames = alloy_frames(6)
    path = tmp_path / "data.extxyz"
    write(path, frames[:3], format="extxyz")
    with open(path, "a") as f:
        f.write('0\nProperties=species:S:1:pos:R:3 energy=1.0 pbc="F F F"\n')
    write(path, frames[3:], format="extxyz", append=True)
    for size in (1, 2, 3):
        with pytest.raises(DataError, match="structure with no atoms"):
            surveyed(open_source(str(path)), size)


def test_a_files_facts_are_read_once_and_again_when_it_changes(tmp_path, monkeypatch):
    """mlip-train's start-up survey of a streamed file reads its structures once; a second survey (the next run, a
    resume) reads none (the memory check then reads its 16 a part), and gives the same survey; the file rewritten, or read under other
    label names, is read again. The split parts (training, validation) share the file's one reading."""
    from mlip_parallel.train.survey import surveys
    from mlip_parallel.train.sources import split

    path = tmp_path / "alloys.extxyz"
    write(path, alloy_frames(40), format="extxyz")
    reads = []
    original = sources.ExtxyzSource.frame  # (every read of a structure: by index, or in turn by the survey)

    def counted(self, f, k):
        reads.append(k)
        return original(self, f, k)

    monkeypatch.setattr(sources.ExtxyzSource, "frame", counted)

    def survey_now(keys=None):
        reads.clear()
        train, validation = split(open_source(str(path), keys), [0.25], seed=1)
        found = surveys((train, validation), None)
        surveying = len(reads)
        candidates = sum(len(part.memory_candidates) for part in found)  # read when the memory check asks
        assert len(reads) == surveying + candidates
        return found, surveying, candidates

    first, read_first, _ = survey_now()
    assert read_first == 40  # every structure once, for both parts
    again, read_again, candidates = survey_now()
    assert read_again == 0 and 0 < candidates <= 2 * 16
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert a.size == b.size and a.first_element == b.first_element and a.missing == b.missing
        np.testing.assert_array_equal(a.atoms, b.atoms)
        np.testing.assert_array_equal(a.energies.solve(), b.energies.solve())
        assert a.force_rms == b.force_rms and a.candidate_positions == b.candidate_positions
    assert survey_now({"energy": "energy"})[1] == 0  # the same names: the same facts
    frames = alloy_frames(41, seed=5)
    write(path, frames, format="extxyz")  # rewritten: another size and time
    changed, read_changed, _ = survey_now()
    assert read_changed == 41 and changed[0].size + changed[1].size == 41
    assert survey_now({"forces": "REF_forces"})[1] == 41  # other names: read again (and these lack forces)


def test_a_shuffled_part_names_its_lowest_structure(tmp_path):
    """In a shuffled split every structure of which lacks energy, the label check names the lowest index of the file
    among the part's structures (not the split's first, an arbitrary one); so does the species check."""
    from mlip_parallel.train.survey import surveys
    from mlip_parallel.train.sources import split

    frames = alloy_frames(14)
    for atoms in frames:
        atoms.calc = SinglePointCalculator(atoms, forces=atoms.get_forces(), stress=atoms.get_stress())
    path = tmp_path / "data.extxyz"
    write(path, frames, format="extxyz")
    train, validation = split(open_source(str(path)), [0.25], seed=3)
    assert train.indices[0] != min(train.indices)  # the split's first is not its lowest
    part = surveys((train, validation), None)[0]
    with pytest.raises(DataError, match=rf"structure {min(train.indices)} \(counting from 0\) has no energy.* "
                                        rf"{len(train)} of these {len(train)} structures lack energy"):
        part.check_labels({"energy": 1.0, "forces": 1.0, "stress": 0.0})
    first_gold = min(k for k in train.indices if 79 in frames[k].numbers)
    with pytest.raises(DataError, match=rf"data.extxyz:{first_gold} \(training\):"):
        part.check_species(potentials.SchNet(species=["Cu", "Ag"], cutoff=4.0, features=4, layers=1), "training")
