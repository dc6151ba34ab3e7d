"""`nccltune install`: put the systemd units in place and enable the service.

The unit files ship in the source tree's `systemd/` folder (the config example in `examples/`);
ExecStart is rewritten to the nccltune executable actually installed, so the unit never points at a
path that does not exist.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .errors import NccltuneError, UnavailableError
from .publish import atomic_write

UNITS = ("nccltune.service", "nccltune-sweep.service")


def shipped_dir(source: str, packaged: str) -> Path:
    """A folder of the source tree (`systemd/`, `examples/`, `launchers/`), or its copy installed as
    package data."""
    for here in (Path(__file__).resolve().parents[1] / source, Path(__file__).resolve().parent / packaged):
        if here.is_dir():
            return here
    raise UnavailableError(f"the {source} files are not installed with this nccltune",
                           hint="install from a source checkout")


def units_dir() -> Path:
    return shipped_dir("systemd", "units")


def systemd_quote(word: str) -> str:
    """One word for a unit's command line: '%' starts a specifier and '$' a variable
    (systemd.unit(5), systemd.service(5)), and whitespace splits words, so a path such as
    `/opt/my venv/bin/nccltune` is quoted."""
    word = word.replace("%", "%%").replace("$", "$$")
    if any(c.isspace() or c in "\"'\\;" for c in word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def install_units(prefix: Path, *, binary: str | None = None, enable: bool = True) -> list[str]:
    exe = binary or shutil.which("nccltune") or str(Path(sys.argv[0]).resolve())
    target = prefix / "etc/systemd/system"
    target.mkdir(parents=True, exist_ok=True)
    done = []
    for name in UNITS:
        text = (units_dir() / name).read_text()
        lines = []
        for line in text.splitlines():
            for key in ("ExecStart=", "ExecReload="):
                if line.startswith(key) and "nccltune" in line.split()[0]:
                    line = key + systemd_quote(exe) + line[len(key) + len(line[len(key):].split()[0]):]
            lines.append(line)
        atomic_write(target / name, "\n".join(lines) + "\n")
        done.append(f"installed {target / name} (ExecStart {exe})")
    conf_dir = prefix / "etc/nccltune"
    conf_dir.mkdir(parents=True, exist_ok=True)
    example = shipped_dir("examples", "examples") / "config.yaml"
    if example.exists() and not (conf_dir / "config.yaml").exists():
        atomic_write(conf_dir / "config.yaml", example.read_text())
        done.append(f"installed {conf_dir / 'config.yaml'} (all defaults; edit to taste)")
    if enable:
        if shutil.which("systemctl") is None:
            raise NccltuneError("systemctl not found: enable the service by hand")
        for cmd in (["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", "nccltune.service"]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise NccltuneError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
            done.append(" ".join(cmd))
    return done
