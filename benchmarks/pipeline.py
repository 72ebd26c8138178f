"""Pipeline-parallel training of a many-block SchNet (energy + force + stress loss, four sweeps),
side by side in one run:

* throughput (structures/s) and per-stage peak memory vs one process, S = 2 and 4 (4 ranks
  oversubscribe this 2-core machine: read its throughput as a functional check, its memory as real);
* measured bubble fraction (time blocked in receives / step time, mean over stages) vs the
  theoretical (S − 1)/(M + S − 1);
* peak memory of 1F1B vs GPipe at equal M.

    python benchmarks/pipeline.py [--blocks 8] [--features 64] [--atoms-per-structure 256] [--microbatches 8]

Peak memory is the process's resident high-water mark (VmHWM) during the first step above its resident
size after set-up (VmRSS): the activations held by in-flight micro-batches. Time is the mean of the
following steps.
"""
import argparse
import json
import sys
import time

from common import ROOT, cu_structures, launch, reset_hwm, status_mb


def worker(args):
    import numpy as np
    import torch

    import potentials
    from mlip_parallel.train.training import Batch, Counts, loss_terms, predict_batch, total_loss

    torch.set_num_threads(1)
    structures = cu_structures(args.structures, args.atoms_per_structure)

    def build(parts=None):
        return potentials.SchNet(["Cu"], cutoff=4.5, features=args.features, layers=args.blocks, parts=parts, seed=0)

    model = build() if args.stages == 1 else None
    weights = {"energy": 1.0, "forces": 10.0, "stress": 1.0}
    steps = 3
    if args.stages == 1:
        def step():
            model.zero_grad()
            batch = Batch(structures, model, model.device)
            total_loss(loss_terms(*predict_batch(model, batch), batch, Counts.of(structures)), weights).backward()
        reset_hwm()
        base = status_mb("VmRSS")
        step()
        peak = status_mb("VmHWM") - base
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - start) / steps
        print(json.dumps({"seconds": seconds, "peak_mb": [peak], "bubble": [0.0]}))
        return
    from mlip_parallel.train.pipeline import PipelineTrainer
    from mlip_parallel.train.trainer import Processes

    Processes("pipeline")
    import torch.distributed as dist

    trainer = PipelineTrainer(build, args.stages, args.microbatches, args.schedule,
                              boundaries=[args.blocks * s // args.stages for s in range(args.stages + 1)])
    dist.barrier()
    reset_hwm()
    base = status_mb("VmRSS")
    trainer.gradients(structures, weights)
    peak = status_mb("VmHWM") - base
    dist.barrier()
    start = time.perf_counter()
    bubbles = []
    for _ in range(steps):
        trainer.gradients(structures, weights)
        bubbles.append(trainer.stage.wait_seconds / trainer.stage.run_seconds)
    seconds = (time.perf_counter() - start) / steps
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (peak, float(np.mean(bubbles)), trainer.stage.in_flight_peak))
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": seconds, "peak_mb": [g[0] for g in gathered], "bubble": [g[1] for g in gathered],
                          "in_flight": [g[2] for g in gathered], "boundaries": trainer.boundaries}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--atoms-per-structure", type=int, default=256, choices=(32, 108, 256))
    parser.add_argument("--structures", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    common = ["--blocks", args.blocks, "--features", args.features, "--atoms-per-structure", args.atoms_per_structure,
              "--structures", args.structures, "--microbatches", args.microbatches]
    one = launch(1, __file__, common + ["--stages", 1])
    print(f"SchNet {args.blocks} blocks, F={args.features}; global batch {args.structures} x "
          f"{args.atoms_per_structure} atoms, M={args.microbatches} micro-batches; energy+force+stress loss")
    print(f"{'run':24s} {'s/step':>8s} {'speed-up':>9s} {'peak MB per stage':>28s} {'bubble':>8s} {'theory':>7s}")
    print(f"{'1 process':24s} {one['seconds']:8.2f} {1.0:9.2f} {one['peak_mb'][0]:28.0f} {'':>8s} {'':>7s}")
    results = {}
    for stages in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            r = launch(stages, __file__, common + ["--stages", stages, "--schedule", schedule])
            results[stages, schedule] = r
            theory = (stages - 1) / (args.microbatches + stages - 1)
            peaks = " ".join(f"{p:.0f}" for p in r["peak_mb"])
            print(f"{f'S={stages} {schedule}':24s} {r['seconds']:8.2f} {one['seconds'] / r['seconds']:9.2f} "
                  f"{peaks:>28s} {sum(r['bubble']) / len(r['bubble']):8.2f} {theory:7.2f}   in flight {r['in_flight']}")
    for stages in (2, 4):
        g, o = results[stages, "gpipe"], results[stages, "1f1b"]
        print(f"S={stages}: peak memory 1F1B / GPipe per stage: "
              + " ".join(f"{a / b:.2f}" for a, b in zip(o["peak_mb"], g["peak_mb"])))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
