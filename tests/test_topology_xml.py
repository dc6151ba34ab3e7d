"""NCCL topology XML: the writer's dialect, golden files, round trips and bad input.

NCCL reads NCCL_TOPO_FILE with its own small parser (xml.cc), so the writer
is checked line by line against that parser's rules, not just for being well-formed XML.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import GOLDEN, TOPOLOGIES

from nccltune.cli import main
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.topology.diff import diff_trees
from nccltune.topology.model import CLASS_NVSWITCH, XNode, from_snapshot, from_xml_tree
from nccltune.topology.ncclxml import FILLED_ATTRS, load_xml, parse_xml, render_xml
from nccltune.topology.paths import compute_paths
from nccltune.topology.snapshot import load_snapshot

NAMES = sorted(p.stem for p in TOPOLOGIES.glob("*.json"))
NCCL_DUMP = GOLDEN / "h200x2-nvswitch-vm.nccl-dump.xml"

_LINE = re.compile(r'^( *)<(/?)([a-z]+)((?: [a-z_]+="[^"]*")*)(/?)>$')
_BUSID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _xml_of(name: str) -> str:
    return render_xml(from_snapshot(load_snapshot(TOPOLOGIES / f"{name}.json")).system)


# -- the writer's dialect, checked mechanically ----------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_writer_follows_nccl_dialect(name: str) -> None:
    text = _xml_of(name)
    assert not text.startswith("<?xml") and "<?" not in text
    assert "\t" not in text and "\r" not in text
    assert text.endswith("\n")
    gpu_buses = set(re.findall(r'<pci busid="([^"]+)" class="0x03', text))
    depth = 0
    elements = 0
    stack: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _LINE.match(line)
        # One tag per line, every value double-quoted, single spaces between attributes,
        # `/>` with no space before it.
        assert m, f"line {lineno} is not one tag in NCCL's dialect: {line!r}"
        indent, closing, tag, attr_text, empty = m.groups()
        attrs = dict(re.findall(r' ([a-z_]+)="([^"]*)"', attr_text))
        assert len(re.findall(r" [a-z_]+=", attr_text)) == len(attrs), f"duplicate attribute, line {lineno}"
        if closing:
            depth -= 1
            assert stack.pop() == tag
            assert not attrs and not empty
        assert len(indent) == 2 * depth, f"line {lineno}: indent {len(indent)} at depth {depth}"
        if closing:
            continue
        elements += 1
        assert len(attrs) <= 16, f"line {lineno}: {len(attrs)} attributes"
        assert all(len(k) <= 253 and len(v) <= 253 for k, v in attrs.items()), f"line {lineno}"
        if tag == "system":
            assert attrs == {"version": "1"}
        if tag == "cpu":
            assert {"numaid", "arch"} <= set(attrs)
            if attrs["arch"] == "x86_64":
                assert {"vendor", "familyid", "modelid"} <= set(attrs), f"line {lineno}"
                assert attrs["familyid"].isdigit() and attrs["modelid"].isdigit()  # decimal, as NCCL
        if tag == "pci":
            assert _BUSID.match(attrs["busid"]), attrs["busid"]  # lower case, NCCL's exact form
            assert attrs["class"].startswith("0x") and attrs["class"] == attrs["class"].lower()
            assert attrs.get("link_speed", "").endswith(" GT/s PCIe"), f"line {lineno}: {attrs}"
            assert int(attrs.get("link_width", "0")) > 0, f"line {lineno}: {attrs}"
        if tag == "gpu":
            assert {"dev", "sm"} <= set(attrs)
        if tag == "nvlink":
            assert {"target", "count", "tclass"} <= set(attrs) and int(attrs["count"]) > 0
            if attrs["target"] not in gpu_buses:
                assert attrs["tclass"] == CLASS_NVSWITCH, f"line {lineno}: {attrs}"
        if tag == "net":
            assert "name" in attrs and "dev" in attrs
        if not empty:
            depth += 1
            stack.append(tag)
    assert depth == 0 and not stack
    assert elements <= 256


@pytest.mark.parametrize("name", NAMES)
def test_writer_output_equals_golden(name: str) -> None:
    golden = GOLDEN / f"{name}.xml"
    regen = (f"if the change is intended, regenerate it with `.venv/bin/nccltune topo --input "
             f"topologies/{name}.json --xml tests/golden/{name}.xml` and review the diff")
    assert golden.exists(), f"missing {golden}; {regen}"
    assert _xml_of(name) == golden.read_text(), f"{golden.name} differs from the writer's output; {regen}"


def test_golden_h100_matches_nccl_example_1_8a() -> None:
    """The H100 file carries the tree of NCCL's hand-written example (the HGX H100 topology-file example)."""
    text = (GOLDEN / "hgx-h100-8gpu.xml").read_text()
    cpus = re.findall(r'<cpu numaid="(\d)" affinity="([0-9a-f,]+)" arch="x86_64" vendor="GenuineIntel" '
                      r'familyid="6" modelid="143">', text)
    assert cpus == [("0", "00000000,000000ff,ffffffff,ffff0000,00000000,00ffffff,ffffffff"),
                    ("1", "ffffffff,ffffff00,00000000,0000ffff,ffffffff,ff000000,00000000")]
    switches = re.findall(r'^    <pci busid="0000:([0-9a-f]{2}):00.0" class="0x060400"', text, re.M)
    assert switches == ["15", "3d", "4c", "5b", "97", "bd", "cb", "d9"]
    system = parse_xml(text, "h100")
    for gpu in system.iter("gpu"):
        counts = [int(n.attrs["count"]) for n in gpu.children if n.tag == "nvlink"]
        assert sum(counts) == 18 and len(counts) == 4
    # Each switch holds exactly one NIC and one GPU, NIC first (bus order).
    for sw in (c for cpu in system.children for c in cpu.children):
        kids = [c.children[0].tag for c in sw.children]
        assert kids == ["nic", "gpu"]


