"""One ``mlip-md`` run, on every rank: ``MDJob(config)`` builds it, ``run()`` runs it and returns the thermo rows.

Building (collective): the start is checked and built (``start.prepare``: the config, the restart it continues,
the integrator, the structure, the model), each rank gets its threads and device, the MD system is made (from the
structure or the restart) and its first forces computed. The memory pre-flight (before the first ghosts) and the
first force call decide alike on every rank, before anything is written.

The loop, once per output stop (every thermo, trajectory and restart step, and the last)::

    integrate to the stop                                  (engine.run)
    at a restart step: write restart.npz, then go on from the file, as a requeued job does
    thermo row (thermo.csv, the screen), trajectory frame, progress
    at the end: final.extxyz, thermo.png, the summary and where the time went (``report``)

An output file that cannot be written raises OutputError on rank 0, naming the file, the reason and the last
restart written; a run that cannot go on (SimulationError, alike on every rank) names it too.
"""
from __future__ import annotations

import time
from pathlib import Path

from mlip_parallel import get_backend
from mlip_parallel.backend import rank_device, set_threads
from mlip_parallel.config import ConfigError
from mlip_parallel.errors import MemoryLimitError, SimulationError
from mlip_parallel.progress import Progress
from mlip_parallel.verify import verify_step
from potentials.committee import Committee
from potentials.errors import OutputError
from potentials.files import atomic_write, naming_errors
from potentials.predict import voigt_stress

from .engine import PHASES, MDSystem, run
from .outputs import CANDIDATES, RunFiles, cut_back, write_extxyz
from .report import close_bar, phase_table, plot_thermo, summary
from .start import prepare

THERMO_COLUMNS = ("step", "time_fs", "temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa",
                  "volume_A3", "seconds_per_step", "force_s", "halo_s", "neighbour_s", "integrate_s", "output_s")
SCREEN_COLUMNS = THERMO_COLUMNS[:9]  # the phase times go to thermo.csv and the end-of-run table
SAMPLES = 10_000  # at most this many thermo samples (every max(1, steps // SAMPLES) steps) feed the summary


