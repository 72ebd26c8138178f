"""The rules a setting obeys, one language for every tool's settings and every model family's options: a
tuple of allowed values, or for a number "finite", "> a", ">= a", or an interval "[a, b]" (any of ``[(``
and ``)]``). Numbers must always be finite (NaN and inf obey no range: every comparison with NaN is false).
Imports nothing heavy: the command-line tools check their settings before torch is loaded."""
from __future__ import annotations

import math


def describe_rule(rule) -> str:
    """``rule`` in words: "one of (...)", "> 0", "in [0, 1)", "a finite number"."""
    if isinstance(rule, tuple):
        return f"one of {rule}"
    return "a finite number" if rule == "finite" else (f"in {rule}" if rule[0] in "[(" else rule)


def obeys(value, rule) -> bool:
    """Whether ``value`` obeys ``rule`` (see the module docstring)."""
    if isinstance(rule, tuple):
        return value in rule
    if not math.isfinite(value):
        return False
    if rule == "finite":
        return True
    if rule.startswith(">"):
        bound = float(rule.lstrip(">= "))
        return value >= bound if rule.startswith(">=") else value > bound
    low, high = (float(x) for x in rule[1:-1].split(","))
    return (value >= low if rule[0] == "[" else value > low) and (value <= high if rule[-1] == "]" else value < high)


def number_problem(name: str, value, rule: str = ">= 0") -> str | None:
    """What is wrong with ``value`` as the number ``name`` under ``rule`` (None: nothing): it must be a
    finite number (not a bool) obeying the rule."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be a number, got {value!r}"
    if not obeys(value, rule):
        what = "a finite number" if rule == "finite" else f"a finite number {describe_rule(rule)}"
        return f"{name} must be {what}, got {value!r}"
    return None


def value_problem(name: str, value, types, rule=None) -> str | None:
    """What is wrong with ``value`` as the setting ``name`` of ``types`` (a type or a tuple; an int is taken
    for a float) under ``rule`` (None: any value of the type; numbers then must be finite), or None."""
    types = types if isinstance(types, tuple) else (types,)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        return f"{name} must be {' or '.join(t.__name__ for t in types)}, got {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return number_problem(name, value, "finite" if rule is None else rule)
    if rule is not None and value not in rule:
        return f"{name} must be {describe_rule(rule)}, got {value!r}"
    return None
