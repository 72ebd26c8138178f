"""The only code that talks to MPI: a serial backend and an mpi4py backend with one interface.

Both move numpy arrays or torch tensors (host-staged: CUDA tensors are copied to the host unless the
MPI library is CUDA-aware) and count the seconds spent communicating in ``comm_seconds``.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from .launch import install_abort_on_error, launched_by_mpiexec  # noqa: F401 (re-exported)


class SerialBackend:
    """One process, no MPI. A message to oneself is a copy."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    cuda_aware = False

    def __init__(self):
        self.comm_seconds = 0.0

    def sendrecv(self, send, dest, source, recv_rows=None):
        if dest is None or source is None:
            return send[:0]
        return send.clone() if isinstance(send, torch.Tensor) else np.array(send, copy=True)

    def allreduce(self, value, op="sum"):
        return np.array(value, dtype=np.float64, copy=True) if np.ndim(value) else type(value)(value)

    def allgather(self, obj):
        return [obj]

    def bcast(self, obj, root=0):
        return obj

    def barrier(self):
        pass

    def abort(self, code=1):
        raise SystemExit(code)

    @property
    def library(self) -> str:
        return "none (serial backend)"


class MPIBackend:
    """mpi4py on a duplicate of the caller's communicator, so our messages never match theirs."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()  # ranks on this node
        node.Free()
        self.cuda_aware = os.environ.get("MLIP_CUDA_AWARE_MPI", "0") == "1"
        self.comm_seconds = 0.0
        if self.size > 1:
            install_abort_on_error()

    def sendrecv(self, send, dest, source, recv_rows=None):
        """Send ``send`` (rows of an array) to ``dest`` and return the rows received from ``source``.

        ``dest``/``source`` None means no peer (PROC_NULL). When ``recv_rows`` is None the row count
        travels first; otherwise the caller knows it from the plan. Trailing shape and dtype are the
        sender's and must match on both sides.
        """
        if dest is not None and dest == source == self.rank:  # a periodic self-image: no message
            return send.clone() if isinstance(send, torch.Tensor) else np.array(send, copy=True)
        t0 = time.perf_counter()
        MPI = self.MPI
        dest = MPI.PROC_NULL if dest is None else dest
        source = MPI.PROC_NULL if source is None else source
        is_tensor = isinstance(send, torch.Tensor)
        device = send.device if is_tensor else None
        direct = is_tensor and device.type == "cuda" and self.cuda_aware
        if is_tensor and not direct:
            buf = send.detach().contiguous().cpu().numpy()
        elif direct:
            buf = send.detach().contiguous()
        else:
            buf = np.ascontiguousarray(send)
        if recv_rows is None:
            n_in = np.zeros(1, dtype=np.int64)
            self.comm.Sendrecv(np.array([len(buf)], dtype=np.int64), dest=dest, sendtag=1,
                               recvbuf=n_in, source=source, recvtag=1)
            recv_rows = int(n_in[0]) if source != MPI.PROC_NULL else 0
        shape = (recv_rows,) + tuple(buf.shape[1:])
        if direct:
            recv = torch.empty(shape, dtype=send.dtype, device=device)
        else:
            recv = np.empty(shape, dtype=buf.dtype)
        self.comm.Sendrecv(buf, dest=dest, sendtag=2, recvbuf=recv, source=source, recvtag=2)
        self.comm_seconds += time.perf_counter() - t0
        if is_tensor and not direct:
            return torch.from_numpy(recv).to(device)
        return recv

    def allreduce(self, value, op="sum"):
        t0 = time.perf_counter()
        ops = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}
        if np.ndim(value):
            arr = np.ascontiguousarray(value, dtype=np.float64)
            out = np.empty_like(arr)
            self.comm.Allreduce(arr, out, op=ops[op])
        else:
            out = self.comm.allreduce(value, op=ops[op])
        self.comm_seconds += time.perf_counter() - t0
        return out

    def allgather(self, obj):
        t0 = time.perf_counter()
        out = self.comm.allgather(obj)
        self.comm_seconds += time.perf_counter() - t0
        return out

    def bcast(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def barrier(self):
        self.comm.Barrier()

    def abort(self, code=1):
        self.MPI.COMM_WORLD.Abort(code)

    @property
    def library(self) -> str:
        return " ".join(self.MPI.Get_library_version().splitlines()[0].split())


_BACKENDS: dict = {}


def get_backend(comm=None):
    """The backend for ``comm``: a backend object is returned as is; an mpi4py communicator gets an
    MPIBackend (cached per communicator); None means MPI.COMM_WORLD under mpiexec with more than one
    rank, serial otherwise."""
    if isinstance(comm, (SerialBackend, MPIBackend)):
        return comm
    if comm is None:
        if not launched_by_mpiexec():
            return _BACKENDS.setdefault("serial", SerialBackend())
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_size() == 1:
            return _BACKENDS.setdefault("serial", SerialBackend())
        comm = MPI.COMM_WORLD
    key = ("mpi", comm.py2f())
    if key not in _BACKENDS:
        _BACKENDS[key] = MPIBackend(comm)
    return _BACKENDS[key]


def set_threads(backend) -> int:
    """torch's intra-op threads = this node's cores ÷ its ranks (at least 1), unless the user chose them
    (OMP_NUM_THREADS set); returns the number in force."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, getattr(backend, "local_size", 1))))
    return torch.get_num_threads()


def rank_device(backend) -> torch.device:
    """``cuda:<local rank mod #GPUs>`` where CUDA exists, CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{backend.local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")
