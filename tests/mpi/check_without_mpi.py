"""The self-check (python -m mlip_parallel.check) with mpi4py made unimportable: under torchrun the torch
backend needs no MPI at all."""
import runpy
import sys

sys.modules["mpi4py"] = None  # any `import mpi4py` now raises ImportError
sys.argv = ["mlip_parallel.check", *sys.argv[1:]]
runpy.run_module("mlip_parallel.check", run_name="__main__")
