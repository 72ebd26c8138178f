"""The ``mace`` family: MACE ``.model`` files (``potentials.MACE``, the ``mace`` extra), read without running
their pickle and run through mace-torch's own modules; a trained one is written back as a ``.model`` file. A
MACE user's LAMMPS deck (``pair_style mace`` or ``pair_style mliap unified``) runs with ``mlip-lammps`` as it is."""
from __future__ import annotations

import os

from . import DeckModel, Family, ModelSpecError, Option, archive_pickle

EXPORTS = ("-mliap_lammps.pt", "-lammps.pt")  # mace_create_lammps_model writes FILE.model + these


def load(spec: str, head=None, dtype=None, parts=None):
    from ..adapters.mace import MACE  # (its package: loaded with a model)

    return MACE(spec, head=head, dtype=dtype, parts=parts)


def recognise(path: str):
    _, data = archive_pickle(path)
    return "a MACE model file" if b"mace.modules" in data else None


def lammps_deck(deck: str, commands: list):
    """A MACE user's deck: ``pair_style mace ...`` with ``pair_coeff * * FILE E1 E2 ...``, or ``pair_style mliap
    unified FILE 0`` with ``pair_coeff * * E1 E2 ...``. FILE is MACE's LAMMPS export (FILE.model-lammps.pt /
    -mliap_lammps.pt); the eager FILE.model beside it is what runs. None when the deck has no such pair style;
    ModelSpecError (naming the deck's line) when it is one that cannot run here."""
    style = coeff = None
    for index, (start, _, words) in enumerate(commands):
        if words[:1] == ["pair_style"]:
            style = (index, start, words)
        elif words[:1] == ["pair_coeff"]:
            coeff = (index, start, words)
    if style is None:
        return None
    words = style[2]
    kind = words[1] if len(words) > 1 else ""
    if kind not in ("mace", "mliap") and not (kind.startswith("hybrid") and ("mace" in words or "mliap" in words)):
        return None
    where = f"{deck}:{style[1] + 1}"
    if kind.startswith("hybrid"):
        raise ModelSpecError(f"{where}: pair_style {kind} with mace: only a deck whose pair style is MACE alone runs "
                             f"here")
    if kind == "mliap" and words[2:3] != ["unified"]:
        return None  # an ML-IAP model of another kind (SNAP, ...): not MACE's
    if coeff is None or coeff[2][1:3] != ["*", "*"]:
        raise ModelSpecError(f"{where}: pair_style {kind} needs 'pair_coeff * * ...' naming the elements")
    if kind == "mace":
        if len(coeff[2]) < 5:
            raise ModelSpecError(f"{deck}:{coeff[1] + 1}: expected 'pair_coeff * * MODEL ELEMENTS...'")
        export, elements = coeff[2][3], coeff[2][4:]
    else:
        if len(words) < 4:
            raise ModelSpecError(f"{where}: expected 'pair_style mliap unified MODEL 0'")
        export, elements = words[3], coeff[2][3:]
    if kind == "mliap" and not export.endswith((*EXPORTS, ".model")):
        return None  # another package's ML-IAP model (nequip's, ...): not MACE's
    if "$" in export:
        raise ModelSpecError(f"{where}: the model path {export} holds a LAMMPS variable; write the path out (it is "
                             f"read before LAMMPS starts)")
    if "NULL" in elements:
        raise ModelSpecError(f"{deck}:{coeff[1] + 1}: a NULL type: every atom type needs an element here")
    eager = next((export[: -len(s)] for s in EXPORTS if export.endswith(s)), export)
    if not os.path.isfile(eager):
        raise ModelSpecError(f"{where}: the deck's MACE model {export} runs here from the .model file it was exported "
                             f"from, {eager}, which does not exist: put it beside the export")
    return DeckModel(f"mace:{eager}", list(elements), [style[0], coeff[0]])


FAMILY = Family(
    "mace", load, recognise=recognise, native_file="{stem}.model", lammps_deck=lammps_deck,
    options={"head": Option(str, None, "the head of a multi-head MACE model (default: the only head, else "
                                       "'default')")},
    help="a MACE model file (.model, as MACE's training writes it; read without running the pickle's code; needs the "
         "mace extra)",
    model_classes={"MACE": "potentials.adapters.mace:MACE"},
)
