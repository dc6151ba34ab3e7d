"""Errors that carry the documented exit code of the command line contract.

Exit codes (DESIGN.md section 3): 0 ok, 1 check failed, 2 usage, 69 no GPU/NVML/torch,
75 busy (lock held, GPUs in use), 78 bad config or input.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
EXIT_BUSY = 75
EXIT_CONFIG = 78


class NccltuneError(Exception):
    """Base error: a message for the user and the exit code that goes with it."""

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class CheckFailed(NccltuneError):
    exit_code = EXIT_CHECK_FAILED


class UsageError(NccltuneError):
    exit_code = EXIT_USAGE


class UnavailableError(NccltuneError):
    """No NVIDIA GPU, no NVML, or no torch where one is needed."""

    exit_code = EXIT_UNAVAILABLE


class BusyError(NccltuneError):
    """Another sweep holds the lock, or compute processes hold the GPUs."""

    exit_code = EXIT_BUSY


class InputError(NccltuneError):
    """Malformed config, snapshot or XML. The message names the file and line or element."""

    exit_code = EXIT_CONFIG

    def __init__(self, path: str, message: str, *, line: int | None = None, hint: str | None = None) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}", hint=hint)
        self.path = path
        self.line = line
