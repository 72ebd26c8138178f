"""Memory of pipeline-parallel training with stage-local models, side by side in one run:

* a PaiNN of ≥ 50 M parameters (features 768, 8 blocks, float32) trained as mlip-train does (AdamW,
  EMA, energy + force + stress loss, 1F1B) in one process and in 2 and 4 stages: every stage's peak
  memory above its import baseline, as a fraction of the one-process peak (targets: ≤ 0.6 at 2 stages,
  ≤ 0.35 at 4), and the parameters each rank holds;
* the largest model that trains within a per-rank memory budget (``--budget-gib``, as on a GPU of that
  size), in one process and in 4 stages: a bisection over the width, each candidate trained for two
  steps and its measured peak compared with the budget.

* ``--train``: the regime where parameters dominate, through the ``mlip-train`` command itself (its
  defaults: glibc keeps freed memory, schedule auto, cost-balanced boundaries, a merged checkpoint per
  epoch): the same PaiNN on 4-atom Cu structures, batch 2, M=2, 2 epochs, in one process and in 4
  stages; every process's peak (VmHWM at exit) minus the same run with a 16-feature model (what a
  process holds whatever the model), and the largest stage as a fraction of one process; and the
  torch tensors each process holds at the end of training (counted over the live tensors' storages;
  this CPU build of torch keeps no allocator statistics), on CUDA also torch's peak allocated bytes.

* ``--mace`` / ``--sevennet`` / ``--allegro``: another package's model in stages: a random MACE of
  MACE-MP-0-medium channels (128x0e+128x1o, max_ell 3, correlation 3, r_max 6 Å, float32) with four
  interactions, SevenNet-0 (five layers), or a random Allegro of the nequip framework (l_max 2, four
  layers, 64 scalar and 16 tensor features, r_max 4.5 Å, float64; its per-edge state travels), each stage
  keeping only its parts of the file; AdamW + EMA, energy + force +
  stress loss, 1F1B: every stage's peak as a fraction of the one-process peak at S = 2 and 4, and the
  seconds per step after a warm-up step at S = 2 against one process (2 ranks on the 2 cores; S = 4
  oversubscribes them).

    python benchmarks/pipeline_memory.py [--features 768] [--blocks 8] [--budget-gib 3]
    python benchmarks/pipeline_memory.py --train [--features 768] [--blocks 8]
    python benchmarks/pipeline_memory.py --mace [--structures 4] [--microbatches 4]
    python benchmarks/pipeline_memory.py --sevennet
    python benchmarks/pipeline_memory.py --allegro

Peak memory is the process's resident high-water mark (VmHWM) over building the model and two
optimizer steps, minus its resident size after the imports and the process-group set-up (VmRSS).
The processes run with glibc's malloc defaults (they do not call mlip-train's ``keep_freed_memory``), as
the figures in docs/benchmarks.md were measured: freed large tensors go back to the system, and fragmentation of a
kept heap does not enter the peaks.
4 ranks oversubscribe this 2-core machine: times are not the point here.
"""
import argparse
import json
import os
import sys
from pathlib import Path

from common import ROOT, cu_structures, launch, reset_hwm, status_mb



def worker(args):
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    import potentials
    from mlip_parallel.train.training import Batch, Counts, LossRule, batch_gradients

    torch.set_num_threads(1)
    structures = cu_structures(args.structures, 32)
    weights = LossRule(energy=1.0, forces=10.0, stress=1.0)

    def build(parts=None):
        if args.mace_file or args.sevennet or args.allegro_file:  # its trained weights, as mlip-train selects them
            from potentials.base import select_weights                 # (adapters are frozen)

            model = (potentials.MACE(args.mace_file, parts=parts) if args.mace_file else
                     potentials.NequIPFramework(args.allegro_file, parts=parts) if args.allegro_file else
                     potentials.SevenNet("7net-0", parts=parts)).train()
            select_weights(model)
            return model
        return potentials.PaiNN(["Cu"], cutoff=4.5, features=args.features, layers=args.blocks, parts=parts, seed=0)

    if args.stages > 1:
        from mlip_parallel.train.pipeline import PipelineTrainer
        from mlip_parallel.train.processes import Processes

        Processes("pipeline")
        import torch.distributed as dist
        dist.barrier()
    reset_hwm()
    base = status_mb("VmRSS")
    if args.stages == 1:
        model = build()

        def step():
            batch = Batch(structures, model, model.device)
            batch_gradients(model, batch, Counts.of(structures), weights, trained)  # mlip-train's step
            torch.nn.utils.clip_grad_norm_(trained, 10.0)
            optimizer.step()
            optimizer.zero_grad()
    else:
        trainer = PipelineTrainer(build, args.stages, args.microbatches, "1f1b",
                                  boundaries=[args.blocks * s // args.stages for s in range(args.stages + 1)])
        model = trainer.model

        def step():
            trainer.step(structures, weights, optimizer, clip_norm=10.0)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=False)
    import time

    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        ema.update_parameters(model)
        seconds.append(time.perf_counter() - start)
    peak = status_mb("VmHWM") - base
    held = sum(p.numel() for p in model.parameters())
    shared = sum(p.numel() for name, p in model.named_parameters() if model.part_of(name) is None)  # on every stage
    result = {"peak_mb": [peak], "held": [held], "shared": shared, "parts": [len(model.parts)], "finite": [bool(all(
        torch.isfinite(p).all() for p in model.parameters()))], "step_seconds": sum(seconds[1:]) / max(1, len(seconds) - 1)}
    if args.stages > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (peak, held, len(model.parts), result["finite"][0]))
        result = {"peak_mb": [g[0] for g in gathered], "held": [g[1] for g in gathered],
                  "parts": [g[2] for g in gathered], "finite": [g[3] for g in gathered],
                  "step_seconds": result["step_seconds"], "shared": shared}
        if dist.get_rank() != 0:
            return
    print(json.dumps(result))


