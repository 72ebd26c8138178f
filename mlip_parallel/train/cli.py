"""``mlip-train CONFIG.yaml`` trains a potential; ``mlip-train eval MODEL DATA`` prints its errors.

Run it in one process, or under ``mpiexec -n P`` (or torchrun) for data parallelism: every rank
takes a share of each global batch and the gradients are summed with torch.distributed (gloo on CPU,
nccl on GPU), so P ranks follow the single-process trajectory. ``parallel: graph`` instead splits
every structure by space over the ranks (structures too large for one device); ``parallel: pipeline``
splits the model's blocks over stages, each rank building only its stage's parts (models too large
for one device), with data parallelism across pipeline replicas.

Writes OUTPUT/best.pt and OUTPUT/last.pt (potentials checkpoints: ``potentials.load`` reads them;
last.pt also holds the optimizer, schedule and EMA state for an exact ``resume``; in pipeline mode both
are assembled part by part and each stage's state goes to OUTPUT/pipeline/stageS.stepN.pt), OUTPUT/metrics.csv
and OUTPUT/learning_curve.png, each atomically (a kill leaves the previous file). With ``resume``, the same
command run again after a crash continues from the last complete last.pt (at a validation, or every
``output.checkpoint_every`` steps: mid-epoch too) and ends as if never interrupted.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from potentials.errors import OutputError
from potentials.families import FamilyError, families, new_models
from potentials.files import atomic_write

from ..allocator import keep_freed_memory
from ..config import (ConfigError, ConfigTable, config_parser, read_job,  # noqa: F401  (validate: with SCHEMA, RULES)
                      report_error, validate)
from ..errors import MLIPError
from ..launch import end_job
from ..model_section import add_option_arguments, argument_options, model_rules, model_schema
from ..progress import Progress
from .outputs import format_errors, species_text

# key: (types, default, help); a dict value is a nested section. The model section's starting-model keys come from
# the model families (TABLE, model_keys).
SECTIONS = {
    "data": {
        "train": ((str, list), None, "training structures: a file with energy/forces/stress (extxyz and xyz indexed "
                                     "once and read a structure at a time, ASE db, fairchem's ASE-LMDB .aselmdb, "
                                     "any other ASE-readable file), or a list of files read as one set in order; an "
                                     "entry {file: PATH, share: S} is a file sampled at that fraction of each "
                                     "epoch's structures (docs/training.md: mixtures)"),
        "validation": ((str, list), None, "validation file(s) (default: validation_fraction of train)"),
        "test": ((str, list), None, "test file(s) (default: test_fraction of train), evaluated with best.pt at the "
                                    "end"),
        "stream": (bool, None, "read the structures from disk at each use instead of holding them: memory that does "
                               "not grow with the data set, each structure parsed again at every use (extxyz through "
                               "an index of its frames; only each rank's share of a data-parallel batch is read); "
                               "default: streamed where the data files take more than 256 MB on disk, or with "
                               "data.workers (the log says which)"),
        "workers": (int, 0, "data.stream: worker processes per rank that read the training structures and build "
                            "their neighbour lists ahead of the model (0: read when used)"),
        "keys": (dict, None, "the labels' names in the files, e.g. {energy: REF_energy, forces: REF_forces, stress: "
                             "REF_stress, config_type: kind, charge: total_charge, spin: multiplicity} (default: "
                             "energy, forces, stress, config_type, charge, spin; a calculator's results, info or "
                             "arrays; config_type, charge and spin: info entries, charge and spin whole numbers, read "
                             "by a model that takes them: fairchem's omol task, the others at model.charge and "
                             "model.spin)"),
        "validation_fraction": (float, 0.1, "share of train held out for validation when no validation file"),
        "test_fraction": (float, 0.0, "share of train held out for the test when no test file"),
    },
    "model": {
        "name": lambda: (str, None, f"a new model of this package: {', '.join(new_models())} (default "
                                    f"{next(iter(new_models()))} where no starting model is given)"),
        "cutoff": (float, None, "new model: cutoff radius, Å (default 5.0)"),
        "hyperparameters": (dict, None, "new model: further constructor arguments, e.g. {features: 64, layers: 3}"),
        "species": (list, None, "new model: element symbols (default: those in the training data)"),
        # then the trained model to start from: one key per model family that trains (model_section), its options
        "freeze": (list, [], "glob patterns over the weights' names (as the model's own package names them, e.g. "
                             "'interactions.*') that stay fixed; a pattern matching nothing is an error that lists the "
                             "groups"),
        "lora": (dict, None, "low-rank adaptation: {targets: [glob, ...], rank: 4, alpha: 1.0}: every weight stays "
                             "fixed and each weight a glob matches (a matrix, or an e3nn Linear's per-path matrices; "
                             "names as model.freeze's) learns an update (alpha/rank) B A of that rank, B starting at "
                             "zero; best.pt and the package's own file hold the weights with the updates added "
                             "(data or graph parallel)"),
        "reference_energies": (str, "keep", "a starting model's per-element reference energies (its E0s or per-type "
                                            "energy shifts): keep them (MACE's E0s foundation), refit: add the least "
                                            "squares of the model's energy residual per element on the training set "
                                            "(E0s estimated), or fit: the least squares of the energy labels on the "
                                            "element counts, before training (E0s average; a new model's are always "
                                            "fitted so)"),
    },
    "loss": {
        "energy_weight": (float, 1.0, "weight of the energy-per-atom MSE (eV²)"),
        "forces_weight": (float, 10.0, "weight of the force-component MSE (eV²/Å²)"),
        "stress_weight": (float, 0.0, "weight of the stress-component MSE (eV²/Å⁶)"),
        "type": (str, "mse", "mse (mean squared errors); huber: each error's Huber loss (torch's: x²/2 within "
                             "huber_delta, linear beyond) in place of its square; universal: MACE's, Huber's with the "
                             "force threshold 0.7, 0.4, 0.1 x huber_delta where the labelled force is over 100, 200, "
                             "300 eV/Å; val_loss stays the weighted MSE"),
        "huber_delta": (float, 0.01, "loss.type huber or universal: the threshold between its quadratic and linear "
                                     "parts (in each error's unit: eV/atom, eV/Å, eV/Å³)"),
        "config_type_weights": (dict, None, "{config_type: weight}: each penalty of a structure of that config_type "
                                            "(an atoms.info entry; data.keys.config_type names it) times the weight, "
                                            "others 1 (MACE's --config_type_weights)"),
    },
    "stage_two": {
        "start_epoch": (int, 0, "from this epoch on (counting from 1) train with stage two's loss weights and "
                                "learning rate (MACE's --stage_two / --swa with --start_swa); best.pt and early "
                                "stopping then compare stage two's validation losses only (0: one stage)"),
        "energy_weight": (float, None, "stage two's loss.energy_weight (default: stage one's)"),
        "forces_weight": (float, None, "stage two's loss.forces_weight (default: stage one's)"),
        "stress_weight": (float, None, "stage two's loss.stress_weight (default: stage one's)"),
        "lr": (float, None, "stage two's learning rate, constant from its first step (x each group's "
                            "optimizer.lr_factors; the schedule stops); default: the schedule goes on"),
        "average": (bool, False, "score and save the average of the weights at each stage-two epoch's end "
                                 "(stochastic weight averaging, MACE's SWA model) instead of the EMA"),
    },
    "optimizer": {
        "lr": (float, 1e-3, "AdamW learning rate"),
        "lr_factors": (dict, None, "{glob: factor} over the weights' names (as model.freeze names them): a matched "
                                   "weight learns at lr x factor (the first glob that matches; e.g. {'readouts.*': "
                                   "10}); the schedule scales every group alike"),
        "amsgrad": (bool, False, "AdamW's AMSGrad variant (the running maximum of the second moment; MACE's "
                                 "--amsgrad)"),
        "weight_decay": (float, 0.0, "AdamW weight decay"),
        "gradient_clip": (float, 10.0, "clip the gradient norm to this (0: no clipping)"),
    },
    "schedule": {
        "name": (str, "plateau", "plateau (reduce on validation loss), cosine, or none"),
        "patience": (int, 10, "plateau: validations without improvement before reducing"),
        "factor": (float, 0.5, "plateau: learning-rate factor"),
        "min_lr": (float, 1e-5, "plateau/cosine: lowest learning rate"),
        "warmup_steps": (int, 0, "cosine/none: the learning rate rises linearly over this many first steps (0: none); "
                                 "cosine then falls to min_lr over the run's remaining steps"),
    },
    "early_stopping": {
        "patience": (int, 0, "end the run when this many validations in a row have not lowered the validation loss "
                             "below the best before them (0: never); best.pt holds the best"),
    },
    "training_errors": (int, None, "at each validation also score the evaluation model on this many training "
                                   "structures (a fixed seeded subset, read as the training set is): metrics.csv's "
                                   "train_* columns (default: as many as the validation set, so the validation's cost "
                                   "at most doubles; 0: none)"),
    "ema_decay": (float, 0.99, "exponential moving average of the weights (0: none); best.pt/last.pt hold the average"),
    "epochs": (int, 100, "number of epochs"),
    "max_steps": (int, 0, "end after this many optimizer steps if epochs have not ended it first (0: epochs alone); "
                          "for data sets where an epoch is long"),
    "validate_every": (int, 0, "validate (a metrics.csv row, best.pt, last.pt) every this many steps, and at the "
                               "run's end (0: at each epoch's end)"),
    "batch_size": (int, 8, "structures per global batch (split over the ranks in data parallel)"),
    "batch_atoms": (int, 0, "instead of batch_size: global batches of at most this many atoms (a larger structure "
                            "alone), each rank's share of about as many atoms; for data of mixed sizes (0: off)"),
    "seed": (int, 0, "seed of the split, the shuffling and the initial weights"),
    "parallel": (str, "data", "data (each rank a share of every batch), graph (each structure split by space) "
                              "or pipeline (the model's blocks split over stages; see pipeline)"),
    "pipeline": {
        "stages": (int, 2, "pipeline: stages per pipeline; ranks = replicas × stages (data parallel across replicas)"),
        "microbatches": (int, 4, "pipeline: micro-batches per global batch and replica"),
        "schedule": (str, "auto", "pipeline: auto (times five warm-up steps, then runs the order predicted "
                                  "fastest under those costs within 1.2 × 1F1B's memory), gpipe, or 1f1b (at most "
                                  "stages micro-batches in flight per stage)"),
        "boundaries": (list, None, "pipeline: block index where each stage starts, plus the end, e.g. [0, 2, 6] "
                                   "(default: balance measured block costs)"),
        "two_bw": (bool, False, "pipeline: PipeDream-2BW one-step-stale weight updates"),
        "recompute": (bool, False, "pipeline: recompute each stage's forward before its backward sweeps"),
        "merge": (bool, True, "pipeline: the double backward's first sweep computes only what the next stage waits "
                              "for and leaves the rest to the second, one pass through the forward graph (faster; "
                              "holds A's gradients until B: false for 1F1B's memory of before)"),
    },
    "resume": (bool, False, "continue from OUTPUT/last.pt when it exists (same config; epochs = the new total)"),
    "keep_freed_memory": (bool, True, "glibc's malloc keeps freed tensors' memory for reuse instead of returning it "
                                      "to the system and faulting it in again (CPU training 1.1-1.3x faster; the "
                                      "resident size stays at its peak); your own MALLOC_TRIM_THRESHOLD_, "
                                      "MALLOC_TOP_PAD_, MALLOC_MMAP_THRESHOLD_ or glibc.malloc tunables win"),
    "output": {
        "directory": (str, "train_output", "output directory (refused when it is not empty, unless overwrite or resume)"),
        "overwrite": (bool, False, "write into a non-empty output directory"),
        "checkpoint_every": (int, 0, "also write last.pt every this many steps, for an exact resume mid-epoch (0: at "
                                     "each validation only)"),
        "tensorboard": (bool, False, "also log each metrics.csv row to TensorBoard event files in OUTPUT/tensorboard"),
        "wandb": (dict, None, "also log each metrics.csv row to Weights & Biases: {project: NAME, mode: offline | online "
                              "(default offline unless WANDB_MODE, or WANDB_API_KEY for online), name: RUN}; the run "
                              "files in OUTPUT/wandb, a resumed run continues the same run"),
        "progress": (bool, True, "report progress on stderr: a bar on a terminal, a line per validation in a log "
                                 "file (epoch or step, rate, ETA, validation errors); false (or --no-progress): none"),
    },
}
# allowed values (a tuple) or the range of a number (mlip_parallel.config.obeys); other numbers: finite, >= 0
KEY_RULES = {"model.reference_energies": ("keep", "refit", "fit"),
         "schedule.name": ("plateau", "cosine", "none"), "parallel": ("data", "graph", "pipeline"),
         "loss.type": ("mse", "huber", "universal"), "loss.huber_delta": "> 0",
         "stage_two.lr": "> 0",
         "pipeline.schedule": ("auto", "gpipe", "1f1b"),
         "data.validation_fraction": "[0, 1)", "data.test_fraction": "[0, 1)", "model.cutoff": "> 0",
         "optimizer.lr": "> 0", "schedule.factor": "(0, 1)", "ema_decay": "[0, 1)", "epochs": ">= 1",
         "batch_size": ">= 1", "pipeline.stages": ">= 1", "pipeline.microbatches": ">= 1"}


def model_keys() -> tuple:
    """(keys, rules) of mlip-train's model section from the model families: a key per family that trains (the model
    to start from) and its options, dtype, and the choices of ``model.name`` (a new model)."""
    return model_schema(trainable=True), {**model_rules(trainable=True), "model.name": tuple(new_models())}


# mlip-train's configuration: the families' model keys after the new model's (name, cutoff, hyperparameters, species)
TABLE = ConfigTable(SECTIONS, KEY_RULES, model_keys, model_after=4)


def __getattr__(name):  # SCHEMA and RULES (TABLE's, the families' keys in them), built at each use
    if name in ("SCHEMA", "RULES"):
        return TABLE.schema() if name == "SCHEMA" else TABLE.all_rules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train(config) -> list:
    """Run the validated ``config`` (``trainer.Trainer``); return the metric rows (every rank)."""
    from .trainer import Trainer  # (torch: at first use)

    return Trainer(config).fit()


def evaluate_model(model_path, data_path, batch_size: int = 8, progress: bool = False, deviations=None, keys=None,
                   **options) -> dict:
    """MAE/RMSE of a model (a checkpoint, a bundled model name, or any ``potentials.load_model`` spec:
    ``mace:FILE.model``, ``nequip:FILE``, ``sevennet:NAME``, ``fairchem:FILE``, ..., with its family's
    ``options``: ``head``, ``task``, ...) on every structure of a labelled file (one process); ``progress``
    prints a header and a progress bar. ``model_path`` a list of several: a committee (``potentials.Committee``,
    their mean), whose model deviation of each structure (DeePMD's max_devi_f, min_devi_f, avg_devi_f, devi_e) is
    written to the CSV file ``deviations`` (a path, or an open text file), one row per structure. The structures
    are read a batch at a time (``sources.open_source``: ``data_path`` a file or a list of them, ``keys`` the
    labels' names), so memory does not grow with the file."""
    import potentials

    from .sources import open_source  # (torch: at first use)
    from .training import check_species, error_sums, error_table

    specs = [model_path] if isinstance(model_path, str) else list(model_path)
    try:
        model = potentials.load_model(specs[0], **options) if len(specs) == 1 else \
            potentials.load_committee(specs, **options)
    except (potentials.MLIPError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
    committee = len(specs) > 1
    structures = open_source(data_path, keys)
    if progress:
        what = f"a committee of {len(specs)}" if committee else type(model).__name__
        print(f"mlip-train eval: {what} {species_text(model.species)} (cutoff {model.cutoff:g} Å) from "
              f"{', '.join(specs)}\nscoring every structure of {structures.name}: {len(structures)} structures",
              flush=True)

    sums = np.zeros(9)
    bar = Progress("mlip-train eval", len(structures), 0, "structure", None if progress else "off")
    rows = []
    for start in range(0, len(structures), batch_size):
        chunk = [structures[k] for k in range(start, min(start + batch_size, len(structures)))]
        check_species(model, chunk, "evaluation", error=ConfigError)
        if committee:  # one evaluation per structure gives both its errors and its deviation
            for structure in chunk:
                errors, row = structure_deviation(model, structure)
                sums += errors
                rows.append(row)
        else:
            sums += error_sums(model, chunk, batch_size, model.device)
        bar.update(start + len(chunk))
    bar.close()
    if rows:
        write_deviations(deviations if deviations is not None else sys.stdout, rows)
    return error_table(sums)


DEVIATION_COLUMNS = ("structure", "max_devi_f", "min_devi_f", "avg_devi_f", "devi_e")


def structure_deviation(committee, structure) -> tuple:
    """A committee's evaluation of one structure (``structures.Structure``): (the [9] error sums of its mean energy,
    forces and stress against the labels, ``training.prediction_errors``; its model deviation, a row of
    ``DEVIATION_COLUMNS``)."""
    import torch
    from ase.stress import voigt_6_to_full_3x3_stress

    from ..backend import SerialBackend  # (torch: at first use)
    from ..evaluate import evaluate
    from .training import Labels, prediction_errors

    result = evaluate(committee, structure.to_atoms(), comm=SerialBackend(), min_distance=0.0)
    stress = torch.as_tensor(voigt_6_to_full_3x3_stress(result["stress"]))[None] if "stress" in result else None
    errors = prediction_errors(Labels([structure], "cpu"), torch.tensor([result["energy"]], dtype=torch.float64),
                               torch.as_tensor(result["forces"]), stress)
    return errors, {"structure": structure.source, **{k: result[k] for k in DEVIATION_COLUMNS[1:]}}


def write_deviations(target, rows) -> None:
    """The rows (``structure_deviation``) as CSV into ``target``: a path (written atomically) or an open file."""
    import csv

    def write(f):
        writer = csv.DictWriter(f, fieldnames=DEVIATION_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    if hasattr(target, "write"):
        write(target)
        target.flush()
    else:
        with atomic_write(target, "w") as f:
            write(f)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        families()
    except FamilyError as exc:  # an installed package's model family that cannot be registered
        report_error("mlip-train", exc)
        return 2
    if argv[:1] == ["eval"]:
        parser = argparse.ArgumentParser(prog="mlip-train eval", description="errors of a model on every structure "
                                         "of a labelled file")
        parser.add_argument("model", nargs="+", help="checkpoint path (best.pt), bundled model name (cu-emt), or "
                                                     "NAME:SPEC of a model family "
                                                     f"({', '.join(f'{name}:...' for name in families())}); several: "
                                                     "a committee, scored by its mean, with its model deviation of "
                                                     "every structure (CSV on stdout, or --deviations FILE)")
        parser.add_argument("data", help="a file with energy/forces/stress (extxyz, ASE db, .aselmdb, any ASE-readable "
                                         "file), read a batch at a time")
        parser.add_argument("--deviations", metavar="FILE", help="a committee: write the model deviation of each "
                                                                 "structure to this CSV file")
        for quantity in ("energy", "forces", "stress"):
            parser.add_argument(f"--{quantity}-key", metavar="NAME", help=f"the {quantity} label's name in the file "
                                                                          f"(default {quantity})")
        add_option_arguments(parser)
        args = parser.parse_args(argv[1:])
        keys = {q: getattr(args, f"{q}_key") for q in ("energy", "forces", "stress") if getattr(args, f"{q}_key")}
        try:
            print(format_errors(evaluate_model(args.model if len(args.model) > 1 else args.model[0], args.data,
                                               progress=True, deviations=args.deviations, keys=keys,
                                               **argument_options(args))))
        except MLIPError as exc:
            report_error("mlip-train", exc)
            return 2
        return 0
    args = config_parser("mlip-train", __doc__.splitlines()[0], TABLE.schema()).parse_args(argv)
    try:
        config = read_job(args, TABLE.schema(), TABLE.all_rules())
        if config["keep_freed_memory"]:
            keep_freed_memory()
        from ..backend import get_backend, set_threads  # (torch: at first use)
        set_threads(get_backend())  # cores ÷ ranks each, on cores of their own where the job fills the node
        train(config)
    except OutputError as exc:  # this rank could not write: one line, and the whole job ends
        end_job("mlip-train", exc)
        return 1
    except MLIPError as exc:  # bad config or data: raised alike on every rank, before any collective ...
        if getattr(exc, "ends_job", False):  # ... but this one, found by this rank alone: the whole job ends
            end_job("mlip-train", exc, 2)
        else:
            report_error("mlip-train", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
