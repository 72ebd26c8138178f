"""The ``aimnet`` family: AIMNet2 models (``potentials.adapters.aimnet.AIMNet``, the ``aimnet`` extra), run through
aimnet's own modules, their Coulomb energy the model section's ``long_range`` term. The spec is a config shipped with
aimnet (``aimnet2``), a YAML config (untrained weights from ``weights_seed``) or a released v2 ``.pt`` file."""
from __future__ import annotations

from . import Family, Option


def load(spec: str, dtype=None, weights_seed: int = 0):
    from ..adapters.aimnet import AIMNet  # (its package: loaded with a model)

    return AIMNet(spec, seed=weights_seed, dtype=dtype)


FAMILY = Family(
    "aimnet", load,
    options={"weights_seed": Option(int, 0, "the untrained weights of a config: their random stream's seed", ">= 0")},
    help="an AIMNet2 model: a config shipped with aimnet (aimnet2), a YAML config (untrained weights) or a released "
         "v2 .pt file (needs the aimnet extra); its Coulomb energy is the model's long_range term",
    native_file="{stem}_aimnet.pt", model_classes={"AIMNet": "potentials.adapters.aimnet:AIMNet"},
)
