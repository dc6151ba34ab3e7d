"""The catalogue of tunables: valid values, what to sweep by default, and validation.

Every value a user gives (config `sweep.variables`/`sweep.pin`, the environment, `--set`) is
validated here before anything runs, because NCCL silently ignores many invalid spellings
(`NCCL_P2P_LEVEL=nvl`, `NCCL_DEBUG_SUBSYS` with one bad token) and fails hard on others
(an unknown `NCCL_ALGO` token). Facts are from NCCL 2.28-2.30 (paths.cc, tuning.cc, misc/param.cc).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..collectives import TUNER_NAMES
from ..names import IDENTITY_VARIABLES

# Level names NCCL_P2P_LEVEL / NCCL_NET_GDR_LEVEL accept (case-sensitive). C2C and P2C exist only
# since 2.26/2.27: older NCCL silently ignores them, so nccltune never proposes them itself.
LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
PORTABLE_LEVELS = ("LOC", "NVL", "NVB", "PIX", "PXB", "PHB", "SYS")
# Legacy integers (paths.cc ncclGetLevel): 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and above SYS.
LEGACY_LEVEL = {0: "LOC", 1: "PIX", 2: "PXB", 3: "PHB"}
ALGOS = ("tree", "ring", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
PROTOS = ("ll", "ll128", "simple")
# The function names NCCL_ALGO/NCCL_PROTO's per-collective entries accept: NCCL's own spelling.
FUNCS = TUNER_NAMES


def level_of(value: str) -> str | None:
    """The level a P2P/GDR level value means to NCCL, or None if NCCL would ignore it."""
    if value in LEVELS:
        return value
    if value[:1].isdigit() and value.isdigit():
        n = int(value)
        return LEGACY_LEVEL.get(n, "SYS")
    return None


def _check_level(value: str) -> str | None:
    if level_of(value) is not None:
        return None
    if value.upper() in LEVELS:
        return (f"{value!r}: level names are case-sensitive; NCCL silently ignores {value!r} "
                f"(use {value.upper()!r})")
    return f"{value!r} is not a level: NCCL silently ignores it (use one of {', '.join(PORTABLE_LEVELS)})"


def _check_list(names: tuple[str, ...], what: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        entries = value.split(";")
        for i, entry in enumerate(entries):
            func, sep, items = entry.rpartition(":")
            if not sep:
                func, items = "", entry
                if i > 0:
                    return f"{value!r}: only the first entry may omit the function (NCCL fails init)"
            if func and func.lower() not in FUNCS:
                return f"{value!r}: unknown function {func!r} (one of {', '.join(FUNCS)})"
            items = items[1:] if items.startswith("^") else items
            for token in items.split(","):
                if token.strip().lower() not in names:
                    return (f"{value!r}: unknown {what} {token!r}; NCCL fails to initialise "
                            f"(one of {', '.join(names)})")
        return None

    return check


def _check_int(lo: int, hi: int, multiple: int = 1) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if not re.fullmatch(r"[0-9]+", value):
            return f"{value!r} is not a decimal integer (NCCL parses text like 'abc' as 0 without a word)"
        if value.startswith("0") and value != "0":
            return f"{value!r}: a leading 0 makes NCCL read it as octal"
        n = int(value)
        if not lo <= n <= hi:
            return f"{value} is outside {lo}..{hi}"
        if n % multiple:
            return f"{value} is not a multiple of {multiple}"
        return None

    return check


def _check_choice(*choices: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        return None if value in choices else f"{value!r} is not one of {', '.join(choices)}"

    return check


@dataclass(frozen=True)
class Tunable:
    name: str
    sweep: tuple[str, ...]  # values measured by default (the baseline "unset" is always measured)
    check: Callable[[str], str | None]
    doc: str
    kind: str = "perf"  # "perf": swept; "policy": chosen by config, never swept
    scope: str = "node"  # "node": intra-node all-reduce; "net": only with traffic over NICs
    default: str | None = None  # NCCL's default, when a value equal to it means "unset"
    # The variable without which this one usually changes nothing: screened on top of that
    # variable's best screened value, not alone (the search, strategy.Search).
    acts_with: str | None = None

    def validate(self, value: str) -> str | None:
        if value == "":
            return "empty value"
        return self.check(value)


CATALOGUE: dict[str, Tunable] = {t.name: t for t in (
    Tunable("NCCL_P2P_LEVEL", PORTABLE_LEVELS, _check_level,
            "highest path type over which GPUs use P2P (default PXB; SYS on AMD with <=2 GPUs)"),
    Tunable("NCCL_P2P_DISABLE", ("1",), _check_choice("0", "1"), "1 disables P2P (same as P2P_LEVEL=LOC)"),
    Tunable("NCCL_NET_GDR_LEVEL", PORTABLE_LEVELS, _check_level,
            "highest GPU-NIC path type for GPUDirect RDMA", scope="net"),
    Tunable("NCCL_NET_GDR_READ", ("0", "1"), _check_choice("0", "1"), "GPUDirect RDMA reads on send",
            scope="net"),
    Tunable("TORCH_NCCL_ASYNC_ERROR_HANDLING", (), _check_choice("0", "1", "2", "3"),
            "what PyTorch does on a collective error or timeout (3: kill the process without a "
            "possibly hanging ncclCommAbort; 1: abort then kill)", kind="policy"),
    Tunable("NCCL_ALGO", ("Ring", "Tree"), _check_list(ALGOS, "algorithm"), "algorithms allowed"),
    Tunable("NCCL_PROTO", ("Simple", "LL", "LL128"), _check_list(PROTOS, "protocol"), "protocols allowed"),
    Tunable("NCCL_MIN_NCHANNELS", ("16", "24", "32"), _check_int(1, 64), "at least this many channels"),
    Tunable("NCCL_MAX_NCHANNELS", ("8", "16"), _check_int(1, 64), "at most this many channels"),
    Tunable("NCCL_MIN_CTAS", (), _check_int(1, 64), "at least this many CTAs (overrides the app's config)"),
    Tunable("NCCL_MAX_CTAS", (), _check_int(1, 64), "at most this many CTAs (overrides the app's config)"),
    Tunable("NCCL_BUFFSIZE", ("2097152", "8388608"), _check_int(65536, 1 << 30),
            "Simple-protocol buffer per channel and peer, bytes", default="4194304"),
    Tunable("NCCL_NTHREADS", ("256",), _check_int(64, 512, 32), "threads per CTA for Simple/LL",
            default="512"),
    Tunable("NCCL_SHM_DISABLE", ("1",), _check_choice("0", "1"), "1 disables the shared-memory fallback",
            default="0"),
    Tunable("NCCL_CUMEM_ENABLE", ("0",), _check_choice("0", "1"),
            "P2P through cuMem handles (default: auto)"),
    Tunable("NCCL_PXN_DISABLE", ("1",), _check_choice("0", "1"), "1 disables PXN (NIC via a peer GPU)",
            scope="net", default="0"),
    Tunable("NCCL_CROSS_NIC", ("0", "1"), _check_choice("0", "1", "2"), "rings may change NIC between nodes",
            scope="net", default="2"),
    Tunable("NCCL_IB_QPS_PER_CONNECTION", ("2", "4"), _check_int(1, 128), "InfiniBand QPs per connection",
            scope="net", default="1"),
    # Socket transport only (transport/net_socket.cc): at most 16 threads and 64 sockets in all;
    # NCCL caps larger values itself. Unset (-2) is NCCL's auto, which depends on the NIC and is
    # not 1: set to 1 explicitly, each ran at twice the auto's bandwidth on the lent H100's
    # loopback (bench/results/h100x1-2026-12-07), so 1 is a candidate too.
    Tunable("NCCL_SOCKET_NTHREADS", ("1", "2", "4"), _check_int(1, 16), "socket transport: helper threads per "
            "connection", scope="net"),
    # NCCL opens threads x sockets-per-thread sockets, and its auto is 0 helper threads except on
    # AWS and GCP NICs (net_socket.cc ncclNetSocketGetNsockNthread): alone, sockets per thread is
    # NCCL's defaults on most nodes, so it is screened with the best number of threads.
    Tunable("NCCL_NSOCKS_PERTHREAD", ("1", "2", "4"), _check_int(1, 64), "socket transport: sockets per helper "
            "thread (threads x sockets at most 64)", scope="net", acts_with="NCCL_SOCKET_NTHREADS"),
    # 2 is NCCL's auto (nvls.cc ncclNvlsInit): the same as leaving the variable unset.
    Tunable("NCCL_NVLS_ENABLE", ("0",), _check_choice("0", "1", "2"),
            "NVLink SHARP (multicast); only ever swept towards 0, never forced on", default="2"),
)}

# Variables nccltune sets itself in trials, or that only steer diagnostics: never published
# from a sweep and never swept. NCCL's identity variables (names.IDENTITY_VARIABLES: NCCL_HOSTID
# names a node to NCCL, ranks with different values are different hosts; NCCL_COMM_ID one job's
# bootstrap ...) are each node's or job's own: from the calling environment they reach this node's
# own ranks only, never pinned, swept, sent to others or published (the config's reader refuses them).
MANAGED = {"NCCL_TOPO_FILE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_TOPO_DUMP_FILE",
           "NCCL_GRAPH_DUMP_FILE", *IDENTITY_VARIABLES}


def validate_value(name: str, value: str) -> str | None:
    """An error message if NCCL would reject or silently ignore this value, else None."""
    tunable = CATALOGUE.get(name)
    if tunable is None:
        return None
    return tunable.validate(value)


def unknown_variable_hint(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(CATALOGUE), n=1)
    return f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(CATALOGUE))}"
