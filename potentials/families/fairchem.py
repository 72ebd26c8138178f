"""The ``fairchem`` family: fairchem's UMA and eSEN checkpoints (``potentials.FAIRChem``, the ``fairchem``
extra), read without running their pickle, run through fairchem's own modules on one task."""
from __future__ import annotations

from . import Family, Option, archive_pickle


def load(spec: str, task=None, charge=None, spin=None, dtype=None, parts=None):
    from ..adapters.fairchem import FAIRChem  # (its package: loaded with a model)

    return FAIRChem(spec, task=task, charge=charge, spin=spin, dtype=dtype, parts=parts)


def recognise(path: str):
    _, data = archive_pickle(path)
    return "a fairchem checkpoint" if b"MLIPInferenceCheckpoint" in data else None


FAMILY = Family(
    "fairchem", load, recognise=recognise, native_file="inference_ckpt.pt",
    options={
        "task": Option(str, None, "the task (omat, omol, oc20, odac, omc; as FAIRChemCalculator's task_name; default: "
                                  "the checkpoint's only one)"),
        "charge": Option(int, 0, "task omol: the system's total charge", "[-100, 100]"),
        "spin": Option(int, 1, "task omol: the system's spin multiplicity", "[0, 100]"),
    },
    help="a fairchem UMA or eSEN checkpoint (the file fairchem's load_predict_unit reads; read without running the "
         "pickle's code; needs the fairchem extra)",
    model_classes={"FAIRChem": "potentials.adapters.fairchem:FAIRChem"},
)
