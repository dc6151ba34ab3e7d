"""NCCL topology XML (`NCCL_TOPO_FILE`): write NCCL's narrow dialect, read any NCCL file.

NCCL parses topology files with a small hand-written parser (xml.cc), not a real XML parser:
no `<?xml?>` declaration, no tabs, every tag and its attributes on one line, quoted values of
at most 253 characters, at most 16 attributes per element and 256 elements per file, and
`<system version="1">` at the root. The writer produces exactly that; `check_dialect` verifies
any text against those rules, and the reader reports faults with file and line. This module is
the only user of lxml.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from lxml import etree

from ..errors import InputError
from ..files.inputfile import read_input_text
from .model import Topology, XNode, from_xml_tree

MAX_ELEMENTS = 256  # NCCL_TOPO_XML_MAX_NODES
MAX_ATTRS = 16
MAX_VALUE_LEN = 253  # 254 fails: "value ... too long (max 255)"
MAX_CHILDREN = 640
# 256 elements of 16 short attributes stay far below this; a larger file is no NCCL topology.
MAX_XML_BYTES = 4 << 20
# Elements NCCL's parser handles, by parent; anything else is skipped with its subtree.
HANDLED = {
    "system": {"cpu"},
    "cpu": {"pci", "nic"},
    "pci": {"pci", "gpu", "nic", "pcilink"},
    "gpu": {"nvlink", "c2c"},
    "nic": {"net"},
}
# Attributes NCCL rewrites on every init, or adds for the communicator; never a real difference.
VOLATILE_ATTRS = {"host_hash", "rank", "keep"}
# Attributes NCCL fills in when absent (so a re-dump may carry them while our file did not).
FILLED_ATTRS = {"gdr", "mlopart", "latency", "maxconn", "net", "coll", "gin", "rma", "port",
                "guid", "speed", "rail", "plane", "dev", "affinity", "vendor", "device",
                "subsystem_vendor", "subsystem_device", "familyid", "modelid", "arch"}


def _to_element(node: XNode) -> etree._Element:
    el = etree.Element(node.tag)
    for key, value in node.attrs.items():
        el.set(key, value)
    for child in node.children:
        el.append(_to_element(child))
    return el


def render_xml(system: XNode) -> str:
    """Serialise in NCCL's dialect (two-space indent, `/>` for leaf elements, no declaration)."""
    text = etree.tostring(_to_element(system), pretty_print=True, encoding="unicode")
    check_dialect(text, "<generated>")
    return text


def write_xml(topo: Topology, path: Path) -> str:
    """Write the topology file atomically; returns the text written."""
    from ..files.atomicfile import atomic_write

    text = render_xml(topo.system)
    atomic_write(path, text)
    return text


_NAME = r"[A-Za-z_][\w.:-]*"
# One tag as NCCL's xmlGetNode reads it: the name, then ` name="value"` (or single quotes) pairs,
# all on one line; `/>` or `>` ends it. Extra spaces parse, as empty-named attributes.
_TAG = re.compile(
    rf"<(/?)({_NAME})((?: +{_NAME}=(?:\"[^\"\n\r]*\"|'[^'\n\r]*'))*)( *)(/?)>"
)
_ATTR = re.compile(rf"( +)({_NAME})=(?:\"([^\"]*)\"|'([^']*)')")


def check_dialect(text: str, path: str) -> None:
    """Check text against NCCL's parser rules (xml.cc, xmlGetNode and xmlLoadSub).

    NCCL reads a sequence of tags separated by spaces and line breaks: no declaration, no
    tabs, no text between tags, each tag with its attributes on one line, every value quoted.
    Several tags may share a line (NCCL does not care), but no tag may span two.

    Raises:
        InputError: the first rule broken, with its line (exit 78).
    """
    if "\t" in text:
        line = text[: text.index("\t")].count("\n") + 1
        raise InputError(path, "tab character: NCCL's XML parser rejects tabs", line=line)
    elements = 0
    pos, lineno = 0, 1
    while pos < len(text):
        c = text[pos]
        if c in " \r\n":
            lineno += c == "\n"
            pos += 1
            continue
        if c != "<":
            snippet = text[pos:].split("\n", 1)[0].strip()[:80]
            raise InputError(path, f"text outside a tag ({snippet!r}): NCCL's parser expects '<' here",
                             line=lineno)
        if text.startswith("<!--", pos):
            end = text.find("-->", pos + 4)
            if end < 0:
                raise InputError(path, "comment is never closed with -->", line=lineno)
            lineno += text.count("\n", pos, end)
            pos = end + 3
            continue
        if text.startswith("<?", pos):
            raise InputError(path, "XML declaration or processing instruction: NCCL fails with "
                                   "\"expected >, got '?'\"", line=lineno)
        m = _TAG.match(text, pos)
        if m is None:
            rest = text[pos:]
            close = rest.find(">")
            if close >= 0 and "\n" in rest[:close]:
                why = "a tag continues on the next line: NCCL needs each tag on one line"
            else:
                why = "not a tag in NCCL's dialect (name=\"value\" pairs separated by spaces)"
            raise InputError(path, f"{why}: {rest.split(chr(10), 1)[0].strip()[:80]!r}", line=lineno)
        closing, name, attr_text, trailing = m.group(1), m.group(2), m.group(3), m.group(4)
        pos = m.end()
        if closing:
            if attr_text or trailing or m.group(5):
                raise InputError(path, f"closing tag </{name}> with attributes or '/'", line=lineno)
            continue
        elements += 1
        if elements > MAX_ELEMENTS:
            raise InputError(path, f"more than {MAX_ELEMENTS} elements (this is element {elements}, <{name}>): "
                                   f"NCCL reads at most {MAX_ELEMENTS} per file", line=lineno)
        attrs = _ATTR.findall(attr_text)
        # Every space beyond the first before a name, and every space before the end of the
        # tag, is an empty-named attribute to NCCL; they count towards its limit.
        empties = sum(len(sep) - 1 for sep, _, _, _ in attrs) + len(trailing)
        if len(attrs) + empties > MAX_ATTRS:
            raise InputError(path, f"<{name}> has {len(attrs) + empties} attributes (counting the empty "
                                   f"ones NCCL makes of extra spaces); NCCL reads {MAX_ATTRS}", line=lineno)
        for _, key, dq, sq in attrs:
            value = dq or sq
            if len(value) > MAX_VALUE_LEN or len(key) > MAX_VALUE_LEN:
                raise InputError(path, f"attribute {key} is longer than NCCL's {MAX_VALUE_LEN} characters",
                                 line=lineno)


