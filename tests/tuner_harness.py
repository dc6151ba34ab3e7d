"""Drive nccltune's tuner plugin through its exported NCCL structs with ctypes, as NCCL would.

The library comes from build_plugin into a temporary directory, or from NCCLTUNE_TEST_TUNER_LIB when
the sanitizer run hands the same tests an instrumented build.

NCCL's part is played by nccl_host.c, compiled here: init gets that library's logger, and the plugin
asks the library the logger lives in for its version (ncclGetVersion), as it asks the libnccl that
loaded it. The default host is loaded RTLD_LOCAL, as torch loads libnccl, and says 2.28.9.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nccltune.tuner.build import find_compiler
from nccltune.tuner.table import ALGORITHMS, COLLECTIVES, PROTOCOLS, nccl_version_code

LIB_ENV = "NCCLTUNE_TEST_TUNER_LIB"
TABLE_ENV = "NCCLTUNE_TUNER_TABLE"
FINGERPRINT_ENV = "NCCLTUNE_TUNER_FINGERPRINT"

LOG_WARN = 2
LOG_INFO = 3
FLAG_INIT = 0x1
FLAG_TUNING = 0x40
IGNORE = -1.0

# NCCL's logger is variadic; the plugin always calls it as (level, flags, file, line, "%s", msg), so a
# fixed-argument callback that takes the message as a sixth argument reads it.
LOGGER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_char_p)


class NvlDomainInfo(ctypes.Structure):
    _fields_ = [("nNvlDomains", ctypes.c_int), ("minRanksPerNvlDomain", ctypes.c_int),
                ("maxRanksPerNvlDomain", ctypes.c_int)]


INIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.c_size_t,
                        ctypes.c_size_t, LOGGER, ctypes.POINTER(NvlDomainInfo), ctypes.c_void_p)
GET_COLL_INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.POINTER(ctypes.c_int))
FINALIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class TunerV5(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT), ("getCollInfo", GET_COLL_INFO), ("finalize", FINALIZE)]


class TunerV6(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT), ("getCollInfo", GET_COLL_INFO), ("finalize", FINALIZE),
                ("getChunkSize", ctypes.c_void_p)]


class TunerV7(ctypes.Structure):
    """v6's members; init's last argument points to the v7 constants (ConstantsV7)."""

    _fields_ = TunerV6._fields_


_SCALES, _HW_LINKS = 3, 3
_BW_TABLES = ("llMaxBws", "perChMaxRingLL128Bws", "perChMaxTreeLL128Bws", "perChMaxTreeBws", "perChMaxNVLSTreeBws")


def _constants(compcaps: int) -> type[ctypes.Structure]:
    row = ctypes.c_double * _SCALES
    fields = [("baseLatencies", (ctypes.c_double * len(PROTOCOLS)) * len(ALGORITHMS)),
              ("hwLatencies", ((ctypes.c_double * len(PROTOCOLS)) * len(ALGORITHMS)) * _HW_LINKS)]
    fields += [(name, row * compcaps) for name in _BW_TABLES]
    return type(f"Constants{compcaps}", (ctypes.Structure,), {"_fields_": fields})


# NCCL's model constants as init receives them: v5/v6 with 4 compute-capability rows per bandwidth
# table, v7 (NCCL 2.32.6) with 5 (tuner_v7.h: NCCL_NUM_COMPCAPS_V7).
ConstantsV5 = _constants(4)
ConstantsV7 = _constants(5)


def filled_constants(kind: type[ctypes.Structure]) -> ctypes.Structure:
    """A constants struct with a distinct value in every double, to see any change."""
    obj = kind()
    raw = (ctypes.c_double * (ctypes.sizeof(kind) // ctypes.sizeof(ctypes.c_double))).from_buffer(obj)
    for i in range(len(raw)):
        raw[i] = 1000.0 + i
    return obj


def load_v7(lib: ctypes.CDLL) -> TunerV7:
    return TunerV7.in_dll(lib, "ncclTunerPlugin_v7")


CostTable = (ctypes.c_float * len(PROTOCOLS)) * len(ALGORITHMS)


def cost_table(ignore: tuple[tuple[str, str], ...] = ()) -> ctypes.Array[ctypes.Array[ctypes.c_float]]:
    """A float[7][3] cost table as NCCL fills it: distinct positive costs, IGNORE where asked."""
    table = CostTable()
    for a in range(len(ALGORITHMS)):
        for p in range(len(PROTOCOLS)):
            table[a][p] = 10.0 + a * 3 + p
    for algo, proto in ignore:
        table[ALGORITHMS.index(algo)][PROTOCOLS.index(proto)] = IGNORE
    return table


def cells(table: ctypes.Array[ctypes.Array[ctypes.c_float]]) -> list[list[float]]:
    return [[table[a][p] for p in range(len(PROTOCOLS))] for a in range(len(ALGORITHMS))]


HOST_SOURCE = Path(__file__).with_name("nccl_host.c")
SINK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_char_p)


class NcclHost:
    """One loaded copy of nccl_host.c: its logger, and the version its ncclGetVersion reports."""

    def __init__(self, path: Path, *, global_scope: bool = False) -> None:
        self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL if global_scope else ctypes.RTLD_LOCAL)
        self.logger = ctypes.cast(self.lib.host_log, ctypes.c_void_p).value
        self.set_version("2.28.9")

    def set_version(self, version: str | None) -> None:
        """What ncclGetVersion reports; None makes it fail."""
        self.lib.host_set_version(nccl_version_code(version) or 0 if version else 0, 1 if version else 0)


def compile_host(out_dir: Path, name: str = "libnccl-host.so") -> Path:
    """nccl_host.c compiled into out_dir (each copy a library of its own)."""
    compiler = find_compiler()
    assert compiler is not None, "the tests need a C compiler"
    out = out_dir / name
    subprocess.run([compiler, "-std=c11", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(HOST_SOURCE)], check=True, capture_output=True)
    return out


_default_host: list[NcclHost] = []


def default_host() -> NcclHost:
    """The host every init uses unless told otherwise: loaded once per process, RTLD_LOCAL."""
    if not _default_host:
        _default_host.append(NcclHost(compile_host(Path(tempfile.mkdtemp(prefix="nccltune-host-")))))
    return _default_host[0]


@dataclass
class LogLine:
    level: int
    flags: int
    fmt: str
    message: str


@dataclass
class Comm:
    """One communicator's tuner context and the lines it logged."""

    plugin: TunerV5 | TunerV7
    ctx: ctypes.c_void_p
    lines: list[LogLine] = field(default_factory=list)
    init_rc: int = 0
    keep: list[object] = field(default_factory=list)  # ctypes objects that must outlive the context

    def call(self, collective: str, n_bytes: int, *, table: ctypes.Array[ctypes.Array[ctypes.c_float]] | None = None,
             num_algo: int = len(ALGORITHMS), num_proto: int = len(PROTOCOLS), channels_in: int = 0,
             null_table: bool = False, null_channels: bool = False, coll_index: int | None = None,
             ) -> tuple[int, list[list[float]], list[list[float]], int]:
        """getCollInfo once: (rc, cells before, cells after, nChannels after)."""
        t = cost_table() if table is None else table
        before = cells(t)
        nch = ctypes.c_int(channels_in)
        coll = COLLECTIVES.index(collective) if coll_index is None else coll_index
        rc = self.plugin.getCollInfo(self.ctx, coll, n_bytes, 1, None if null_table else ctypes.addressof(t),
                                     num_algo, num_proto, 0, None if null_channels else ctypes.byref(nch))
        return rc, before, cells(t), nch.value

    def finalize(self) -> int:
        return int(self.plugin.finalize(self.ctx))


