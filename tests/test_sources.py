"""Training data read lazily (mlip_parallel.train.sources): extxyz through a byte-offset index, ASE db, fairchem's
ASE-LMDB and lists of files give the same structures and train to the same metrics; the index is cached and rebuilt
when its file changes; the labels' names are configurable; malformed files are named with the line; mlip-train eval
holds one batch of structures at a time."""
import csv
import weakref
from pathlib import Path

import numpy as np
import pytest

import potentials
from ase.build import bulk
from ase.io import read, write

from comparison import assert_close
from conftest import importable, require
from systems import emt_labelled
from mlip_parallel.train import sources
from mlip_parallel.train.cli import RULES, SCHEMA, evaluate_model, train, validate
from mlip_parallel.train.structures import DataError
from mlip_parallel.train.training import error_sums, error_table
from mlip_parallel.train.sources import read_structures

FIELDS = ("numbers", "positions", "cell", "pbc", "energy", "forces", "stress")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLIP_PARALLEL_CACHE", str(tmp_path / "cache"))


def frames(count=12, seed=0):
    """Rattled Cu cells of 4 and 8 atoms (mixed sizes), labelled by ASE's EMT, as read back from an extxyz (so every
    format holds the same rounded numbers)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        atoms = bulk("Cu", cubic=True).repeat((1, 1, 1 + k % 2))
        atoms.positions += rng.normal(0, 0.08, atoms.positions.shape)
        out.append(emt_labelled(atoms))
    return out


def same(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def write_formats(directory: Path, atoms_list) -> dict:
    """The same structures as extxyz, ASE db, ASE-LMDB (where ase-db-backends is installed) and two extxyz halves."""
    import ase.db

    paths = {"extxyz": directory / "data.extxyz"}
    write(paths["extxyz"], atoms_list, format="extxyz")
    again = read(paths["extxyz"], ":")
    paths["db"] = directory / "data.db"
    with ase.db.connect(paths["db"]) as db:
        for atoms in again:
            db.write(atoms)
    if importable("ase_db_backends"):
        from ase_db_backends.aselmdb import LMDBDatabase

        paths["aselmdb"] = directory / "data.aselmdb"
        with LMDBDatabase(paths["aselmdb"]) as db:
            for atoms in again:
                db.write(atoms)
    half = len(again) // 2
    write(directory / "first.extxyz", again[:half], format="extxyz")
    write(directory / "second.extxyz", again[half:], format="extxyz")
    paths["list"] = [str(directory / "first.extxyz"), str(directory / "second.extxyz")]
    return paths


def test_formats_give_the_same_structures_and_train_alike(tmp_path):
    """Every format (and a list of two files) gives the same structures, by index and in order, and the same
    metrics.csv, digit for digit, held in memory or streamed (data.stream: read at each use)."""
    paths = write_formats(tmp_path, frames())
    reference = read_structures(paths["extxyz"])
    assert len(reference) == 12 and reference[1].positions.shape == (8, 3)
    for name, path in paths.items():
        source = sources.open_source(path)
        assert len(source) == 12, name
        for k in (0, 5, 11, -1):  # random access, in the file's order
            same(source[k], reference[k])
        structures = list(source)
        assert len(structures) == len(reference), name
        for a, b in zip(structures, reference):
            same(a, b)
    metrics = {}
    runs = [(name, path, False) for name, path in paths.items()] + [(f"{name}, streamed", path, True)
                                                                   for name, path in paths.items()]
    for name, path, stream in runs:
        out = tmp_path / f"run_{name}"
        config = {"data": {"train": path if isinstance(path, list) else str(path), "validation_fraction": 0.25,
                           "stream": stream},
                  "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 2},
                            "dtype": "float64"},
                  "epochs": 2, "batch_size": 3, "seed": 1, "output": {"directory": str(out)}}
        train(validate(config, SCHEMA, RULES))
        with open(out / "metrics.csv") as f:
            metrics[name] = [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]
    assert len(metrics["extxyz"]) == 2
    for name, rows in metrics.items():
        assert rows == metrics["extxyz"], name  # the same batches: the same losses, digit for digit
    require("ase_db_backends")  # ASE-LMDB left out without it: the test is skipped or fails


def test_the_index_is_cached_and_rebuilt_when_its_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "data.extxyz"
    write(path, frames(6), format="extxyz")
    built = []
    index = sources.index_extxyz
    monkeypatch.setattr(sources, "index_extxyz", lambda p: built.append(p) or index(p))
    assert len(sources.open_source(path)) == 6 and len(built) == 1
    assert len(sources.open_source(path)) == 6 and len(built) == 1  # from the cache
    assert len(list((tmp_path / "cache" / "index").glob("*.npz"))) == 1
    write(path, frames(9, seed=1), format="extxyz")  # changed: indexed anew
    source = sources.open_source(path)
    assert len(source) == 9 and len(built) == 2
    same(source[8], read_structures(path)[8])
    offsets = index(path)
    assert offsets[0] == 0 and offsets[-1] == path.stat().st_size and np.all(np.diff(offsets) > 0)


def test_label_names_and_bad_files_are_named(tmp_path):
    atoms_list = frames(4)
    renamed = []
    for atoms in atoms_list:
        copy = atoms.copy()
        copy.info["REF_energy"] = atoms.get_potential_energy()
        copy.arrays["REF_forces"] = atoms.get_forces()
        copy.info["total_charge"], copy.info["multiplicity"] = len(renamed) - 1, 2  # a charge and spin, renamed
        renamed.append(copy)  # no calculator: the labels only under their own names
    path = tmp_path / "ref.extxyz"
    write(path, renamed, format="extxyz")
    plain = read_structures(path)
    assert plain[0].energy is None and plain[0].forces is None
    keyed = read_structures(path, {"energy": "REF_energy", "forces": "REF_forces"})
    assert keyed[2].energy == pytest.approx(atoms_list[2].get_potential_energy(), rel=1e-12)
    assert_close(keyed[2].forces, atoms_list[2].get_forces(), 1e-8, scale="absolute", label="REF_forces")
    assert [(s.charge, s.spin) for s in keyed] == [(None, None)] * 4
    charged = read_structures(path, {"charge": "total_charge", "spin": "multiplicity"})
    assert [(s.charge, s.spin) for s in charged] == [(-1, 2), (0, 2), (1, 2), (2, 2)]
    assert all(type(s.charge) is int for s in charged)

    garbage = tmp_path / "garbage.extxyz"
    garbage.write_text("2\ncomment\nCu 0 0 0\nCu 1.8 0 0\nnot a count\n")
    truncated = tmp_path / "truncated.extxyz"
    truncated.write_text("3\ncomment\nCu 0 0 0\n")
    cases = [(garbage, None, r"garbage.extxyz: cannot read structures: line 5: expected the atom count of a frame "
                             r"\(extxyz\), got 'not a count'"),
             (truncated, None, r"truncated.extxyz: cannot read structures: frame 0 \(counting from 0\) ends early"),
             (path, {"dipole": "q"}, r"data.keys: 'dipole' is not a key it takes \(energy, forces, stress, "
                                     r"config_type, charge, spin\)"),
             ([str(path), 3], None, r"a data file is a path, got 3"),
             ([], None, r"no data file given")]
    for data, keys, message in cases:
        with pytest.raises(DataError, match=message):
            sources.open_source(data, keys)
    for name, value in (("charge", 0.5), ("charge", "one"), ("spin", -1), ("charge", 101)):
        odd = renamed[1].copy()
        odd.info[name] = value  # charge and spin are whole numbers in fairchem's ranges: [-100, 100], [0, 100]
        write(tmp_path / "odd.extxyz", [renamed[0], odd], format="extxyz")
        with pytest.raises(DataError, match=rf"odd.extxyz: structure 1 \(counting from 0\) has {name} {value!r}: a "
                                            rf"whole number in \[-?\d+, 100\] is needed"):
            read_structures(tmp_path / "odd.extxyz")


def test_eval_holds_one_batch_at_a_time(tmp_path, monkeypatch):
    """mlip-train eval over 40 structures in batches of 4: at most one batch of them alive at once (a list of all would
    hold 40), and the same errors as the structures read whole."""
    path = tmp_path / "data.extxyz"
    write(path, frames(40, seed=2), format="extxyz")
    alive, most = [0], [0]
    read_one = sources.ExtxyzSource.frame  # (every read of a structure: by index, or in turn by the survey)

    def counted(self, f, k):
        structure = read_one(self, f, k)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(structure, lambda: alive.__setitem__(0, alive[0] - 1))
        return structure

    monkeypatch.setattr(sources.ExtxyzSource, "frame", counted)
    streamed = evaluate_model("cu-emt", str(path), batch_size=4)
    assert most[0] <= 8, most  # this batch and, at most, the last one not yet collected
    monkeypatch.setattr(sources.ExtxyzSource, "frame", read_one)
    model = potentials.load_model("cu-emt")
    whole = error_table(error_sums(model, read_structures(path), 4, model.device))
    for key, value in whole.items():
        assert streamed[key] == pytest.approx(value, rel=1e-6), key  # (float32 cu-emt: sums in another order)


def test_workers_read_ahead_what_each_rank_uses_with_its_neighbour_lists(tmp_path):
    """global_batches with 2 worker processes: the same global batches, step for step, as reading when used (from
    step 3 on: a resumed run); each step's structures of this rank (even positions of the batch) arrive read, with
    the neighbour lists vesin gives; a structure that cannot be read is its own one-line DataError from the model's
    process."""
    from mlip_parallel.train.loader import ReadAhead, StepBatches, global_batches
    from potentials.graph import neighbour_list

    path = tmp_path / "data.extxyz"
    write(path, frames(12), format="extxyz")
    source = sources.open_source(str(path))
    batches = StepBatches(len(source), 5, seed=4)  # 3 steps an epoch: 5, 5, 2

    def mine(positions):
        return positions[0::2]

    plain = list(global_batches(source, batches, 3, 9, 0, mine, None))
    ahead = list(global_batches(source, batches, 3, 9, 2, mine, 4.0))
    assert len(plain) == len(ahead) == 6
    for a, b in zip(plain, ahead):
        np.testing.assert_array_equal(a.indices, b.indices)
        assert isinstance(b.structures, ReadAhead) and set(b.structures.ready) == set(int(k) for k in a.indices[0::2])
        for k, s in b.structures.ready.items():
            same(s, source[k])
            assert s._edges is not None and s._edges[0] == 4.0
            expected = neighbour_list(s.positions, s.cell, s.pbc, 4.0)
            assert len(s._edges[1]) == len(expected)
            for x, y in zip(s._edges[1], expected):
                np.testing.assert_array_equal(x, y)
    with open(path, "a") as f:
        f.write('0\nProperties=species:S:1:pos:R:3 energy=1.0 pbc="F F F"\n')
    broken = sources.open_source(str(path))
    with pytest.raises(DataError, match=r"data.extxyz:12: a structure with no atoms$"):
        list(global_batches(broken, StepBatches(len(broken), 13, seed=0), 0, 1, 1, lambda positions: positions, 4.0))


def test_batches_of_at_most_so_many_atoms():
    """batch_atoms 20 over structures of 4 to 24 atoms: each epoch takes every structure once, in its seeded order, cut
    where the next structure would pass 20 atoms (a 24-atom one alone); a batch's positions largest first, so ranks
    dealt rank, rank + P, ... hold about as many atoms; steps map to (epoch, batch) and back across epochs."""
    from mlip_parallel.train.loader import StepBatches

    atoms = np.random.default_rng(0).choice([4, 8, 12, 24], size=40)
    batches = StepBatches(40, 999, seed=2, atoms=atoms, batch_atoms=20)
    step = 0
    for epoch in range(3):
        order = np.random.default_rng([2, epoch]).permutation(40)
        assert batches.first_step(epoch) == step
        seen = []
        for b in range(batches.batches_in(epoch)):
            assert batches.locate(step) == (epoch, b)
            positions = batches(step)
            assert list(atoms[positions]) == sorted(atoms[positions], reverse=True)
            assert atoms[positions].sum() <= 20 or len(positions) == 1
            if len(seen) + len(positions) < 40:  # greedy: the next structure would not have fitted
                assert atoms[positions].sum() + atoms[order[len(seen) + len(positions)]] > 20
            seen.extend(sorted(positions, key=lambda k: list(order).index(k)))
            step += 1
        assert seen == list(order)  # contiguous runs of the epoch's order, none left out
    assert batches.total_steps(3) == batches.first_step(3) and batches.total_steps(100, max_steps=7) == 7
    assert batches.total_steps(2, max_steps=10 ** 6) == batches.first_step(2)
    assert batches.epochs_done(batches.first_step(2)) == 2
    assert 1 < batches.epochs_done(batches.first_step(1) + 1) < 2
    plain = StepBatches(40, 6, seed=2)
    assert plain.first_step(3) == 21 and plain.locate(20) == (2, 6) and len(plain(20)) == 4


def test_a_mixture_samples_its_shares():
    """Positions 0-29 whole, 30-79 sampled at 0.2 and 80-89 at 0.1: every epoch holds each whole position once and
    round(s × 30 / 0.7) draws of each sampled range (9 and 4), a sampled range's structures each drawn once before
    any is drawn again (50 over 5.6 epochs; 10 over 2.5), no position outside its range; batches cover the epoch's
    members exactly; without a mixture an epoch is the plain seeded permutation of before."""
    from mlip_parallel.train.loader import StepBatches

    batches = StepBatches(90, 5, seed=3, mixture=[(30, 80, 0.2), (80, 90, 0.1)])
    assert batches.draws == [9, 4] and batches.epoch_size == 43 and batches.first_step(2) == 2 * 9
    drawn = {0: [], 1: []}
    for epoch in range(12):
        members = batches.members(epoch)
        np.testing.assert_array_equal(np.sort(members[:30]), np.arange(30))
        first, second = members[30:39], members[39:]
        assert ((30 <= first) & (first < 80)).all() and ((80 <= second) & (second < 90)).all()
        drawn[0].extend(first)
        drawn[1].extend(second)
        seen = np.concatenate([batches(step) for step in range(batches.first_step(epoch),
                                                                batches.first_step(epoch + 1))])
        np.testing.assert_array_equal(np.sort(seen), np.sort(members))
    for sequence, (start, stop) in ((drawn[0], (30, 80)), (drawn[1], (80, 90))):
        size = stop - start
        for cycle in range(len(sequence) // size):  # each full pass over the range: a permutation of it
            assert sorted(sequence[cycle * size:(cycle + 1) * size]) == list(range(start, stop))
    assert batches.members(5).tolist() == batches.members(5).tolist()  # from the seed alone
    plain = StepBatches(40, 6, seed=2)
    np.testing.assert_array_equal(np.concatenate([plain(s) for s in range(7)]),
                                  np.random.default_rng([2, 0]).permutation(40))


def test_mlip_train_draws_each_epoch_from_the_sampled_file(tmp_path, monkeypatch, capsys):
    """data.train [own (12 structures), {file: replay (20), share: 0.25}], validation_fraction 0.25: the 9 own
    training structures and 3 replay ones an epoch (0.25 of 12), the validation set all own; the log states it."""
    from mlip_parallel.train import strategies

    write(tmp_path / "own.extxyz", frames(12), format="extxyz")
    write(tmp_path / "replay.extxyz", frames(20, seed=1), format="extxyz")
    used, original = [], strategies.DataParallel.step

    def step(self, global_batch, *args):
        used.append([s.source for s in global_batch])
        return original(self, global_batch, *args)

    monkeypatch.setattr(strategies.DataParallel, "step", step)
    config = {"data": {"train": [str(tmp_path / "own.extxyz"), {"file": str(tmp_path / "replay.extxyz"),
                                                                 "share": 0.25}],
                       "validation_fraction": 0.25, "stream": True},
              "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 8, "layers": 1}},
              "epochs": 4, "batch_size": 4, "output": {"directory": str(tmp_path / "out"), "progress": False}}
    train(validate(config, SCHEMA, RULES))
    assert "12 per epoch (9 whole, 3 of 20 sampled (0.25)) training / 3 validation" in capsys.readouterr().out
    assert len(used) == 4 * 3
    replay = []
    for epoch in range(4):
        sources_ = [s for batch in used[3 * epoch:3 * epoch + 3] for s in batch]
        own = sorted(s for s in sources_ if "own.extxyz" in s)
        assert len(own) == 9 == len(set(own)), own
        replay.extend(s for s in sources_ if "replay.extxyz" in s)
        assert len(replay) == 3 * (epoch + 1)
    assert len(set(replay)) == 12  # 12 of the 20 drawn, none twice yet


def test_a_structure_unreadable_mid_run_stops_the_job_in_one_line(tmp_path, monkeypatch, capsys):
    """A streamed file garbled after start-up (it was read whole then): training stops at the first structure it cannot
    read, naming it and the last checkpoint (DataErrorMidRun); mlip-train prints that one line and exits 2, through
    the path that ends every rank of a job (launch.end_job: one rank found it)."""
    import yaml

    from mlip_parallel.train import cli
    from mlip_parallel.train.trainer import Trainer
    from mlip_parallel.train.structures import DataErrorMidRun

    path = tmp_path / "data.extxyz"
    write(path, frames(12), format="extxyz")
    config = {"data": {"train": str(path), "validation_fraction": 0.25, "stream": True},
              "model": {"name": "SchNet", "cutoff": 4.0, "hyperparameters": {"features": 4, "layers": 1}},
              "epochs": 2, "batch_size": 3, "output": {"directory": str(tmp_path / "run"), "checkpoint_every": 2}}
    trainer = Trainer(validate(config, SCHEMA, RULES))
    text = path.read_bytes()
    path.write_bytes(text[:len(text) // 2] + b"x" * (len(text) - len(text) // 2))  # its second half garbled
    with pytest.raises(DataErrorMidRun, match=r"data.extxyz: structure \d+ \(counting from 0\) cannot be read: .*; "
                                              r"training stopped; last checkpoint written: (none yet|.*last.pt \(epoch)"):
        trainer.fit()

    def stopped(_):
        raise DataErrorMidRun("data.extxyz: structure 7 cannot be read; training stopped; last checkpoint written: x")

    monkeypatch.setattr(cli, "train", stopped)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(dict(config, output={"directory": str(tmp_path / "other")})))
    assert cli.main([str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("mlip-train: error:") == 1 and "structure 7 cannot be read; training stopped" in err, err


def test_large_data_is_streamed_by_default_and_the_log_says_so(tmp_path, monkeypatch):
    """data.stream left out: the structures are held where the data files take at most STREAM_ABOVE_BYTES on disk
    and streamed from disk above it (here the threshold lowered below the file's size), data.workers stream, an
    explicit data.stream wins; the log line names the choice and the key that reverses it."""
    from mlip_parallel.train import model_setup

    path = tmp_path / "data.extxyz"
    write(path, frames(12), format="extxyz")
    size = path.stat().st_size

    def loaded(**data):
        config = validate({"data": {"train": str(path), "validation_fraction": 0.25, **data},
                           "model": {"name": "SchNet"}, "output": {"directory": str(tmp_path / "out")}}, SCHEMA, RULES)
        train_set, _, _, _, note = model_setup.load_data(config)
        return isinstance(train_set, list), note

    held, note = loaded()
    assert held and "held in memory (within 256 MB; data.stream: true to stream it)" in note, note
    monkeypatch.setattr(model_setup, "STREAM_ABOVE_BYTES", size - 1)
    held, note = loaded()
    assert not held and f"data {size / 1e6:.3g} MB on disk, streamed from disk (above 0 MB; data.stream: false" \
        in note, note
    assert loaded(stream=False)[0] and not loaded(stream=True)[0]
    monkeypatch.setattr(model_setup, "STREAM_ABOVE_BYTES", 10**12)
    assert not loaded(workers=1)[0] and "data.workers read ahead" in loaded(workers=1)[1]