def painn_parameters(features, blocks, rbf=20):
    """Parameters of PaiNN(["Cu"], features, layers=blocks, rbf) (counted from its layer shapes)."""
    f = features
    block = (f * f + f) + (f * 3 * f + 3 * f) + (rbf * 3 * f + 3 * f) + 2 * f * f + (2 * f * f + f) + (f * 3 * f + 3 * f)
    readout = f * (f // 2) + f // 2 + f // 2 + 1
    return f + blocks * block + readout


def run(stages, features, blocks, structures, extra=(), microbatches=4):
    return launch(stages, __file__, ["--stages", stages, "--features", features, "--blocks", blocks,
                                     "--structures", structures, "--microbatches", microbatches, *extra])


def adapter_regime(kind, structures, microbatches) -> None:
    """The --mace / --sevennet / --allegro figures (see the module's docstring)."""
    import tempfile
    from pathlib import Path

    from mace_scaling import make_model

    with tempfile.TemporaryDirectory() as tmp:
        if kind == "mace":
            path = str(Path(tmp) / "mace-medium-4.model")
            make_model(path, "float32", "128x0e+128x1o", interactions=4)
            extra, blocks, title = ["--mace-file", path], 4, "MACE, MP-0-medium channels, 4 interactions"
        elif kind == "allegro":
            path = str(Path(tmp) / "allegro-4.ckpt")
            write_allegro(path)
            extra, blocks, title = ["--allegro-file", path], 4, "Allegro, l_max 2, 4 layers, 64 scalar / 16 tensor features"
        else:
            extra, blocks, title = ["--sevennet"], 5, "SevenNet-0, 5 interaction layers"
        results = {s: run(s, 0, blocks, structures, extra + ["--steps", 3], microbatches) for s in (1, 2, 4)}
    one = results[1]
    print(f"{title}, {one['held'][0] / 1e6:.2f} M parameters ({'float64' if kind == 'allegro' else 'float32'}); AdamW + EMA, "
          f"energy+force+stress loss, {structures} x 32-atom Cu, 1F1B, M={microbatches}")
    print(f"{'run':6s} {'largest stage peak MB':>22s} {'fraction of 1 process':>22s} {'s per step':>11s}  per stage: "
          f"peak MB / M parameters held")
    for stages, r in results.items():
        worst = max(r["peak_mb"])
        detail = ", ".join(f"{p:.0f}/{h / 1e6:.2f}M" for p, h in zip(r["peak_mb"], r["held"]))
        print(f"{f'S={stages}':6s} {worst:22.0f} {worst / one['peak_mb'][0]:22.2f} {r['step_seconds']:11.2f}  {detail}")
        # the stages hold the model exactly once, but for the weights of no part, which every stage holds
        assert sum(r["held"]) - (stages - 1) * r["shared"] == one["held"][0] and all(r["finite"]), r
    print(f"step time, one process / 2 stages: {one['step_seconds'] / results[2]['step_seconds']:.2f}x")


def write_allegro(path) -> None:
    """A random Allegro of benchmarks/nequip_scaling.py's size with four layers (l_max 2, 64 scalar and 16 tensor
    features, MLPs 64 wide, r_max 4.5 Å, float64) as a nequip-framework checkpoint: the test fixture's
    architecture resized, built by the framework."""
    sys.path.insert(0, str(ROOT / "tests"))
    from systems import allegro_architecture, write_framework_model

    write_framework_model(path, allegro_architecture(num_layers=4, num_scalar_features=64, num_tensor_features=16,
                                                     allegro_mlp_hidden_layers_width=64,
                                                     readout_mlp_hidden_layers_width=32))


def largest_features(fits, low, high, step=8):
    """The largest width in [low, high) (multiples of ``step``) with ``fits(width)`` true, by bisection
    over measured runs: ``fits(low)`` must hold and ``fits(high)`` fail."""
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def tensor_mb() -> float:
    """MB of the storages of every live torch tensor of this process (each storage once)."""
    import gc
    import warnings

    import torch

    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes warns
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def train_worker(job, out) -> None:
    """``mlip-train job`` in this process (one rank of a job), then to ``out.rankR.json``: its VmHWM (MB)
    and the MB of torch tensors it holds at the end of training (the Trainer still alive: weights,
    gradients, AdamW state, EMA, cached structures), on CUDA also torch's peak allocated bytes."""
    import torch

    from mlip_parallel.config import launch_rank
    from mlip_parallel.train import trainer
    from mlip_parallel.train.cli import main

    held = {}
    fit = trainer.Trainer.fit

    def fit_and_count(self):
        rows = fit(self)
        held["tensor_mb"] = tensor_mb()
        return rows

    trainer.Trainer.fit = fit_and_count
    code = main([job])
    if torch.cuda.is_available():
        held["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    with open(f"{out}.rank{launch_rank()}.json", "w") as f:
        json.dump({"hwm_mb": status_mb("VmHWM"), "vm_peak_mb": status_mb("VmPeak"), "exit": code, **held}, f)


def train_run(job: dict, stem, ranks: int, limit_gb=None) -> dict:
    """``job`` (an mlip-train config) written to ``stem``.yaml and run by ``train_worker`` on ``ranks`` processes
    (``parallel: pipeline`` needs as many stages; one process: ``sys.executable``), every process under an
    address-space limit of ``limit_gb`` (``ulimit -v``: the memory pre-flight reads it). {"ranks": each process's
    ``train_worker`` record (rank 0 first; those written), "error": the run's last line of standard error when it
    failed, else None}."""
    import resource
    import subprocess

    import yaml

    from common import launcher_command

    Path(f"{stem}.yaml").write_text(yaml.safe_dump(job))
    command = ([sys.executable] if ranks == 1 else launcher_command(ranks)) + [
        str(Path(__file__).resolve()), "--train-worker", f"{stem}.yaml", str(stem)]
    limit = None if limit_gb is None else int(limit_gb * 2**30)
    out = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, preexec_fn=None if limit is None else
                         lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    records = [json.loads(Path(f"{stem}.rank{r}.json").read_text()) for r in range(ranks)
               if Path(f"{stem}.rank{r}.json").exists()]
    failed = out.returncode != 0 or len(records) < ranks or any(r["exit"] for r in records)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    return {"ranks": records, "error": (lines[-1] if lines else f"exit {out.returncode}") if failed else None}


def train_peaks(directory, data, ranks, features, blocks) -> list:
    """Each process's ``train_worker`` record of ``mlip-train`` on ``ranks`` processes (pipeline of ``ranks``
    stages, or one process) for the parameter-dominated job."""
    name = f"{directory}/S{ranks}.F{features}"
    job = {"data": {"train": str(data), "validation_fraction": 0.25},
           "model": {"name": "PaiNN", "cutoff": 4.5, "hyperparameters": {"features": features, "layers": blocks},
                     "dtype": "float32"},
           "loss": {"energy_weight": 1.0, "forces_weight": 10.0, "stress_weight": 1.0}, "optimizer": {"lr": 1e-4},
           "ema_decay": 0.99, "epochs": 2, "batch_size": 2, "seed": 0,
           "parallel": "pipeline" if ranks > 1 else "data",
           "pipeline": {"stages": ranks, "microbatches": 2}, "output": {"directory": f"{name}_out"}}
    run = train_run(job, name, ranks)
    assert run["error"] is None, run
    return run["ranks"]


def train_regime(features, blocks) -> None:
    import tempfile

    from ase.io import write

    from common import cu_emt_frames

    with tempfile.TemporaryDirectory() as directory:
        data = f"{directory}/cu4.extxyz"
        write(data, cu_emt_frames(12, 4), format="extxyz")
        print(f"mlip-train, PaiNN features={features}, {blocks} blocks ({painn_parameters(features, blocks) / 1e6:.1f} M "
              f"parameters, float32), 12 x 4-atom Cu (9 training), batch 2, M=2, AdamW + EMA, E+F+S, 2 epochs; "
              f"peak MB above the same run with features=16:")
        above, tensors, allocated = {}, {}, {}
        for ranks in (1, 4):
            big, tiny = train_peaks(directory, data, ranks, features, blocks), train_peaks(directory, data, ranks, 16, blocks)
            above[ranks] = [b["hwm_mb"] - t["hwm_mb"] for b, t in zip(big, tiny)]
            tensors[ranks] = [b["tensor_mb"] for b in big]
            allocated[ranks] = [b.get("cuda_peak_allocated_mb") for b in big]
        one = above[1][0]
        print(f"  one process: {one:.0f} MB")
        print(f"  4 stages: {', '.join(f'{a:.0f}' for a in above[4])} MB (rank 0 first); largest / one process "
              f"{max(above[4]) / one:.2f}, stages 1-3 {max(above[4][1:]) / one:.2f}")
        weights = painn_parameters(features, blocks) * 4 / 2**20
        print(f"torch tensors held at the end of training (weights {weights:.0f} MB: with gradients, AdamW's two "
              f"moments and the EMA, 5x = {5 * weights:.0f} MB in all):")
        print(f"  one process: {tensors[1][0]:.0f} MB; 4 stages: {', '.join(f'{t:.0f}' for t in tensors[4])} MB; "
              f"largest / one process {max(tensors[4]) / tensors[1][0]:.2f}")
        if allocated[1][0] is not None:
            print(f"torch.cuda.max_memory_allocated: one process {allocated[1][0]:.0f} MB; 4 stages "
                  f"{', '.join(f'{a:.0f}' for a in allocated[4])} MB; largest / one process "
                  f"{max(allocated[4]) / allocated[1][0]:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--train", action="store_true", help="the parameter-dominated regime through mlip-train")
    parser.add_argument("--stages", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--features", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--structures", type=int, default=4, help="32-atom Cu structures per global batch")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per global batch (pipeline runs)")
    parser.add_argument("--budget-gib", type=float, default=3.0, help="per-rank memory budget for the largest model")
    parser.add_argument("--mace", action="store_true", help="a MACE of MP-0-medium channels in stages (see above)")
    parser.add_argument("--sevennet", action="store_true", help="SevenNet-0 in stages (see above)")
    parser.add_argument("--allegro", action="store_true", help="an Allegro of 4 layers in stages (see above)")
    parser.add_argument("--mace-file", help=argparse.SUPPRESS)
    parser.add_argument("--allegro-file", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.train_worker:
        train_worker(*args.train_worker)
        return
    if args.train:
        train_regime(args.features, args.blocks)
        return
    if args.mace or args.sevennet or args.allegro:
        kind = "mace" if args.mace else "allegro" if args.allegro else "sevennet"
        adapter_regime(kind, args.structures, args.microbatches)
        return
    total = painn_parameters(args.features, args.blocks)
    print(f"PaiNN features={args.features}, {args.blocks} blocks: {total / 1e6:.1f} M parameters (float32); "
          f"AdamW + EMA, energy+force+stress loss, {args.structures} x 32-atom Cu, 1F1B, M={args.microbatches}")
    results = {s: run(s, args.features, args.blocks, args.structures, microbatches=args.microbatches) for s in (1, 2, 4)}
    one = results[1]["peak_mb"][0]
    print(f"{'run':10s} {'largest stage peak MB':>22s} {'fraction of 1 process':>22s}  per stage: peak MB / M parameters held")
    for stages, r in results.items():
        worst = max(r["peak_mb"])
        detail = ", ".join(f"{p:.0f}/{h / 1e6:.1f}M" for p, h in zip(r["peak_mb"], r["held"]))
        print(f"{f'S={stages}':10s} {worst:22.0f} {worst / one:22.2f}  {detail}")
        assert sum(r["held"]) == total, (sum(r["held"]), total)  # the stages hold the model exactly once
    # the largest model in a per-rank budget, by bisection over the width with a training run at each
    budget = args.budget_gib * 1024
    print(f"largest PaiNN ({args.blocks} blocks) that trains within {args.budget_gib:g} GiB per rank "
          "(bisection over the width, two training steps each):")
    largest = {}
    for stages in (1, 4):
        peaks = {args.features: results[stages]}

        def fits(features):
            if features not in peaks:
                peaks[features] = run(stages, features, args.blocks, args.structures, microbatches=args.microbatches)
            r = peaks[features]
            return max(r["peak_mb"]) <= budget and all(r["finite"])

        low, high = args.features // 8 // 8 * 8, args.features
        while fits(high):  # grow until a run no longer fits
            low, high = high, int(1.5 * high) // 8 * 8
        while not fits(low):
            low, high = low // 2 // 8 * 8, low
        features = largest_features(fits, low, high)
        largest[stages] = painn_parameters(features, args.blocks)
        over = min(f for f in peaks if f > features)  # the narrowest width measured over the budget
        print(f"  {stages} {'process' if stages == 1 else 'stages '}: features={features}, "
              f"{largest[stages] / 1e6:.0f} M parameters, largest peak {max(peaks[features]['peak_mb']) / 1024:.2f} GiB "
              f"(features={over}: {max(peaks[over]['peak_mb']) / 1024:.2f} GiB)")
    print(f"  parameters, 4 stages / 1 process: {largest[4] / largest[1]:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
