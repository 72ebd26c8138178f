"""The ``checkpoint`` family: this package's own checkpoints (``potentials.save``: a state dict beside a JSON
config, e.g. ``mlip-train``'s ``best.pt``) and bundled models (``cu-emt``). A spec without a family's prefix
names one of these."""
from __future__ import annotations

from . import Family

# this package's architectures that mlip-train builds new (model.name), by name
ARCHITECTURES = {"SchNet": "potentials.schnet:SchNet", "PaiNN": "potentials.painn:PaiNN",
                 "NequIP": "potentials.nequip:NequIP"}
# a small model of each (the self-check's: python -m mlip_parallel.check), beside species, cutoff and seed
SMALL = {"SchNet": dict(features=32, layers=3), "PaiNN": dict(features=16, layers=3),
         "NequIP": dict(l_max=1, features=4, layers=2)}


def load(spec: str, parts=None):
    """The checkpoint at ``spec`` (a path, or a bundled model's name), only ``parts`` of a block model if given."""
    from ..checkpoint import load as load_checkpoint

    return load_checkpoint(spec, parts=parts)


def architecture(name: str):
    """The class of this package's architecture ``name`` (one of ``ARCHITECTURES``)."""
    from importlib import import_module

    module, _, attribute = ARCHITECTURES[name].partition(":")
    return getattr(import_module(module), attribute)


FAMILY = Family(
    "checkpoint", load,
    help="path of a potentials checkpoint (potentials.save, e.g. mlip-train's best.pt, also of a fine-tuned model of "
         "another family) or a bundled model name (cu-emt: a PaiNN for Cu trained on EMT data)",
    model_classes=ARCHITECTURES,
)
