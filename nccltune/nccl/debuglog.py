"""Reader for NCCL's own ``NCCL_DEBUG=INFO`` output.

NCCL tells us things no other source does: whether it really loaded the topology file we
published, which transport each channel ended up on, and which algorithm and protocol it picked
for each message size. This module turns that text into a frozen :class:`NcclLog`.

Formats follow ``debug.cc:ncclDebugLogV`` and were checked against a live 2.28.9 log (see
``tests/fixtures/nccllog/``). Each message pattern below cites the NCCL source file that prints
it. The parser is line-based and keeps no state from one line to the next. That way lines from
several ranks or processes may be interleaved in any order, and garbage, partial or truncated
lines are skipped rather than raised on. A line is accepted with any prefix before
``NCCL INFO`` / ``NCCL WARN``. That covers ``host:pid:tid [dev]``, an optional ``[timestamp]``,
the WARN ``file.cc:line`` part, and launcher prefixes such as mpirun's ``[1,4]<stdout>:``.

Standard library only: the daemon and CLI read logs without torch or any NCCL binding.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..collectives import COLLECTIVES
from ..logsetup import escaped

# Not "log": that is the name of the parsed-log parameter of the public functions below.
logger = logging.getLogger(__name__)

__all__ = [
    "GraphSearch",
    "NcclLog",
    "SizeChoice",
    "TuningChoice",
    "algo_proto_by_size",
    "choices_by_size",
    "nccl_func",
    "parse_nccl_log",
    "prevailing",
    "summarize",
]


@dataclass(frozen=True)
class TuningChoice:
    """One ``<Func>: <n> Bytes -> Algo <A> proto <P> channel{Lo..Hi}={lo..hi}`` line.

    Printed by rank 0 only, under the TUNING subsystem, once per collective launch
    (``src/enqueue.cc``; names since 2.25; 2.21-2.24 print numbers,
    which are kept as text).
    """

    func: str
    size_bytes: int
    algo: str
    proto: str
    channel_lo: int
    channel_hi: int


@dataclass(frozen=True)
class GraphSearch:
    """One graph search result (``src/graph/search.cc:ncclTopoPrintGraph``).

    ``pattern`` 4 is a ring, 1/2/3 are trees, 5 is NVLS. ``bw_*`` are GB/s per channel; the
    ``type_*`` fields are the path types the search settled for inside and between nodes.
    """

    pattern: int
    crossnic: int
    nchannels: int
    bw_intra: float
    bw_inter: float
    type_intra: str
    type_inter: str
    same_channels: int | None = None


@dataclass(frozen=True)
class NcclLog:
    """What an NCCL INFO log says, across every process whose lines it contains.

    Counts and lists add up over all ranks in the text; single values (``version``,
    ``network``, ...) keep the last value seen, except ``version``/``cuda_*`` which keep the
    first. Parse each rank's log on its own when per-rank values matter.

    ``transports`` counts ``... via ...`` connection lines by key. The keys are:

    * ``P2P/CUMEM``, ``P2P/IPC``, ``P2P/MNNVL``, ``P2P/direct pointer``, ``P2P/indirect``
      (``src/transport/p2p.cc``; the ``/read`` and ``/CE`` suffixes are folded in);
    * ``SHM/direct`` when both sides write directly, ``SHM/CE`` when either side uses the copy
      engine (``src/transport/shm.cc`` prints ``SHM/<send>/<recv>``; old versions one word);
    * ``NET/<plugin>`` or ``NET/<plugin>/GDRDMA``, e.g. ``NET/Socket``, ``NET/IB/GDRDMA``,
      ``NET/AWS Libfabric/GDRDMA`` (``src/transport/net.cc``; net device, PXN proxy rank,
      ``(PCI)`` and ``/Shared`` are folded in);
    * ``COLLNET`` for every CollNet connection (``src/transport/coll_net.cc``);
    * anything else: the first two ``/``-separated words after ``via``.

    ``topo_loaded`` turns True as soon as NCCL opens a topology file, before it parses it: a
    file that NCCL then rejects shows up in ``errors`` (``XML Parse ...``) and no
    ``Init COMPLETE`` follows.

    ``paths`` maps a base node (``GPU/0-60``) to {other node: (hops, GB/s, path type)}, as
    printed by ``src/graph/paths.cc:printNodePaths`` after P2P/GDR/PXN rerouting.
    """

    version: str | None = None
    cuda_version: str | None = None
    cuda_driver: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    topo_file: str | None = None
    topo_loaded: bool = False
    topo_name: str | None = None
    topo_open_error: str | None = None
    topo_hints: list[str] = field(default_factory=list)
    ignored_elements: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    network: str | None = None
    transports: dict[str, int] = field(default_factory=dict)
    tuning: list[TuningChoice] = field(default_factory=list)
    graphs: list[GraphSearch] = field(default_factory=list)
    paths: dict[str, dict[str, tuple[int, float, str]]] = field(default_factory=dict)
    coll_channels: int | None = None
    max_bw: float | None = None
    total_bw: float | None = None
    init_complete_ranks: set[int] = field(default_factory=set)
    nranks: int | None = None
    p2p_disabled_pairs: list[tuple[int, int]] = field(default_factory=list)
    # The file named by "Loading topology file X": differs from topo_file when NCCL picked up
    # /var/run/nvidia-topologyd/virtualTopology.xml on its own (topo.cc, no NCCL_TOPO_FILE).
    topo_loaded_file: str | None = None
    # "TUNER/Plugin: Using nccltune (v5)" (plugin/tuner.cc): the tuner plugin NCCL bound, by name
    # and ABI version; None when it loaded none. `tuner_notes`: what nccltune's own plugin said
    # at each init ("using table ...", "table ... is stale ...": nccltune_tuner.c), INFO or WARN.
    tuner: str | None = None
    tuner_notes: list[str] = field(default_factory=list)


# --- Line framing (debug.cc:ncclDebugLogV) -------------------------------------------------

_INFO_TAG = "NCCL INFO "
_WARN_TAG = "NCCL WARN "

# --- Message patterns (applied to the text after "NCCL INFO " / "NCCL WARN ") --------------
# re.ASCII so that \d and \w never match other scripts' digits in garbage input.
_A = re.ASCII

# init.cc:showVersion. Also printed without any prefix under NCCL_DEBUG=VERSION, so it is
# searched for in the whole line.
_VERSION_RE = re.compile(r"NCCL version (\d+)\.(\d+)\.(\d+)([^\s+]*)\+cuda(\d+)\.(\d+)", _A)
_DRIVER_RE = re.compile(r"^cudaDriverVersion (\d+)", _A)
# misc/param.cc:ncclLoadParam prints numbers as "%s set by environment to %lld." (with the
# period); string variables are echoed by the code that reads them, e.g. topo.cc for
# NCCL_TOPO_FILE, init.cc for NCCL_COLLNET_ENABLE ("%s." again).
_ENV_RE = re.compile(r"^(NCCL_[A-Z0-9_]+) set by environment to ?(.*)$", _A)
_NUMERIC_WITH_PERIOD_RE = re.compile(r"^-?\d+\.$", _A)
# graph/xml.cc:ncclTopoGetXmlFromFile / ncclTopoXmlLoadSystem. "Could not open" is INFO in
# current releases (live on 2.28.9) and a WARN in older ones; either way NCCL goes on with
# auto-detection.
_TOPO_LOAD_FILE_RE = re.compile(r"^Loading topology file (.+)$", _A)
_TOPO_LOAD_NAME_RE = re.compile(r"^Loading topology (.+)$", _A)
_TOPO_UNNAMED_RE = re.compile(r"Loading unnamed topology", _A)
_TOPO_OPEN_ERROR_RE = re.compile(r"^Could not open XML topology file (.*?) : (.*)$", _A)
# graph/xml.h:kvConvertToInt and printMissingTopoDictValueHint / printMissingTopoAttrHint;
# xml.cc:xmlGetNode for extra attributes. All are signs of a faulty topology file.
_TOPO_HINT_RE = re.compile(
    r"^(?:KV Convert to int : could not find value|HINT: |XML Parse : Ignoring extra attributes)", _A
)
# graph/xml.cc:xmlLoadSub
_IGNORED_ELEMENT_RE = re.compile(r"^Ignoring element (\S+)", _A)
# init.cc / net.cc: the network plugin may have a space in its name ("AWS Libfabric").
_NETWORK_RE = re.compile(r"^Using network (.+)$", _A)
# transport/{p2p,shm,net,coll_net}.cc. Channel ids are "%02d/%d" now and "%02d" in older
# releases; peers are "rank[nvmlDev]" now and "rank[busId hex]" in older releases.
_VIA_RE = re.compile(r"^(?:Channel|CollNet|Coll|Ring) \d+(?:/\d+)? : .*? via (.+)$", _A)
_NET_VIA_RE = re.compile(r"^NET/(.+?)/\d+(?:\(\d+\))?(.*)$", _A)
# enqueue.cc (TUNING). Some builds append " comm 0x...", so the end is not anchored.
_TUNING_RE = re.compile(
    r"^(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+) channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}", _A
)
# graph/search.cc:ncclTopoPrintGraph; older releases print "speed" instead of "bw".
_GRAPH_RE = re.compile(
    r"^Pattern (\d+), crossNic (\d+), nChannels (\d+), (?:bw|speed) ([\d.]+)/([\d.]+), "
    r"type (\w+)/(\w+)(?:, sameChannels (\d+))?",
    _A,
)
# graph/topo.cc:ncclTopoPrint
_SYSTEM_RE = re.compile(r"^=== System : maxBw ([\d.]+) totalBw ([\d.]+) ===", _A)
# graph/paths.cc:printNodePaths: "%s/%lx-%lx :" then " %s/%lx-%lx (%d/%.1f/%s)" per node.
# Older releases print ids as a single "%lX". Lines are cut at 1024 characters, so only complete
# entries are taken.
_NODE = r"[A-Z]+/[0-9A-Fa-f]+(?:-[0-9A-Fa-f]+)?"
_PATH_BASE_RE = re.compile(rf"^({_NODE}) :(.*)$", _A)
_PATH_ENTRY_RE = re.compile(rf"({_NODE}) \((\d+)/([\d.]+)/(\w+)\)", _A)
# init.cc
_COLL_CHANNELS_RE = re.compile(r"(?:^|\s)(\d+) coll channels,", _A)
_INIT_COMPLETE_RE = re.compile(r"\brank (\d+) nranks (\d+)\b.*Init COMPLETE", _A)
_COMM_SUMMARY_RE = re.compile(r"\brank (\d+) nRanks (\d+) nNodes (\d+)", _A)
# plugin/tuner.cc: the plugin NCCL bound; nccltune_tuner.c prefixes every line it logs.
_TUNER_RE = re.compile(r"^TUNER/Plugin: Using (.+)$", _A)
TUNER_NOTE_PREFIX = "nccltune tuner: "
_TUNER_NOTE_RE = re.compile(re.escape(TUNER_NOTE_PREFIX) + "(.*)", _A | re.DOTALL)
# graph/paths.cc:ncclTopoCheckP2p (INFO; the NVLINK variant is a WARN and fails the init).
_P2P_DISABLED_RE = re.compile(r"P2P is disabled between (?:NVLINK )?connected GPUs (\d+) and (\d+)", _A)

# WARN messages that mean the communicator (or the collective) failed, not just a remark.
_FAILURE_WARN_RES = (
    re.compile(r"^XML (?:Parse|Mismatch)", _A),  # graph/xml.cc parser, fatal (ncclInternalError)
    re.compile(r"^XML Topology has wrong version", _A),  # xml.cc, ncclInvalidUsage
    re.compile(r"^Attribute \S+ of node \S+ not found", _A),  # graph/xml.h:xmlGetAttrStr
    re.compile(r"^Error\b", _A),  # "Error : ..." limits in xml.cc; enqueue.cc no algo/proto
    re.compile(r"no algorithm/protocol available", _A),  # enqueue.cc (older text has no "Error :")
    # xml.h: "to str" always fails; "to int" was a fatal WARN in old releases (seen on 2.8.3)
    # and is an INFO with a fallback value now.
    re.compile(r"^KV Convert to (?:str|int)", _A),
    re.compile(r"P2P is disabled between NVLINK connected GPUs", _A),  # paths.cc, ncclUnhandledCudaError
    re.compile(r"\b(?:failure|failed|timeout|timed out|abort(?:ed|ing)?)\b", _A | re.IGNORECASE),
)
# Plugin lookups ("Failed to find ncclNetPlugin symbol", ...) were WARNs in some releases but
# only mean "use the built-in one", so they never count as failures.
_BENIGN_WARN_RE = re.compile(r"plugin", _A | re.IGNORECASE)


Number = TypeVar("Number", int, float)


def number(text: str, kind: type[Number]) -> Number | None:
    """`kind(text)`, or None where the text is no such number: a line of a tool's output is read,
    never trusted (a garbage line may hold 5000 digits, which int() refuses)."""
    try:
        return kind(text)
    except ValueError:
        return None


def _transport_key(via: str) -> str:
    """Collapse the text after ``via`` to one of the keys documented on :class:`NcclLog`."""
    via = via.strip()
    if via.startswith("P2P/"):
        mode = via[len("P2P/") :]
        for fixed in ("direct pointer", "indirect"):
            if mode.startswith(fixed):
                return f"P2P/{fixed}"
        return "P2P/" + mode.split("/", 1)[0]
    if via.startswith("SHM/"):
        sides = via[len("SHM/") :].split("/")
        return "SHM/CE" if "CE" in sides else "SHM/direct"
    if via.startswith("NET/"):
        m = _NET_VIA_RE.match(via)
        if m is None:
            return "NET/" + via[len("NET/") :].split("/", 1)[0]
        return f"NET/{m.group(1)}" + ("/GDRDMA" if "/GDRDMA" in m.group(2) else "")
    if via.startswith("COLLNET/"):
        return "COLLNET"
    return "/".join(via.split("/")[:2])


def _is_failure(warning: str) -> bool:
    if _BENIGN_WARN_RE.search(warning):
        return False
    return any(r.search(warning) for r in _FAILURE_WARN_RES)


# The ranks write the log, so what it holds is bounded where it is kept: a line longer than
# MAX_LINE_CHARS is no line of NCCL's (its longest, a GPU's path line on a big node, is a few
# hundred characters) and is skipped; every other line is escaped as it is read
# (logsetup.escaped: no newline, no terminal escape reaches a report or a log); each kept message
# (a warning, an error, a hint, a tuner note, an ignored element) is cut to MAX_MESSAGE_CHARS, and
# at most MAX_KEPT_MESSAGES of each kind are kept: a real log has a handful.
MAX_LINE_CHARS = 16 << 10
MAX_MESSAGE_CHARS = 500
MAX_KEPT_MESSAGES = 200


def _keep(into: list[str], msg: str) -> None:
    if len(into) < MAX_KEPT_MESSAGES:
        into.append(msg[:MAX_MESSAGE_CHARS])


class _Builder:
    """Mutable accumulator; frozen into an :class:`NcclLog` at the end."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.cuda_version: str | None = None
        self.cuda_driver: int | None = None
        self.env: dict[str, str] = {}
        self.topo_file: str | None = None
        self.topo_loaded = False
        self.topo_loaded_file: str | None = None
        self.topo_name: str | None = None
        self.topo_open_error: str | None = None
        self.topo_hints: list[str] = []
        self.ignored_elements: list[str] = []
        self.warnings: list[str] = []
        self.errors: list[str] = []
        self.network: str | None = None
        self.transports: Counter[str] = Counter()
        self.tuning: list[TuningChoice] = []
        self.graphs: list[GraphSearch] = []
        self.paths: dict[str, dict[str, tuple[int, float, str]]] = {}
        self.coll_channels: int | None = None
        self.max_bw: float | None = None
        self.total_bw: float | None = None
        self.init_complete_ranks: set[int] = set()
        self.nranks: int | None = None
        self.p2p_disabled_pairs: list[tuple[int, int]] = []
        self.tuner: str | None = None
        self.tuner_notes: list[str] = []

    def line(self, line: str) -> None:
        if len(line) > MAX_LINE_CHARS:
            return
        line = escaped(line, None)
        if self.version is None:
            self._version(line)
        # When two processes' writes collide on one line, the tag that comes last starts the
        # only message that can still be whole.
        warn_at, info_at = line.rfind(_WARN_TAG), line.rfind(_INFO_TAG)
        if warn_at > info_at:
            self._warn(line[warn_at + len(_WARN_TAG) :].strip())
        elif info_at >= 0:
            self._info(line[info_at + len(_INFO_TAG) :].strip())

    def _version(self, line: str) -> None:
        m = _VERSION_RE.search(line)
        if m is None:
            return
        major, minor, patch, suffix, cuda_major, cuda_minor = m.groups()
        self.version = f"{major}.{minor}.{patch}{suffix}"
        self.cuda_version = f"{cuda_major}.{cuda_minor}"

    def _warn(self, msg: str) -> None:
        _keep(self.warnings, msg)
        note = _TUNER_NOTE_RE.match(msg)
        if note is not None:
            self._tuner_note(note)
        if _is_failure(msg):
            _keep(self.errors, msg)
        # Releases before 2.2x printed these topology messages as WARN, not INFO.
        self._first_of(_TOPOLOGY_MESSAGES, msg)
        m = _P2P_DISABLED_RE.search(msg)
        if m is not None:
            self._p2p_pair(m)

    def _info(self, msg: str) -> None:
        self._first_of(_INFO_MESSAGES, msg)

    def _first_of(self, kinds: tuple[tuple[_Find, _Take], ...], msg: str) -> None:
        """The first kind of message `msg` is, in the order of `kinds`, takes it; none: skipped."""
        for find, take in kinds:
            m = find(msg)
            if m is not None:
                take(self, m)
                return

    def _transport(self, m: re.Match[str]) -> None:
        self.transports[_transport_key(m.group(1))] += 1

    def _tuner_note(self, m: re.Match[str]) -> None:
        _keep(self.tuner_notes, m.group(1))

    def _tuner(self, m: re.Match[str]) -> None:
        self.tuner = m.group(1).strip()

    def _topo_file_loaded(self, m: re.Match[str]) -> None:
        self.topo_loaded = True
        self.topo_loaded_file = m.group(1).strip()

    def _topo_unnamed_loaded(self, m: re.Match[str]) -> None:
        self.topo_loaded = True

    def _topo_named_loaded(self, m: re.Match[str]) -> None:
        # <system name="file"> prints "Loading topology file" with nothing after it.
        self.topo_loaded = True
        self.topo_name = m.group(1).strip()

    def _topo_open_error(self, m: re.Match[str]) -> None:
        self.topo_open_error = m.group(2).strip()[:MAX_MESSAGE_CHARS]

    def _topo_hint(self, m: re.Match[str]) -> None:
        _keep(self.topo_hints, m.string)

    def _ignored_element(self, m: re.Match[str]) -> None:
        _keep(self.ignored_elements, m.group(1))

    def _system(self, m: re.Match[str]) -> None:
        self.max_bw = number(m.group(1), float)
        self.total_bw = number(m.group(2), float)

    def _driver(self, m: re.Match[str]) -> None:
        self.cuda_driver = number(m.group(1), int)

    def _network(self, m: re.Match[str]) -> None:
        self.network = m.group(1).strip()

    def _coll_channels(self, m: re.Match[str]) -> None:
        self.coll_channels = number(m.group(1), int)

    def _init_complete(self, m: re.Match[str]) -> None:
        rank, nranks = number(m.group(1), int), number(m.group(2), int)
        if rank is not None:
            self.init_complete_ranks.add(rank)
        if nranks is not None:
            self.nranks = nranks

    def _comm_summary(self, m: re.Match[str]) -> None:
        nranks = number(m.group(2), int)
        if nranks is not None:
            self.nranks = nranks

    def _env(self, m: re.Match[str]) -> None:
        name, value = m.group(1), m.group(2).strip()
        if _NUMERIC_WITH_PERIOD_RE.match(value):
            value = value[:-1]
        self.env[name] = value
        if name == "NCCL_TOPO_FILE":
            self.topo_file = value

    def _tuning(self, m: re.Match[str]) -> None:
        size, lo, hi = number(m.group(2), int), number(m.group(5), int), number(m.group(6), int)
        if size is None or lo is None or hi is None:
            return
        self.tuning.append(TuningChoice(m.group(1), size, m.group(3), m.group(4), lo, hi))

    def _graph(self, m: re.Match[str]) -> None:
        pattern, crossnic, nchannels = number(m.group(1), int), number(m.group(2), int), number(m.group(3), int)
        bw_intra, bw_inter = number(m.group(4), float), number(m.group(5), float)
        if pattern is None or crossnic is None or nchannels is None or bw_intra is None or bw_inter is None:
            return
        same = number(m.group(8), int) if m.group(8) is not None else None
        self.graphs.append(
            GraphSearch(pattern, crossnic, nchannels, bw_intra, bw_inter, m.group(6), m.group(7), same)
        )

    def _path_line(self, m: re.Match[str]) -> None:
        row = self.paths.setdefault(m.group(1), {})
        for node, hops_text, bw_text, path_type in _PATH_ENTRY_RE.findall(m.group(2)):
            hops, bw = number(hops_text, int), number(bw_text, float)
            if hops is not None and bw is not None:
                row[node] = (hops, bw, path_type)

    def _p2p_pair(self, m: re.Match[str]) -> None:
        ga, gb = number(m.group(1), int), number(m.group(2), int)
        if ga is None or gb is None:
            return
        pair = (ga, gb)
        if pair not in self.p2p_disabled_pairs:
            self.p2p_disabled_pairs.append(pair)

    def build(self) -> NcclLog:
        return NcclLog(
            version=self.version,
            cuda_version=self.cuda_version,
            cuda_driver=self.cuda_driver,
            env=self.env,
            topo_file=self.topo_file,
            topo_loaded=self.topo_loaded,
            topo_name=self.topo_name,
            topo_open_error=self.topo_open_error,
            topo_hints=self.topo_hints,
            ignored_elements=self.ignored_elements,
            warnings=self.warnings,
            errors=self.errors,
            network=self.network,
            transports=dict(self.transports),
            tuning=self.tuning,
            graphs=self.graphs,
            paths=self.paths,
            coll_channels=self.coll_channels,
            max_bw=self.max_bw,
            total_bw=self.total_bw,
            init_complete_ranks=self.init_complete_ranks,
            nranks=self.nranks,
            p2p_disabled_pairs=self.p2p_disabled_pairs,
            topo_loaded_file=self.topo_loaded_file,
            tuner=self.tuner,
            tuner_notes=self.tuner_notes,
        )


