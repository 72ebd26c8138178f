"""The ``born_coulomb`` family: ``potentials.BornCoulomb``, Born–Mayer–Huggins pairs and fixed per-element charges
whose Coulomb energy is summed over the periodic structure (LAMMPS's ``born/coul/long`` with a kspace solver). In a
YAML model section its value is ``{charges: {Na: 1.0, Cl: -1.0}, pairs: {Na-Cl: [A, rho, sigma, C, D], ...},
cutoff: 9.0, shift: false}`` and the model section's ``long_range`` key chooses the solver (required); as a spec
``born_coulomb:FILE.yaml``, a file of that mapping with ``long_range`` in it."""
from __future__ import annotations

from collections.abc import Mapping

from . import Family, ModelSpecError

KEYS = ("charges", "pairs", "cutoff", "shift")


def load(spec):
    """A ``BornCoulomb`` from the mapping ``spec`` {charges, pairs, cutoff, shift} (its long-range solver:
    ``load_model``'s ``long_range``), or from a YAML file of that mapping with its ``long_range`` inside
    (``born_coulomb:FILE.yaml``: what a command line such as ``mlip-lammps --model`` names)."""
    from ..born import BornCoulomb  # (torch: at first use)
    from ..coulomb import LongRangeError

    keys = KEYS
    if isinstance(spec, str):
        spec, keys = read_file(spec), KEYS + ("long_range",)
    if not isinstance(spec, Mapping):
        raise ModelSpecError(f"expected a mapping {{charges, pairs, cutoff}}, got {spec!r}")
    unknown, missing = sorted(str(k) for k in spec if k not in keys), [k for k in KEYS[:3] if k not in spec]
    if unknown or missing:
        raise ModelSpecError(f"{'unknown key(s) ' + str(unknown) if unknown else 'missing ' + ', '.join(missing)}: "
                             "born_coulomb takes charges ({element: e}), pairs ({'A-B': [A, rho, sigma, C, D]}: eV, Å, "
                             "Å, eV·Å⁶, eV·Å⁸), cutoff (Å) and shift (true: the pairs shifted to zero at the cutoff)")
    try:
        return BornCoulomb(**spec)
    except LongRangeError as exc:
        raise ModelSpecError(str(exc)) from None


def read_file(path: str):
    """The mapping in the YAML file ``path``; ModelSpecError naming a file that cannot be read or parsed."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ModelSpecError(f"{path}: cannot read it as a YAML mapping of charges, pairs, cutoff, shift and "
                             f"long_range ({reason})") from None


FAMILY = Family(
    "born_coulomb", load,
    help="Born–Mayer–Huggins pairs and fixed charges {charges: {Na: 1.0, Cl: -1.0}, pairs: {Na-Cl: [A, rho, sigma, C, "
         "D], ...}, cutoff: Å, shift: false} (LAMMPS's born/coul/long); the model's long_range key picks Ewald, PME "
         "or P3M (as a spec: born_coulomb:FILE.yaml, that mapping with long_range in it)",
    trainable=False, spec_type=(dict, str),
    model_classes={"BornCoulomb": "potentials.born:BornCoulomb"},
)
