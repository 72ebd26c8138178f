"""The ``sevennet`` family: SevenNet checkpoints (``potentials.SevenNet``, the ``sevenn`` extra), run through
sevenn's own modules; a trained one is written back as a sevenn checkpoint."""
from __future__ import annotations

import re

from . import Family, archive_pickle


def load(spec: str, parts=None):
    from ..adapters.sevennet import SevenNet  # (its package: loaded with a model)

    return SevenNet(spec, parts=parts)


def pretrained(name: str) -> bool:
    """Whether ``name`` has the form of sevenn's pretrained names (7net-0, sevennet-l3i5, 7net-mf-ompa, ...)."""
    return re.fullmatch(r"(7net|sevennet)-[0-9a-z_.-]+", name.lower()) is not None


def recognise(path: str):
    _, data = archive_pickle(path)
    return "a SevenNet checkpoint" if b"model_state_dict" in data and b"_type_map" in data else None


FAMILY = Family(
    "sevennet", load, recognise=recognise, native_file="checkpoint_{stem}.pth",
    help="a SevenNet checkpoint: a name sevenn knows (7net-0, shipped inside sevenn) or a path (needs the sevenn "
         "extra)",
    names=pretrained, model_classes={"SevenNet": "potentials.adapters.sevennet:SevenNet"},
)
