"""The ``nequip`` family: NequIP and Allegro models of the nequip framework (``potentials.NequIPFramework``, the
``nequip`` extra), run through the framework's own modules; a trained one is written back as a framework
checkpoint. Its files are pickles the framework runs: naming one is the user's choice to run it."""
from __future__ import annotations

from . import Family, archive_pickle


def load(spec: str, parts=None):
    from ..adapters.nequip import NequIPFramework  # (its package: loaded with a model)

    return NequIPFramework(spec, parts=parts)


def recognise(path: str):
    names, data = archive_pickle(path)
    if any(n.endswith("/model/package_metadata.txt") for n in names):
        return "a nequip-framework package (.nequip.zip)"
    return "a nequip-framework checkpoint" if b"pytorch-lightning_version" in data else None


FAMILY = Family(
    "nequip", load, recognise=recognise, native_file="{stem}.ckpt",
    help="a NequIP or Allegro model of the nequip framework: its .ckpt checkpoint or .nequip.zip package (loaded by "
         "the framework, which unpickles it; needs the nequip extra)",
    model_classes={"NequIPFramework": "potentials.adapters.nequip:NequIPFramework"},
)
