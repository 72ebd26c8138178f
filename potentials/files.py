"""Crash-safe file writes: a file is complete under its name or not there at all.

``atomic_write(path)`` writes to a temporary name in the same directory, flushes it to disk (fsync)
and renames it over ``path`` (``os.replace``, atomic on POSIX file systems), then syncs the directory.
A process killed at any moment leaves either the previous file or the new one, never a part of one;
an error while writing removes the temporary file and leaves the previous one untouched.
"""
from __future__ import annotations

import contextlib
import os

from .errors import OutputError


def temporary_name(path) -> str:
    """Where ``atomic_write(path)`` writes before the rename (a hidden name beside ``path``)."""
    head, tail = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(head, f".{tail}.partial")


def sync_directory(directory) -> None:
    """fsync ``directory`` so that a rename in it is on disk (skipped where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", **open_kwargs):
    """``with atomic_write(path) as f: ...``: the file object of a temporary file that replaces
    ``path`` when the block ends without an error (flushed and fsynced first). An OSError while
    writing, syncing or renaming is raised as OutputError naming ``path``; the previous file stays."""
    path = os.fspath(path)
    partial = temporary_name(path)
    watched = None
    try:
        with open(partial, mode, **open_kwargs) as f:
            watched = _Watched(f)
            yield watched
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        # torch.save reports a failed write as a RuntimeError of its own ("unexpected pos ..."): name the
        # OSError that the write raised underneath
        error = exc if isinstance(exc, OSError) else getattr(watched, "error", None)
        if error is not None and not isinstance(exc, OutputError):
            raise cannot_write(path, error) from None
        raise
    sync_directory(os.path.dirname(os.path.abspath(path)))


class _Watched:
    """A file object that remembers the OSError its ``write`` raised (for writers that replace it)."""

    def __init__(self, file):
        self._file, self.error = file, None

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __iter__(self):
        return iter(self._file)


def cannot_write(path, exc: OSError) -> OutputError:
    """OutputError("cannot write PATH: [Errno 28] No space left on device"): the errno and the system's
    words, without the file name the OSError's own text repeats."""
    reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None and exc.strerror else \
        str(exc) or type(exc).__name__
    return OutputError(f"cannot write {os.fspath(path)}: {reason}")


@contextlib.contextmanager
def naming_errors(path):
    """Raise an OSError of the block as OutputError("cannot write PATH: [Errno N] reason")."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        raise cannot_write(path, exc) from None
