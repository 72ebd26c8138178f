"""The ``checkpoint`` family: this package's own checkpoints (``potentials.save``: a state dict beside a JSON
config, e.g. ``mlip-train``'s ``best.pt``) and bundled models (``cu-emt``). A spec without a family's prefix
names one of these."""
from __future__ import annotations

from ..families import new_model_class
from . import Family

# this package's architectures, which mlip-train builds new (model.name; SchNet the default)
ARCHITECTURES = {"SchNet": "potentials.schnet:SchNet", "PaiNN": "potentials.painn:PaiNN",
                 "NequIP": "potentials.nequip:NequIP"}
SMALL = {"SchNet": dict(features=32, layers=3), "PaiNN": dict(features=16, layers=3),
         "NequIP": dict(l_max=1, features=4, layers=2)}  # the self-check's small model of each


def load(spec: str, parts=None):
    """The checkpoint at ``spec`` (a path, or a bundled model's name), only ``parts`` of a block model if given."""
    from ..checkpoint import load as load_checkpoint  # (torch: at first use)

    return load_checkpoint(spec, parts=parts)


def small(name: str):
    """A build() of the small model of architecture ``name`` for the self-check: Ag and Cu, 4 Å, seed 0."""
    def build():
        return new_model_class(name)(["Ag", "Cu"], cutoff=4.0, seed=0, **SMALL[name])
    return build


FAMILY = Family(
    "checkpoint", load,
    help="path of a potentials checkpoint (potentials.save, e.g. mlip-train's best.pt, also of a fine-tuned model of "
         "another family) or a bundled model name (cu-emt: a PaiNN for Cu trained on EMT data)",
    model_classes=ARCHITECTURES, new_models=ARCHITECTURES, check_models={name: small(name) for name in ARCHITECTURES},
)
