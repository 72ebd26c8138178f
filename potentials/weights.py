"""Weights by name: the groups a model's weight names fall into, for the messages that list them (a ``model.freeze``
or LoRA pattern, or an ``optimizer.lr_factors`` glob, that matches no weight)."""
from __future__ import annotations


def weight_groups(names) -> list:
    """The parameter groups of weight ``names``, for messages: each name cut after its first component that
    tells modules apart (a layer index stays with its module: "interactions.0.*", "model.func.layer1_convnet.*")."""
    names = list(names)
    for depth in range(1, 8):
        groups = set()
        for name in names:
            parts = name.split(".")
            cut = min(depth, len(parts) - 1)
            while cut < len(parts) - 1 and parts[cut].isdigit():
                cut += 1
            groups.add(".".join(parts[:cut]) + ".*" if cut else name)
        if len(groups) > 1 or depth >= max((n.count(".") for n in names), default=0):
            return sorted(groups)
    return sorted(groups)
