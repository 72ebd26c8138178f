"""Exception types shared by the whole toolkit (the lowest package defines them; others import them)."""


class MLIPError(Exception):
    """Base class of every error this toolkit raises on purpose."""


class UnknownSpeciesError(MLIPError, ValueError):
    """The structure holds an element the model was not built for."""


class InvalidStructureError(MLIPError, ValueError):
    """The structure cannot be evaluated: non-finite positions, a degenerate cell, ..."""


class OutputError(MLIPError, OSError):
    """An output file could not be written (disk full, no permission, an I/O error): the message names
    the file, the operating system's reason and, where a run wrote one, its last restart or checkpoint."""
