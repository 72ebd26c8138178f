"""Low-rank adaptation (LoRA) of a model's linear weights, for any model family.

``add_lora(model, rank, alpha, targets)`` freezes every weight of ``model`` and gives each weight whose name
(``model.named_weights()``: as its package names it) matches a glob of ``targets`` a trainable low-rank update,
through ``torch.nn.utils.parametrize``: the module that owns the weight reads W + (alpha / rank) · ΔW wherever it
reads W, so the package's own code runs unchanged. ΔW is B·A per two-dimensional block of W: the whole weight of a
matrix (``torch.nn.Linear``'s [out, in], e3nn's fully connected layers' [in, out]), or each path's
[mul_in, mul_out] block of an e3nn ``o3.Linear``'s flat weight (its ``instructions``; an update within each path
keeps the layer equivariant), or each matrix of a stack [n, out, in] (fairchem's mixture-of-experts layers, one
per expert; its SO(3) linear layers, one per degree l, which keeps them equivariant). B starts at zero: the adapted
model starts as the model. ``merged(model)`` is a copy
with every update added into its weight and the parametrizations gone: an ordinary model of its class, for
checkpoints and the package's own file format.
"""
from __future__ import annotations

import copy
import zlib
from fnmatch import fnmatchcase

import torch
from torch.nn.utils import parametrize

from .errors import MLIPError
from .weights import weight_groups


class LoRAError(MLIPError, ValueError):
    """A LoRA request that cannot be met: a glob matching no weight, or a weight without matrix blocks."""


class LowRankUpdate(torch.nn.Module):
    """The parametrization W → W + scale · ΔW of one weight: ``blocks`` (offset, rows, cols) tiling the flattened W
    in order, each updated by B [rows, rank] @ A [rank, cols]; A drawn from N(0, 1/cols) by ``generator``, B zero."""

    def __init__(self, weight: torch.Tensor, blocks, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.blocks, self.scale, self.shape = list(blocks), alpha / rank, weight.shape
        options = dict(dtype=weight.dtype, device=weight.device)
        self.A = torch.nn.ParameterList(
            torch.nn.Parameter((torch.randn(rank, cols, generator=generator, dtype=torch.float64) / cols ** 0.5)
                               .to(**options)) for _, _, cols in self.blocks)
        self.B = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(rows, rank, **options))
                                        for _, rows, _ in self.blocks)

    def delta(self) -> torch.Tensor:
        """ΔW × scale, in W's shape (the blocks tile the flattened W in order: ``weight_blocks``)."""
        return (self.scale * torch.cat([(b @ a).reshape(-1) for a, b in zip(self.A, self.B)])).reshape(self.shape)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta()


def weight_blocks(owner: torch.nn.Module, attribute: str, weight: torch.Tensor) -> list:
    """(offset, rows, cols) of ``weight``'s matrix blocks in its flattened form: the matrix itself, each matrix of a
    stack [n, rows, cols], or an e3nn ``o3.Linear``'s per-path blocks; [] for a weight of none of these kinds."""
    if weight.dim() == 2:
        return [(0, weight.shape[0], weight.shape[1])]
    if weight.dim() == 3:
        n, rows, cols = weight.shape
        return [(k * rows * cols, rows, cols) for k in range(n)]
    instructions = getattr(owner, "instructions", None)
    if weight.dim() != 1 or attribute != "weight" or not instructions:
        return []
    blocks, offset = [], 0
    for instruction in instructions:
        shape = tuple(getattr(instruction, "path_shape", ()))
        if getattr(instruction, "has_weight", True) is False:
            continue
        if len(shape) != 2:
            return []  # a tensor product's paths (uvw: three dimensions): not a linear layer
        blocks.append((offset, shape[0], shape[1]))
        offset += shape[0] * shape[1]
    return blocks if offset == weight.numel() else []


def add_lora(model, rank: int, alpha: float, targets, seed: int = 0, require_match: bool = True) -> list:
    """Freeze every weight of ``model`` and add a trainable ``LowRankUpdate`` of ``rank`` (scale alpha / rank) to
    each weight whose ``named_weights`` name matches a glob of ``targets``; returns the adapted names. A weight's A is
    drawn from ``seed`` and its name alone, so a pipeline stage holding some of the weights draws the same A for
    each as the whole model does. LoRAError for a glob that matches no weight (``require_match``: a stage's caller
    checks the globs over all stages instead), or a matched weight with no matrix blocks (its shape named)."""
    if rank < 1:
        raise LoRAError(f"model.lora.rank: the rank of the updates is an integer >= 1, got {rank}")
    named = model.named_weights()
    owners = {id(p): (module, attribute) for module in model.modules()
              for attribute, p in module._parameters.items() if p is not None}
    for glob in targets if require_match else ():
        if not any(fnmatchcase(name, glob) for name, _ in named):
            raise LoRAError(f"model.lora.targets: {glob!r} matches none of the {type(model).__name__}'s weights; its "
                            f"parameter groups are {', '.join(weight_groups(n for n, _ in named))}")
    chosen = [(name, p) for name, p in named if any(fnmatchcase(name, glob) for glob in targets)]
    plans = []
    for name, p in chosen:
        owner, attribute = owners[id(p)]
        blocks = weight_blocks(owner, attribute, p)
        if not blocks:
            raise LoRAError(f"model.lora.targets: {name} {tuple(p.shape)} is not a linear layer's weight (a matrix, a "
                            f"stack of them, or an e3nn Linear's per-path matrices): leave it out of the targets")
        plans.append((name, owner, attribute, p, blocks))
    for p in model.parameters():
        p.requires_grad_(False)
    for name, owner, attribute, p, blocks in plans:
        generator = torch.Generator().manual_seed(seed * 2 ** 32 + zlib.crc32(name.encode()))
        parametrize.register_parametrization(owner, attribute, LowRankUpdate(p, blocks, rank, alpha, generator))
    model.lora_settings = {"rank": rank, "alpha": alpha, "targets": list(targets), "seed": seed,  # (a copy's)
                           "require_match": require_match}
    return [name for name, _ in chosen]


def has_lora(model) -> bool:
    return any(parametrize.is_parametrized(m) for m in model.modules())


def merged(model):
    """``model`` itself where it has no LoRA updates, else a copy with each update added into its weight (no
    parametrizations left: the model's ordinary state dict and files)."""
    if not has_lora(model):
        return model
    copied = copy.deepcopy(model)
    for module in list(copied.modules()):
        if parametrize.is_parametrized(module):
            with torch.no_grad():
                values = {a: module.parametrizations[a]() for a in module.parametrizations}
            # back to the module's own class by hand: parametrize's remove_parametrizations deletes the weight's
            # property from the parametrized class, which a deepcopy shares with the original's module
            module.__class__ = module.__class__.__bases__[0]
            del module._modules["parametrizations"]
            for attribute, value in values.items():
                module.register_parameter(attribute, torch.nn.Parameter(value, requires_grad=False))
    copied.lora_settings = None
    return copied
