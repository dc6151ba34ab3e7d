"""The tuner plugin prebuilt when the package is built (setup.py's build hook): a real wheel is built
and installed into a directory here, and its nccltune, run on a PATH without any compiler, publishes
the prebuilt library; a stamp that does not fit sends it back to the on-node build, and doctor says
which one is in use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from nccltune.nccl.site import tuner_symbols
from nccltune.tuner.build import LIBRARY_NAME, STAMP_NAME

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="the build hook needs a C compiler")

# Runs the installed copy only: no site (so not the checkout's editable install), the target
# directory first, then the venv's libraries for nccltune's own dependencies.
PROBE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import nccltune
from pathlib import Path
from nccltune.tuner.build import build_plugin, prebuilt_plugin
from nccltune.checks.doctor import plugin_finding
got = build_plugin(Path(sys.argv[3]))
finding = plugin_finding()
print(json.dumps({"package": nccltune.__file__, "ok": got.ok, "path": str(got.path), "compiler": got.compiler,
                  "prebuilt": str(got.prebuilt) if got.prebuilt else None, "message": got.message,
                  "finding": finding.code if finding else None,
                  "finding_message": finding.message if finding else None}))
"""


def build_wheel(out: Path, **env: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True, timeout=300, env={**os.environ, **env})
    (wheel,) = out.glob("nccltune-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prebuilt")
    wheel = build_wheel(root / "wheel")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                    str(root / "site"), str(wheel)], check=True, capture_output=True, timeout=300)
    return wheel, root / "site"


def probe(site: Path, out: Path, path: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE, str(site), sysconfig.get_paths()["purelib"], str(out)],
                          capture_output=True, text=True, timeout=120, env={"PATH": path, "HOME": str(out.parent)})
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout)
    assert str(doc["package"]).startswith(str(site))
    return doc


def test_the_wheel_carries_the_plugin_for_this_platform(installed: tuple[Path, Path]) -> None:
    wheel, site = installed
    assert wheel.name.endswith(f"-py3-none-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"nccltune/tuner/prebuilt/{LIBRARY_NAME}" in names and f"nccltune/tuner/prebuilt/{STAMP_NAME}" in names
    library = site / "nccltune" / "tuner" / "prebuilt" / LIBRARY_NAME
    # Every ABI version the source exports, in the one library.
    assert tuner_symbols(library) == ("ncclTunerPlugin_v7", "ncclTunerPlugin_v6", "ncclTunerPlugin_v5")


def test_without_a_compiler_the_prebuilt_plugin_is_published(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, site = installed
    empty = tmp_path / "no-compilers"
    empty.mkdir()
    doc = probe(site, tmp_path / "out", str(empty))
    assert doc["ok"] is True and doc["compiler"] is None
    assert doc["prebuilt"] == str(site / "nccltune" / "tuner" / "prebuilt" / LIBRARY_NAME)
    assert Path(str(doc["path"])).read_bytes() == Path(str(doc["prebuilt"])).read_bytes()
    assert doc["finding"] == "tuner-plugin-prebuilt" and "prebuilt with the package" in str(doc["finding_message"])


def test_a_prebuilt_plugin_that_does_not_fit_falls_back_to_the_on_node_build(
        installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, site = installed
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    stamp = copy / "nccltune" / "tuner" / "prebuilt" / STAMP_NAME
    stamp.write_text("0" * 64 + " another-machine\n")
    with_cc = probe(copy, tmp_path / "out", os.environ["PATH"])
    assert with_cc["ok"] is True and with_cc["compiler"] and with_cc["prebuilt"] is None
    assert with_cc["finding"] is None  # compiled here: the usual case
    empty = tmp_path / "no-compilers"
    empty.mkdir()
    without = probe(copy, tmp_path / "out2", str(empty))
    assert without["ok"] is False and "not active" in str(without["message"])
    assert without["finding"] == "tuner-plugin-unavailable"
    assert "for another source or machine" in str(without["finding_message"])


def test_a_build_without_the_plugin_stays_a_pure_wheel(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, NCCLTUNE_NO_PREBUILT_TUNER="1")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not any("prebuilt" in name for name in zipfile.ZipFile(wheel).namelist())
