"""Molecular dynamics on top of mlip_parallel: the ASE calculator (``MLIPCalculator``), the native
distributed MD engine (``md.engine``: ``MDSystem``, ``run``), its integrators (``md.integrators``) and
the ``mlip-md`` command (``md.cli``)."""
from .calculator import MLIPCalculator

__all__ = ["MLIPCalculator"]
