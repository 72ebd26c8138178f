"""The only code that talks between ranks: three backends with one interface (docs/architecture.md §2).

* ``MPIBackend``: mpi4py; CUDA tensors are staged through the host unless the MPI library is CUDA-aware
  (``MLIP_CUDA_AWARE_MPI=1``).
* ``TorchBackend``: torch.distributed; NCCL moves CUDA tensors device to device (when each rank of a node
  has a GPU of its own), gloo moves CPU data and host-staged CUDA tensors.
* ``SerialBackend``: one process.

Each moves numpy arrays or torch tensors and counts the seconds spent communicating in
``comm_seconds``. The MPI and torch backends also carry training's messages (``allreduce_``, ``subgroup``,
``send`` / ``recv``, ``isend`` / ``irecv``, ``send_object`` / ``recv_object``: a pipeline's stages and replicas)
and a shared ``counter()`` (an atomic fetch-and-add on a TCP store: a batch job's queue of structures). ``get_backend`` chooses
one; ``init_process_group`` is the one torch.distributed set-up, shared with training; ``rank_device`` is each
rank's device.
"""
from __future__ import annotations

import atexit
import os
import socket
import time

import numpy as np
import torch

from .errors import BackendError
from .launch import install_abort_on_error, launched_by_mpiexec, launched_by_torchrun  # noqa: F401 (re-exported)
from .launch import usable_cpus


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

    def allreduce_(self, tensor, group=None):
        return tensor

    def counter(self) -> "LocalCounter":
        return LocalCounter()

    def subgroup(self, ranks):
        return None

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

    # What training adds (as TorchBackend's): tensors travel as their host copies unless the MPI is CUDA-aware.
    def _buffer(self, tensor: torch.Tensor):
        """What MPI reads or writes for ``tensor``: the tensor itself where MPI takes it (CPU, or CUDA with a
        CUDA-aware MPI), else its host copy."""
        if tensor.device.type == "cpu" or self.cuda_aware:
            return tensor.detach().contiguous()
        return tensor.detach().cpu()

    def allreduce_(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (of ``group``, a ``subgroup``), in place; returns it."""
        t0 = time.perf_counter()
        buf = self._buffer(tensor)
        (group or self.comm).Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        if buf.data_ptr() != tensor.data_ptr():
            tensor.copy_(buf)
        self.comm_seconds += time.perf_counter() - t0
        return tensor

    def subgroup(self, ranks):
        """A communicator of ``ranks`` (collective: every rank makes every group, in the same order; a rank outside
        it gets none)."""
        group = self.comm.Create(self.comm.Get_group().Incl(list(ranks)))
        return None if group == self.MPI.COMM_NULL else group

    def send(self, tensor: torch.Tensor, dest: int) -> None:
        self.comm.Send(self._buffer(tensor), dest=dest, tag=0)

    def recv(self, tensor: torch.Tensor, source: int) -> torch.Tensor:
        buf = self._buffer(tensor)
        self.comm.Recv(buf, source=source, tag=0)
        if buf.data_ptr() != tensor.data_ptr():
            tensor.copy_(buf)
        return tensor

    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0):
        buf = self._buffer(tensor)
        return _Request(self.comm.Isend(buf, dest=dest, tag=tag), buf)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0):
        buf = self._buffer(tensor)
        return _Request(self.comm.Irecv(buf, source=source, tag=tag), buf, tensor)

    def counter(self) -> "_StoreCounter":
        """A shared counter (collective: every rank creates it alike): an atomic add on a TCP store that rank 0
        serves from a thread of its own (torch.distributed's TCPStore, without a process group), so that a rank
        takes from it at once, busy as rank 0 may be (an MPI one-sided window would wait for rank 0's next MPI call
        under MPICH: up to one evaluation per take)."""
        from torch.distributed import TCPStore

        hosts = self.allgather(socket.gethostname())
        store, address = None, None
        if self.rank == 0:
            host = "127.0.0.1" if len(set(hosts)) == 1 else rendezvous(hosts)[0]
            store = TCPStore(host, 0, None, True, wait_for_workers=False)
            address = (host, store.port)
        host, port = self.bcast(address)
        if store is None:
            store = TCPStore(host, port, None, False)
        self.barrier()
        return _StoreCounter(store, "count")

    def send_object(self, obj, dest: int) -> None:
        self.comm.send(obj, dest=dest, tag=0)

    def recv_object(self, source: int):
        return self.comm.recv(source=source, tag=0)

    @property
    def library(self) -> str:
        return " ".join(self.MPI.Get_library_version().splitlines()[0].split())


class LocalCounter:
    """A counter of one process: ``add(k)`` returns its value before adding ``k``; ``free()`` (collective) ends it.
    What ``counter()`` of every backend returns, shared there by the ranks."""

    def __init__(self):
        self.value = 0

    def add(self, k: int) -> int:
        self.value += k
        return self.value - k

    def free(self) -> None:
        pass


class _StoreCounter:
    """A shared counter on a torch.distributed store (the rendezvous store under torchrun, or one of its own under
    MPI): an atomic ``add`` under a key of its own."""

    def __init__(self, store, key: str):
        self.store, self.key = store, key

    def add(self, k: int) -> int:
        return int(self.store.add(self.key, k)) - k

    def free(self) -> None:
        self.store = None


class _Request:
    """An MPI request with torch's ``wait()``: keeps its buffer alive until then, and a received host copy goes
    into ``into`` (the tensor it was posted for) when it arrives."""

    def __init__(self, request, buffer, into=None):
        self.request, self.buffer, self.into = request, buffer, into

    def wait(self) -> None:
        self.request.Wait()
        if self.into is not None and self.buffer.data_ptr() != self.into.data_ptr():
            self.into.copy_(self.buffer)


class TorchBackend:
    """torch.distributed on the process group that ``init_process_group`` set up: NCCL moves CUDA
    tensors device to device, gloo moves CPU tensors and numpy arrays. Swaps are ``batch_isend_irecv``."""

    def __init__(self):
        import torch.distributed as dist

        init_process_group()
        self.dist, self.comm_seconds = dist, 0.0
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank, self.local_size = _local_rank_and_size(self)
        self.cuda_aware = nccl_in_use()  # NCCL: device-direct

    def sendrecv(self, send, dest, source, recv_rows=None):
        """As ``MPIBackend.sendrecv``: rows of ``send`` to ``dest``, the rows from ``source`` returned
        (numpy in, numpy out; a tensor comes back on its own device)."""
        is_tensor = isinstance(send, torch.Tensor)
        if dest is not None and dest == source == self.rank:
            return send.clone() if is_tensor else np.array(send, copy=True)
        t0 = time.perf_counter()
        data = send.detach().contiguous() if is_tensor else torch.from_numpy(np.ascontiguousarray(send))
        if data.device.type == "cuda" and not self.cuda_aware:
            data = data.cpu()
        dtype = data.dtype
        if dtype == torch.bool:
            data = data.view(torch.uint8)
        if recv_rows is None:  # the row count first
            count = torch.zeros(1, dtype=torch.int64, device=data.device)
            self._swap(torch.tensor([len(data)], dtype=torch.int64, device=data.device), dest, count, source)
            recv_rows = int(count[0]) if source is not None else 0
        recv = torch.empty((recv_rows,) + tuple(data.shape[1:]), dtype=data.dtype, device=data.device)
        self._swap(data, dest if len(data) else None, recv, source if recv_rows else None)
        if dtype == torch.bool:
            recv = recv.view(torch.bool)
        self.comm_seconds += time.perf_counter() - t0
        if not is_tensor:
            return recv.numpy()
        return recv.to(send.device)

    def _swap(self, send, dest, recv, source):
        """Post the send and the receive together and wait for both; None: no message that way. Zero-row
        messages are skipped on both ends (each end knows the count)."""
        ops = []
        if dest is not None:
            ops.append(self.dist.P2POp(self.dist.isend, send, dest))
        if source is not None:
            ops.append(self.dist.P2POp(self.dist.irecv, recv, source))
        if ops:
            for request in self.dist.batch_isend_irecv(ops):
                request.wait()

    def allreduce(self, value, op="sum"):
        t0 = time.perf_counter()
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        array = np.ndim(value) > 0
        integer = not array and isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        t = torch.tensor(np.asarray(value, dtype=np.int64 if integer else np.float64))
        self.dist.all_reduce(t, op=ops[op])
        out = t.numpy() if array else (int(t) if integer else type(value)(t.item()))
        self.comm_seconds += time.perf_counter() - t0
        return out

    def allgather(self, obj):
        t0 = time.perf_counter()
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        self.comm_seconds += time.perf_counter() - t0
        return out

    def bcast(self, obj, root=0):
        holder = [obj]
        self.dist.broadcast_object_list(holder, src=root)
        return holder[0]

    def barrier(self):
        self.dist.barrier()

    # What training adds to the halo's verbs: tensors summed where they are (gradients on their device), groups of
    # ranks (a pipeline stage's replicas), messages between two ranks (a pipeline's stages), objects to one rank.
    def allreduce_(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (of ``group``, a ``subgroup``), in place on its device; returns it."""
        t0 = time.perf_counter()
        self.dist.all_reduce(tensor, group=group)
        self.comm_seconds += time.perf_counter() - t0
        return tensor

    def subgroup(self, ranks):
        """A group of ``ranks`` (collective: every rank makes every group, in the same order)."""
        return self.dist.new_group(list(ranks))

    def send(self, tensor: torch.Tensor, dest: int) -> None:
        """``tensor`` to rank ``dest`` (blocking)."""
        self.dist.send(tensor, dest)

    def recv(self, tensor: torch.Tensor, source: int) -> torch.Tensor:
        """Rank ``source``'s message into ``tensor`` (blocking); returns it."""
        self.dist.recv(tensor, source)
        return tensor

    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0):
        """Start sending ``tensor`` to ``dest``; the request's ``wait()`` completes it."""
        return self.dist.isend(tensor, dest, tag=tag)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0):
        """Start receiving ``source``'s message of ``tag`` into ``tensor``; the request's ``wait()`` completes it."""
        return self.dist.irecv(tensor, source, tag=tag)

    def counter(self) -> _StoreCounter:
        """A shared counter (collective: every rank creates it alike) on the rendezvous store."""
        self._counters = getattr(self, "_counters", 0) + 1
        self.barrier()  # (every rank has its key before any adds to it)
        return _StoreCounter(self.dist.distributed_c10d._get_default_store(), f"mlip_parallel/counter/{self._counters}")

    def send_object(self, obj, dest: int) -> None:
        """A picklable ``obj`` to rank ``dest``."""
        self.dist.send_object_list([obj], dst=dest)

    def recv_object(self, source: int):
        """The object rank ``source`` sent (``send_object``)."""
        holder = [None]
        self.dist.recv_object_list(holder, src=source)
        return holder[0]

    @property
    def library(self) -> str:
        return f"torch.distributed {self.dist.get_backend()} (torch {torch.__version__})"


