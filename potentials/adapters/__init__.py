"""Other packages' trained models, run through their own code with our halo between their layers.

* ``sevennet.SevenNet``: a SevenNet checkpoint (sevenn's modules, halo after each
  ``{t}_self_interaction_1``).
* ``mace.MACE``: a MACE ``.model`` file (mace-torch's modules, halo through MACE's own
  ``lammps_mliap`` ghost-exchange hook); read by ``pickled`` without running the pickle's code.
* ``nequip.NequIPFramework``: a NequIP or Allegro model of the nequip framework (``.ckpt`` or
  ``.nequip.zip``; the framework's modules, halo through its own ghost-exchange slots).
* ``fairchem.FAIRChem``: a fairchem UMA or eSEN checkpoint (fairchem-core's modules, halo on the node
  embeddings entering each block's edge step); read without running the pickle's code.
* ``exchange.GhostExchange``: the LAMMPS-ML-IAP-style exchange object both packages call.

``load_model(spec)`` is the one place a model is named by a string (the CLIs' model options).
"""
from __future__ import annotations

from ..errors import MLIPError

PREFIXES = ("sevennet:", "mace:", "nequip:", "fairchem:")


def load_model(spec: str, dtype: str | None = None, head: str | None = None, checkpoint_dtype: str | None = None,
               parts=None, task: str | None = None, charge: int | None = None, spin: int | None = None):
    """The model named by ``spec``: "sevennet:NAME" (a name sevenn knows, e.g. 7net-0, or a checkpoint
    path), "mace:PATH" (a MACE .model file; read without running the pickle — naming it here is the
    user's choice to read a pickle), "nequip:PATH" (a nequip-framework .ckpt or .nequip.zip, loaded by the
    framework, which runs the pickle: naming it is that choice), "fairchem:PATH" (a fairchem UMA/eSEN
    checkpoint, read without running its pickle), else a potentials checkpoint path or bundled name ("cu-emt").
    ``dtype`` "float32"/"float64", or None: the file's own (for a potentials checkpoint,
    ``checkpoint_dtype`` if given: the MD tools run checkpoints in float64).
    ``head``: a multi-head MACE model's head. ``task``, ``charge``, ``spin``: a fairchem model's task (omat, omol,
    ...) and, for omol, the system's charge and spin multiplicity. ``parts``: only these parts of a model that splits into pipeline
    stages (a potentials checkpoint of a block model, a MACE file). Raises an ``MLIPError`` (the message names the spec's
    problem) or ImportError (the package the adapter needs is not installed)."""
    import torch

    dtypes = {None: None, "float32": torch.float32, "float64": torch.float64}
    if dtype is None and not spec.startswith(PREFIXES):
        dtype = checkpoint_dtype
    if dtype not in dtypes:
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    if head is not None and not spec.startswith("mace:"):
        raise ModelSpecError(f"{spec}: a head is chosen only for MACE models (mace:PATH)")
    if (task, charge, spin) != (None, None, None) and not spec.startswith("fairchem:"):
        raise ModelSpecError(f"{spec}: a task, charge and spin are chosen only for fairchem models (fairchem:PATH)")
    if spec.startswith("fairchem:"):
        from .fairchem import FAIRChem

        if parts is not None:
            raise ModelSpecError(f"{spec}: a fairchem model does not split into pipeline stages")
        return FAIRChem(spec[len("fairchem:"):], task=task, charge=charge, spin=spin, dtype=dtypes[dtype])
    if spec.startswith("sevennet:"):
        from .sevennet import SevenNet

        model = SevenNet(spec[len("sevennet:"):], parts=parts)
        return model if dtype is None else model.to(dtypes[dtype])
    if spec.startswith("mace:"):
        from .mace import MACE

        return MACE(spec[len("mace:"):], head=head, dtype=dtypes[dtype], parts=parts)
    if spec.startswith("nequip:"):
        from .nequip import NequIPFramework

        model = NequIPFramework(spec[len("nequip:"):], parts=parts)
        return model if dtype is None else model.to(dtypes[dtype])
    from ..checkpoint import load

    model = load(spec, parts=parts)
    return model if dtype is None else model.to(dtypes[dtype])


class ModelSpecError(MLIPError, ValueError):
    """A model named by a string that does not fit (an option the model does not take)."""
