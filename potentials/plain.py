"""Other packages' configurations as JSON, so that a potentials checkpoint (a JSON config beside the
weights, read with ``weights_only=True``) can rebuild their architectures without unpickling anything.

``encode`` turns the values packages keep in their configs — dicts with integer keys (sevenn's type
map), tuples, numpy arrays and scalars, small tensors, torch devices and dtypes — into JSON values,
tagging what JSON cannot say; ``decode`` turns them back. Anything else is refused (TypeError naming
the key), never stored as a string that would come back as something else.
"""
from __future__ import annotations

import numpy as np
import torch

_TAGS = ("__items__", "__tuple__", "__ndarray__", "__tensor__", "__device__", "__dtype__")


def encode(value, where: str = "config"):
    """A JSON value (dicts with string keys, lists, numbers, strings, booleans, None) for ``value``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"__items__": [[encode(k, where), encode(v, f"{where}.{k}")] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{k}]") for k, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{k}]") for k, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).split(".")[-1]}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).split(".")[-1]}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored as JSON")


def decode(value):
    """The inverse of ``encode``."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=value["dtype"])
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if "__device__" in value:
        return torch.device(value["__device__"])
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    return {k: decode(v) for k, v in value.items()}