def _local_rank_and_size(backend) -> tuple:
    """(rank on this node, ranks on this node): torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else counted
    from every rank's host name."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    hosts = backend.allgather(socket.gethostname())
    mine = [r for r, h in enumerate(hosts) if h == hosts[backend.rank]]
    return mine.index(backend.rank), len(mine)


def nccl_usable(ranks_on_node: int) -> bool:
    """Whether NCCL can carry this node's CUDA tensors: CUDA and NCCL exist and each of the node's
    ``ranks_on_node`` ranks has a GPU of its own (NCCL refuses two ranks on one GPU)."""
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.is_nccl_available() and ranks_on_node <= torch.cuda.device_count()


_group_kind_in_use = None  # the backend string init_process_group chose


def nccl_in_use() -> bool:
    """Whether the process group moves CUDA tensors device to device (NCCL); else they go through the
    host (gloo)."""
    import torch.distributed as dist

    return dist.is_initialized() and "nccl" in (_group_kind_in_use or str(dist.get_backend()))


def init_process_group() -> None:
    """Set up torch.distributed once per process — the one set-up that the torch halo backend and
    data/pipeline-parallel training share. Under torchrun from its environment (``env://``); under
    mpiexec rank 0 picks an address and a free port that MPI tells every rank. Backend
    ``cpu:gloo,cuda:nccl`` where NCCL can carry the CUDA tensors (``nccl_usable``), gloo otherwise
    (ranks sharing a GPU, or no CUDA: CUDA tensors are then staged through the host); each rank's CUDA
    device is ``rank_device``."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    atexit.register(_destroy_process_group)  # else gloo's threads may outlive the interpreter (SIGABRT)
    if launched_by_torchrun():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        dist.init_process_group(_group_kind(ranks_on_node), init_method="env://")
        install_abort_on_error()
        return
    mpi = get_backend("mpi")  # the serial backend in a job of one process
    hosts = mpi.allgather(socket.gethostname())
    address = None
    if mpi.rank == 0:
        try:
            address = rendezvous(hosts)
        except BackendError as exc:
            address = str(exc)
    address = mpi.bcast(address)
    if isinstance(address, str):  # raised on every rank alike
        raise BackendError(address)
    host, port = address
    if torch.cuda.is_available():
        torch.cuda.set_device(rank_device(mpi))
    kind = _group_kind(max(hosts.count(h) for h in hosts))
    dist.init_process_group(kind, init_method=f"tcp://{host}:{port}", rank=mpi.rank, world_size=mpi.size)


def _group_kind(ranks_on_node: int) -> str:
    """torch.distributed's backend string for nodes of ``ranks_on_node`` ranks (the largest node's count,
    the same on every rank), remembered for ``nccl_in_use``."""
    global _group_kind_in_use
    _group_kind_in_use = "cpu:gloo,cuda:nccl" if nccl_usable(ranks_on_node) else "gloo"
    return _group_kind_in_use


def _destroy_process_group(wait_seconds: float = 10.0) -> None:
    """At exit: wait until every rank has got here (through the rendezvous store, not a collective, and
    at most ``wait_seconds``: a rank that exits alone is not held), then tear the process group down.
    A rank that tears its connections down while a peer still uses them can make gloo abort (SIGABRT)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("mlip_parallel/exit", 1)
        deadline = time.monotonic() + wait_seconds
        while store.add("mlip_parallel/exit", 0) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 (the store is gone: its host rank has exited already)
        pass
    dist.destroy_process_group()


def rendezvous(hosts) -> tuple:
    """(address, free port) of rank 0 that every rank can reach, given every rank's host name: loopback
    when all ranks share rank 0's host; else ``MASTER_ADDR`` if set, or the first non-loopback address of
    rank 0's host name (``gethostbyname`` may answer 127.0.1.1, which other nodes cannot reach)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    if len(set(hosts)) == 1:
        return "127.0.0.1", port
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], port
    addresses = {info[4][0] for info in socket.getaddrinfo(hosts[0], None, socket.AF_INET)}
    routable = sorted(a for a in addresses if not a.startswith("127."))
    if not routable:
        raise BackendError(f"rank 0's host {hosts[0]!r} resolves only to loopback addresses {sorted(addresses)}, "
                           "which the other nodes cannot reach: set MASTER_ADDR to an address of rank 0's node")
    return routable[0], port


