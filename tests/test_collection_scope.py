"""Test collection stays out of the recorded trees.

A recorded sysfs keeps the kernel's symlink cycles (class/net/eth0/device/net/eth0/...). A
collector that follows them walks until the kernel refuses the path, and where it refuses
first depends on the file system the checkout lies on, so the rule is held here, not found by
chance on one machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import conftest

TESTS = conftest.TESTS


def test_every_directory_symlink_lies_in_a_tree_collection_ignores():
    ignored = [TESTS / name for name in conftest.collect_ignore]
    outside = []
    for root, dirs, _files in os.walk(TESTS):
        for name in dirs:
            path = Path(root) / name
            if path.is_symlink() and not any(path.is_relative_to(top) for top in ignored):
                outside.append(str(path.relative_to(TESTS)))
    assert outside == [], f"directory symlinks outside {conftest.collect_ignore}: {outside}"


def test_the_recorded_sysfs_holds_a_cycle_so_the_rule_matters():
    link = TESTS / "fixtures/h200x1-sysfs/sys/devices/pci0000:00/0000:00:03.0/virtio2/net/eth0/device"
    assert link.is_symlink()
    assert link.resolve() in (link.parent / "x").resolve().parents
    assert "fixtures" in conftest.collect_ignore
