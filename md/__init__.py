"""Molecular dynamics on top of mlip_parallel: the ASE calculator and the native MD engine.

Not built yet (issue 4); nothing here is importable API so far.
"""
