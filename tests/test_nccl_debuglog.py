"""Tests for nccltune.nccl.debuglog against a real NCCL 2.28.9 log and hand-written ones."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from conftest import NCCL_LOGS

from nccltune.nccl.debuglog import (
    GraphSearch,
    NcclLog,
    SizeChoice,
    TuningChoice,
    algo_proto_by_size,
    choices_by_size,
    nccl_func,
    parse_nccl_log,
    prevailing,
    summarize,
)

FIXTURES = NCCL_LOGS


def _read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def h200() -> NcclLog:
    return parse_nccl_log(_read("h200x2-init-rank0.txt"))


# --- The real 2.28.9 log (2x H200, NVSwitch, VM) -------------------------------------------


def test_h200_version_and_driver(h200: NcclLog) -> None:
    assert h200.version == "2.28.9"
    assert h200.cuda_version == "13.0"
    assert h200.cuda_driver == 13000


def test_h200_env_strips_the_period_of_numbers(h200: NcclLog) -> None:
    assert h200.env["NCCL_NVLS_ENABLE"] == "0"
    assert h200.env["NCCL_TOPO_DUMP_FILE"] == "./nccl_topo_dump.xml"
    assert h200.env["NCCL_GRAPH_DUMP_FILE"] == "./nccl_graph_dump.xml"
    assert "NCCL_TOPO_FILE" not in h200.env


def test_h200_no_topology_file(h200: NcclLog) -> None:
    assert h200.topo_file is None
    assert h200.topo_loaded is False
    assert h200.topo_loaded_file is None
    assert h200.topo_open_error is None
    assert h200.topo_hints == []
    assert h200.ignored_elements == []


def test_h200_system_and_paths(h200: NcclLog) -> None:
    assert h200.max_bw == pytest.approx(370.8)
    assert h200.total_bw == pytest.approx(370.8)
    assert h200.paths["GPU/0-60"]["GPU/0-70"] == (2, 370.8, "NVL")
    assert h200.paths["GPU/0-60"]["GPU/0-60"] == (0, 5000.0, "LOC")
    assert h200.paths["GPU/0-70"]["NVS/0-0"] == (1, 370.8, "NVL")
    assert h200.paths["GPU/0-60"]["CPU/0-ffffffffffffff"] == (1, 48.0, "PHB")
    assert h200.paths["NET/0-0"]["GPU/0-70"] == (3, 1.2, "PHB")
    assert set(h200.paths) == {"GPU/0-60", "GPU/0-70", "NET/0-0"}


def test_h200_graphs(h200: NcclLog) -> None:
    assert h200.graphs == [
        GraphSearch(4, 0, 12, 30.0, 30.0, "NVL", "PIX", 1),
        GraphSearch(1, 0, 12, 60.0, 60.0, "NVL", "PIX", 0),
    ]


def test_h200_channels_network_init(h200: NcclLog) -> None:
    assert h200.coll_channels == 24
    assert h200.network == "Socket"
    assert h200.init_complete_ranks == {0}
    assert h200.nranks == 2
    assert h200.p2p_disabled_pairs == []
    assert h200.warnings == []
    assert h200.errors == []


def test_h200_transports(h200: NcclLog) -> None:
    # 24 ring channels, 0[0] -> 1[1], all over cuMem-based P2P on NVLink.
    assert h200.transports == {"P2P/CUMEM": 24}


def test_h200_tuning(h200: NcclLog) -> None:
    assert len(h200.tuning) == 150
    assert h200.tuning[0] == TuningChoice("AllReduce", 1024, "RING", "LL", 0, 0)
    assert TuningChoice("AllReduce", 16777216, "RING", "SIMPLE", 0, 23) in h200.tuning
    assert algo_proto_by_size(h200) == {
        1024: ("RING", "LL"),
        65536: ("RING", "LL"),
        1048576: ("RING", "LL"),
        16777216: ("RING", "SIMPLE"),
        268435456: ("RING", "SIMPLE"),
        1073741824: ("RING", "SIMPLE"),
    }
    assert algo_proto_by_size(h200, "AllGather") == {}


def test_h200_summary_is_json(h200: NcclLog) -> None:
    summary = summarize(h200)
    assert json.loads(json.dumps(summary)) == summary
    assert summary["version"] == "2.28.9"
    assert summary["topo_loaded"] is False
    assert summary["topo_file"] is None
    assert summary["topo_hint_count"] == 0
    assert summary["warnings"] == []
    assert summary["transports"] == {"P2P/CUMEM": 24}
    assert summary["allreduce_algo_proto"]["16777216"] == {"algo": "RING", "proto": "SIMPLE"}
    assert list(summary["allreduce_algo_proto"]) == [
        "1024",
        "65536",
        "1048576",
        "16777216",
        "268435456",
        "1073741824",
    ]


def test_full_prefix_parses_the_same(h200: NcclLog) -> None:
    assert parse_nccl_log(_read("h200x2-init-rank0-prefixed.txt")) == h200


def test_crlf_and_timestamps_parse_the_same(h200: NcclLog) -> None:
    lines = _read("h200x2-init-rank0-prefixed.txt").splitlines()
    text = "".join(f"[2026-11-30 12:00:{i % 60:02d}] {line}\r\n" for i, line in enumerate(lines))
    assert parse_nccl_log(text) == h200


def test_line_order_does_not_matter(h200: NcclLog) -> None:
    # Ranks interleave their lines arbitrarily; nothing may depend on the line before.
    lines = _read("h200x2-init-rank0-prefixed.txt").splitlines()
    random.Random(1584).shuffle(lines)
    shuffled = parse_nccl_log("\n".join(lines))
    assert shuffled.transports == h200.transports
    assert Counter(shuffled.tuning) == Counter(h200.tuning)
    assert Counter(shuffled.graphs) == Counter(h200.graphs)
    assert shuffled.paths == h200.paths
    assert shuffled.env == h200.env
    assert shuffled.version == h200.version
    assert algo_proto_by_size(shuffled) == algo_proto_by_size(h200)


# --- Topology file messages ------------------------------------------------------------------


def test_topology_file_loaded_with_hints() -> None:
    log = parse_nccl_log(_read("topo-loaded-hints.txt"))
    assert log.topo_file == "/var/lib/nccltune/ncclTopology.xml"
    assert log.env["NCCL_TOPO_FILE"] == "/var/lib/nccltune/ncclTopology.xml"
    assert log.topo_loaded is True
    assert log.topo_loaded_file == "/var/lib/nccltune/ncclTopology.xml"
    assert log.topo_name is None
    assert log.topo_open_error is None
    assert log.ignored_elements == ["nvswitch"]
    assert len(log.topo_hints) == 3
    assert log.topo_hints[0].startswith("KV Convert to int : could not find value of ''")
    assert log.topo_hints[1].startswith("HINT: In many cases this error indicates missing or faulty")
    assert log.topo_hints[2].startswith("HINT: To confirm, set NCCL_TOPO_DUMP_FILE")
    assert log.errors == []
    assert log.version == "2.28.9"
    assert log.cuda_version == "12.9"
    assert log.network == "IB"
    assert log.coll_channels == 32
    assert log.nranks == 8
    assert summarize(log)["topo_hint_count"] == 3


def test_named_topology() -> None:
    log = parse_nccl_log(
        "h:1:1 [0] NCCL INFO Loading topology file /x.xml\nh:1:1 [0] NCCL INFO Loading topology dgx-h200\n"
    )
    assert log.topo_loaded is True
    assert log.topo_loaded_file == "/x.xml"
    assert log.topo_name == "dgx-h200"


def test_unnamed_topology_alone_counts_as_loaded() -> None:
    log = parse_nccl_log("h:1:1 [0] NCCL INFO Loading unnamed topology\n")
    assert log.topo_loaded is True
    assert log.topo_name is None


def test_topology_file_that_cannot_be_opened() -> None:
    log = parse_nccl_log(_read("topo-open-failed.txt"))
    assert log.topo_file == "/etc/nccltune/missing.xml"
    assert log.topo_loaded is False
    assert log.topo_open_error == "No such file or directory"
    assert log.errors == []
    assert log.init_complete_ranks == {0}
    summary = summarize(log)
    assert summary["topo_open_error"] == "No such file or directory"


def test_could_not_open_as_warn_in_older_releases() -> None:
    text = "h:1:1 [0] xml.cc:386 NCCL WARN Could not open XML topology file /x.xml : Permission denied\n"
    log = parse_nccl_log(text)
    assert log.topo_open_error == "Permission denied"
    assert log.warnings == ["Could not open XML topology file /x.xml : Permission denied"]
    assert log.errors == []


def test_xml_declaration_is_a_fatal_parse_error() -> None:
    log = parse_nccl_log(_read("topo-xml-declaration.txt"))
    assert log.topo_file == "/tmp/with-declaration.xml"
    assert log.topo_loaded is True  # "Loading topology file" comes before the parse
    assert log.topo_name is None
    assert log.warnings == ["XML Parse : expected >, got '?'"]
    assert log.errors == ["XML Parse : expected >, got '?'"]
    assert log.init_complete_ranks == set()
    assert summarize(log)["errors"] == ["XML Parse : expected >, got '?'"]


@pytest.mark.parametrize(
    ("message", "is_error"),
    [
        ("XML Topology has wrong version 2, 1 needed", True),
        ("Attribute busid of node nic not found", True),
        ("Error : no algorithm/protocol available for function AllReduce with datatype ncclFloat32.", True),
        ("Error : XML parser is limited to 256 nodes", True),
        ("XML Mismatch : pci / cpu", True),
        ("KV Convert to str : could not find value 7 in dictionary", True),
        ("Cuda failure 'out of memory'", True),
        ("Net : Call to recv from 10.0.0.2<43215> failed : Connection reset by peer", True),
        ("NET/Plugin: Failed to find ncclNetPlugin_v8 symbol.", False),
        ('Missing "iommu=pt" from kernel command line which can lead to system instablity or hang!', False),
        ("Could not open XML topology file /x.xml : No such file or directory", False),
    ],
)
def test_warn_classification(message: str, is_error: bool) -> None:
    line = f"[2026-11-30 12:00:00] host:10:11 [0] some.cc:12 NCCL WARN {message}\n"
    log = parse_nccl_log(line)
    assert log.warnings == [message]
    assert log.errors == ([message] if is_error else [])


def test_hint_after_missing_attribute() -> None:
    text = (
        "\n[2026-11-30 12:00:00] h:5:5 [0] xml.h:98 NCCL WARN Attribute busid of node nic not found\n"
        "h:5:5 [0] NCCL INFO HINT: In many cases this error indicates that NCCL could not obtain "
        "complete PCI topology information, which inside a container is often caused by running "
        "with '--net host'.\n"
    )
    log = parse_nccl_log(text)
    assert log.errors == ["Attribute busid of node nic not found"]
    assert len(log.topo_hints) == 1


def test_ignored_elements_and_extra_attributes() -> None:
    text = (
        "h:1:1 [0] NCCL INFO Loading topology file /x.xml\n"
        "h:1:1 [0] NCCL INFO Loading unnamed topology\n"
        "h:1:1 [0] NCCL INFO Ignoring element nvswitch\n"
        "h:1:1 [0] NCCL INFO Ignoring element comment\n"
        "h:1:1 [0] NCCL INFO XML Parse : Ignoring extra attributes (max 16)\n"
    )
    log = parse_nccl_log(text)
    assert log.ignored_elements == ["nvswitch", "comment"]
    assert log.topo_hints == ["XML Parse : Ignoring extra attributes (max 16)"]
    assert log.errors == []


# --- Transports, tuning, several processes ---------------------------------------------------


def test_two_nodes_interleaved() -> None:
    log = parse_nccl_log(_read("two-nodes-interleaved.txt"))
    assert log.transports == {
        "NET/IB/GDRDMA": 3,
        "SHM/direct": 1,
        "SHM/CE": 1,
        "P2P/IPC": 1,
        "P2P/direct pointer": 1,
        "NET/Socket": 1,
        "COLLNET": 1,
    }
    assert log.network == "IB"
    assert log.env == {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_P2P_LEVEL": "NVL"}
    assert log.p2p_disabled_pairs == [(0, 1)]
    assert log.init_complete_ranks == {0, 2}
    assert log.nranks == 4
    assert algo_proto_by_size(log) == {
        4096: ("TREE", "LL"),
        262144: ("TREE", "LL128"),
        33554432: ("RING", "SIMPLE"),  # two RING launches against one NVLS
    }
    assert algo_proto_by_size(log, "AllGather") == {262144: ("RING", "LL128")}
    assert TuningChoice("AllReduce", 33554432, "NVLS", "SIMPLE", 0, 15) in log.tuning


def test_tuning_tie_keeps_the_first_choice() -> None:
    text = (
        "h:1:1 [0] NCCL INFO AllReduce: 8 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}\n"
        "h:1:1 [0] NCCL INFO AllReduce: 8 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}\n"
    )
    assert algo_proto_by_size(parse_nccl_log(text)) == {8: ("TREE", "LL")}


def test_one_rule_gives_the_choice_with_its_channels_wherever_it_is_asked() -> None:
    text = (
        "h:1:1 [0] NCCL INFO AllReduce: 64 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..3}\n"
        "h:1:1 [0] NCCL INFO AllReduce: 64 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}\n"
        "h:1:1 [0] NCCL INFO AllReduce: 64 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}\n"
        "h:1:1 [0] NCCL INFO AllGather: 64 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..7}\n"
    )
    log = parse_nccl_log(text)
    # The most frequent algorithm/protocol wins; the channels of its first launch come along.
    assert choices_by_size(log) == {64: SizeChoice("RING", "LL", 4)}
    assert choices_by_size(log, nccl_func("all_gather")) == {64: SizeChoice("RING", "SIMPLE", 8)}
    assert choices_by_size(log)[64].label == "RING/LL"
    # Across trials the same rule: most frequent, the first seen on a tie, nothing from nothing.
    ring, tree = SizeChoice("RING", "LL"), SizeChoice("TREE", "LL")
    assert prevailing([tree, ring, ring]) == ring
    assert prevailing([tree, ring]) == tree
    assert prevailing([]) is None
    assert nccl_func("all_reduce") == "AllReduce" and nccl_func("reduce_scatter") == "ReduceScatter"


def test_tuning_line_with_trailing_comm_pointer() -> None:
    text = "h:1:1 [0] NCCL INFO AllReduce: 4 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0} comm 0x55a7\n"
    assert parse_nccl_log(text).tuning == [TuningChoice("AllReduce", 4, "TREE", "LL", 0, 0)]


@pytest.mark.parametrize(
    ("via", "key"),
    [
        ("P2P/CUMEM", "P2P/CUMEM"),
        ("P2P/CUMEM/read/CE", "P2P/CUMEM"),
        ("P2P/MNNVL", "P2P/MNNVL"),
        ("P2P/IPC/CE", "P2P/IPC"),
        ("P2P/direct pointer", "P2P/direct pointer"),
        ("P2P/indirect/2[2]/read", "P2P/indirect"),
        ("SHM/direct", "SHM/direct"),
        ("SHM/direct/CE", "SHM/CE"),
        ("NET/Socket/0", "NET/Socket"),
        ("NET/IB/3/GDRDMA", "NET/IB/GDRDMA"),
        ("NET/AWS Libfabric/0/GDRDMA", "NET/AWS Libfabric/GDRDMA"),
    ],
)
def test_transport_keys(via: str, key: str) -> None:
    log = parse_nccl_log(f"h:1:2 [0] NCCL INFO Channel 05/1 : 0[0] -> 1[1] via {via}\n")
    assert log.transports == {key: 1}


def test_ring_order_lines_are_not_transports() -> None:
    text = "h:1:1 [0] NCCL INFO Channel 00/24 : 0 1\nh:1:1 [0] NCCL INFO Ring 00 : 1 -> 0 -> 1\n"
    assert parse_nccl_log(text).transports == {}


# --- Older formats and odd framing ----------------------------------------------------------


def test_older_release_formats() -> None:
    text = (
        "NCCL version 2.10.3+cuda11.4\n"  # NCCL_DEBUG=VERSION: no prefix at all
        "h:1:1 [0] NCCL INFO Channel 00 : 0[1b000] -> 1[1c000] via P2P/IPC/read\n"
        "h:1:1 [0] NCCL INFO Ring 00 : 0 -> 1 [send] via NET/IB/0/GDRDMA\n"
        "h:1:1 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 2, speed 12.000000/12.000000, "
        "type PIX/PIX, sameChannels 1\n"
        "h:1:1 [0] NCCL INFO GPU/1B000 :GPU/1B000 (0/5000.000000/LOC) GPU/1C000 (2/12.000000/PIX) \n"
    )
    log = parse_nccl_log(text)
    assert log.version == "2.10.3"
    assert log.cuda_version == "11.4"
    assert log.transports == {"P2P/IPC": 1, "NET/IB/GDRDMA": 1}
    assert log.graphs == [GraphSearch(4, 0, 2, 12.0, 12.0, "PIX", "PIX", 1)]
    assert log.paths == {"GPU/1B000": {"GPU/1B000": (0, 5000.0, "LOC"), "GPU/1C000": (2, 12.0, "PIX")}}


def test_launcher_prefix_and_collided_lines() -> None:
    text = (
        "[1,4]<stdout>:gpt3:1140649:1140649 [4] enqueue.cc:323 NCCL WARN Error : no algorithm/protocol "
        "available\n"
        # Two processes' writes landed on one line; only the last message is whole.
        "vm:1:1 [0] NCCL INFO Chanvm:2:2 [1] NCCL INFO Using network IB\n"
    )
    log = parse_nccl_log(text)
    assert log.errors == ["Error : no algorithm/protocol available"]
    assert log.network == "IB"
    assert log.transports == {}


def test_path_line_cut_at_1024_characters() -> None:
    line = "h:1:1 [0] NCCL INFO GPU/0-60 :GPU/0-60 (0/5000.0/LOC) GPU/0-70 (2/370.8/NVL) NVS/0-0 (1/37"
    assert parse_nccl_log(line).paths == {
        "GPU/0-60": {"GPU/0-60": (0, 5000.0, "LOC"), "GPU/0-70": (2, 370.8, "NVL")}
    }


def test_empty_text() -> None:
    log = parse_nccl_log("")
    assert log == NcclLog()
    assert algo_proto_by_size(log) == {}
    assert json.loads(json.dumps(summarize(log)))["version"] is None


# --- Robustness -----------------------------------------------------------------------------


def test_numbers_too_long_for_int_are_skipped() -> None:
    digits = "9" * 5000  # int() refuses more than 4300 digits since Python 3.11
    text = (
        f"h:1:1 [0] NCCL INFO AllReduce: {digits} Bytes -> Algo RING proto LL channel{{Lo..Hi}}={{0..0}}\n"
        f"h:1:1 [0] NCCL INFO cudaDriverVersion {digits}\n"
        f"h:1:1 [0] NCCL INFO {digits} coll channels, 0 collnet channels\n"
        f"h:1:1 [0] NCCL INFO === System : maxBw 1.2.3 totalBw {digits}.{digits} ===\n"
        f"h:1:1 [0] NCCL INFO Pattern {digits}, crossNic 0, nChannels 1, bw 1.0/1.0, type NVL/PIX\n"
        f"h:1:1 [0] NCCL INFO GPU/0-1 :GPU/0-2 ({digits}/1.0/NVL) GPU/0-3 (1/1.2.3/NVL)\n"
        f"h:1:1 [0] NCCL INFO P2P is disabled between connected GPUs {digits} and 1.\n"
        f"h:1:1 [0] NCCL INFO comm 0x1 rank {digits} nranks {digits} cudaDev 0 - Init COMPLETE\n"
    )
    log = parse_nccl_log(text)
    assert log.tuning == []
    assert log.cuda_driver is None
    assert log.coll_channels is None
    assert log.max_bw is None
    assert log.graphs == []
    assert log.paths == {"GPU/0-1": {}}
    assert log.p2p_disabled_pairs == []
    assert log.init_complete_ranks == set()
    json.dumps(summarize(log))


def _check_survives(text: str) -> None:
    log = parse_nccl_log(text)
    assert isinstance(log, NcclLog)
    json.dumps(summarize(log))
    algo_proto_by_size(log)


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_random_bytes(seed: int) -> None:
    rng = random.Random(seed)
    raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20000)))
    _check_survives(raw.decode("latin-1"))
    _check_survives(raw.decode("utf-8", errors="replace"))
    _check_survives(raw.decode("utf-8", errors="surrogateescape"))


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_spliced_and_truncated_real_lines(seed: int) -> None:
    # Pieces of real lines, cut anywhere and glued in random order, with random bytes and line
    # ends sprinkled in: what a crashed or interleaved multi-process log can look like.
    rng = random.Random(seed)
    real = _read("h200x2-init-rank0-prefixed.txt") + _read("two-nodes-interleaved.txt")
    real += _read("topo-loaded-hints.txt") + _read("topo-xml-declaration.txt")
    pieces: list[str] = []
    for _ in range(400):
        start = rng.randrange(len(real))
        pieces.append(real[start : start + rng.randrange(1, 200)])
        roll = rng.random()
        if roll < 0.1:
            pieces.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))).decode("latin-1"))
        elif roll < 0.3:
            pieces.append(rng.choice(["\n", "\r\n", "\r", " NCCL INFO ", " NCCL WARN ", "\x00"]))
    _check_survives("".join(pieces))
    # A log cut off in the middle of a line.
    _check_survives(real[: rng.randrange(len(real))])


def test_frozen() -> None:
    log = parse_nccl_log("")
    with pytest.raises(AttributeError):
        log.version = "2.0.0"  # type: ignore[misc]
