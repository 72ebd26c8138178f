"""The bridge: a model of this package as LAMMPS's forces, through ``fix ID all external pf/callback 1 1``. At every
force evaluation LAMMPS calls us on every rank with its local atoms; we return their forces and the global energy
and virial (``fix_modify ID energy yes virial yes``, so ``pe``, ``press``, barostats and minimizers see them).

The halo follows LAMMPS's decomposition (docs/architecture.md §2–§3): a ``Grid`` whose cut planes and rank layout
are LAMMPS's subdomains (``sublo``/``subhi``, or ``sublo_lambda``/``subhi_lambda`` for triclinic boxes; re-read
after ``balance`` / ``fix balance``) and our own ``Subdomain`` (halo) over LAMMPS's local atoms, so
``forward_decomposed`` evaluates message-passing models layerwise exactly as the MD engine does. LAMMPS's own ghost
atoms are not used (fix external sets local forces only, and LAMMPS cannot refresh ghost features). The ghosts
and the pair candidates are rebuilt when LAMMPS migrates or reorders atoms, when the subdomains change, and when
any atom moved more than half our skin since the last rebuild, decided collectively; atoms that have left their
subdomain since LAMMPS last migrated them widen the ghost shell by twice that distance.

An exception inside the callback ends the job: a ``LammpsBridgeError`` raised alike on every rank with one line
and status 2, any other with ``rank N: <type>: <message>`` and an abort (LAMMPS would otherwise swallow it)."""
from __future__ import annotations

import ctypes
import os
import sys
import time

from potentials import UnknownSpeciesError

from ..config import report_error
from ..errors import LammpsBridgeError, MemoryLimitError, SimulationError
from ..launch import abort_job, finalize_mpi
from ..verify import verify_step

PROG = "mlip-lammps"
MASS_TOLERANCE = 0.5  # amu: a type's mass must be this close to its element's atomic mass
SCRATCH: list = []  # temporary directories of running decks, removed even when the job ends in a callback
DEVIATION_FIX = "mlip_devi"  # the fix property/atom the bridge defines for a committee's per-atom deviation
DEVIATION_PROPERTIES = ("d_mlip_devi_f", "d_mlip_devi_e")  # σ_F (eV/Å) and the per-atom energy deviation (eV)
DEVIATION_VECTOR = ("max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")  # f_ID[1..4], the fix external's vector


