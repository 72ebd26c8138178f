"""Molecular dynamics on top of mlip_parallel. So far: the ASE calculator (the native MD engine is
issue 4's)."""
from .calculator import MLIPCalculator

__all__ = ["MLIPCalculator"]
