"""The report of an ``mlip-md`` run: the summary of its thermo samples (means ± block standard errors, the energy
drift), where the time went, the progress bar's last line, and OUTPUT/thermo.png."""
from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

from mlip_parallel.launch import launched_by_mpiexec
from potentials.files import atomic_write


def phase_table(mean, slowest) -> str:
    """Where the time went, as LAMMPS prints it after a run: seconds per phase (mean and slowest rank)
    and the share of the total."""
    from .engine import PHASES  # (torch: at first use)

    total = max(float(sum(mean)), 1e-300)
    lines = [f"{'phase':10s} {'mean s':>10s} {'max s':>10s} {'% of time':>10s}"]
    for phase, m, s in zip(PHASES, mean, slowest):
        lines.append(f"{phase:10s} {m:10.3f} {s:10.3f} {100 * m / total:10.1f}")
    return "\n".join(lines)


def close_bar(bar) -> None:
    """Close the progress bar (stderr) before the last lines go to stdout. Under mpiexec the two streams
    reach the terminal through separate pipes, in no fixed order: give the bar's last line a moment to
    arrive first, or the next line runs into it."""
    bar.close()
    sys.stderr.flush()
    if launched_by_mpiexec():
        time.sleep(0.2)


def block_average(values, blocks: int = 10) -> tuple:
    """(mean, standard error of the mean from ``blocks`` consecutive block means; nan below 2 blocks)."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    blocks = min(blocks, len(values))
    if blocks < 2:
        return float(values.mean()) if len(values) else float("nan"), float("nan")
    size = len(values) // blocks
    means = values[len(values) - blocks * size:].reshape(blocks, size).mean(axis=1)
    return float(values.mean()), float(means.std(ddof=1) / np.sqrt(blocks))


def summary(samples: list, n_atoms: int, ensemble: str) -> str:
    """Means ± block standard errors of T, P and the energies per atom (and V under npt) over the second
    half of the run; for nve, the drift of the total energy (least-squares slope over the whole run)."""
    import numpy as np

    first, last = samples[0]["step"], samples[-1]["step"]
    half = [s for s in samples if 2 * (s["step"] - first) >= last - first]
    quantities = [("temperature_K", "temperature_K", 1.0), ("pressure_GPa", "pressure_GPa", 1.0),
                  ("epot_eV/atom", "epot_eV", 1.0 / n_atoms), ("etot_eV/atom", "etot_eV", 1.0 / n_atoms)]
    if ensemble == "npt":
        quantities.append(("volume_A3", "volume_A3", 1.0))
    lines = [f"mlip-md: steps {half[0]['step']} to {last} (second half, {len(half)} samples), "
             f"mean ± standard error of 10 block means:"]
    for label, key, scale in quantities:
        mean, error = block_average([s[key] * scale for s in half])
        lines.append(f"  {label:14s} {mean:14.7g} ± {error:.2g}")
    if ensemble == "nve" and len(samples) > 1:
        t_ns = np.array([s["time_fs"] for s in samples]) * 1e-6
        drift = np.polyfit(t_ns, np.array([s["etot_eV"] for s in samples]) / n_atoms, 1)[0]
        lines.append(f"  energy drift   {drift:14.3g} eV/atom/ns (slope of etot over steps {first} to {last})")
    return "\n".join(lines)


def plot_thermo(directory: Path) -> None:
    """OUTPUT/thermo.png: temperature, energies per atom and pressure against time, from thermo.csv."""
    from matplotlib.figure import Figure  # renders PNG with Agg, without pyplot's global state

    with open(directory / "thermo.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    t_ps = [float(r["time_fs"]) / 1000 for r in rows]
    fig = Figure(figsize=(6, 7), layout="constrained")
    temperature, energy, pressure = fig.subplots(3, 1, sharex=True)
    temperature.plot(t_ps, [float(r["temperature_K"]) for r in rows])
    temperature.set_ylabel("T (K)")
    for key in ("epot_eV", "etot_eV"):
        energy.plot(t_ps, [float(r[key]) for r in rows], label=key.split("_")[0])
    energy.set_ylabel("E (eV)")
    energy.legend()
    pressure.plot(t_ps, [float(r["pressure_GPa"]) for r in rows])
    pressure.set_ylabel("P (GPa)")
    pressure.set_xlabel("time (ps)")

    with atomic_write(directory / "thermo.png") as f:
        fig.savefig(f, format="png", dpi=100)