KINDS = ("mpi", "torch", "serial")
_BACKENDS: dict = {}


def backend_kind() -> str:
    """The halo backend this process uses when none is given: ``MLIP_PARALLEL_BACKEND`` (mpi, torch or
    serial) if set; else torch under torchrun, mpi under an MPI launcher with more than one rank,
    serial otherwise."""
    kind = os.environ.get("MLIP_PARALLEL_BACKEND", "").strip().lower()
    if kind:
        if kind not in KINDS:
            raise BackendError(f"MLIP_PARALLEL_BACKEND={kind!r}: expected one of {', '.join(KINDS)}")
        return kind
    if launched_by_torchrun():
        return "torch"
    return "mpi" if launched_by_mpiexec() else "serial"


def get_backend(comm=None):
    """The backend for ``comm``: a backend object is returned as is; "mpi", "torch" or "serial" names
    one; an mpi4py communicator gets an MPIBackend on it; None means ``backend_kind()``. Backends are
    cached, and a job of one process gets the serial backend whatever was asked."""
    if isinstance(comm, (SerialBackend, MPIBackend, TorchBackend)):
        return comm
    if comm is None or isinstance(comm, str):
        kind = backend_kind() if comm is None else comm.strip().lower()
        if kind not in KINDS:
            raise BackendError(f"unknown backend {comm!r}: expected one of {', '.join(KINDS)}")
        if kind == "serial" or _world_size() == 1:
            return _BACKENDS.setdefault("serial", SerialBackend())
        if kind == "torch":
            if "torch" not in _BACKENDS:
                _BACKENDS["torch"] = TorchBackend()
            return _BACKENDS["torch"]
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    key = ("mpi", comm.py2f())
    if key not in _BACKENDS:
        _BACKENDS[key] = MPIBackend(comm)
    return _BACKENDS[key]


