"""An instrumented filesystem for the test scripts: counts, at the operating system's interface (``os.preadv``,
``os.pread``, ``os.read``, ``os.readv`` and ``mmap.mmap`` of a file), the bytes this process read from the data objects
(``*.bin``) under a directory, and writes the count to a file at exit. It sits below the library (which counts in
its backends), so a test can check the library's reads against it."""

from __future__ import annotations

import atexit
import mmap
import os
import threading
from collections.abc import Callable

_lock = threading.Lock()


def install(root: str, out: str) -> Callable[[], None]:
    """Count the bytes read from ``root/**/*.bin`` from now on; write the total to ``out`` when the process exits.
    Returns the function that writes it, for a process that ends without running ``atexit`` (a script forked by the
    tests' fork server, tests/zygote.py, ends with ``os._exit``)."""
    root = os.path.realpath(root)
    total = [0]

    def counted(fd: int) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return path.startswith(root + os.sep) and path.endswith(".bin")

    def add(fd: int, n: int) -> None:
        if n > 0 and counted(fd):
            with _lock:
                total[0] += n

    preadv, pread, read, readv = os.preadv, os.pread, os.read, os.readv

    def _preadv(fd, buffers, offset, *a):
        n = preadv(fd, buffers, offset, *a)
        add(fd, n)
        return n

    def _pread(fd, length, offset):
        data = pread(fd, length, offset)
        add(fd, len(data))
        return data

    def _read(fd, length):
        data = read(fd, length)
        add(fd, len(data))
        return data

    def _readv(fd, buffers):
        n = readv(fd, buffers)
        add(fd, n)
        return n

    class _Mmap(mmap.mmap):  # a mapped file counts whole: the upper bound of what it may read
        def __new__(cls, fileno, length, *a, **kw):
            m = super().__new__(cls, fileno, length, *a, **kw)
            if fileno >= 0:
                add(fileno, len(m))
            return m

    os.preadv, os.pread, os.read, os.readv = _preadv, _pread, _read, _readv
    mmap.mmap = _Mmap  # type: ignore[misc]

    def write() -> None:
        with open(out, "w") as f:
            f.write(str(total[0]))

    atexit.register(write)
    return write
