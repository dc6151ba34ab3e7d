"""`nccltune install` and `nccltune uninstall`: the systemd units, the example config, the
launchers (the torchrun wrapper, the Slurm task prolog) and the system user the benchmark ranks
run as, and nothing else.

The files ship in the source tree's `systemd/`, `examples/` and `launchers/` folders (or their
copies installed as package data). ExecStart is rewritten to the nccltune executable actually
installed, so the unit never points at a path that does not exist, and ReadWritePaths= to every
directory the config lets nccltune write in (``Config.written_dirs``: the config below the prefix,
or the defaults). ``--prefix DIR`` is a DESTDIR, for packages and images: the files go below DIR,
but every path written inside them (ExecStart, ReadWritePaths=, the manifest's file names) is the
final one without DIR, and ExecStart is ``--binary`` or the units' own /usr/local/bin/nccltune,
never the nccltune running the install (a build checkout's venv). Install first makes a plan
(what it would write and run): `--dry-run` prints it, otherwise it is carried out and a manifest
of every file written, with its SHA-256, is kept in /etc/nccltune/installed.json. Uninstall removes
only the files whose content is still what install wrote (an edited config or wrapper stays, and
is named), never the state directory.

The rank user (trials.credentials.DEFAULT_USER) is created on this machine only (prefix /), with
`useradd --system`: no home, no login shell, its own group, and as supplementary groups those that
own the GPUs' and RDMA devices' nodes (often video or render) so that it can open them as the jobs
do. Installing again adds only a group it lacks. Uninstall keeps the user (files may be its).
"""

from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError, NccltuneError, UnavailableError
from .files.atomicfile import atomic_write
from .files.inputfile import loads_strict, read_input_file
from .files.trust import check_file, ensure_dir, trusted_target, walk_trusted
from .trials.credentials import DEFAULT_USER

log = logging.getLogger(__name__)

