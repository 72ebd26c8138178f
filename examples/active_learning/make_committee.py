"""Four committee members for the active-learning demo: the bundled cu-emt model (PaiNN for copper, float64) with
every weight moved by seeded Gaussian noise of 3 % of its tensor's mean magnitude — a stand-in for four models
trained with different seeds, whose forces differ by a few 0.01 eV/Å on warm copper.

    python examples/active_learning/make_committee.py [--output committee] [--members 4] [--scale 0.03]
"""
import argparse
from pathlib import Path

import torch

import potentials


def perturbed_cu_emt(seed: int, scale: float = 0.03):
    """cu-emt (float64) with each weight tensor p moved by ``scale`` × mean|p| × N(0, 1) noise of ``seed``."""
    model = potentials.load_model("cu-emt", "float64")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="committee", help="directory for m0.pt, m1.pt, ...")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--scale", type=float, default=0.03)
    args = parser.parse_args()
    directory = Path(args.output)
    directory.mkdir(parents=True, exist_ok=True)
    for seed in range(args.members):
        potentials.save(perturbed_cu_emt(seed, args.scale), directory / f"m{seed}.pt")
    print(f"{args.members} members in {directory}/: " + ", ".join(f"m{k}.pt" for k in range(args.members)))


if __name__ == "__main__":
    main()
