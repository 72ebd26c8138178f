"""Molecular dynamics on top of mlip_parallel: the ASE calculator (``MLIPCalculator``), the native
distributed MD engine (``md.engine``: ``MDSystem``, ``run``), its integrators (``md.integrators``) and
the ``mlip-md`` command (``md.cli``). ``MLIPCalculator`` is imported on first use (fast ``mlip-md --help``)."""

__all__ = ["MLIPCalculator"]


def __getattr__(name):
    if name == "MLIPCalculator":
        from .calculator import MLIPCalculator  # (torch: at first use)
        return MLIPCalculator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