def _from_element(el: etree._Element) -> XNode:
    line = el.sourceline
    node = XNode(str(el.tag), {str(k): str(v) for k, v in el.attrib.items()},
                 line=int(line) if isinstance(line, int) else None)
    for child in el:
        if isinstance(child.tag, str):
            node.children.append(_from_element(child))
    return node


def parse_xml(text: str, path: str = "<xml>") -> XNode:
    """Parse an NCCL topology file and validate it the way NCCL would.

    Raises:
        InputError: not well-formed, outside NCCL's dialect or limits, wrong root or version,
            or a required attribute missing; names the file and line (exit 78).
    """
    try:
        parser = etree.XMLParser(remove_comments=True, resolve_entities=False, no_network=True)
        root = etree.fromstring(text.encode(), parser)
    except etree.XMLSyntaxError as exc:
        line = exc.lineno if exc.lineno else None
        raise InputError(path, f"malformed XML: {exc.msg}", line=line) from exc
    check_dialect(text, path)
    system = _from_element(root)
    if system.tag != "system":
        raise InputError(path, f"root element is <{system.tag}>, NCCL needs <system>", line=system.line)
    if system.attrs.get("version") != "1":
        raise InputError(path, f"<system version={system.attrs.get('version')!r}>: NCCL needs version=\"1\"",
                         line=system.line)
    _check_required(system, path)
    return system


def _check_required(system: XNode, path: str) -> None:
    """Attributes whose absence NCCL cannot fill in from a file-only branch.

    Only elements NCCL handles are checked: it skips anything else with its whole subtree
    (INFO "Ignoring element"), so what is inside such a subtree cannot break it.
    """

    def check(node: XNode) -> None:
        if node.tag == "cpu" and "numaid" not in node.attrs:
            raise InputError(path, "<cpu> without numaid", line=node.line)
        if node.tag == "pci":
            busid = node.attrs.get("busid")
            if busid is None:
                raise InputError(path, "<pci> without busid", line=node.line)
            if busid != busid.lower():
                raise InputError(path, f"bus id {busid} is not lower case: NCCL compares bus ids as "
                                       "strings and would create a second node", line=node.line)
        if node.tag == "gpu":
            for attr in ("dev", "sm"):
                if attr in node.attrs and _strtol(node.attrs[attr]) is None:
                    raise InputError(path, f"<gpu {attr}={node.attrs[attr]!r}> is not a number", line=node.line)
        if node.tag == "nvlink":
            for attr in ("target", "count", "tclass"):
                if attr not in node.attrs:
                    raise InputError(path, f"<nvlink> without {attr}", line=node.line)
            if _strtol(node.attrs["count"]) is None:
                raise InputError(path, f"<nvlink count={node.attrs['count']!r}> is not a number",
                                 line=node.line)
        for child in node.children:
            if child.tag in HANDLED.get(node.tag, set()):
                check(child)

    check(system)


def _strtol(text: str) -> int | None:
    """An integer attribute as NCCL reads it with strtol(..., 0): decimal or 0x hex.

    (A leading-zero octal value, which strtol would also take, is refused: NCCL never writes one.)
    """
    try:
        return int(text, 0)
    except ValueError:
        return None


def load_xml(path: str | Path) -> Topology:
    """Read an NCCL topology file into the model. Raises InputError (exit 78)."""
    p = Path(path)
    text = read_input_text(p, MAX_XML_BYTES, "topology XML", not_text="not a text file (not UTF-8)", trusted=True)
    return from_xml_tree(parse_xml(text, str(p)), source=f"xml:{p}")


def looks_like_xml(path: str | Path) -> bool:
    """Whether a regular file starts like XML. Anything else (a FIFO, a device) is not looked
    into here, so that the loader refuses it instead of a read hanging."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 256).lstrip()
    except OSError:
        return False
    finally:
        os.close(fd)
    return head.startswith(b"<")