def _check_model_knows(model, numbers, where: str) -> None:
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

    from ..grid import Grid  # (torch: at first use)

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

    def __init__(self, model, backend, mode: str, skin: float, memory_budget_gb: float | None = None):
        self.model, self.backend, self.mode, self.skin = model, backend, mode, float(skin)
        # the evaluations' chunk budget (GB; inf: every edge at once), None until the first rebuild's pre-flight
        # chooses it, then kept for the run
        self.memory_budget_gb = memory_budget_gb
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

        from ..domain import Domain  # (torch: at first use)
        from ..evaluate import ghost_reach
        from ..subdomain import Subdomain

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
            from ..preflight import check_rank_memory  # (torch: at first use)

            n_atoms = int(backend.allreduce(len(ids))) if backend.size > 1 else len(ids)
            try:
                self.memory_budget_gb = check_rank_memory(
                    backend, self.model, n_atoms, domain, grid.dims, ghost_reach(self.model, self.mode), self.skin,
                    self.mode == "layerwise", self.memory_budget_gb)
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
    callback), ``decomposition.rebuilds``. ``verify``: the first call's energy, forces and stress compared with one
    process's evaluation of the same structure (``mlip_parallel.verify``), a LammpsBridgeError naming the
    differences where they are beyond summation order; ``verified`` the comparison's line.

    A committee (``potentials.Committee``) runs its members on one decomposition; LAMMPS gets their mean (or first)
    forces, energy and virial, and the model deviation: per atom in ``d_mlip_devi_f`` (σ_F, eV/Å) and
    ``d_mlip_devi_e`` (eV), custom properties of a ``fix mlip_devi all property/atom`` the bridge defines where the
    deck has not (``dump ... custom ... d_mlip_devi_f``), and per frame as the fix's global vector ``f_ID[1..4]``:
    max, min and mean σ_F over all atoms and the members' energy deviation per atom (DeePMD's max_devi_f,
    min_devi_f, avg_devi_f, devi_e; ``thermo_style custom ... f_ID[1]``, ``fix print``). ``deviation`` holds the
    last call's as a dict."""

    def __init__(self, lmp, model, fix_id: str, elements=None, mode: str = "layerwise", skin: float = 1.0,
                 device=None, memory_budget_gb: float | None = None, verify: bool = False):
        import numpy as np
        import torch

        from ..backend import SerialBackend, get_backend, rank_device  # (torch: at first use)
        from ..evaluate import MODES

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
        from potentials.messages import memory_budget_bytes  # (torch: at first use)

        try:  # the knob's one check (potentials.messages), reported as the bridge's error
            memory_budget_bytes(memory_budget_gb, device)
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
        self.decomposition = LammpsDecomposition(model, self.backend, mode, skin, memory_budget_gb)
        self.mode, self.calls, self.seconds = mode, 0, 0.0
        self.verify, self.verified = verify, None
        self._masses, self._type_numbers = None, None
        self.energy, self.forces, self.virial = 0.0, np.zeros((0, 3)), np.zeros(6)
        lmp.command(f"fix_modify {fix_id} energy yes virial yes")
        from potentials.committee import Committee  # (torch: at first use)

        self.committee, self.deviation = isinstance(model, Committee), None
        if self.committee:
            missing = [name for name in DEVIATION_PROPERTIES if lmp.extract_atom_datatype(name) < 0]
            if missing:
                lmp.command(f"fix {DEVIATION_FIX} all property/atom {' '.join(missing)}")
            lmp.fix_external_set_vector_length(fix_id, len(DEVIATION_VECTOR))
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

        from ..evaluate import committee_step, forward_decomposed, global_sums  # (torch: at first use)

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
        try:  # the non-finite forces are counted over every rank: all of them raise alike
            if self.committee:
                members = committee_step(self.model, self.decomposition.sub, self.mode,
                                         self.decomposition.memory_budget_gb)
                energies, forces = members.energies, members.forces
                self.energy, d = members.energy, members.dE_dstrain
            else:
                energies, forces, dE_dstrain = forward_decomposed(self.model, self.decomposition.sub, self.mode,
                                                                  memory_budget_gb=self.decomposition.memory_budget_gb)
                # both global, the same on every rank (LAMMPS divides the virial by the number of ranks and sums)
                self.energy, d = global_sums(self.backend, energies, dE_dstrain, forces=forces)
        except SimulationError as exc:
            raise LammpsBridgeError(f"step {step}: {exc}") from None
        if self.committee:
            self._set_deviation(members, nlocal)
        forces = forces.detach().cpu().numpy()
        if self.verify and self.calls == 0:
            self.verified = self._check(step, tags, x - boxlo, numbers, forces, cell, pbc, d)
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

    def _set_deviation(self, members, nlocal: int) -> None:
        """A committee's deviation of this call (``members``: ``committee_step``'s) into LAMMPS: the owned atoms' σ_F
        and energy deviation into the per-atom properties, the frame's summary into the fix's vector (collective)."""
        import numpy as np

        from ..evaluate import deviation_summary  # (torch: at first use)

        if nlocal:
            for name, values in zip(DEVIATION_PROPERTIES, (members.devi_f, members.devi_energies)):
                target = np.ctypeslib.as_array(self.lmp.extract_atom(name), shape=(nlocal,))
                target[:] = values.detach().cpu().numpy()
        n_atoms = int(self.lmp.get_natoms())
        self.deviation = deviation_summary(self.backend, members.devi_f, members.member_energies, n_atoms)
        for index, key in enumerate(DEVIATION_VECTOR, start=1):
            self.lmp.fix_external_set_vector(self.fix_id, index, self.deviation[key])

    def _check(self, step, tags, x, numbers, forces, cell, pbc, dE_dstrain) -> str:
        """The comparison of ``verify`` (collective): this call's structure and result gathered on rank 0 in tag
        order, against one process's evaluation; LammpsBridgeError on every rank when beyond summation order."""
        import numpy as np
        from ase import Atoms

        from potentials.predict import voigt_stress  # (torch: at first use)

        pieces = self.backend.allgather((tags, x, numbers, forces))
        frame = result = None
        if self.backend.rank == 0:
            tags, x, numbers, forces = (np.concatenate([p[k] for p in pieces]) for k in range(4))
            order = np.argsort(tags)
            frame = Atoms(numbers=numbers[order], positions=x[order], cell=cell, pbc=pbc)
            result = {"energy": self.energy, "forces": forces[order]}
            if frame.cell.rank == 3:
                result["stress"] = voigt_stress(dE_dstrain, frame.cell.volume)
        line = verify_step(self.model, frame, result, self.backend, step, LammpsBridgeError)
        if self.backend.rank == 0:
            print(f"{PROG}: {line}", flush=True)
        return line


def _remove_scratch() -> None:
    import shutil

    for path in SCRATCH:
        shutil.rmtree(path, ignore_errors=True)


def _stop_everywhere(exc) -> None:
    """Every rank raised ``exc`` alike inside the callback: report it once and end every rank with
    status 2 (MPI finalised on all ranks together: no rank waits for another)."""
    _remove_scratch()
    report_error(PROG, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        finalize_mpi()
    finally:
        os._exit(2)


def _abort(exc) -> None:
    """An exception on this rank alone: print ``rank N: <type>: <message>`` and abort the whole job."""
    _remove_scratch()
    abort_job(exc)
