"""Package attributes imported on first use (PEP 562), so that ``import potentials`` / ``import
mlip_parallel`` cost nothing until a model or the distributed layer is needed (fast CLI start-up)."""
from __future__ import annotations

import sys
import types
from importlib import import_module


def lazy_exports(package: str, exports: dict) -> list:
    """Make ``package.NAME`` import ``package.MODULE`` on first use, for ``exports = {MODULE: (NAME, ...)}``.
    An exported name equal to a submodule's name (``potentials.predict``, ``mlip_parallel.evaluate``) stays
    the exported object after that submodule is imported. Returns the exported names (for ``__all__``)."""
    where = {name: module for module, names in exports.items() for name in names}

    class Package(types.ModuleType):
        def __getattr__(self, name):
            if name in where:
                value = getattr(import_module(f"{package}.{where[name]}"), name)
                types.ModuleType.__setattr__(self, name, value)
                return value
            raise AttributeError(f"module {package!r} has no attribute {name!r}")

        def __setattr__(self, name, value):
            if name in where and isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}":
                return  # the import system binding the submodule: keep the exported function
            types.ModuleType.__setattr__(self, name, value)

    sys.modules[package].__class__ = Package
    return sorted(where)
