"""What another package may change in the process while it loads or builds a model (``import mace`` sets an
environment variable; the nequip framework's ``set_global_state`` the default dtype, every random generator's
seed and some variables; fairchem warning filters, an inductor cache directory and draws from torch's
generator), and how the adapters put it back: ``process_kept``, the one helper every adapter uses."""
from __future__ import annotations

import os
import random as python_random
import warnings
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def process_kept(*, random: bool = False, dtype: bool = False, warning_filters: bool = False):
    """Inside, a package may change the process's environment variables and, where asked, torch's, numpy's and
    Python's random states (``random``), torch's default dtype (``dtype``) and the warning filters
    (``warning_filters``). After (also after an exception), what changed is put back: each variable that the
    block set, changed or removed gets its value from before, and no other variable is touched (the
    environment is never cleared and refilled)."""
    environment = dict(os.environ)
    states = (torch.get_rng_state(), np.random.get_state(), python_random.getstate()) if random else None
    default = torch.get_default_dtype()
    filters = list(warnings.filters)
    try:
        yield
    finally:
        now = dict(os.environ)
        for key in set(environment) | set(now):
            if now.get(key) != environment.get(key):
                if key in environment:
                    os.environ[key] = environment[key]
                else:
                    del os.environ[key]
        if states is not None:
            torch.set_rng_state(states[0])
            np.random.set_state(states[1])
            python_random.setstate(states[2])
        if dtype:
            torch.set_default_dtype(default)
        if warning_filters:
            warnings.filters[:] = filters