# How a kind of message is found in a message's text, and what the builder takes from it.
_Find = Callable[[str], re.Match[str] | None]
_Take = Callable[[_Builder, re.Match[str]], None]

# The topology file's messages, INFO now and WARN in releases before 2.2x.
_TOPOLOGY_MESSAGES: tuple[tuple[_Find, _Take], ...] = (
    (_TOPO_LOAD_FILE_RE.match, _Builder._topo_file_loaded),
    (_TOPO_UNNAMED_RE.fullmatch, _Builder._topo_unnamed_loaded),
    (_TOPO_LOAD_NAME_RE.match, _Builder._topo_named_loaded),
    (_TOPO_OPEN_ERROR_RE.match, _Builder._topo_open_error),
    (_TOPO_HINT_RE.match, _Builder._topo_hint),
    (_IGNORED_ELEMENT_RE.match, _Builder._ignored_element),
)
# INFO messages, the first kind that matches taking one; the cheapest and most frequent first:
# the transport and tuning lines dominate big logs.
_INFO_MESSAGES: tuple[tuple[_Find, _Take], ...] = (
    (_VIA_RE.match, _Builder._transport),
    (_TUNING_RE.match, _Builder._tuning),
    (_PATH_BASE_RE.match, _Builder._path_line),
    (_ENV_RE.match, _Builder._env),
    (_TUNER_NOTE_RE.match, _Builder._tuner_note),
    (_TUNER_RE.match, _Builder._tuner),
    *_TOPOLOGY_MESSAGES,
    (_GRAPH_RE.match, _Builder._graph),
    (_SYSTEM_RE.match, _Builder._system),
    (_DRIVER_RE.match, _Builder._driver),
    (_NETWORK_RE.match, _Builder._network),
    (_COLL_CHANNELS_RE.search, _Builder._coll_channels),
    (_INIT_COMPLETE_RE.search, _Builder._init_complete),
    (_COMM_SUMMARY_RE.search, _Builder._comm_summary),
    (_P2P_DISABLED_RE.search, _Builder._p2p_pair),
)


