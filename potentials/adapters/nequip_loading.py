"""Loading a model of the nequip framework (PyPI ``nequip``, ``nequip-allegro``): the framework's own
``load_saved_model`` on a training checkpoint (``.ckpt``) or a package (``.nequip.zip``), eager, or its builder on
the model config a potentials checkpoint of a fine-tuned one stores. Both files are pickles (a package holds code
too), so naming the file (``nequip:`` in the tools) is the user's choice to run them. The framework's
``set_global_state`` (which loading needs) sets the default dtype to float64, seeds every generator and changes
e3nn's and torch's compile settings for the process: all of it is put back as it was (``process_state_kept``)."""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch

from ..errors import MLIPError
from ..process import process_kept

INSTALL = "pip install -e .[nequip]"
COMPILED = (".nequip.pth", ".nequip.pt2", ".pth", ".pt2")


class NequIPFrameworkError(MLIPError, ValueError):
    """A nequip-framework model file cannot be used: compiled, missing, unreadable, or with type names
    that are not chemical elements."""


@contextmanager
def process_state_kept():
    """Run the framework's loading, then put back what its ``set_global_state`` changes: torch's default
    dtype, the torch / numpy / Python random states and the environment variables it sets (``process_kept``),
    torch's JIT fusion strategy, e3nn's optimization defaults, the dynamo flags and the multiprocessing
    sharing strategy."""
    import e3nn

    with warnings.catch_warnings():  # torch.jit's fusion settings are deprecated; the framework still sets them
        warnings.simplefilter("ignore", DeprecationWarning)
        fusion = torch.jit.set_fusion_strategy([("STATIC", 2), ("DYNAMIC", 10)])
        torch.jit.set_fusion_strategy(fusion)
    e3nn_defaults = dict(e3nn.get_optimization_defaults())
    dynamo = {k: getattr(torch._dynamo.config, k) for k in ("capture_dynamic_output_shape_ops",
                                                            "capture_scalar_outputs")}
    sharing = torch.multiprocessing.get_sharing_strategy()
    try:
        with process_kept(random=True, dtype=True):
            yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.set_fusion_strategy(fusion)
        e3nn.set_optimization_defaults(**e3nn_defaults)
        for key, value in dynamo.items():
            setattr(torch._dynamo.config, key, value)
        torch.multiprocessing.set_sharing_strategy(sharing)


def load_framework_model(path, model_key: str = "sole_model"):
    """The eager GraphModel saved at ``path`` (.ckpt or .nequip.zip), in eval mode, on the CPU; the
    process's global state as it was before."""
    path = os.fspath(path)
    if path.endswith(COMPILED):
        raise NequIPFrameworkError(f"{path}: a compiled nequip model (nequip-compile output) is opaque here; pass "
                                   f"the .nequip.zip package or the .ckpt checkpoint it was compiled from")
    if not os.path.isfile(path):
        raise NequIPFrameworkError(f"{path}: no such file")
    if not path.endswith((".ckpt", ".nequip.zip")):
        raise NequIPFrameworkError(f"{path}: not a nequip-framework model file (a .ckpt checkpoint or a .nequip.zip "
                                   f"package)")
    with process_state_kept():  # (importing the framework sets environment variables too: lightning's)
        try:
            from nequip.model.saved_models.load_utils import load_saved_model
            from nequip.utils.global_state import set_global_state
        except ImportError as exc:
            raise ImportError(f"potentials.NequIPFramework needs the nequip framework: {INSTALL} ({exc})") from None
        set_global_state()
        try:
            model = load_saved_model(path, compile_mode="eager", model_key=model_key)
        except Exception as exc:  # the framework raises many types for a damaged or foreign file
            raise NequIPFrameworkError(f"{path}: the nequip framework cannot load it ({type(exc).__name__}: "
                                       f"{(str(exc).splitlines() or [''])[0]})") from None
    return model.eval()


def framework_architecture(path, model_key: str) -> dict:
    """What rebuilds the model saved at ``path`` without the file (JSON): {"model": the model's config (its
    builder's ``_target_`` and arguments), "training_module": the training module's config, "versions": the
    package versions it was trained with, "model_key"}. Read from a .ckpt's hyper-parameters (the
    framework's own loader has unpickled the file already) or a .nequip.zip's ``model/config.yaml``."""
    import json
    import zipfile

    import yaml

    if path.endswith(".nequip.zip"):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/model/config.yaml")]
            config = yaml.safe_load(archive.read(names[0])) if names else {}
        training_module, versions = config.get("training_module", {}), {}
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        info = checkpoint.get("hyper_parameters", {}).get("info_dict", {})
        training_module, versions = info.get("training_module", {}), info.get("versions", {})
    model = training_module.get("model")
    if isinstance(model, dict) and model_key != "sole_model":
        model = model.get(model_key)
    if not isinstance(model, dict) or "_target_" not in model:
        raise NequIPFrameworkError(f"{path}: holds no model config for {model_key!r} (its training_module.model)")
    return json.loads(json.dumps({"model": model, "training_module": training_module, "versions": versions,
                                  "model_key": model_key}))


def build_framework_model(model_config: dict):
    """The GraphModel ``model_config`` describes, built by its builder (``_target_``) as the framework's
    training module builds it, eager, under the framework's global state (then put back)."""
    config = dict(model_config)
    with process_state_kept():
        from hydra.utils import get_method
        from nequip.model.utils import override_model_compile_mode
        from nequip.utils.global_state import set_global_state

        set_global_state()
        with override_model_compile_mode("eager"):
            try:
                return get_method(config.pop("_target_"))(**config).eval()
            except Exception as exc:  # the framework's builders raise many types for a config they reject
                raise NequIPFrameworkError(f"the nequip framework cannot build this model ({type(exc).__name__}: "
                                           f"{(str(exc).splitlines() or [''])[0]})") from None
