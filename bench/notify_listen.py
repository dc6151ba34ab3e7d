"""Listen on a systemd-style notify socket and print each datagram with a timestamp.

    python bench/notify_listen.py /tmp/notify.sock > notify.log &
    NOTIFY_SOCKET=/tmp/notify.sock nccltune daemon ...
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

path = sys.argv[1]
with contextlib.suppress(OSError):
    os.unlink(path)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind(path)
start = time.monotonic()
while True:
    data = sock.recv(65536).decode(errors="replace")
    print(f"{time.monotonic() - start:8.2f}s {' | '.join(data.splitlines())}", flush=True)
