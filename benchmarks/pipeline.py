"""Pipeline-parallel training of a many-block SchNet (energy + force + stress loss, four sweeps),
side by side in one run:

* time per step (gradients of the global batch) and per-stage peak memory vs one process (the whole
  batch at once, as ``mlip-train`` steps; and one structure at a time), S = 2 and 4
  (4 ranks oversubscribe this 2-core machine: read its throughput as a functional check, its memory as
  real), for GPipe, 1F1B and auto (the cost-aware schedule chosen after its timed warm-up steps);
* the pipeline's work: both S = 2 stages run in one process, taking turns (``in_sequence``), against one
  process: what splitting the model into stages adds, without bubble or a second core;
* the simulator's predicted step time (``schedule.check`` with the sweep costs each run measured in
  its warm-up steps) beside the measured one;
* measured bubble fraction (time blocked in receives / step time, mean over stages) vs the predicted;
* peak memory of auto and GPipe relative to 1F1B at equal M, and relative to 1F1B with A not merged into B
  (``--no-merge`` runs: A back-propagates through the forward graph itself, as before the merge);
* the sweep costs (ms per micro-batch) each S = 2 run measured, stage by stage, merged and not;
* the predicted gain of auto over plain four-sweep 1F1B at 4 and 8 stages, from the costs measured at
  S = 2 (per block: a stage's costs divided by its blocks).

    python benchmarks/pipeline.py [--blocks 8] [--features 64] [--atoms-per-structure 256] [--microbatches 8]
                                  [--render] [--no-s4]

Every process runs with glibc's malloc keeping freed memory (``keep_freed_memory``, mlip-train's default).
Every run first takes the steps that measure the sweep costs (three; auto: five, on plain and split
sweeps in turn, after which it picks its schedule). Peak memory is the process's resident high-water mark
(VmHWM) during the next step above its resident size before it (VmRSS, after returning freed heap to
the system): the activations held by in-flight micro-batches.
Time is the mean of the following steps.
"""
import argparse
import json
import sys
import time

from common import ROOT, cu_structures, launch, reset_hwm, status_mb


