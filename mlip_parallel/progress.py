"""Progress of a long run on stderr, fit for where stderr goes.

On a terminal: tqdm's bar. In a file or a pipe — a batch job's log, where a bar's carriage returns pile
up into one line thousands of characters long — a plain line now and then that a person tails and a
script greps: ``mlip-md: step 4000/10000 (40 %), 310 step/s, ETA 0:00:19``. Switched off: nothing.

A rank of an MPI job writes into a pipe to its launcher even when the launcher writes to a terminal;
``stderr_is_terminal`` then asks the launcher's own stderr (Linux: /proc)."""
from __future__ import annotations

import os
import sys
import time

LAUNCHERS = ("mpiexec", "mpirun", "mpiexec.hydra", "hydra_pmi_proxy", "orterun", "prterun", "prted", "srun",
             "slurmstepd")


def duration(seconds: float) -> str:
    """``seconds`` as H:MM:SS with two digits at least for the hours, a day and more included (100,000 s is
    27:46:40)."""
    whole = int(round(seconds))
    return f"{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def stderr_is_terminal(stream=None) -> bool:
    """Whether what this process writes to ``stream`` (stderr) reaches a terminal: the stream is one, or it
    is a pipe to an MPI launcher (up to three processes up) whose own stderr is one."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    try:
        pid = os.getpid()
        for _ in range(3):
            pid = _parent(pid)
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name not in LAUNCHERS:
                return False
            target = os.readlink(f"/proc/{pid}/fd/2")
            if target.startswith(("/dev/pts/", "/dev/tty")):
                return True
    except (OSError, ValueError, IndexError):
        pass
    return False


class Progress:
    """Progress of ``total`` ``unit``s from ``initial``, reported as ``name``: ``mode`` "bar" (tqdm),
    "lines" (a line when ``every_seconds`` have passed since the last, and at the end) or "off";
    None: "bar" on a terminal, else "lines" (``stderr_is_terminal``)."""

    def __init__(self, name: str, total: int, initial: int = 0, unit: str = "step", mode: str | None = None,
                 every_seconds: float = 30.0, stream=None):
        self.name, self.total, self.unit, self.every = name, total, unit, every_seconds
        self.stream = sys.stderr if stream is None else stream
        self.mode = mode or ("bar" if stderr_is_terminal(self.stream) else "lines")
        self.n = self.start_n = initial
        self.start = self.last = time.monotonic()
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit=unit, file=self.stream, dynamic_ncols=True)

    def update(self, n: int, **postfix) -> None:
        """Now at ``n`` of ``total``; ``postfix``: values shown beside (e.g. a validation loss)."""
        self.n = n
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            if postfix:
                self.bar.set_postfix(postfix)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self.last >= self.every or n >= self.total:
                self.last = now
                self.stream.write(self.line(now, postfix) + "\n")
                self.stream.flush()

    def line(self, now: float, postfix: dict) -> str:
        done, elapsed = self.n - self.start_n, now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else float("nan")
        eta = duration(eta) if eta == eta else "?"
        shown = "".join(f", {k} {v}" for k, v in postfix.items())
        return (f"{self.name}: {self.unit} {self.n}/{self.total} ({100 * self.n / max(1, self.total):.0f} %), "
                f"{rate:.3g} {self.unit}/s, ETA {eta}{shown}")

    def clear(self) -> None:
        """Take the bar off the screen before other lines are printed (a no-op without a bar)."""
        if self.bar is not None:
            self.bar.clear()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.stream.flush()
