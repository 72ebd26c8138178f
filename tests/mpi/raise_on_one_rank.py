"""Rank 1 raises while the others enter a collective evaluation: the job must abort, not hang (under
mpiexec or torchrun, with either halo backend), and print rank 1's message. ``--process-group``: first
start torch.distributed over the job (as mlip-train does), whose excepthook wraps the job's own."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import mlip_parallel  # noqa: E402
from systems import GEOMETRIES, lennard_jones  # noqa: E402

torch.set_num_threads(1)
if "--process-group" in sys.argv:
    from mlip_parallel.train.processes import Processes
    Processes("data")
atoms = GEOMETRIES["fcc_bulk"]()
mlip_parallel.evaluate(lennard_jones(), atoms)
if mlip_parallel.get_backend().rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
mlip_parallel.evaluate(lennard_jones(), atoms)  # the other ranks wait here for rank 1
mlip_parallel.evaluate(lennard_jones(), atoms)
print("not reached", flush=True)
