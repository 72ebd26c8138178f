"""``python tests/mpi/disk_full.py BYTES DIRECTORY -m MODULE ARGS...``: run MODULE's ``main(ARGS)`` as if the
file system of DIRECTORY held only BYTES more bytes: writes to files under DIRECTORY raise
``OSError(ENOSPC)`` once BYTES have been written (the disk-full test where no tmpfs can be mounted).
Under mpiexec each rank counts its own writes (only rank 0 writes mlip-md's outputs)."""
import builtins
import errno
import importlib
import io
import os
import sys

budget, root = [int(sys.argv[1])], os.path.abspath(sys.argv[2])
real_open = io.open


class FullDisk:
    """A file object whose writes fail with ENOSPC once the budget is spent (a partial write first)."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        if len(data) > budget[0]:
            self._file.write(data[:budget[0]])
            budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= len(data)
        return self._file.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __iter__(self):
        return iter(self._file)

    def __getattr__(self, name):
        return getattr(self._file, name)


def limited_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    writing = any(c in mode for c in "wax+")
    inside = isinstance(file, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(file)).startswith(root)
    return FullDisk(f) if writing and inside else f


builtins.open = io.open = limited_open
module = importlib.import_module(sys.argv[4])
sys.exit(module.main(sys.argv[5:]))