def parse_nccl_log(text: str) -> NcclLog:
    """Parse the text of an ``NCCL_DEBUG=INFO`` log (one rank, or several interleaved).

    Lines that are not NCCL's, or that are cut short or garbled, are skipped; the parser never
    raises on content. CRLF and lone CR line ends are accepted. What it keeps as text is escaped
    and bounded (MAX_MESSAGE_CHARS, MAX_KEPT_MESSAGES): the ranks wrote the log.
    """
    builder = _Builder()
    for line in text.splitlines():
        builder.line(line)
    result = builder.build()
    logger.debug(
        "parsed NCCL log: version %s, %d warnings, %d tuning lines",
        result.version,
        len(result.warnings),
        len(result.tuning),
    )
    return result


@dataclass(frozen=True)
class SizeChoice:
    """What NCCL used for one message size: algorithm, protocol and channel count."""

    algo: str
    proto: str
    channels: int | None = None

    @property
    def label(self) -> str:
        """"RING/LL": how reports name the choice."""
        return f"{self.algo}/{self.proto}"


def nccl_func(collective: str) -> str | None:
    """NCCL's name for a collective in its per-size TUNING lines (all_reduce -> AllReduce,
    all_to_all -> AlltoAll); None for a collective NCCL logs no such line for (send/recv) or one
    nccltune does not know."""
    known = COLLECTIVES.get(collective)
    return known.log_func if known else None