def trimmed_rss() -> float:
    """VmRSS after garbage collection and returning freed heap to the system (glibc malloc_trim)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return status_mb("VmRSS")


def worker(args):
    import numpy as np
    import torch

    import potentials
    from mlip_parallel.allocator import keep_freed_memory
    from mlip_parallel.train.training import Batch, Counts, LossRule, batch_gradients

    torch.set_num_threads(1)
    keep_freed_memory()  # as mlip-train does (its default), on both sides
    structures = cu_structures(args.structures, args.atoms_per_structure)

    def build(parts=None):
        return potentials.SchNet(["Cu"], cutoff=4.5, features=args.features, layers=args.blocks, parts=parts, seed=0)

    model = build() if args.stages == 1 and args.layout != "sequential" else None
    weights = LossRule(energy=1.0, forces=10.0, stress=1.0)
    steps = 3
    if args.stages == 1 and args.layout == "sequential":
        step = in_sequence(build, structures, args, weights)
    elif args.stages == 1:
        def step():
            model.zero_grad()
            if args.layout == "micro":  # one structure at a time, gradients accumulated
                for s in structures:
                    batch_gradients(model, Batch([s], model, model.device), Counts.of(structures), weights,
                                    model.parameters())
                return
            batch = Batch(structures, model, model.device)
            batch_gradients(model, batch, Counts.of(structures), weights, model.parameters())  # mlip-train's step
    if args.stages == 1:
        step()
        base = trimmed_rss()
        reset_hwm()
        step()
        peak = status_mb("VmHWM") - base
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - start) / steps
        stage_seconds = getattr(step, "stage_seconds", [])
        print(json.dumps({"seconds": seconds, "peak_mb": [peak], "bubble": [0.0],
                          "stage_seconds": [sum(t[-steps:]) / steps for t in stage_seconds]}))
        return
    from mlip_parallel.train.pipeline import PipelineTrainer
    from mlip_parallel.train.pipeline.schedule import render
    from mlip_parallel.train.processes import Processes

    Processes("pipeline")
    import torch.distributed as dist

    trainer = PipelineTrainer(build, args.stages, args.microbatches, args.schedule,
                              boundaries=[args.blocks * s // args.stages for s in range(args.stages + 1)],
                              merge=not args.no_merge)
    while trainer.costs is None:  # the warm-up steps measure the costs (three; auto: five)
        trainer.gradients(structures, weights)
    dist.barrier()
    base = trimmed_rss()
    reset_hwm()
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
        costs, timeline = trainer.costs, trainer.timeline
        print(json.dumps({"seconds": seconds, "peak_mb": [g[0] for g in gathered], "bubble": [g[1] for g in gathered],
                          "in_flight": [g[2] for g in gathered], "boundaries": trainer.boundaries,
                          "name": trainer.schedule_name, "predicted": timeline["time"],
                          "predicted_bubble": timeline["bubble_fraction"],
                          "costs": {"seconds": costs.seconds, "latency": costs.latency, "memory": costs.memory},
                          "render": render(timeline) if args.render else ""}))
    dist.destroy_process_group()


def in_sequence(build, structures, args, weights):
    """A step of the 2-stage pipeline run in this one process: both stages' 1F1B actions, the real
    ``PipelineStage`` code, each stage in a thread of its own that holds one lock while it computes and
    lets go of it only to wait for a message (messages are handed over in memory): the stages take turns,
    never compute at once, so the step's time is the two stages' work added, with no bubble and no
    second core. ``step.stage_seconds[s]``: stage s's compute seconds per step."""
    import threading

    import numpy as np

    from mlip_parallel.train.pipeline import PipelineStage
    from mlip_parallel.train.pipeline.schedule import one_f_one_b
    from mlip_parallel.train.training import Batch, Counts
    from potentials.base import stage_parts

    turn, box = threading.Condition(), {}

    class InMemory(PipelineStage):
        def _post_receives(self, actions):
            pass

        def _send(self, tensor, to, m, sweep, part=0):
            box[m, str(sweep), part] = tensor.detach().clone()
            turn.notify_all()

        def _recv(self, m, sweep, part=0):
            start = time.perf_counter()
            turn.wait_for(lambda: (m, str(sweep), part) in box or "failed" in box)  # the other stage computes
            if "failed" in box:
                raise RuntimeError("the other stage failed")
            self.wait_seconds += time.perf_counter() - start
            return box.pop((m, str(sweep), part))

    boundaries = [0, args.blocks // 2, args.blocks]
    stages = [InMemory(build(stage_parts(args.blocks, boundaries, s)), s, 2, boundaries,
                       (None if s == 0 else 0, 1 if s == 0 else None)) for s in range(2)]
    lists = one_f_one_b(2, args.microbatches)
    counts = Counts.of(structures)
    chunks = np.array_split(np.arange(len(structures)), args.microbatches)

    def step():
        failed = []

        def run(stage):
            for p in stage.parameters:
                p.grad = None
            try:
                with turn:
                    stage.run(lists[stage.stage], [Batch([structures[k] for k in c], stage.model, stage.model.device)
                                                   for c in chunks], counts, weights)
            except BaseException as exc:  # noqa: BLE001 (re-raised in the main thread)
                failed.append(exc)
                with turn:
                    box["failed"] = True
                    turn.notify_all()
                return
            step.stage_seconds[stage.stage].append(stage.run_seconds - stage.wait_seconds)
        threads = [threading.Thread(target=run, args=(stage,)) for stage in stages]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
    step.stage_seconds = [[], []]
    return step


def scaled_costs(costs, blocks, stages):
    """Costs of ``stages`` even stages from those measured on 2 even stages of ``blocks`` blocks: per block, a
    measured stage's seconds and memory divided by its blocks (the first half of the new stages from stage
    0's, the second from stage 1's), times the new stage's blocks."""
    from mlip_parallel.train.pipeline.schedule import Costs

    per = blocks // 2
    new = blocks // stages

    def row(table, s):
        source = table[0 if s < stages // 2 else 1]
        return {k: v if k == "merged" else v * new / per for k, v in source.items()}  # "merged" is a flag
    return Costs(tuple(row(costs["seconds"], s) for s in range(stages)), costs["latency"],
                 tuple(row(costs["memory"], s) for s in range(stages)))


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
    parser.add_argument("--render", action="store_true", help="print auto's chosen schedule with measured durations")
    parser.add_argument("--no-merge", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="whole", choices=("whole", "micro", "sequential"), help=argparse.SUPPRESS)
    parser.add_argument("--no-s4", action="store_true", help="skip the 4-stage runs (oversubscribed on 2 cores)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    common = ["--blocks", args.blocks, "--features", args.features, "--atoms-per-structure", args.atoms_per_structure,
              "--structures", args.structures, "--microbatches", args.microbatches]
    common += ["--render"] if args.render else []
    one = launch(1, __file__, common + ["--stages", 1])
    print(f"SchNet {args.blocks} blocks, F={args.features}; global batch {args.structures} x "
          f"{args.atoms_per_structure} atoms, M={args.microbatches} micro-batches; energy+force+stress loss")
    print(f"{'run':19s} {'s/step':>7s} {'speed-up':>8s} {'predicted':>9s} {'pred/meas':>9s} {'peak MB per stage':>18s} "
          f"{'bubble':>6s} {'pred.':>5s}  schedule")
    print(f"{'1 process':19s} {one['seconds']:7.2f} {1.0:8.2f} {'':>9s} {'':>9s} {one['peak_mb'][0]:18.0f}")
    micro = launch(1, __file__, common + ["--stages", 1, "--layout", "micro"])
    print(f"{'1 process, M=' + str(args.microbatches):19s} {micro['seconds']:7.2f} {one['seconds'] / micro['seconds']:8.2f}"
          f" {'':>9s} {'':>9s} {micro['peak_mb'][0]:18.0f}  (one structure at a time, gradients accumulated)")
    if args.structures == args.microbatches:  # the pipeline's work, both stages in one process, one after the other
        both = launch(1, __file__, common + ["--stages", 1, "--layout", "sequential"])
        work = both["stage_seconds"]
        print(f"{'S=2 in sequence':19s} {both['seconds']:7.2f} {one['seconds'] / both['seconds']:8.2f} {'':>9s} {'':>9s} "
              f"{both['peak_mb'][0]:18.0f}  (both stages' 1F1B sweeps in one process, taking turns: their work added)")
        print(f"S=2 work: stages {work[0]:.3f} + {work[1]:.3f} s = {sum(work) / one['seconds']:.2f} x one process, "
              f"{sum(work) / micro['seconds']:.2f} x one process at M={args.microbatches}; the slower stage "
              f"{max(work):.3f} s (what a step on two cores cannot beat): {one['seconds'] / max(work):.2f}x at most")
    results = {}
    runs = [(2, s) for s in ("gpipe", "1f1b", "auto", "1f1b unmerged", "auto unmerged")]
    runs += [] if args.no_s4 else [(4, s) for s in ("gpipe", "1f1b", "auto")]
    for stages, schedule in runs:
        name, *rest = schedule.split()
        extra = ["--no-merge"] if rest else []
        r = launch(stages, __file__, common + ["--stages", stages, "--schedule", name] + extra)
        results[stages, schedule] = r
        peaks = " ".join(f"{p:.0f}" for p in r["peak_mb"])
        print(f"{f'S={stages} {schedule}':19s} {r['seconds']:7.2f} {one['seconds'] / r['seconds']:8.2f} "
              f"{r['predicted']:9.2f} {r['predicted'] / r['seconds']:9.2f} {peaks:>18s} "
              f"{sum(r['bubble']) / len(r['bubble']):6.2f} {r['predicted_bubble']:5.2f}  {r['name']}")
    def memory_ratios(run, reference):  # peak memory per stage, run / reference
        return " ".join(f"{a / b:.2f}" for a, b in zip(run["peak_mb"], reference["peak_mb"]))

    for stages, schedule in runs:
        if schedule == "1f1b":
            continue
        reference = "1f1b unmerged" if schedule.endswith("unmerged") else "1f1b"
        line = memory_ratios(results[stages, schedule], results[stages, reference])
        if stages == 2 and not schedule.endswith("unmerged"):
            line += "; / 1F1B unmerged: " + memory_ratios(results[stages, schedule], results[2, "1f1b unmerged"])
        print(f"S={stages}: peak memory {schedule} / {reference} per stage: {line}")
    for schedule in ("1f1b", "auto", "1f1b unmerged", "auto unmerged"):
        measured = results[2, schedule]["costs"]
        print(f"S=2 {schedule:13s} sweep costs, ms per micro-batch: " + "; ".join(
            f"stage {s}: " + " ".join(f"{k} {1e3 * v:.0f}" for k, v in row.items()) + f" (sum of F, B1, A, B "
            f"{1e3 * sum(row.get(k, 0.0) for k in ('F', 'B1', 'A', 'B')):.0f})"
            for s, row in enumerate(measured["seconds"])))
    if args.render:
        print("S=2 auto, measured durations:\n" + results[2, "auto"]["render"])
    from mlip_parallel.train.pipeline.schedule import SWEEPS, auto, check, one_f_one_b

    measured = results[2, "auto"]["costs"]
    for s, (seconds, held) in enumerate(zip(measured["seconds"], measured["memory"])):
        print(f"S=2 measured costs, stage {s}: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in seconds.items())
              + "; held " + ", ".join(f"{k} {v / 2 ** 20:.0f} MB" for k, v in held.items() if k != "merged")
              + (" (B1's graph until B: A runs in B)" if held.get("merged") else ""))
    print(f"S=2 message latency {1e3 * measured['latency']:.2f} ms")
    for stages in (4, 8):
        if args.blocks % stages or stages > args.blocks:  # predictions from the S=2 costs: no S=4 run needed
            continue
        costs = scaled_costs(measured, args.blocks, stages)
        name, _, chosen = auto(stages, args.microbatches, SWEEPS["forces"], costs)
        plain = check(one_f_one_b(stages, args.microbatches), stages, args.microbatches, costs=costs)
        print(f"S={stages} predicted from the S=2 costs: 1F1B {plain['time']:.2f} s (bubble "
              f"{plain['bubble_fraction']:.2f}), auto {chosen['time']:.2f} s (bubble {chosen['bubble_fraction']:.2f}; "
              f"{name}): {plain['time'] / chosen['time']:.2f}x")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
