"""Copy the parts of this node's /sys and /proc that nccltune's sysfs reader looks at into a
directory tree, keeping the kernel's layout and its symlinks (made relative), so tests read a
tree recorded from a real node rather than one generated from nccltune's own model.

    python3 bench/record_sysfs_tree.py OUT_DIR

What is copied: every PCI device's directory under /sys/bus/pci/devices (the small attribute
files at the top of each: ids, class, link speed and width, NUMA node, local CPUs) with every
ancestor bridge, /sys/class/net and /sys/class/infiniband with their `device` links and port
attributes, the NUMA nodes, /sys/module entries of the GPUDirect modules, /proc/cpuinfo and
/proc/modules. Binary or large attributes (config space, ROM, resources) are left out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ATTR_MAX = 64 * 1024
SKIP = {"config", "rom", "remove", "rescan", "reset", "reset_method", "driver_override", "new_id",
        "remove_id", "bind", "unbind", "uevent", "modalias", "msi_bus", "broken_parity_status"}


def copy_attrs(src: Path, out: Path) -> None:
    """The small readable regular files directly in `src`, into the same relative place."""
    dest = out / str(src).lstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        entries = sorted(os.listdir(src))
    except OSError:
        return
    for name in entries:
        path = src / name
        if name in SKIP or name.startswith("resource") or path.is_symlink() or not path.is_file():
            continue
        try:
            data = path.read_bytes()[:ATTR_MAX]
        except OSError:
            continue
        if b"\0" in data:
            continue
        (dest / name).write_bytes(data)


def copy_link(link: Path, out: Path) -> None:
    """A symlink as a relative link inside the tree (sysfs links are relative already)."""
    dest = out / str(link).lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink() or dest.exists():
        return
    target = os.path.realpath(link)
    os.symlink(os.path.relpath(out / target.lstrip("/"), dest.parent), dest)


def copy_device_chain(real: Path, out: Path) -> None:
    """A device directory and every ancestor up to /sys/devices."""
    node = real
    while str(node).startswith("/sys/devices/") and node != Path("/sys/devices"):
        copy_attrs(node, out)
        node = node.parent


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pci = Path("/sys/bus/pci/devices")
    for name in sorted(os.listdir(pci)):
        copy_device_chain(Path(os.path.realpath(pci / name)), out)
        copy_link(pci / name, out)
    for cls in ("net", "infiniband"):
        base = Path("/sys/class") / cls
        if not base.is_dir():
            continue
        for name in sorted(os.listdir(base)):
            real = Path(os.path.realpath(base / name))
            copy_device_chain(real, out)
            copy_link(base / name, out)
            dev = base / name / "device"
            if dev.exists():
                copy_device_chain(Path(os.path.realpath(dev)), out)
                copy_link(Path(os.path.realpath(base / name)) / "device", out)
            ports = real / "ports"
            if ports.is_dir():
                for port in sorted(os.listdir(ports)):
                    copy_attrs(ports / port, out)
    nodes = Path("/sys/devices/system/node")
    if nodes.is_dir():
        copy_attrs(nodes, out)
        for name in sorted(os.listdir(nodes)):
            if name.startswith("node") and name[4:].isdigit():
                copy_attrs(nodes / name, out)
    for module in ("nvidia_peermem", "nv_peer_mem", "nvidia"):
        path = Path("/sys/module") / module
        if path.is_dir():
            (out / "sys/module" / module).mkdir(parents=True, exist_ok=True)
    for name in ("cpuinfo", "modules"):
        try:
            data = Path("/proc", name).read_bytes()
        except OSError:
            continue
        (out / "proc").mkdir(parents=True, exist_ok=True)
        (out / "proc" / name).write_bytes(data)
    files = sum(len(f) for _, _, f in os.walk(out))
    print(f"recorded {files} files and links under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