class MDJob:
    """A validated ``config``'s run (see the module docstring): ``system`` (``engine.MDSystem``), ``first_step``
    and ``steps`` (the last), ``backend``, ``root`` (rank 0, which writes)."""

    def __init__(self, config):
        import torch

        self.config = config
        start = prepare(config)
        self.backend = get_backend()
        self.threads = set_threads(self.backend)
        self.model, self.integrator, self.restart = start["model"], start["integrator"], start["restart"]
        self.model.to(torch.device("cpu") if config["device"] == "cpu" else rank_device(self.backend))  # atoms follow
        self.continues, self.steps = start["continues"], start["steps"]
        self.root = self.backend.rank == 0
        out = config["output"]
        self.directory = Path(out["directory"])
        self.restart_path = self.directory / "restart.npz"
        # From here on every rank takes part in collectives; an error raised alike everywhere (SimulationError) ends
        # the run with one line, any other through the abort hook.
        try:
            if self.restart is not None:
                self.system, self.first_step = self._from_restart(self.restart)
            else:
                self.system = MDSystem.from_atoms(self.model, start["atoms"], balance=config["balance_every"] > 0,
                                                  **self._options())
                self.first_step = 0
            self.system.compute_forces()
        except MemoryLimitError as exc:
            raise ConfigError(str(exc)) from None
        except SimulationError as exc:
            raise SimulationError(f"step {self.first_step if self.restart is not None else 0}: {exc}") from None
        self.committee = isinstance(self.model, Committee)
        self.continuing = self.continues is not None  # cut the outputs back to the restart, then append
        self.last_restart = f"{self.restart} (step {self.first_step})" if self.continuing else "none yet"
        self.verified = self._verify() if config["verify"] else None

    def _verify(self) -> str:
        """The first step's energy, forces and stress against one process's evaluation of the same structure
        (``mlip_parallel.verify.verify_step``); SimulationError naming the differences where they are beyond
        summation order. Returns the comparison's line. Collective, before anything is written."""
        frame = self.snapshot(self.first_step)
        result = None
        if self.root:
            result = {"energy": frame.calc.results["energy"], "forces": frame.calc.results["forces"]}
            if "stress" in frame.calc.results:
                result["stress"] = frame.calc.results["stress"]
        return verify_step(self.model, frame, result, self.backend, self.first_step, SimulationError)

    def _options(self) -> dict:
        config = self.config
        return dict(skin=config["skin"], mode=config["mode"], memory_budget_gb=config["memory_budget_gb"])

    def _from_restart(self, path):
        return MDSystem.from_restart(self.model, path, integrator=self.integrator, **self._options())

    def run(self) -> list:
        """Integrate from ``first_step`` to ``steps``, writing the outputs; the thermo rows (every rank)."""
        try:
            return self._run()
        except OutputError as exc:
            raise OutputError(f"{exc}; last restart written: {self.last_restart}") from None
        except SimulationError as exc:  # alike on every rank: thermo.csv and the trajectory end at the last row
            raise SimulationError(f"{exc}; last restart written: {self.last_restart}") from None

    def _run(self) -> list:
        config, integrator = self.config, self.integrator
        out, steps, first_step = config["output"], self.steps, self.first_step
        every, traj_every, restart_every = max(1, out["thermo_every"]), out["trajectory_every"], out["restart_every"]
        devi_every = (config["uncertainty"]["every"] or every) if self.committee else 0
        stride = max(1, (steps - first_step) // SAMPLES)
        unrecorded = self.continues == {}  # a restart written without a record of the outputs
        files, bar = self._announce(f"trajectory.{out['trajectory_format']}" if traj_every else None)
        root = self.root

        rows, step = [], first_step
        stops = {steps} | {s for n in (every, traj_every, restart_every, devi_every) if n
                           for s in range(0, steps + 1, n)}
        samples = [self.system.thermo(first_step, integrator.dt)]  # for the summary: every `stride` steps
        start_time = time.perf_counter()
        last_timers, last_step = dict(self.system.timers), step
        for target in sorted(s for s in stops if s >= first_step):
            if target > step:
                t0 = time.perf_counter()
                chunk = run(self.system, integrator, target - step, thermo_every=stride, start_step=step,
                            balance_every=config["balance_every"])[1:]
                per_step = (time.perf_counter() - t0) / (target - step)
                samples += chunk
                step = target
                state = chunk[-1] if chunk and chunk[-1]["step"] == step else self.system.thermo(step, integrator.dt)
            else:
                state, per_step = self.system.thermo(step, integrator.dt), 0.0
            output_start = time.perf_counter()
            deviation = self.system.deviation() if devi_every and step % devi_every == 0 else None  # (collective)
            stop = deviation is not None and config["uncertainty"]["stop_above"] is not None and \
                deviation["max_devi_f"] > config["uncertainty"]["stop_above"] and step > first_step
            restart_due = step == steps or stop or (restart_every and step % restart_every == 0)
            if restart_due and not (self.continuing and step == first_step):  # not again the one continued from
                state = self._write_restart(step, files)
                if deviation is not None:  # from the forces of the run continued from the file, as a requeue's
                    deviation = self.system.deviation()
            # a restart written without a record of the outputs holds its own step's row and frame already
            written = unrecorded and step == first_step
            if (step % every == 0 or step == steps) and not written:
                span = max(1, step - last_step)  # seconds per step in each phase since the last row (rank 0's)
                row = dict(state, seconds_per_step=per_step, **{f"{phase}_s": (self.system.timers[phase] -
                                                                               last_timers[phase]) / span
                                                                for phase in PHASES})
                last_timers, last_step = dict(self.system.timers), step
                rows.append(row)
                if root:
                    files.row(row)
                    bar.clear()
                    print(" ".join(f"{row[c]:14.6g}" for c in SCREEN_COLUMNS), flush=True)
            if traj_every and step % traj_every == 0 and not written:
                frame = self.snapshot(step)
                if root:
                    files.frame(frame)
            if deviation is not None and not written:
                self._deviation_outputs(step, deviation, files)
            if stop:
                raise SimulationError(f"step {step}: max_devi_f {deviation['max_devi_f']:.4g} eV/Å is above "
                                      f"uncertainty.stop_above ({config['uncertainty']['stop_above']:g} eV/Å): the "
                                      f"committee disagrees")
            if root:
                bar.update(step)
            self.system.timers["output"] += time.perf_counter() - output_start
        self._finish(files, bar, samples, start_time)
        return rows

    def _announce(self, trajectory: str | None):
        """Rank 0: the output directory (cut back to the restart continued from), the run's files and the opening
        lines; returns (its RunFiles, its progress bar), (None, None) on the other ranks."""
        if not self.root:
            return None, None
        config, backend, directory = self.config, self.backend, self.directory
        with naming_errors(directory):
            directory.mkdir(parents=True, exist_ok=True)
        if self.continuing:
            cut_back(directory, self.continues, appended=(trajectory, CANDIDATES))
        files = RunFiles(directory, THERMO_COLUMNS, trajectory, fresh=not self.continuing, deviation=self.committee)
        via = f" ({backend.library.split(' (')[0]})" if backend.size > 1 else ""
        print(f"mlip-md: {self.system.n_atoms} atoms on {backend.size} rank(s){via} x {self.threads} thread(s), "
              f"{self.system.device}, {config['ensemble']}, steps {self.first_step} to {self.steps} of "
              f"{config['timestep_fs']} fs")
        if self.verified:
            print(f"mlip-md: {self.verified}")
        print(" ".join(f"{c:>14s}" for c in SCREEN_COLUMNS), flush=True)
        return files, Progress("mlip-md", self.steps, self.first_step, "step",
                               None if config["output"]["progress"] else "off")

    def _finish(self, files, bar, samples: list, start_time: float) -> None:
        """final.extxyz, the files closed and the thermo plot (rank 0), and the closing summary (collective) of the
        run since ``start_time`` (``time.perf_counter``)."""
        final = self.snapshot(self.steps)
        if self.root:
            with atomic_write(self.directory / "final.extxyz", "w") as f:
                write_extxyz(f, final)
            files.close()
            elapsed = time.perf_counter() - start_time
            close_bar(bar)
            plot_thermo(self.directory)
        self._report(samples, elapsed if self.root else None)

    def _deviation_outputs(self, step: int, deviation: dict, files) -> None:
        """A committee's row of model_devi.csv, and the frame in candidates.extxyz where ``uncertainty.select``
        holds its max_devi_f (collective: the frame is gathered)."""
        select = self.config["uncertainty"]["select"]
        if self.root:
            files.deviation_row(dict(deviation, step=step))
        if select is not None and select[0] <= deviation["max_devi_f"] <= select[1]:
            frame, devi_f = self.snapshot(step), self.system.gather("devi_f")
            if self.root:
                frame.calc = None  # the committee's energy and forces are no labels
                frame.arrays["devi_f"] = devi_f
                frame.info.update(deviation)
                files.candidate(frame)

    def _write_restart(self, step: int, files) -> dict:
        """Write restart.npz at ``step`` (the state at ``step``, the files up to the step before), then go on from
        the file, as a requeued job does, so that the two are bit-identical from here on; the thermo state there."""
        system = self.system
        system.save_restart(self.restart_path, step, self.integrator, outputs=files.record() if self.root else None)
        self.last_restart = f"{self.restart_path} (step {step})"
        timers, rebuilds = system.timers, system.rebuilds
        del system, self.system
        self.system, _ = self._from_restart(self.restart_path)
        self.system.timers, self.system.rebuilds = timers, rebuilds + self.system.rebuilds
        self.system.compute_forces()
        return self.system.thermo(step, self.integrator.dt)

    def snapshot(self, step: int):
        """The whole structure at ``step`` as an ASE Atoms with velocities, energy, forces and stress, in global id
        order, on rank 0 (None elsewhere). Collective (a gather)."""
        from ase import Atoms, units
        from ase.calculators.singlepoint import SinglePointCalculator

        system = self.system
        positions, numbers, velocities, forces = (system.gather(k) for k in
                                                  ("positions", "numbers", "velocities", "forces"))
        if not self.root:
            return None
        frame = Atoms(numbers=numbers, positions=positions, cell=system.cell, pbc=system.pbc)
        frame.set_velocities(velocities)
        frame.info.update(step=step, time_fs=step * self.integrator.dt / units.fs)
        results = {"energy": system.energy, "forces": forces}
        if frame.cell.rank == 3:
            results["stress"] = voigt_stress(system.virial, frame.cell.volume)
        frame.calc = SinglePointCalculator(frame, **results)
        return frame

    def _report(self, samples: list, elapsed: float | None) -> None:
        """The closing lines on rank 0: the time, the summary of the thermo samples and where the time went
        (collective: the phase times are reduced over the ranks)."""
        import numpy as np

        phases = np.array([self.system.timers[phase] for phase in PHASES])
        slowest, mean = self.backend.allreduce(phases, op="max"), self.backend.allreduce(phases) / self.backend.size
        if self.root:
            print(f"mlip-md: done in {elapsed:.1f} s ({1e3 * elapsed / max(1, self.steps - self.first_step):.3g} "
                  f"ms/step), {self.system.rebuilds} neighbour-list rebuilds; output in {self.directory}/")
            print(summary(samples, self.system.n_atoms, self.config["ensemble"]), flush=True)
            print(phase_table(mean, slowest), flush=True)
