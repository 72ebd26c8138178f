"""The ``lennard_jones`` family (alias ``lj``): ``potentials.LennardJones``, the pair potential shifted to zero at
its cutoff. In a YAML model section its value is a mapping ``{epsilon: eV, sigma: Å, cutoff: Å}``; as a spec
``lj:EPSILON,SIGMA,CUTOFF``."""
from __future__ import annotations

from collections.abc import Mapping

from . import Family, ModelSpecError

PARAMETERS = ("epsilon", "sigma", "cutoff")


def load(spec):
    """A ``LennardJones`` from ``spec``: "EPSILON,SIGMA,CUTOFF" (eV, Å, Å) or a mapping of those three."""
    from ..lj import LennardJones  # (torch: at first use)

    if isinstance(spec, str):
        fields = spec.split(",")
        try:
            if len(fields) != 3:
                raise ValueError(f"{len(fields)} number(s)")
            spec = dict(zip(PARAMETERS, (float(v) for v in fields)))
        except ValueError as exc:
            raise ModelSpecError(f"expected EPSILON,SIGMA,CUTOFF: three positive numbers (eV, Å, Å) ({exc})") from None
    if not isinstance(spec, Mapping):
        raise ModelSpecError(f"expected a mapping {{epsilon, sigma, cutoff}}, got {spec!r}")
    unknown = sorted(str(k) for k in spec if k not in PARAMETERS)
    if unknown:
        raise ModelSpecError(f"unknown parameter(s) {unknown}: Lennard-Jones takes epsilon (eV), sigma (Å) and "
                             f"cutoff (Å)")
    try:
        return LennardJones(**spec)
    except ValueError as exc:
        raise ModelSpecError(str(exc)) from None


FAMILY = Family(
    "lennard_jones", load,
    help="Lennard-Jones parameters {epsilon: eV, sigma: Å, cutoff: Å} (as a spec lj:EPSILON,SIGMA,CUTOFF)",
    aliases=("lj",), trainable=False, spec_type=(dict, str),
    model_classes={"LennardJones": "potentials.lj:LennardJones"},
    check_models={"LennardJones": lambda: load({"epsilon": 0.4, "sigma": 2.3, "cutoff": 5.0})},
)
