"""Choosing the communication backend and the torch.distributed rendezvous (no processes started)."""
import socket

import pytest

from mlip_parallel import backend as backends
from mlip_parallel.errors import BackendError

LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                      "HYDRA_CONTROL_FD", "RANK", "WORLD_SIZE", "MLIP_PARALLEL_BACKEND")


@pytest.fixture
def bare(monkeypatch):
    """An environment without any launcher's variables."""
    for key in LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_backend_kind_follows_launcher_and_variable(bare):
    assert backends.backend_kind() == "serial"
    bare.setenv("PMI_RANK", "0")
    assert backends.backend_kind() == "mpi"
    bare.setenv("MLIP_PARALLEL_BACKEND", "torch")
    assert backends.backend_kind() == "torch"
    bare.delenv("PMI_RANK")
    bare.delenv("MLIP_PARALLEL_BACKEND")
    bare.setenv("RANK", "0")
    bare.setenv("WORLD_SIZE", "2")
    assert backends.backend_kind() == "torch"  # torchrun
    bare.setenv("MLIP_PARALLEL_BACKEND", "nccl")
    with pytest.raises(BackendError, match="MLIP_PARALLEL_BACKEND='nccl': expected one of mpi, torch, serial"):
        backends.backend_kind()


def test_one_process_gets_the_serial_backend_whatever_was_asked(bare):
    assert isinstance(backends.get_backend("torch"), backends.SerialBackend)
    assert isinstance(backends.get_backend("mpi"), backends.SerialBackend)
    bare.setenv("RANK", "0")
    bare.setenv("WORLD_SIZE", "1")
    assert isinstance(backends.get_backend(), backends.SerialBackend)
    with pytest.raises(BackendError, match="unknown backend 'gloo'"):
        backends.get_backend("gloo")


def test_rendezvous_address_reachable_from_other_nodes(monkeypatch):
    """Rank 0 picks the torch.distributed rendezvous: loopback on one host; across hosts MASTER_ADDR or a
    non-loopback address of its host, never 127.0.1.1 (which gethostbyname may answer)."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert backends.rendezvous(["node1", "node1"])[0] == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert backends.rendezvous(["node1", "node2"])[0] == "10.1.2.3"
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a: [(2, 1, 6, "", ("127.0.1.1", 0)),
                                                                  (2, 1, 6, "", ("192.168.7.5", 0))])
    assert backends.rendezvous(["node1", "node2"])[0] == "192.168.7.5"
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a: [(2, 1, 6, "", ("127.0.1.1", 0))])
    with pytest.raises(BackendError, match="set MASTER_ADDR"):
        backends.rendezvous(["node1", "node2"])


def test_nccl_only_where_each_rank_has_its_own_gpu(monkeypatch):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on an H200 with NCCL 2.28):
    the process group then uses gloo, and CUDA tensors travel through the host."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(backends, "_group_kind_in_use", None)  # restored afterwards
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert backends.nccl_usable(1) and backends.nccl_usable(2) and not backends.nccl_usable(4)
    assert backends._group_kind(2) == "cpu:gloo,cuda:nccl"
    assert backends._group_kind(3) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not backends.nccl_usable(1) and backends._group_kind(1) == "gloo"


@pytest.mark.slow  # (launches jobs of every kind)
def test_gpu_check_cpu_parts_pass():
    """benchmarks/gpu_check.py --cpu (the GPU machine's one command, with the CPU as the device): every
    section runs and every correctness row passes (training: 2 data-parallel replicas of 2 pipeline stages equal one
    process); the throughput rows cover both backends. Left out here: the self-check section (its command,
    ``mlip_parallel.check`` under mpiexec and torchrun, runs in tests/test_mpi.py), SevenNet-0 and MACE among the
    models (the packages' imports; they run distributed in tests/test_mpi.py), the 2-rank training runs (the 4-rank
    run holds both kinds; tests/test_training.py runs each)."""
    import subprocess
    import sys

    from conftest import HANG_GUARD, ROOT

    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--ranks", "2", "--sizes", "4",
           "--steps", "2", "--md-steps", "10", "--train-epochs", "1", "--skip", "self-check",
           "--models", "SchNet", "PaiNN", "NequIP", "--train-ranks", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert " 0 failed" in out, out
    for text in ("SchNet on cpu", "PaiNN on cpu", "NequIP on cpu", "MD on cpu", "2 ranks, torch.distributed gloo",
                 "one process", "mlip-train on cpu", "pipeline 2 replicas x 2 stages, 4 ranks"):
        assert text in out, (text, out)
    assert "SevenNet-0 on cpu" not in out and "data-parallel, 2 ranks" not in out, out  # (the options took)
