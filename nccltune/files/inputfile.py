"""Reading an input file (config, snapshot, NCCL XML, JSON documents) without hanging, exhausting
memory or believing a file another user controls; and every JSON nccltune reads, parsed strictly:
`loads_strict` / `parse_json` for text already in memory, `read_json` for a file. And reading what a
less trusted process wrote (a rank's output, NCCL's log, /proc, sysfs) within a bound (`read_bounded`),
or what a program prints as it runs (a container image's probe, `ldconfig -p`: `read_output`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import selectors
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from ..errors import InputError
from . import trust


def read_input_file(path: Path, max_bytes: int, what: str, *, trusted: bool = False) -> bytes:
    """Read an input file safely: only a regular file (a FIFO would hang, /dev/zero never ends),
    at most ``max_bytes``. Opened O_NONBLOCK so that opening a FIFO cannot block either.

    ``trusted``: the file is read as configuration (the config file, a snapshot, a class
    profile): it and its whole chain must pass trust.resolve_trusted, and what is opened is the
    real path that walk checked.

    Raises:
        InputError: a directory, a device, a FIFO or a socket, larger than ``max_bytes``, or (with
            ``trusted``) a component on its way another user may change (exit 78).
        OSError: it cannot be opened (FileNotFoundError and the like; the caller words it).
    """
    real = trust.resolve_trusted(path, what)[0] if trusted else path
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
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


def read_input_text(path: Path, max_bytes: int, what: str, *, not_text: str, trusted: bool = False) -> str:
    """`read_input_file`, as UTF-8 text.

    Raises:
        InputError: what read_input_file refuses, a file that cannot be read (`cannot read: ...`),
            or one that is not UTF-8 (`not_text`, at the line of the first byte that is not) (exit 78).
    """
    try:
        raw = read_input_file(path, max_bytes, what, trusted=trusted)
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(str(path), not_text, line=raw[: exc.start].count(b"\n") + 1) from exc


@dataclass(frozen=True)
class Bounded:
    """What `read_bounded` kept of a file: `data`, from its start or its end, and `size`, how
    long the file was (at least) when it was read."""

    data: bytes
    size: int
    tail: bool = False

    @property
    def cut(self) -> bool:
        """The file held more than `data`."""
        return self.size > len(self.data)

    def text(self) -> str:
        """`data` as text, undecodable bytes replaced."""
        return self.data.decode(errors="replace")

    def lines(self) -> list[str]:
        """`data` as text lines (undecodable bytes replaced), less the line cut in two at the edge
        where the file was cut, unless it is the only one."""
        lines = self.data.decode(errors="replace").splitlines()
        if self.cut and len(lines) > 1:
            lines = lines[1:] if self.tail else lines[:-1]
        return lines


def open_regular(path: Path, *, follow: bool = False) -> tuple[int, os.stat_result]:
    """A descriptor (and its stat) of a regular file another process or user shaped, opened
    read-only and non-blocking (a FIFO cannot hold the opener), its last component's link not
    followed unless `follow`; read_bounded's open, and that of a reader that seeks (an ELF file's
    sections). The caller closes it.

    Raises:
        OSError: it cannot be opened (ELOOP for a symlink), or is not a regular file (EINVAL).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: Path, limit: int, *, tail: bool = False, follow: bool = False) -> Bounded:
    """The first `limit` bytes of a file another process or user wrote (with `tail`: its last
    `limit` bytes), never more whatever the file does meanwhile: only a regular file, a symlink at
    its last component not followed (with `follow`: followed, for a file its owner may place by a
    link, as NCCL's conf files), opened non-blocking (a FIFO cannot hold the reader). The one reader
    of a rank's output, NCCL's log, NCCL's conf files, /proc and sysfs; whether the file went on
    past `limit` is `Bounded.cut`, from what the read found rather than the size the file claims
    (a sysfs attribute says 4096 bytes, a /proc file 0).

    Raises:
        OSError: it cannot be opened (ELOOP for a symlink), or is not a regular file (EINVAL).
    """
    fd, st = open_regular(path, follow=follow)
    try:
        start = max(0, st.st_size - limit) if tail else 0
        chunks: list[bytes] = []
        got = 0
        want = limit if tail else limit + 1  # one byte more says whether the file goes on
        while got < want:
            chunk = os.pread(fd, min(1 << 20, want - got), start + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    # From its start, a read that ended before `limit` saw the whole file, whatever st_size said.
    size = len(data) if not tail and len(data) <= limit else max(st.st_size, start + len(data))
    return Bounded(data[:limit], size, tail)


@dataclass(frozen=True)
class Ran:
    """What `read_output` kept of a program's run: `stdout` from its start, `stderr` from its end,
    `returncode` (None: it was killed, `killed` says why)."""

    returncode: int | None
    stdout: Bounded
    stderr: Bounded
    killed: str | None = None


class Piped(Protocol):
    """A started program whose stdout and stderr are pipes to this process (subprocess.Popen with
    stdout=PIPE, stderr=PIPE), leading a process group of its own (start_new_session=True)."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


def _pump(fd: int, kept: bytearray, *, limit: int, tail: bool) -> tuple[int, bool]:
    """One read of `fd` into `kept` (at most `limit` bytes: the first ones, or with `tail` the last
    ones): (bytes read, whether the pipe is at its end)."""
    chunk = os.read(fd, 1 << 16)
    if not chunk:
        return 0, True
    kept += chunk
    if tail and len(kept) > limit:
        del kept[:len(kept) - limit]
    return len(chunk), False


def read_output(proc: Piped, *, limit: int, err_limit: int, timeout_s: float) -> Ran:
    """The first `limit` bytes of a running program's stdout and the last `err_limit` of its
    stderr, never more in memory or on disk whatever it prints (a program root runs on what
    another party shaped, a container image, may print without end); the program's process
    group is killed as soon as stdout goes past `limit` or `timeout_s` passes (`Ran.killed` says
    which; `Ran.stdout.cut` for the first). The caller starts the program (the modules that own
    processes do: the import contract) and reads it here."""
    assert proc.stdout is not None and proc.stderr is not None, "read_output needs both pipes"
    try:
        return _read_output(proc, proc.stdout, proc.stderr, limit=limit, err_limit=err_limit, timeout_s=timeout_s)
    except BaseException:  # a signal, an interrupt: the program does not outlive its reader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _read_output(proc: Piped, stdout: IO[bytes], stderr: IO[bytes], *, limit: int, err_limit: int,
                 timeout_s: float) -> Ran:
    out, err = bytearray(), bytearray()
    out_size = err_size = 0
    killed: str | None = None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(stdout, selectors.EVENT_READ, out)
        sel.register(stderr, selectors.EVENT_READ, err)
        while sel.get_map() and killed is None:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = f"still running after {timeout_s:g} s"
                break
            for key, _ in sel.select(left):
                is_out = key.data is out
                got, ended = _pump(key.fd, key.data, limit=limit if is_out else err_limit, tail=not is_out)
                if is_out:
                    out_size += got
                else:
                    err_size += got
                if ended:
                    sel.unregister(key.fileobj)
                elif is_out and out_size > limit:
                    killed = f"printed more than {limit} bytes"
                    break
    while killed is None and proc.poll() is None:  # both pipes closed: it may still run
        if time.monotonic() > deadline:
            killed = f"still running after {timeout_s:g} s"
        else:
            time.sleep(0.01)
    if killed is not None:
        with contextlib.suppress(ProcessLookupError):  # it ended, and its group with it
            os.killpg(proc.pid, signal.SIGKILL)
    stdout.close()
    stderr.close()
    code = proc.wait()
    return Ran(None if killed else code, Bounded(bytes(out[:limit]), out_size),
               Bounded(bytes(err), err_size, tail=True), killed)


# Deeper than any document nccltune reads or writes (a profile nests 6 levels), far below where
# a parser or a schema check would run out of stack.
MAX_JSON_DEPTH = 64


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            # Two readers could take either copy: the document means nothing certain.
            raise ValueError(f"duplicate key {key!r}")
        doc[key] = value
    return doc


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _depth(doc: Any) -> int:
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:
                stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


# A JSON string escape that can only stand for half a UTF-16 pair: Python's parser turns a lone
# one into a lone surrogate, a str that no UTF-8 writer (nccl.json, stdout, the journal) can encode.
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate(doc: Any, where: str = "$") -> str | None:
    """The JSON path of the first string (key or value) of ``doc`` that is not valid Unicode text
    (it holds a lone surrogate, so it has no UTF-8 form), or None."""
    stack: list[tuple[Any, str]] = [(doc, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(node, dict):
            for key, value in node.items():
                stack.append((value, f"{path}.{key}"))
                stack.append((key, f"{path} (a key)"))
        elif isinstance(node, list):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(node))
    return None


def _too_large(data: str | bytes, max_bytes: int | None) -> bool:
    if max_bytes is None:
        return False
    # A str is at least as long in UTF-8 as in characters: only a close call is encoded to count.
    if len(data) > max_bytes:
        return True
    return (isinstance(data, str) and 4 * len(data) > max_bytes
            and len(data.encode("utf-8", "surrogatepass")) > max_bytes)


def loads_strict(data: str | bytes, *, max_bytes: int | None = None, lone_surrogates: bool = False) -> Any:
    """THE JSON parser of nccltune, for text already in memory (bytes are UTF-8): json.loads,
    refusing what Python's parser accepts and JSON (or one meaning) does not: NaN and Infinity, a
    key twice in one object (at any depth), nesting deeper than MAX_JSON_DEPTH, a string with a
    lone surrogate escape (no character: the text would have no UTF-8 form) unless
    ``lone_surrogates`` (a reader that checks its texts itself, with a message of its own); and,
    with ``max_bytes``, text longer than that.

    Raises:
        json.JSONDecodeError: not JSON (its msg, lineno and colno say where).
        UnicodeDecodeError: bytes that are not UTF-8.
        ValueError: one of the refusals above, worded for a message.
    """
    if _too_large(data, max_bytes):
        raise ValueError(f"larger than {max_bytes} bytes")
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    try:
        doc = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_not_json)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if not lone_surrogates and _SURROGATE_ESCAPE_RE.search(text):
        bad = lone_surrogate(doc)
        if bad is not None:
            raise ValueError(f"{bad}: a lone surrogate escape (\\ud800-\\udfff without its pair) is no "
                             "character, so the text is not valid UTF-8")
    return doc


def parse_json(data: bytes | str, name: str, *, max_bytes: int | None = None) -> Any:
    """A JSON document already in memory, named ``name`` (its file) in every message, parsed by
    loads_strict.

    Raises:
        InputError: larger than ``max_bytes``, not UTF-8, not JSON (with its line and column), or
            refused by loads_strict (exit 78).
    """
    if _too_large(data, max_bytes):
        raise InputError(name, f"larger than {max_bytes} bytes; not a JSON document nccltune reads")
    try:
        return loads_strict(data)
    except UnicodeDecodeError as exc:
        raise InputError(name, f"not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputError(name, f"not valid JSON: {exc.msg} (column {exc.colno})", line=exc.lineno) from None
    except ValueError as exc:
        raise InputError(name, f"not valid JSON: {exc}") from None


def read_json(path: Path, max_bytes: int, what: str, *, trusted: bool = False, shown: str | None = None) -> Any:
    """A JSON file: read by read_input_file (a regular file, at most ``max_bytes``; with
    ``trusted``, under the trust rule), parsed by parse_json. ``shown``: the name messages give it
    where it is not ``path`` itself.

    Raises:
        InputError: it cannot be read (``cannot read: ...``), is no regular file, is larger than
            ``max_bytes``, or is not strict JSON (with its line and column), naming the file (exit 78).
    """
    name = str(path) if shown is None else shown
    try:
        raw = read_input_file(path, max_bytes, what, trusted=trusted)
    except OSError as exc:
        raise InputError(name, f"cannot read: {exc.strerror or exc}") from exc
    return parse_json(raw, name)