def prevailing(choices: Iterable[SizeChoice]) -> SizeChoice | None:
    """THE rule for the choice NCCL made at one size when it was seen several times (several
    launches, communicators, trials or repeats): the most frequent wins; on a tie, the one seen
    first. None when there was none."""
    counts = Counter(choices)
    return counts.most_common(1)[0][0] if counts else None


def choices_by_size(log: NcclLog, func: str = "AllReduce") -> dict[int, SizeChoice]:
    """Algorithm, protocol and channels NCCL chose for each message size of ``func`` (NCCL's
    name, see :func:`nccl_func`), sorted by size, under :func:`prevailing`."""
    by_size: dict[int, list[SizeChoice]] = {}
    for c in log.tuning:
        if c.func == func:
            channels = c.channel_hi - c.channel_lo + 1 if c.channel_hi >= c.channel_lo else None
            by_size.setdefault(c.size_bytes, []).append(SizeChoice(c.algo, c.proto, channels))
    out: dict[int, SizeChoice] = {}
    for size in sorted(by_size):
        # Channels vary with the launch; the algorithm and protocol decide, the channels of the
        # first launch with that pair come along.
        pair = prevailing(SizeChoice(c.algo, c.proto) for c in by_size[size])
        assert pair is not None
        out[size] = next(c for c in by_size[size] if (c.algo, c.proto) == (pair.algo, pair.proto))
    return out


