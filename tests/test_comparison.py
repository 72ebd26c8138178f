"""The comparison every test uses (tests/comparison.py) fails on what the checks it replaced let through: a NaN in
any position, an infinite value, a shorter list, an empty one; and it names the worst entry."""
import numpy as np
import pytest
import torch

from comparison import assert_beyond, assert_close, compare

REFERENCE = {"energy": -12.5, "forces": np.array([[0.1, -0.2, 0.3], [0.4, 0.5, -0.6]]), "stress": np.arange(6.0)}


def result_with(key, index, value):
    result = {k: np.array(v, dtype=float) for k, v in REFERENCE.items()}
    result[key][index] = value
    return result


@pytest.mark.parametrize("side", ["result", "reference"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_value_not_finite_in_any_position_fails(side, bad):
    positions = [("energy", ())] + [("forces", i) for i in np.ndindex(2, 3)] + [("stress", (i,)) for i in range(6)]
    for key, index in positions:
        planted = result_with(key, index, bad)
        pair = (planted, REFERENCE) if side == "result" else (REFERENCE, planted)
        comparison = compare(*pair, tolerance=1e-9)
        assert not comparison.ok and "not finite" in comparison.problem, (key, index, comparison)
        assert key in comparison.problem, comparison.problem
        with pytest.raises(AssertionError, match="not finite"):
            assert_close(*pair, 1e-9)
        with pytest.raises(AssertionError, match="not finite"):  # a NaN is no proof that a fault moved a result
            assert_beyond(*pair, 1e-9)
    # the sequences the old checks used: a NaN after the first entry was skipped by max(), nan > tol was False
    errors = [1e-12, float("nan"), 1e-13]
    assert max(errors) < 1e-9  # what the replaced checks did
    with pytest.raises(AssertionError, match=r"value\[1\]: result not finite"):
        assert_close(errors, [0.0, 0.0, 0.0], 1e-9, scale="absolute")


def test_shorter_longer_and_empty_sequences_fail():
    for result, reference in [([1.0, 2.0], [1.0, 2.0, 3.0]), ([1.0, 2.0, 3.0], [1.0, 2.0]),
                              ([[1.0, 2.0]], [[1.0, 2.0], [3.0, 4.0]]), ([np.ones(3)], [np.ones(3), np.ones(3)])]:
        comparison = compare(result, reference, 1.0)
        assert not comparison.ok and ("differ" in comparison.problem or "shape" in comparison.problem), comparison
    for empty in ([], np.zeros((0, 3)), {}, {"forces": np.zeros((0, 3))}):
        comparison = compare(empty, empty, 1.0)
        assert not comparison.ok and "nothing to compare" in comparison.problem, (empty, comparison)


def test_keys_and_shapes_must_match():
    missing = {k: v for k, v in REFERENCE.items() if k != "stress"}
    assert "keys differ" in compare(missing, REFERENCE, 1.0).problem
    assert "keys differ" in compare(REFERENCE, missing, 1.0).problem
    transposed = dict(REFERENCE, forces=REFERENCE["forces"].T)
    assert "forces: shape (3, 2) vs reference (2, 3)" in compare(transposed, REFERENCE, 1.0).problem
    assert "not numbers" in compare({"a": "x"}, {"a": "x"}, 1.0).problem
    with pytest.raises(ValueError, match="scale"):
        compare(REFERENCE, REFERENCE, 1.0, scale="relative")


def test_worst_entry_named_and_scales():
    result = result_with("forces", (1, 2), -0.6 + 3e-6)
    comparison = compare(result, REFERENCE, 1e-9)
    assert not comparison.ok
    assert comparison.where.startswith("forces[1, 2] = ") and comparison.error == pytest.approx(3e-6 / 0.6)
    assert "forces[1, 2]" in comparison.message("case") and "beyond 1.0e-09" in comparison.message("case")
    with pytest.raises(AssertionError, match=r"case: forces\[1, 2\]"):
        assert_close(result, REFERENCE, 1e-9, label="case")
    assert assert_close(result, REFERENCE, 1e-5) == pytest.approx(5e-6)
    assert compare(result, REFERENCE, scale="absolute").error == pytest.approx(3e-6)
    assert compare([1.0, 100.0], [2.0, 100.0], scale="each").error == pytest.approx(0.5)
    assert compare([1.0, 100.0], [2.0, 100.0], scale="max").error == pytest.approx(0.01)
    assert assert_beyond(result, REFERENCE, 1e-9) == pytest.approx(5e-6)
    with pytest.raises(AssertionError, match="expected beyond"):
        assert_beyond(REFERENCE, REFERENCE, 1e-9)
    # equal inputs of every kind pass: tensors, nested lists of dicts, tuples
    nested = [{"a": torch.tensor([1.0, 2.0]), "b": (3.0, 4.0)}, {"a": torch.tensor([5.0, 6.0]), "b": (7.0, 8.0)}]
    assert assert_close(nested, [{"a": [1.0, 2.0], "b": [3.0, 4.0]}, {"a": [5.0, 6.0], "b": [7.0, 8.0]}], 0.0) == 0.0