def test_golden_bridge_matches_nccl_example_1_8b() -> None:
    """Two PCIe A100s joined by 12 links: one `nvlink` per GPU, pointing at the other (§1.8 b)."""
    system = parse_xml((GOLDEN / "pcie-2gpu-nvlink-bridge.xml").read_text(), "bridge")
    links = {n.attrs["target"]: n.attrs for n in system.iter("nvlink")}
    assert links == {"0000:44:00.0": {"target": "0000:44:00.0", "count": "12", "tclass": "0x030200"},
                     "0000:43:00.0": {"target": "0000:43:00.0", "count": "12", "tclass": "0x030200"}}
    [switch] = [c for c in system.children[0].children if c.attrs["class"] == "0x060400"]
    assert [c.attrs["busid"] for c in switch.children] == ["0000:43:00.0", "0000:44:00.0"]


# -- round trips -----------------------------------------------------------------------------------

def test_nccl_dump_round_trips_without_difference() -> None:
    original = NCCL_DUMP.read_text()
    topo = load_xml(NCCL_DUMP)
    again = render_xml(topo.system)
    d = diff_trees(parse_xml(original, "dump"), parse_xml(again, "again"))
    assert d.same and not d.filled, d.as_dict()
    # Nothing is lost, not even the attributes NCCL rewrites (host_hash, rank).
    assert again == original