def algo_proto_by_size(log: NcclLog, func: str = "AllReduce") -> dict[int, tuple[str, str]]:
    """Algorithm and protocol NCCL chose for each message size of ``func``, sorted by size
    (the rule of :func:`prevailing`)."""
    return {size: (c.algo, c.proto) for size, c in choices_by_size(log, func).items()}


def summarize(log: NcclLog) -> dict[str, Any]:
    """A JSON-able digest of ``log`` for reports (the caller adds ``schema_version``).

    Sizes become string keys, since JSON object keys are strings.
    """
    return {
        "version": log.version,
        "cuda_version": log.cuda_version,
        "topo_file": log.topo_file,
        "topo_loaded": log.topo_loaded,
        "topo_loaded_file": log.topo_loaded_file,
        "topo_name": log.topo_name,
        "topo_open_error": log.topo_open_error,
        "topo_hint_count": len(log.topo_hints),
        "ignored_elements": list(log.ignored_elements),
        "warnings": list(log.warnings),
        "errors": list(log.errors),
        "network": log.network,
        "transports": dict(sorted(log.transports.items())),
        "coll_channels": log.coll_channels,
        "max_bw_gbps": log.max_bw,
        "total_bw_gbps": log.total_bw,
        "nranks": log.nranks,
        "init_complete_ranks": sorted(log.init_complete_ranks),
        "p2p_disabled_pairs": [list(pair) for pair in log.p2p_disabled_pairs],
        "allreduce_algo_proto": {
            str(size): {"algo": algo, "proto": proto}
            for size, (algo, proto) in algo_proto_by_size(log, "AllReduce").items()
        },
    }
