"""Many structures over the ranks of a communicator (``predict_many``): each rank evaluates a share, several
structures per graph (``potentials.predict_many``), and every rank gets every result. One structure spread over
the ranks is ``evaluate.py``; a batch job with a shared queue, relaxations, MD and resume is ``md/batch_job.py``
(mlip-batch)."""
from __future__ import annotations

import zlib

import numpy as np

import potentials.batch

from .backend import get_backend
from .errors import MLIPError, RanksDisagreeError


def shares(sizes, ranks: int) -> list:
    """The structures (indices into ``sizes``, atoms each) of each of ``ranks`` ranks: the largest first, each to the
    rank with the fewest atoms so far (ties: the lowest rank); each share in input order."""
    load, owned = np.zeros(ranks), [[] for _ in range(ranks)]
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        rank = int(np.argmin(load))
        owned[rank].append(k)
        load[rank] += sizes[k]
    return [sorted(share) for share in owned]


def structures_digest(structures) -> np.ndarray:
    """[3] float64: the number of structures and CRC-32s of their atom counts and of their positions (equal where the
    ranks were given the same list)."""
    positions = b"".join(np.ascontiguousarray(a.positions, dtype=np.float64).tobytes() for a in structures)
    counts = np.array([len(a) for a in structures], dtype=np.int64).tobytes()
    return np.array([len(structures), zlib.crc32(counts), zlib.crc32(positions)], dtype=np.float64)


def predict_many(model, structures, comm=None, **options) -> list:
    """``potentials.predict_many`` of ``structures`` (the same list on every rank of ``comm``: checked, a
    RanksDisagreeError otherwise) with the work shared by the ranks by atom count (``shares``); every rank returns
    every structure's result, in order (collective). ``options``: those of ``potentials.predict_many`` but
    ``names``. A structure that cannot be evaluated raises the same error (a BatchError naming its index) on every
    rank."""
    backend = get_backend(comm)
    structures = list(structures)
    if "names" in options:
        raise TypeError("mlip_parallel.predict_many names each structure by its index in the list; names= is not an "
                        "option here")
    if backend.size == 1:
        return potentials.batch.predict_many(model, structures, **options)
    digest = structures_digest(structures)
    extremes = backend.allreduce(np.concatenate([digest, -digest]), op="max")
    if np.any(extremes[:3] != -extremes[3:]):
        raise RanksDisagreeError(f"the {backend.size} ranks of this communicator were given different lists of "
                                 f"structures: predict_many shares one list among the ranks that call it together")
    mine = shares([len(a) for a in structures], backend.size)[backend.rank]
    results, error = [], None
    try:
        if mine:
            results = potentials.batch.predict_many(model, [structures[k] for k in mine], names=mine, **options)
    except MLIPError as exc:  # (one rank's bad structure: raised on every rank, after the collective below)
        error = (type(exc), str(exc))
    gathered = backend.allgather((mine, results, error))
    errors = [e for _, _, e in gathered if e is not None]
    if errors:
        raise errors[0][0](errors[0][1])
    ordered = [None] * len(structures)
    for indices, values, _ in gathered:
        for k, value in zip(indices, values):
            ordered[k] = value
    return ordered
