"""``python -m mlip_parallel.lammps``: the same as ``mlip-lammps``."""
import sys

from .cli import main

sys.exit(main())
