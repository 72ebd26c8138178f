"""The one comparison every test and MPI script makes between a result and its reference.

A NaN, an infinite value, a missing key, a shorter list, a different shape or nothing to compare at all is a
failure, never a pass: Python's ``max`` skips a NaN that is not first and ``nan > tol`` is False, so the checks
written with them passed on NaN; ``zip`` cut the longer of two lists short. Here every value is checked finite on
both sides before any difference is taken, and a failure names the worst entry (``forces[17, 2]``).

Inputs, nested freely: dicts (the same keys on both sides), lists and tuples (the same length; a list of plain
numbers is one array, any other list is compared entry by entry), numpy arrays, torch tensors and numbers. Scales:

* ``"max"`` (default): |result − reference| / max |reference| per key (per top-level array): a force error relative
  to the largest force, as a summation-order comparison wants;
* ``"each"``: |result_i − reference_i| / |reference_i| per entry;
* ``"absolute"``: |result − reference|.

``compare`` never raises on the data (an MPI script collects its failures); ``assert_close`` and ``assert_beyond``
raise AssertionError with the named entry.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

SCALES = ("max", "each", "absolute")


class Comparison(NamedTuple):
    """``error``: the worst entry's error in ``scale`` (nan where the inputs could not be compared); ``where``: that
    entry, or what made the inputs incomparable; ``within``: the tolerance compared against (None: none given)."""

    error: float
    where: str
    within: float | None
    problem: str | None  # None: comparable (every value finite, shapes and keys alike)

    @property
    def ok(self) -> bool:
        """Comparable and the worst error ≤ the tolerance."""
        return self.problem is None and (self.within is None or self.error <= self.within)

    def beyond(self, bound: float) -> bool:
        """Comparable and the worst error > ``bound`` (a fault must move a result this far)."""
        return self.problem is None and self.error > bound

    def message(self, label: str = "") -> str:
        """One line: the label, then the problem or the worst entry against the tolerance."""
        head = f"{label}: " if label else ""
        if self.problem is not None:
            return f"{head}{self.problem}"
        return f"{head}{self.where}: error {self.error:.3e}" + ("" if self.within is None else
                                                                 f" ({'within' if self.ok else 'beyond'} {self.within:.1e})")


class _Incomparable(Exception):
    pass


def _array(value, where: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().double().numpy()
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise _Incomparable(f"{where or 'value'}: not numbers ({type(value).__name__})") from None
    return array


def _nested(value) -> bool:
    """A list or tuple compared entry by entry: one holding anything but plain numbers."""
    return isinstance(value, (list, tuple)) and not all(np.ndim(v) == 0 and not isinstance(v, (dict, str))
                                                         for v in value)


def _leaves(value, where: str):
    """(path, value) for each comparable leaf of ``value``: dicts by key, nested lists by index."""
    if isinstance(value, dict):
        for key in value:
            yield from _leaves(value[key], f"{where}.{key}" if where else str(key))
    elif _nested(value):
        for k, v in enumerate(value):
            yield from _leaves(v, f"{where}[{k}]")
    else:
        yield where, value


def _structure_problem(result, reference, where: str = "") -> str | None:
    if isinstance(reference, dict) or isinstance(result, dict):
        if not (isinstance(reference, dict) and isinstance(result, dict)):
            return f"{where or 'value'}: a dict compared with a {type(result if isinstance(reference, dict) else reference).__name__}"
        if set(result) != set(reference):
            return (f"{where or 'keys'}: keys differ: {sorted(map(str, result))} vs reference "
                    f"{sorted(map(str, reference))}")
        for key in reference:
            problem = _structure_problem(result[key], reference[key], f"{where}.{key}" if where else str(key))
            if problem:
                return problem
        return None
    if _nested(result) or _nested(reference):
        if not all(isinstance(v, (list, tuple)) for v in (result, reference)) or len(result) != len(reference):
            return (f"{where or 'value'}: lengths differ: {len(result) if hasattr(result, '__len__') else 'scalar'} vs "
                    f"reference {len(reference) if hasattr(reference, '__len__') else 'scalar'}")
        for k, (a, b) in enumerate(zip(result, reference)):
            problem = _structure_problem(a, b, f"{where}[{k}]")
            if problem:
                return problem
    return None


def compare(result, reference, tolerance: float | None = None, scale: str = "max") -> Comparison:
    """``result`` against ``reference`` (see the module docstring); ``tolerance`` the largest error allowed (None:
    only the error is wanted). Never raises on the data: a problem is in the returned ``problem``."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, not {scale!r}")
    nan = float("nan")
    problem = _structure_problem(result, reference)
    if problem:
        return Comparison(nan, "", tolerance, problem)
    worst, where, entries = -1.0, "", 0
    got = dict(_leaves(result, ""))
    try:
        for path, ref in _leaves(reference, ""):
            expected, actual = _array(ref, path), _array(got[path], path)
            if expected.shape != actual.shape:
                raise _Incomparable(f"{path or 'value'}: shape {actual.shape} vs reference {expected.shape}")
            for name, array in (("result", actual), ("reference", expected)):
                bad = ~np.isfinite(array)
                if bad.any():
                    index = np.unravel_index(int(np.argmax(bad)), array.shape) if array.ndim else ()
                    raise _Incomparable(f"{_entry(path, index)}: {name} not finite ({array[index]})")
            if expected.size == 0:
                continue
            difference = np.abs(actual - expected)
            if scale == "max":
                difference = difference / max(float(np.abs(expected).max()), 1e-300)
            elif scale == "each":
                difference = difference / np.maximum(np.abs(expected), 1e-300)
            entries += expected.size
            flat = int(np.argmax(difference))
            if float(difference.flat[flat]) > worst:
                index = np.unravel_index(flat, expected.shape) if expected.ndim else ()
                worst = float(difference.flat[flat])
                where = f"{_entry(path, index)} = {float(actual[index]):.12g} vs reference {float(expected[index]):.12g}"
    except _Incomparable as exc:
        return Comparison(nan, "", tolerance, str(exc))
    if entries == 0:
        return Comparison(nan, "", tolerance, "nothing to compare (empty)")
    return Comparison(worst, where, tolerance, None)


def _entry(path: str, index) -> str:
    return f"{path or 'value'}" + (f"[{', '.join(str(int(i)) for i in index)}]" if len(index) else "")


def assert_close(result, reference, tolerance: float, scale: str = "max", label: str = "") -> float:
    """``compare``, raising AssertionError (the label, the worst entry or the problem) unless within ``tolerance``;
    returns the worst error."""
    comparison = compare(result, reference, tolerance, scale)
    assert comparison.ok, comparison.message(label)
    return comparison.error


def assert_beyond(result, reference, bound: float, scale: str = "max", label: str = "") -> float:
    """``compare``, raising AssertionError unless the inputs are comparable and the worst error exceeds ``bound``
    (a planted fault, or a changed setting, must move the result this far); returns the worst error."""
    comparison = compare(result, reference, None, scale)
    assert comparison.beyond(bound), f"{comparison.message(label)}: expected beyond {bound:.1e}"
    return comparison.error
