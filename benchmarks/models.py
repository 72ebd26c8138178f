"""Per model: energy+forces throughput (atoms/s, one thread) and halo overhead (layerwise evaluate on
one rank vs predict), timings interleaved in one run; optionally eager vs torch.compile.

    python benchmarks/models.py [--cells 6] [--repeat 5] [--compile]
"""
import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_crystal  # noqa: E402

import mlip_parallel  # noqa: E402
import potentials  # noqa: E402

warnings.filterwarnings("ignore")


def models(names):
    torch.manual_seed(0)
    builders = {
        "SchNet": ("SchNet F=64 L=3", lambda: potentials.SchNet(["Cu"], cutoff=5.0, features=64, layers=3)),
        "PaiNN": ("PaiNN F=64 L=3", lambda: potentials.PaiNN(["Cu"], cutoff=5.0, features=64, layers=3)),
        "NequIP": ("NequIP F=16 l=2 L=3", lambda: potentials.NequIP(["Cu"], cutoff=5.0, features=16, layers=3)),
        "SevenNet": ("SevenNet-0", lambda: potentials.SevenNet("7net-0")),
    }
    for key in names:
        label, build = builders[key]
        try:
            yield label, build()
        except ImportError as exc:
            print(f"{label}: skipped ({exc})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=6, help="cubic fcc Cu cells per direction (6 → 864 atoms)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model, dynamic=True)")
    parser.add_argument("--models", default="SchNet,PaiNN,NequIP,SevenNet", help="comma-separated subset")
    args = parser.parse_args()
    torch.set_num_threads(1)
    atoms = cu_crystal(args.cells)
    serial = mlip_parallel.SerialBackend()
    print(f"{len(atoms)} atoms fcc Cu, rc = 5 A, one thread, median of {args.repeat}, energy+forces+stress")
    print(f"{'model':22s} {'predict':>10s} {'atoms/s':>9s} {'evaluate':>10s} {'overhead':>9s}"
          + (f" {'compiled':>10s} {'speed-up':>9s}" if args.compile else ""))
    for name, model in models(args.models.split(",")):
        runs = {"predict": lambda: potentials.predict(model, atoms),
                "evaluate": lambda: mlip_parallel.evaluate(model, atoms, comm=serial)}
        if args.compile:
            compiled = torch.compile(model, dynamic=True)  # attributes (cutoff, species, ...) pass through
            runs["compiled"] = lambda: potentials.predict(compiled, atoms)
        samples = {k: [] for k in runs}
        for k, run in runs.items():
            run()  # warm-up (and compilation)
        for _ in range(args.repeat):  # interleaved: noise hits all variants alike
            for k, run in runs.items():
                t0 = time.perf_counter()
                run()
                samples[k].append(time.perf_counter() - t0)
        if args.compile:  # the compiled model must give the eager result
            eager, fast = potentials.predict(model, atoms), potentials.predict(compiled, atoms)
            assert abs(fast["energy"] - eager["energy"]) <= 1e-5 * abs(eager["energy"]), (fast["energy"], eager["energy"])
        t = {k: statistics.median(v) for k, v in samples.items()}
        line = (f"{name:22s} {t['predict'] * 1e3:8.0f}ms {len(atoms) / t['predict']:9.0f} "
                f"{t['evaluate'] * 1e3:8.0f}ms {t['evaluate'] / t['predict']:8.3f}x")
        if args.compile:
            line += f" {t['compiled'] * 1e3:8.0f}ms {t['predict'] / t['compiled']:8.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
