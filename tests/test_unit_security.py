"""The units' exposure under `systemd-analyze security` stays at or below what the hardening reached,
and the two units keep the same hardening."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

UNITS = ("nccltune.service", "nccltune-sweep.service")
CHECK_UNITS = REPO / ".ci" / "check-units"
# `systemd-analyze security --offline=true` with systemd 252; 8.1 before the hardening. The one
# threshold is .ci/check-units' own.
MAX_EXPOSURE = float(re.findall(r"^MAX_EXPOSURE=([0-9.]+)$", CHECK_UNITS.read_text(), re.M)[0])
# What the daemon itself does as root, and nothing more (the ranks run as bench.user without any).
DAEMON_CAPABILITIES = {"CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_MKNOD"}
# Settings the daemon has and the one-shot sweep has not, by design: its service type and lifecycle.
DAEMON_ONLY = {"Type", "ExecReload", "NotifyAccess", "Restart", "RestartSec", "RestartPreventExitStatus",
               "TimeoutStartSec", "WatchdogSec", "RemainAfterExit", "StartLimitIntervalSec", "StartLimitBurst",
               "WantedBy", "ExecStart", "Description"}


def exposure(unit: Path) -> float:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu: apt-get install systemd)")
    help_text = subprocess.run([analyze, "security", "--help"], capture_output=True, text=True).stdout
    if "--offline" not in help_text:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    got = subprocess.run([analyze, "security", "--offline=true", str(unit)], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", got.stdout + got.stderr)
    assert m, f"no exposure line in:\n{got.stdout}{got.stderr}"
    return float(m.group(1))


@pytest.mark.parametrize("name", UNITS)
def test_exposure_stays_at_or_below_what_was_reached(name: str) -> None:
    score = exposure(REPO / "systemd" / name)
    assert score <= MAX_EXPOSURE, f"{name}: exposure {score} > {MAX_EXPOSURE}; a hardening setting was lost"


def settings(unit: Path) -> dict[str, str]:
    out = {}
    for line in unit.read_text().splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_both_units_have_the_same_hardening() -> None:
    daemon, sweep = (settings(REPO / "systemd" / n) for n in UNITS)
    shared = (set(daemon) | set(sweep)) - DAEMON_ONLY - {"OOMScoreAdjust"}
    differ = {k: (daemon.get(k), sweep.get(k)) for k in sorted(shared) if daemon.get(k) != sweep.get(k)}
    assert not differ, differ
    for key in ("ProtectHostname", "ProtectKernelLogs", "RestrictNamespaces", "UMask", "SystemCallFilter",
                "CapabilityBoundingSet", "SystemCallErrorNumber", "PrivateMounts"):
        assert key in daemon, key
    # The exclusions stay: the GPUs' and NICs' device nodes must remain reachable.
    for absent in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
                   "MemoryDenyWriteExecute", "PrivateNetwork", "RestrictAddressFamilies", "PrivateUsers"):
        assert absent not in daemon and absent not in sweep, absent
    assert "CAP_SYS_ADMIN" not in daemon["CapabilityBoundingSet"]


def test_the_daemon_keeps_only_the_capabilities_it_uses() -> None:
    for name in UNITS:
        unit = settings(REPO / "systemd" / name)
        assert set(unit["CapabilityBoundingSet"].split()) == DAEMON_CAPABILITIES, name
        # No module loading in the sandbox: the one privileged command runs before it ('+').
        assert unit["ProtectKernelModules"] == "yes"
        assert "@module" not in unit["SystemCallFilter"].split()
        assert unit["ExecStartPre"].startswith("-+") and "nvidia-modprobe" in unit["ExecStartPre"]


def test_every_setting_keeps_its_reason() -> None:
    """Each [Service] setting of the hardening has a comment above it (or in the block above it)."""
    for name in UNITS:
        lines = (REPO / "systemd" / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(("CapabilityBoundingSet=", "SystemCallFilter=", "ProtectKernelModules=",
                                "ExecStartPre=", "User=")):
                assert lines[i - 1].startswith("#"), f"{name}: no reason above {line}"
        text = "\n".join(lines)
        for cap in DAEMON_CAPABILITIES:
            assert f"#  - {cap}" in text or f", {cap}:" in text or f"{cap}, " in text, f"{name}: {cap} has no reason"