UNITS = ("nccltune.service", "nccltune-sweep.service")
# Where each launcher goes below the prefix, and the folder it ships in.
LAUNCHERS = (
    ("nccltune-torchrun", "usr/local/bin/nccltune-torchrun"),
    ("slurm-prolog.sh", "etc/slurm/nccltune-task-prolog.sh"),
)
MANIFEST = "etc/nccltune/installed.json"
MAX_MANIFEST_BYTES = 1 << 20  # a few dozen names and digests
CONFIG = "etc/nccltune/config.yaml"
# The executable the shipped units name, ExecStart's below a prefix unless --binary says otherwise.
SHIPPED_EXE = "/usr/local/bin/nccltune"
READ_WRITE_KEY = "ReadWritePaths="
ENABLE = (["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", "nccltune.service"])
DISABLE = ["systemctl", "disable", "--now", "nccltune.service"]
# The device nodes the ranks open: the GPUs (and MIG capabilities), and RDMA for NCCL's IB transport.
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/infiniband/*", "/dev/dri/render*")
NOLOGIN = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")


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


def sha256(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Write:
    """One file install writes: where, what, with which mode, and the line that reports it."""

    path: Path
    text: str
    mode: int
    note: str
    final: Path  # where it lies on the installed system: `path` without the prefix


@dataclass
class InstallPlan:
    writes: list[Write] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_write_paths(dirs: tuple[Path, ...]) -> str:
    """The units' ReadWritePaths= line for `dirs`: each '-'-prefixed, so that a directory not made
    yet does not stop the service from starting (ProtectSystem=strict keeps everything else
    read-only)."""
    return READ_WRITE_KEY + " ".join(systemd_quote(f"-{d}") for d in dirs)


def unit_text(name: str, exe: str, dirs: tuple[Path, ...] | None = None) -> str:
    """A shipped unit with ExecStart (not ExecReload's kill) pointing at `exe`, and its
    ReadWritePaths= listing `dirs` (None: as shipped, the defaults' list)."""
    lines = []
    for line in (units_dir() / name).read_text().splitlines():
        for key in ("ExecStart=", "ExecReload="):
            if line.startswith(key) and "nccltune" in line.split()[0]:
                line = key + systemd_quote(exe) + line[len(key) + len(line[len(key):].split()[0]):]
        if dirs is not None and line.startswith(READ_WRITE_KEY):
            line = read_write_paths(dirs)
        lines.append(line)
    return "\n".join(lines) + "\n"


def device_groups(globs: tuple[str, ...] = DEVICE_GLOBS) -> list[str]:
    """The groups that own the GPUs' and RDMA devices' nodes with read and write for the group
    (root's group excepted: membership in it is not asked for)."""
    import glob

    names = set()
    for pattern in globs:
        for node in glob.glob(pattern):
            try:
                st = os.stat(node)
            except OSError:
                continue
            if st.st_gid != 0 and st.st_mode & 0o060 == 0o060:
                try:
                    names.add(grp.getgrgid(st.st_gid).gr_name)
                except KeyError:
                    continue
    return sorted(names)


def rank_user_commands(name: str = DEFAULT_USER, groups: list[str] | None = None) -> list[list[str]]:
    """What creates the rank user, or adds the device groups it lacks; nothing when it is complete."""
    groups = device_groups() if groups is None else groups
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        shell = next((s for s in NOLOGIN if os.path.exists(s)), NOLOGIN[0])
        cmd = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
               "--shell", shell, "--comment", "nccltune benchmark ranks"]
        return [cmd + (["--groups", ",".join(groups)] if groups else []) + [name]]
    have = {g.gr_name for g in grp.getgrall() if name in g.gr_mem or g.gr_gid == entry.pw_gid}
    missing = [g for g in groups if g not in have]
    return [["usermod", "--append", "--groups", ",".join(missing), name]] if missing else []


def check_prefix(prefix: Path) -> Path:
    """The real directory ``prefix`` names, after the trust rule (files/trust.py): every component
    that exists, and every link on its way, is root's (or the installing user's) and writable by
    nobody else, so that nothing install writes below it goes where another user chose. Creates
    nothing.

    Raises:
        InputError: a component may not be trusted, or is not a directory (exit 78).
    """
    try:
        real, st, missing = walk_trusted(prefix, "install prefix")
    except NotADirectoryError as exc:
        raise InputError(str(prefix), f"refusing the install prefix: {exc.filename} is not a directory") from None
    if not missing and not stat.S_ISDIR(st.st_mode):
        raise InputError(str(prefix), "refusing the install prefix: it is not a directory")
    return real.joinpath(*missing)


def check_binary(exe: str) -> None:
    """ExecStart runs ``exe`` as root: it, and the interpreter its ``#!`` line names, must pass the
    trust rule as far as they exist here (a missing one may only appear where root alone could put
    it; with ``--prefix`` the executable may be the target system's).

    Raises:
        InputError: a component may not be trusted, or the executable is not a regular file (exit 78).
    """
    what = "nccltune executable (ExecStart)"
    try:
        real, st, missing = walk_trusted(exe, what)
    except NotADirectoryError as exc:
        raise InputError(exe, f"refusing the {what}: {exc.filename} is not a directory") from None
    if missing:
        return
    if not stat.S_ISREG(st.st_mode):
        raise InputError(exe, f"refusing the {what}: it is not a regular file")
    try:
        with open(real, "rb") as fh:
            first = fh.readline(4096)
    except OSError as exc:
        raise InputError(exe, f"cannot read the {what}: {exc.strerror}") from None
    words = first[2:].split() if first.startswith(b"#!") else []
    if words:
        interpreter = os.fsdecode(words[0])
        try:
            walk_trusted(interpreter, f"interpreter of the {what}, {exe}")
        except NotADirectoryError as exc:
            raise InputError(interpreter, f"refusing the interpreter of {exe}: {exc.filename} "
                             "is not a directory") from None


def plan_install(prefix: Path, *, binary: str | None = None, enable: bool = True) -> InstallPlan:
    """What install writes and runs, after the trust rule for the prefix and the executable;
    writes nothing. Below a prefix other than / (a DESTDIR) every path written inside a file is
    the final one.

    Raises:
        InputError: the prefix or the executable may not be trusted, or the config below the
            prefix is not valid (exit 78).
    """
    from .config import load_config

    real_prefix = check_prefix(prefix)
    destdir = real_prefix != Path("/")
    if destdir:
        # The target system's executable, never this process's (a build checkout's venv).
        exe = binary or SHIPPED_EXE
        # Root runs it on the target, which may be this very system: as given, and in the image.
        check_binary(exe)
        check_binary(str(prefix / exe.lstrip("/")))
    else:
        exe = binary or shutil.which("nccltune") or str(Path(sys.argv[0]).resolve())
        check_binary(exe)
    # The directories the service may write, from the target's config (its paths are final ones).
    dirs = load_config(prefix / CONFIG).written_dirs()
    plan = InstallPlan()

    def add(where: str, text: str, mode: int, note: str) -> None:
        plan.writes.append(Write(prefix / where, text, mode, note, Path("/") / where))

    for name in UNITS:
        add(f"etc/systemd/system/{name}", unit_text(name, exe, dirs), 0o644, f"(ExecStart {exe})")
    example = shipped_dir("examples", "examples") / "config.yaml"
    if example.exists() and not (prefix / CONFIG).exists():
        add(CONFIG, example.read_text(), 0o644, "(all defaults; edit to taste)")
    launchers = shipped_dir("launchers", "launchers")
    for source, where in LAUNCHERS:
        add(where, (launchers / source).read_text(), 0o755, "")
    prolog = prefix / LAUNCHERS[1][1]
    plan.notes.append(f"for Slurm: TaskProlog=/{LAUNCHERS[1][1]} in slurm.conf (one TaskProlog per node: "
                      f"call {prolog.name} from an existing one)")
    if not destdir:
        plan.commands.extend(rank_user_commands())
    else:
        plan.notes.append(f"on the target, create the user the benchmark ranks run as (bench.user): "
                          f"useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "
                          f"[--groups <the groups owning /dev/nvidia*>] {DEFAULT_USER}")
    if enable:
        plan.commands.extend(list(c) for c in ENABLE)
    return plan


def installed_path(prefix: Path, name: str) -> Path:
    """Where a file the manifest names (its final path) lies below `prefix`. A manifest written
    before the names were final ones names the prefixed path itself."""
    if prefix != Path("/") and Path(name).is_relative_to(prefix):
        return Path(name)
    return prefix / name.lstrip("/")


def _read_manifest(prefix: Path) -> dict[str, str]:
    path = prefix / MANIFEST
    if not path.exists():
        return {}
    # Uninstall deletes what the manifest names: one another user could edit is refused (78).
    check_file(path, "install manifest")
    try:
        doc = loads_strict(read_input_file(path, MAX_MANIFEST_BYTES, "install manifest"))
        files = doc["files"]
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise TypeError("files is not an object of digests")
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(str(path), f"not a manifest nccltune install wrote ({exc})",
                         hint="remove the files by hand, then the manifest") from None
    return {str(k): v for k, v in files.items()}


def _run(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        raise NccltuneError(f"{cmd[0]} not found: run `{shlex.join(cmd)}` by hand")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NccltuneError(f"{shlex.join(cmd)} failed: {proc.stderr.strip()}")


def install_units(prefix: Path, *, binary: str | None = None, enable: bool = True,
                  dry_run: bool = False) -> list[str]:
    """Carry out (or, with `dry_run`, only describe) the install plan; one line per step."""
    plan = plan_install(prefix, binary=binary, enable=enable)
    if dry_run:
        return ([f"would write {w.path} (mode {w.mode:04o}) {w.note}".rstrip() for w in plan.writes]
                + [f"would write {prefix / MANIFEST} (what was written, for uninstall)"]
                + [f"then: {n}" for n in plan.notes]
                + [f"would run {shlex.join(c)}" for c in plan.commands])
    if enable and shutil.which("systemctl") is None:
        raise NccltuneError("systemctl not found: enable the service by hand")
    manifest = _read_manifest(prefix)
    done = []
    for w in plan.writes:
        # Each directory walked under the trust rule before anything is made in it.
        ensure_dir(w.path.parent, "install directory")
        atomic_write(w.path, w.text, w.mode)
        manifest[str(w.final)] = sha256(w.text)
        done.append(f"installed {w.path} {w.note}".rstrip())
    ensure_dir((prefix / MANIFEST).parent, "install directory")
    atomic_write(prefix / MANIFEST, json.dumps({"files": manifest}, indent=1, sort_keys=True) + "\n")
    done.extend(f"then: {n}" for n in plan.notes)
    for cmd in plan.commands:
        _run(cmd)
        done.append(shlex.join(cmd))
    return done


def uninstall(prefix: Path, *, disable: bool = True, dry_run: bool = False) -> list[str]:
    """Remove what install wrote, by its manifest: a file whose content changed since is kept and
    named. The state directory (history, published settings) is never touched."""
    check_prefix(prefix)
    manifest = _read_manifest(prefix)
    if not manifest:
        return [f"nothing to uninstall: no {prefix / MANIFEST}"]
    verb = "would " if dry_run else ""
    done = []
    if disable:
        if dry_run:
            done.append(f"would run {' '.join(DISABLE)}")
        else:
            _run(DISABLE)
            done.append(" ".join(DISABLE))
    for name, digest in sorted(manifest.items()):
        path = installed_path(prefix, name)
        try:
            # Removed by name, in a directory nobody else could have switched.
            trusted_target(path, "installed file", follow_last=False)
        except OSError:  # its directory is gone, or is no directory
            done.append(f"{path}: already gone")
            continue
        if not path.is_file() or path.is_symlink():
            done.append(f"{path}: already gone")
            continue
        if sha256(path.read_text(errors="replace")) != digest:
            done.append(f"kept {path}: changed since install")
            continue
        if not dry_run:
            path.unlink()
        done.append(f"{verb}remove {path}" if dry_run else f"removed {path}")
    if not dry_run:
        (prefix / MANIFEST).unlink()
    done.append(f"{verb}remove {prefix / MANIFEST}" if dry_run else f"removed {prefix / MANIFEST}")
    if disable:
        if dry_run:
            done.append("would run systemctl daemon-reload")
        else:
            _run(["systemctl", "daemon-reload"])
            done.append("systemctl daemon-reload")
    return done
