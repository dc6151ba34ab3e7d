"""The systemd notify protocol (sd_notify(3)) in stdlib: one datagram of "KEY=value" lines.

The socket comes from NOTIFY_SOCKET (or is injected): an absolute path, or an abstract socket
written with a leading '@'. Sending never raises: a service must not die because systemd went
away or was restarted, so failures are logged at debug level and the call returns False.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

# systemd reads the socket from its event loop; a send that blocks longer than this means the
# manager is wedged, and a dropped ping is then better than a daemon stuck in sendto().
_SEND_TIMEOUT_S = 2.0


def _clean(value: object) -> str:
    """Render a field value; a newline would start a new field, so it becomes a space."""
    return " ".join(str(value).splitlines())


class Notifier:
    """Sends state changes to the service manager.

    `socket_path` wins over `env`; `env` defaults to os.environ. With neither giving a usable
    address (not under systemd, or NotifyAccess= unset), the notifier is disabled and every
    send is a no-op returning False.
    """

    def __init__(self, socket_path: str | None = None, env: Mapping[str, str] | None = None) -> None:
        if socket_path is None:
            socket_path = (os.environ if env is None else env).get("NOTIFY_SOCKET") or None
        self.socket_path = socket_path
        self._address: bytes | None = None
        if socket_path is None:
            return
        if socket_path.startswith("@"):
            # Linux abstract namespace: the name starts with a NUL byte instead of '@'.
            self._address = b"\0" + os.fsencode(socket_path[1:])
        elif socket_path.startswith("/"):
            self._address = os.fsencode(socket_path)
        else:
            # sd_notify() rejects relative paths too; newer systemd also offers vsock:
            # addresses, which only matter inside VMs and are not supported here.
            log.debug("NOTIFY_SOCKET=%r is neither an absolute path nor '@abstract'; disabled", socket_path)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to send to."""
        return self._address is not None

    def send(self, text: str) -> bool:
        """Send `text` as one datagram, as is. Returns True when the kernel accepted it."""
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(_SEND_TIMEOUT_S)
                sock.sendto(text.encode("utf-8"), self._address)
        except OSError as exc:
            log.debug("sd_notify to %s failed: %s", self.socket_path, exc)
            return False
        return True

    def notify(self, **fields: object) -> bool:
        """Send the fields, in order, as "KEY=value" lines; newlines in values become spaces.

        Raises:
            ValueError: a key is empty or contains '=' or a newline (a programming error).
        """
        for key in fields:
            if not key or "=" in key or "\n" in key:
                raise ValueError(f"invalid sd_notify field name {key!r}")
        if not fields:
            return False
        return self.send("".join(f"{key}={_clean(value)}\n" for key, value in fields.items()))

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) is complete: systemd considers the service started."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        """Free-form one-line state shown by `systemctl status`."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """Keep-alive ping for WatchdogSec=; send at half of watchdog_interval_s()."""
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> bool:
        """The service is shutting down."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)

    def reloading(self, status: str | None = None) -> bool:
        """A reload started; send ready() when it is done.

        Type=notify-reload (systemd 253) requires MONOTONIC_USEC, the CLOCK_MONOTONIC time of the
        reload in microseconds, so that it can tell this reload from an earlier one.
        """
        fields: dict[str, object] = {
            "RELOADING": 1,
            "MONOTONIC_USEC": time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000,
        }
        if status is not None:
            fields["STATUS"] = status
        return self.notify(**fields)

    def extend_timeout(self, usec: int) -> bool:
        """Ask for `usec` more microseconds before the start/stop/reload timeout fires.

        Raises:
            ValueError: `usec` is not a positive integer.
        """
        if isinstance(usec, bool) or not isinstance(usec, int) or usec <= 0:
            raise ValueError(f"extend_timeout needs a positive number of microseconds, got {usec!r}")
        return self.notify(EXTEND_TIMEOUT_USEC=usec)


def watchdog_interval_s(env: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """The watchdog timeout systemd expects pings within, in seconds, or None when there is none.

    Read from WATCHDOG_USEC. When WATCHDOG_PID is set it must equal `pid` (default os.getpid()):
    the variables are inherited by child processes, which must not think the watchdog is theirs.
    Callers ping at half the returned interval, as sd_watchdog_enabled(3) recommends.
    """
    env = os.environ if env is None else env
    raw_usec = env.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID")
    if raw_pid:
        try:
            watchdog_pid = int(raw_pid)
        except ValueError:
            log.debug("ignoring watchdog: WATCHDOG_PID=%r is not a number", raw_pid)
            return None
        if watchdog_pid != (os.getpid() if pid is None else pid):
            return None
    try:
        usec = int(raw_usec)
    except ValueError:
        log.debug("ignoring watchdog: WATCHDOG_USEC=%r is not a number", raw_usec)
        return None
    if usec <= 0:
        return None
    return usec / 1_000_000
