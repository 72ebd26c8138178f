"""Several scripts of tests/mpi in one launch (run under mpiexec -n P): each rank imports torch and the package once
for all of them, not once per script (about 2.4 CPU seconds per rank and script).

    several.py NAME SCRIPT [ARG ...] [-- NAME SCRIPT [ARG ...]] ...     SCRIPT: a file of tests/mpi, or -m MODULE

Each section runs as ``python SCRIPT ARG ...`` would (as ``__main__``, with its own sys.argv), in order; its exit status
is kept and the next one runs. Rank 0 prints "several: begin NAME" before a section and
"several: end NAME status S in T s" after it (T: its wall seconds), once every rank has finished it, so that each
section's lines of rank 0, stderr's among them (it goes to stdout), fall between its markers (tests/conftest.py's
``sections`` splits an output). An exception other than SystemExit is not caught: mlip_parallel's hook ends every rank
with it, and the sections after it do not run. After each section torch's default dtype, the warning filters and the
working directory are put back, and the planted faults' tally (tests/faults.py) starts at zero; a script that changes
other state of the process (tests/mpi/chunked.py: small chunks; tests/mpi/mistakes.py: an address-space limit) goes last
or shares the launch with its kind alone. Exits 1 if any section did."""
import os
import runpy
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv) -> list:
    """[(name, script or ("-m", module), args)] of the command line."""
    runs, current = [], []
    for arg in argv + ["--"]:
        if arg != "--":
            current.append(arg)
            continue
        if len(current) < 2 or current[1] == "-m" and len(current) < 3:
            raise SystemExit(f"several.py NAME SCRIPT [ARG ...] [-- NAME SCRIPT ...]: got {argv}")
        name, rest = current[0], current[1:]
        runs.append((name, tuple(rest[:2]) if rest[0] == "-m" else os.path.join(HERE, rest[0]),
                     rest[2:] if rest[0] == "-m" else rest[1:]))
        current = []
    return runs


def run(target, args) -> int:
    """One section: ``target`` (a script path, or ("-m", module)) as __main__ with ``args``; its exit status."""
    import torch

    dtype, argv, cwd = torch.get_default_dtype(), sys.argv, os.getcwd()
    if "faults" in sys.modules:  # (each script counts its own planted faults)
        sys.modules["faults"].tally(reset=True)
    try:
        with warnings.catch_warnings():
            if isinstance(target, tuple):
                sys.argv = [target[1], *args]
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, *args]
                runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr, flush=True)
            return 1
        return code or 0
    finally:
        torch.set_default_dtype(dtype)
        sys.argv = argv
        os.chdir(cwd)


def main(argv) -> int:
    from mpi4py import MPI

    world, failed = MPI.COMM_WORLD, 0
    os.dup2(1, 2)  # one stream, both line-buffered: a section's lines on stderr (progress, errors) in it, in order
    sys.stdout.reconfigure(line_buffering=True)
    for name, target, args in parse(argv):
        if world.rank == 0:
            print(f"several: begin {name}", flush=True)
        start = time.perf_counter()
        status = run(target, args)
        sys.stdout.flush()
        sys.stderr.flush()
        status = world.allreduce(status, op=MPI.MAX)  # (every rank done with it: its lines are out)
        if world.rank == 0:
            print(f"several: end {name} status {status} in {time.perf_counter() - start:.1f} s", flush=True)
        failed |= status != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