def _world_size() -> int:
    """How many processes the launcher started (without setting up any communication)."""
    if launched_by_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if not launched_by_mpiexec():
        return 1
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


def set_threads(backend) -> int:
    """torch's intra-op threads = this node's cores ÷ its ranks (at least 1), unless the user chose them
    (OMP_NUM_THREADS set), and each rank's threads on cores of their own (``bind_to_cores``). Collective
    over ``backend``'s ranks; returns the number of threads in force."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cpus() // max(1, getattr(backend, "local_size", 1))))
    bind_to_cores(backend, torch.get_num_threads())
    return torch.get_num_threads()


def bind_to_cores(backend, threads: int) -> list | None:
    """Pin each rank of a job that fills its node's CPUs to CPUs of its own: where the launcher left every
    rank of the node on the same CPU set (no binding of its own) and the node's ranks × ``threads`` is
    exactly that set's size, local rank r takes the r-th ``threads`` of its CPUs, for all its threads.
    Unpinned, the kernel moves the ranks between CPUs and each arrives at cold caches (a 2-stage pipeline
    on 2 cores takes 2–3 % longer per step). A job that leaves CPUs free, or oversubscribes them, or was
    bound by its launcher (``mpiexec -bind-to``, ``srun --cpu-bind``), is left as it is, as is every rank
    under ``MLIP_PARALLEL_BIND_CORES=0``. Collective over ``backend``'s ranks; returns the CPUs this rank
    was pinned to, or None."""
    if getattr(backend, "size", 1) == 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus, host = sorted(os.sched_getaffinity(0)), socket.gethostname()
    node = [c for h, c in backend.allgather((host, cpus)) if h == host]  # every rank takes part, opted out or not
    if os.environ.get("MLIP_PARALLEL_BIND_CORES", "1").strip() == "0" or len(node) * threads != len(cpus) \
            or any(c != cpus for c in node):
        return None
    mine = cpus[backend.local_rank * threads:(backend.local_rank + 1) * threads]
    for task in os.listdir("/proc/self/task"):  # every thread of the process (sched_setaffinity(0) pins one)
        try:
            os.sched_setaffinity(int(task), mine)
        except OSError:  # a thread that has ended meanwhile
            pass
    return mine


def rank_device(backend) -> torch.device:
    """``cuda:<local rank mod #GPUs>`` where CUDA exists, CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{backend.local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")