def load(path: Path) -> tuple[ctypes.CDLL, TunerV5, TunerV6]:
    lib = ctypes.CDLL(str(path))
    return lib, TunerV5.in_dll(lib, "ncclTunerPlugin_v5"), TunerV6.in_dll(lib, "ncclTunerPlugin_v6")


def init(plugin: TunerV5 | TunerV7, n_ranks: int, n_nodes: int, nvl: tuple[int, int, int] | None = None, *,
         with_logger: bool = True, comm_id: int = 0x1234, constants: ctypes.Structure | None = None,
         host: NcclHost | None = None, nccl: str | None = "2.28.9") -> Comm:
    """init as NCCL calls it, from `host` (default_host()) reporting NCCL `nccl` (None: its
    ncclGetVersion fails); nvl is (nNvlDomains, min, max ranks per domain), None passes NULL, as
    do constants=None and with_logger=False (no logger: the plugin cannot find the host through it)."""
    lines: list[LogLine] = []

    def record(level: int, flags: int, fmt: bytes | None, msg: bytes | None) -> None:
        # An exception here would be swallowed by ctypes: record everything, the tests assert on it.
        lines.append(LogLine(level, flags, (fmt or b"").decode(), (msg or b"").decode()))

    nccl_host = host or default_host()
    nccl_host.set_version(nccl)
    sink = SINK(record)
    nccl_host.lib.host_set_sink(sink)
    logger = LOGGER(nccl_host.logger) if with_logger else LOGGER()
    info = NvlDomainInfo(*nvl) if nvl is not None else None
    ctx = ctypes.c_void_p()
    rc = plugin.init(ctypes.byref(ctx), comm_id, n_ranks, n_nodes, logger,
                     ctypes.byref(info) if info is not None else None,
                     ctypes.addressof(constants) if constants is not None else None)
    nccl_host.lib.host_set_sink(None)
    return Comm(plugin, ctx, lines, rc, [logger, info, constants, sink])


@contextmanager
def table_env(path: Path | str | None, fingerprint: str | None) -> Iterator[None]:
    """Set (or unset, for None) the two variables the plugin reads at init, restoring them after."""
    saved = {k: os.environ.get(k) for k in (TABLE_ENV, FINGERPRINT_ENV)}
    try:
        for key, value in ((TABLE_ENV, path), (FINGERPRINT_ENV, fingerprint)):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(value)
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
