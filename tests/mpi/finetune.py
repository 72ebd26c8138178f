"""mlip-train runs in one launch (each ``train(config)`` in this process, under mpiexec -n P or torchrun):
the YAML configs listed in the JSON file given as the first argument, in order — other packages' models
fine-tuned data parallel and graph parallel. Prints "finetune runs done N"; the pytest side
(tests/test_finetune.py) writes the configs and compares the trained weights with one process's."""
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402

from mlip_parallel.config import read_config  # noqa: E402
from mlip_parallel.train.cli import RULES, SCHEMA, train, validate  # noqa: E402

torch.set_num_threads(1)
with open(sys.argv[1]) as f:
    configs = json.load(f)
rank0 = int(os.environ.get("RANK", os.environ.get("PMI_RANK", 0))) == 0
for path in configs:
    start = time.perf_counter()
    train(validate(read_config(path), SCHEMA, RULES))
    if rank0:  # (where a launch spends its time)
        print(f"finetune run {os.path.basename(path)} {time.perf_counter() - start:.1f} s", flush=True)
if rank0:
    print(f"finetune runs done {len(configs)}", flush=True)