def test_our_h200_file_matches_nccls_own_dump() -> None:
    """Our XML for the reference VM and NCCL's dump of it differ only in what NCCL fills in."""
    ours = from_snapshot(load_snapshot(TOPOLOGIES / "h200x2-nvswitch-vm.json")).system
    nccls = parse_xml(NCCL_DUMP.read_text(), str(NCCL_DUMP))
    d = diff_trees(ours, nccls)
    assert d.same, d.as_dict()
    assert d.only_a == d.only_b == d.changed == []
    assert all(entry.attribute in FILLED_ATTRS for entry in d.filled), d.filled
    assert all(str(e).split(" ", 1)[1].split("=", 1)[0] == e.attribute for e in d.filled), "the text line"
    filled = {(e.path.rsplit("/", 1)[-1], e.attribute) for e in d.filled}
    assert filled == {("gpu", "gdr")} | {("net[eth0]", k)
                                           for k in ("latency", "speed", "port", "guid", "maxconn", "gdr")}


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_xml_model_xml_is_stable(name: str) -> None:
    topo = from_snapshot(load_snapshot(TOPOLOGIES / f"{name}.json"))
    first = render_xml(topo.system)
    back = from_xml_tree(parse_xml(first, name), source="xml")
    assert render_xml(back.system) == first
    assert diff_trees(topo.system, back.system).as_dict() == {
        "same": True, "only_a": [], "only_b": [], "changed": [], "filled": []}
    # The model read back from the file gives NCCL the same paths as the snapshot.
    assert compute_paths(back) == compute_paths(topo)
    assert [(g.index, g.bus_id, g.sm) for g in back.gpus] == [(g.index, g.bus_id, g.sm) for g in topo.gpus]
    assert [(n.name, n.speed_mbps) for n in back.nics] == [(n.name, n.speed_mbps) for n in topo.nics]


# -- what NCCL's parser accepts beyond our own spelling ---------------------------------------------

def test_reader_accepts_what_nccls_parser_accepts(tmp_path: Path) -> None:
    """Several tags on a line, single quotes, CRLF, comments and ` />` all parse in NCCL."""
    text = ("<!-- written by hand -->\r\n"
            "<system version='1'><cpu numaid=\"0\" arch=\"x86_64\" vendor=\"GenuineIntel\" familyid=\"6\" "
            "modelid=\"143\">\r\n"
            "  <pci busid=\"0000:17:00.0\" class=\"0x030200\" link_speed=\"32.0 GT/s PCIe\" link_width=\"16\">"
            "<gpu dev=\"0\" sm=\"90\" rank=\"0\" gdr=\"1\" /></pci>\r\n"
            "</cpu></system>\r\n")
    system = parse_xml(text, "hand.xml")
    assert [n.tag for n in system.iter()] == ["system", "cpu", "pci", "gpu"]
    path = tmp_path / "hand.xml"
    path.write_text(text, newline="")
    assert [g.bus_id for g in load_xml(path).gpus] == ["0000:17:00.0"]


# -- bad input: InputError, exit 78, naming file and line -------------------------------------------

GOOD = NCCL_DUMP.read_text()
GOOD_LINES = GOOD.splitlines(keepends=True)


def _replace_line(lineno: int, new: str) -> str:
    lines = list(GOOD_LINES)
    lines[lineno - 1] = new
    return "".join(lines)


def _too_many_elements() -> str:
    pcis = "".join(f'    <pci busid="0000:{i // 32:02x}:{i % 32:02x}.0" class="0x060400" '
                   f'link_speed="16.0 GT/s PCIe" link_width="16"/>\n' for i in range(255))
    return ('<system version="1">\n  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" '
            f'modelid="143">\n{pcis}  </cpu>\n</system>\n')


BAD: dict[str, tuple[str, int, str]] = {
    # name: (text, line NCCL would stop at, part of the message)
    "xml-declaration": ('<?xml version="1.0"?>\n' + GOOD, 1, "declaration"),
    "tab": (_replace_line(5, GOOD_LINES[4].replace("        ", "\t\t", 1)), 5, "tab"),
    "multi-line-tag": (_replace_line(4, '      <gpu dev="0" sm="90"\n        rank="0" gdr="1">\n'), 4, "one line"),
    "unquoted-value": (_replace_line(4, '      <gpu dev=0 sm="90" rank="0" gdr="1">\n'), 4, "malformed"),
    "wrong-root": (GOOD.replace('<system version="1">', '<topology version="1">', 1)
                   .replace("</system>", "</topology>"), 1, "<system>"),
    "version-2": (GOOD.replace('<system version="1">', '<system version="2">', 1), 1, "version"),
    "too-many-elements": (_too_many_elements(), 257, "256"),
    "value-254-chars": (_replace_line(9, f'      <net name="{"e" * 254}" dev="0"/>\n'), 9, "253"),
    "uppercase-bus-id": (GOOD.replace("0000:00:07.0", "0000:00:0A.0", 1), 11, "lower case"),
    "nvlink-without-count": (GOOD.replace(' count="18"', "", 1), 5, "without count"),
    # The first </pci> missing: lxml notices at </cpu>, which no longer closes what is open.
    "malformed": (GOOD.replace("    </pci>\n", "", 1), 15, "malformed"),
    "gpu-dev-not-a-number": (GOOD.replace('<gpu dev="1"', '<gpu dev="one"', 1), 12, "not a number"),
    "text-between-tags": (_replace_line(6, "      hello\n      </gpu>\n"), 6, "text outside a tag"),
}


