"""Reading an input file (config, snapshot, NCCL XML) without hanging or exhausting memory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import InputError


def read_input_file(path: Path, max_bytes: int, what: str) -> bytes:
    """Read an input file safely: only a regular file (a FIFO would hang, /dev/zero never ends),
    at most ``max_bytes``. Opened O_NONBLOCK so that opening a FIFO cannot block either.

    Raises:
        InputError: a directory, a device, a FIFO or a socket, or larger than ``max_bytes`` (exit 78).
        OSError: it cannot be opened (FileNotFoundError and the like; the caller words it).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(str(path), f"is a directory, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(str(path), f"is not a regular file (a device, FIFO or socket), not a {what}")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise InputError(str(path), f"larger than {max_bytes} bytes; not a {what}")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
