"""Other packages' models distributed == their packages' own calculators, several families in one launch (run under
mpiexec -n P or torchrun):

    families.py [--grids | --lean | --backend] FAMILY [FAMILY ...]        FAMILY: mace, nequip, fairchem, sevennet

Each family's module (tests/mpi/FAMILY_models.py) runs its cases through ``AdapterRun`` and returns its verdict; rank
0 prints each family's summary line ("P=…: TITLE N cases, K failures, …; faults caught F of G; …") and its failures
("FAIL FAMILY: …"),
and "skipped: FAMILY (needs PACKAGE)" for a family whose package is not installed (the pytest side skips or fails on
it). On 2 and 3 ranks, each family's halo faults are planted (tests/faults.py) and must be caught. The scope: by
default (2 ranks) every model, every grid for the first, the memory-bounded path in many chunks against one pass,
wide mode and the ASE calculator; ``--grids`` (3 ranks: what is new there is the grids) each family's first model on
every geometry and grid, at the default memory budget; ``--lean`` (the 4-rank launch: its grids are what is new) the
same on the automatic grid and the last explicit one; ``--backend`` (the torch.distributed launch: the backend is what
is new) the same on the last explicit grid alone. Exits 1 on any failure.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(__file__), "..")]
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import mlip_parallel  # noqa: E402
from comparison import compare  # noqa: E402
from faults import tally  # noqa: E402
from systems import GRIDS, adapter_verdict, in_many_chunks, shared_out  # noqa: E402

PACKAGES = {"mace": ("mace",), "nequip": ("nequip", "allegro"), "fairchem": ("fairchem",), "sevennet": ("sevenn",)}
TINY, PLAIN = 1e-9, float("inf")  # memory budgets (GB): many small chunks; one pass over all edges


def one_pass(model, atoms, mode="layerwise", grid=None) -> dict:
    """``evaluate`` in one pass over all edges (where the host's free memory, read per rank, is short of the
    pre-flight's safe-side estimate of one: 1 GB chunks)."""
    try:
        return mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid, memory_budget_gb=PLAIN)
    except mlip_parallel.MemoryLimitError:
        return mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid, memory_budget_gb=1.0)


class AdapterRun:
    """One family's cases in a launch: each evaluated distributed and compared with its package's reference; counts
    the cases, the (case, rank) pairs that owned no atom, the worst error per model. ``scope``: "full", "grids" or
    "lean" or "backend" (the module docstring); ``chunks``: the chunked paths made to run in many small chunks
    (``in_many_chunks``), None where the run evaluates at the default memory budget alone (grids, lean, backend)."""

    def __init__(self, world, scope: str, chunks: dict | None):
        self.world, self.scope, self.chunks = world, scope, chunks
        self.full = scope == "full"
        self.grids = GRIDS[world.size]
        self.failures, self.cases, self.empty, self.worst = [], 0, 0, {}

    def grids_for(self, first: bool) -> list:
        """The grids a model runs on: every grid for the first model (lean: the automatic and the last explicit one;
        backend: the last explicit one), the automatic one for the others (full runs alone hold them)."""
        if not first:
            return self.grids[:1] if self.full else []
        return {"lean": [self.grids[0], self.grids[-1]], "backend": self.grids[-1:]}.get(self.scope, self.grids)

    def case(self, label, model, atoms, reference, tolerance, grid=None, mode="layerwise", view=None,
             plain_tolerance=1e-12, chunked=True):
        """``evaluate`` of ``atoms`` on ``grid`` in ``mode`` (full runs, ``chunked``: on the automatic grid in many
        chunks, and compared with one pass over all edges to ``plain_tolerance``), ``view(result)`` (default: the
        reference's keys) against ``reference`` to ``tolerance``; the result."""
        chunked = chunked and self.full and grid is None and mode == "layerwise"
        result = mlip_parallel.evaluate(model, atoms, mode=mode, grid=grid, memory_budget_gb=TINY if chunked else None)
        if chunked:
            comparison = compare(result, one_pass(model, atoms, mode), plain_tolerance)
            if not comparison.ok:
                self.failures.append(comparison.message(f"{label}: chunked vs one pass"))
        view = view or (lambda r: {k: r[k] for k in reference})
        comparison = compare(view(result), reference, tolerance)
        self.cases += 1
        key = label.split()[0]
        self.worst[key] = float(np.max([self.worst.get(key, 0.0), comparison.error]))
        if not comparison.ok:
            self.failures.append(comparison.message(f"{label} grid={grid} {mode}"))
        if grid is not None:
            owned = self.world.allgather(len(mlip_parallel.Decomposition(atoms, model.cutoff, self.world,
                                                                         grid).owned))
            self.empty += sum(n == 0 for n in owned)
            if not shared_out(owned, len(atoms)):
                self.failures.append(f"{label} grid={grid}: owned atoms per rank {owned}")
        return result

    def check(self, label, result: dict, reference, tolerance) -> None:
        """``result`` (made otherwise: the ASE calculator's) against ``reference`` to ``tolerance``."""
        comparison = compare(result, reference, tolerance)
        if not comparison.ok:
            self.failures.append(comparison.message(label))

    def verdict(self, title: str, expected: int) -> tuple:
        return adapter_verdict(self.world, title, self.failures, self.cases, expected, self.empty, self.chunks,
                               tally(reset=True))


def run_family(name: str, world, scope: str) -> list:
    """The failures of family ``name``'s module run (its summary and failures printed on rank 0)."""
    module = importlib.import_module(f"{name}_models")
    with pytest.MonkeyPatch.context() as patch:  # the chunk sizes put back for the next family
        chunks = in_many_chunks(patch.setattr) if scope == "full" else None
        failures, line = module.run(AdapterRun(world, scope, chunks))
    if world.rank == 0:
        print(line, flush=True)
        for failure in failures:
            print(f"FAIL {name}:", failure, flush=True)
    return failures


def main(argv) -> int:
    scopes = [a.removeprefix("--") for a in argv if a in ("--lean", "--grids", "--backend")]
    scope = scopes[0] if len(scopes) == 1 else "full"
    names = [a for a in argv if not a.startswith("--")]
    unknown = [n for n in names if n not in PACKAGES]
    if unknown or not names or len(scopes) > 1:
        raise SystemExit(f"families.py [--grids | --lean | --backend] FAMILY ...: FAMILY one of {sorted(PACKAGES)}, "
                         f"got {argv}")
    torch.set_num_threads(1)
    world = mlip_parallel.get_backend()
    failures = []
    for name in names:
        absent = [m for m in PACKAGES[name] if importlib.util.find_spec(m) is None]
        if name != "nequip" and absent or name == "nequip" and "nequip" in absent:
            if world.rank == 0:
                print(f"skipped: {name} (needs {', '.join(absent)})", flush=True)
            continue
        failures += run_family(name, world, scope)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