def test_good_base_is_good(tmp_path: Path) -> None:
    path = tmp_path / "good.xml"
    path.write_text(GOOD)
    assert len(load_xml(path).gpus) == 2
    assert len(_too_many_elements().splitlines()) == 259  # 257 elements, the last on line 257


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_xml_is_input_error_with_file_and_line(tmp_path: Path, case: str) -> None:
    text, line, words = BAD[case]
    path = tmp_path / f"{case}.xml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_xml(path)
    err = info.value
    assert err.exit_code == EXIT_CONFIG == 78
    assert err.path == str(path)
    assert err.line == line, str(err)
    assert str(err).startswith(f"{path}:{line}: "), str(err)
    assert words in str(err), str(err)


def test_254_characters_fail_but_253_pass(tmp_path: Path) -> None:
    ok = tmp_path / "ok.xml"
    ok.write_text(_replace_line(9, f'      <net name="{"e" * 253}" dev="0"/>\n'))
    assert load_xml(ok).nics[0].name == "e" * 253


def test_256_elements_pass(tmp_path: Path) -> None:
    text = _too_many_elements().replace(
        '    <pci busid="0000:07:1e.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16"/>\n', "")
    path = tmp_path / "ok.xml"
    path.write_text(text)
    assert parse_xml(text, str(path)).count() == 256


def test_seventeen_attributes_fail(tmp_path: Path) -> None:
    extra = " ".join(f'x{i}="1"' for i in range(11))  # 6 on the net element + 11 = 17
    path = tmp_path / "attrs.xml"
    path.write_text(_replace_line(9, f'      <net name="eth0" dev="0" latency="0" speed="10000" port="0" '
                                     f'guid="0x0" {extra}/>\n'))
    with pytest.raises(InputError, match=r":9: <net> has 17 attributes"):
        load_xml(path)


def test_render_refuses_a_tree_nccl_cannot_read() -> None:
    system = XNode("system", {"version": "1"})
    cpu = system.add(XNode("cpu", {"numaid": "0", "arch": "x86_64"}))
    for i in range(300):
        cpu.add(XNode("pci", {"busid": f"0000:{i // 32:02x}:{i % 32:02x}.0", "class": "0x060400"}))
    with pytest.raises(InputError, match="256"):
        render_xml(system)


@pytest.mark.parametrize("case", ["xml-declaration", "unquoted-value", "too-many-elements", "uppercase-bus-id"])
def test_cli_bad_xml_exits_78_and_writes_nothing(tmp_path: Path, case: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    text, line, _ = BAD[case]
    bad = tmp_path / "bad.xml"
    bad.write_text(text)
    out = tmp_path / "out" / "ncclTopology.xml"
    out.parent.mkdir()
    assert main(["topo", "--input", str(bad), "--xml", str(out)]) == 78
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no temporary file left either
    err = capsys.readouterr().err
    assert f"{bad}:{line}:" in err, err


def test_cli_writes_the_golden_xml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ncclTopology.xml"
    assert main(["topo", "--input", str(TOPOLOGIES / "hgx-h100-8gpu.json"), "--xml", str(out)]) == 0
    assert out.read_text() == (GOLDEN / "hgx-h100-8gpu.xml").read_text()
    assert f"NCCL_TOPO_FILE={out}" in capsys.readouterr().out
