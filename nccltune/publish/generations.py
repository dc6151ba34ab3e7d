"""Generation sets: how one Setting becomes the published set, as one unit, and what is kept.

The writer of publish/ alone: ``publish_generation`` is called by publisher.publish_setting, the
one publish function, and by nothing else (tests/test_one_publish.py holds every other module to it).

Layout (DESIGN.md section 3), one *set* per publish, in the publish directory::

    <publish_dir>/generations/<N>/nccl.sh          export NAME='value' lines (``. nccl.sh``): every job
    <publish_dir>/generations/<N>/nccl.env         NAME=value lines (systemd EnvironmentFile=, docker --env-file):
                                                   every job
    <publish_dir>/generations/<N>/nccl-single-node.sh   the same two forms of the part measured for
    <publish_dir>/generations/<N>/nccl-single-node.env  single-node jobs only (may hold no variable)
    <publish_dir>/generations/<N>/nccl-nodes-<C>.sh     the same two forms of each part by node count
    <publish_dir>/generations/<N>/nccl-nodes-<C>.env    (C = 2, 4, ...: jobs of C nodes up to the next
                                                   count; listed in nccl.sh's "# node counts:" line)
    <publish_dir>/generations/<N>/nccl.json        both parts, labelled, with their provenance
    <publish_dir>/generations/<N>/ncclTopology.xml when a topology is published with the set
    <publish_dir>/generations/<N>/libnccl-tuner-nccltune.so, tuner-table.txt   when a tuner is published
    <publish_dir>/generations/<N>/class-profile.json   the class profile the set comes from, if any
    <publish_dir>/generations/last                 the last generation number handed out
    <publish_dir>/current -> generations/<N>       the one switch
    <publish_dir>/nccl.sh -> current/nccl.sh       (and the other four): the paths users know; the
                                                   nccl-nodes-<C> files have no such link (the counts
                                                   differ between sets): current/nccl-nodes-<C>.sh

Under the publish lock (an flock on the publish directory itself, so two publishers never
interleave) a publish takes the next generation number and records it in ``generations/last``
first (so a number is never handed out twice, even after a crash), writes the whole set into a
hidden ``generations/.<N>.tmp-*`` directory (each file fsync'ed), renames it to
``generations/<N>``, and then switches ``current`` with one rename of a symlink. A reader that
resolves ``current`` once (readback.py) sees generation N or N+1, never a mix; a kill at any point
leaves the old set published and at most a hidden directory that the next publish removes. Every
file carries its generation (``# generation: N``, ``provenance.generation``). The newest
``KEEP_GENERATIONS`` generations stay on disk, so the NCCL_TOPO_FILE of a job started on an older
one stays valid while it runs. Every file and directory is created through O_NOFOLLOW/O_EXCL opens
in directories that pass the trust rule (``nccltune.files.trust``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BusyError, InputError
from ..files import trust
from ..files.atomicfile import TEMP_INFIX, fail_without_temp, fsync_dir, remove_dead_temps, remove_quietly, replace_file
from ..files.inputfile import read_json
from ..files.trust import CLOEXEC, NOFOLLOW
from .applied import set_digest
from .formats import (
    ENV_NAME,
    JSON_NAME,
    MAX_PUBLISHED_BYTES,
    PUBLISHED_NAMES,
    SH_NAME,
    SINGLE_ENV_NAME,
    SINGLE_SH_NAME,
    TOPOLOGY_NAME,
    TUNER_PLUGIN_NAME,
    TUNER_TABLE_NAME,
    render_set,
)
from .setting import PublishError, Setting

log = logging.getLogger(__name__)

CURRENT_NAME = "current"
GENERATIONS_DIR = "generations"
COUNTER_NAME = "last"
# Generations kept on disk (the current one included): enough for jobs started on an older one.
KEEP_GENERATIONS = 4

_LOCK_TIMEOUT_S = 10.0
_LOCK_POLL_S = 0.05


@dataclass(frozen=True)
class PublishedFiles:
    """What one publish wrote: the three well-known paths (links into ``current``), the generation,
    and the generation's own topology file when one was published."""

    sh_path: Path
    env_path: Path
    json_path: Path
    generation: int
    topology_path: Path | None = None
    single_sh_path: Path | None = None
    single_env_path: Path | None = None
    tuner_plugin_path: Path | None = None
    tuner_table_path: Path | None = None
    # The variables as written: the generation's own topology file and tuner copies named.
    env: dict[str, str] = field(default_factory=dict)
    single_node_env: dict[str, str] = field(default_factory=dict)
    digest: str = ""  # of the generation's nccl.json: with the generation, the set's name in the marker
    nodes_env: dict[int, dict[str, str]] = field(default_factory=dict)  # the parts by node count

    @property
    def set_id(self) -> str:
        """``GENERATION:DIGEST``, as the marker of what a launch applied (publish.applied) names the set."""
        return f"{self.generation}:{self.digest}"


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Serialise publishers into one directory (see the module docstring: the publish lock).

    The lock is an flock on the directory itself, so no lock file is added to the state dir.

    Raises:
        BusyError: another publisher held the lock for longer than the timeout (exit 75).
        PublishError: the directory cannot be opened.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC)
    except OSError as exc:
        raise PublishError(directory, exc, action="cannot open directory") from exc
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BusyError(f"{directory}: another nccltune process is publishing there") from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        # Closing the descriptor releases the flock.
        os.close(fd)


def _legacy_generation(json_path: Path) -> int:
    """The generation recorded in a pre-generation-directory nccl.json (a regular file); 0 when
    there is none or it is unreadable (a corrupt file is what the publish replaces)."""
    try:
        if json_path.is_symlink() or not json_path.is_file():
            return 0
        doc = read_json(json_path, MAX_PUBLISHED_BYTES, "published nccl.json")
    except (OSError, InputError) as exc:
        log.warning("%s: unreadable (%s); the generation count restarts at 1", json_path,
                    exc.message if isinstance(exc, InputError) else exc)
        return 0
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    generation = prov.get("generation") if isinstance(prov, dict) else None
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        return 0
    return generation


def _generation_numbers(gen_dir: Path) -> list[int]:
    """Numbers of the complete generation directories, ascending."""
    try:
        names = os.listdir(gen_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise PublishError(gen_dir, exc, action="cannot list") from exc
    return sorted(int(n) for n in names if n.isdigit() and not n.startswith("0"))


def _read_counter(path: Path) -> int:
    try:
        fd = trust.open_file(path, os.O_RDONLY, "generation counter")
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise PublishError(path, exc, action="cannot read") from exc
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else 0


def current_generation(out_dir: Path) -> int | None:
    """The generation ``current`` points at, or None when there is no valid link."""
    try:
        target = os.readlink(out_dir / CURRENT_NAME)
    except OSError:
        return None
    head, _, number = target.rpartition("/")
    if head != GENERATIONS_DIR or not number.isdigit():
        return None
    return int(number)


# Link temps are named apart from file temps: only publishers (under the lock) make them.
_LINK_TEMP_PREFIX = ".link."


def _switch_link(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` atomically: a symlink under a temp name, renamed over ``link``."""
    if os.path.islink(link) and os.readlink(link) == target:
        return
    for _ in range(16):
        tmp = link.with_name(f"{_LINK_TEMP_PREFIX}{link.name}{TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.symlink(target, tmp)
        except FileExistsError:
            continue
        except OSError as exc:
            raise PublishError(link, exc, action="cannot create link") from exc
        break
    else:
        raise PublishError(link, FileExistsError(errno.EEXIST, "no free temporary link name"))
    try:
        os.replace(tmp, link)
    except BaseException as exc:
        fail_without_temp(tmp, link, exc)


def _write_generation(directory: Path, files: list[tuple[str, bytes]]) -> None:
    """Fill a fresh generation directory; every file fsync'ed, then the directory."""
    for name, data in files:
        path = directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
        except OSError as exc:
            raise PublishError(path, exc) from exc
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o644)
            os.fsync(fd)
        except OSError as exc:
            raise PublishError(path, exc) from exc
        finally:
            os.close(fd)
    fsync_dir(directory)


def _prune(out_dir: Path, keep: int, current: int) -> None:
    """Remove generations older than the newest ``keep`` (never ``current``) and what dead
    publishers left: half-built generation directories, counter temps, link temps.

    Runs under the publish lock, so every temp of a publisher is a dead one's, whatever its age.
    """
    gen_dir = out_dir / GENERATIONS_DIR
    numbers = [n for n in _generation_numbers(gen_dir) if n <= current]
    doomed = [gen_dir / str(n) for n in numbers[:-keep]] if keep > 0 else []
    doomed += [gen_dir / e for e in os.listdir(gen_dir) if TEMP_INFIX in e]
    doomed += [out_dir / e for e in os.listdir(out_dir) if e.startswith(_LINK_TEMP_PREFIX) and TEMP_INFIX in e]
    for path in doomed:
        remove_quietly(path)


def _prepare_out_dir(out_dir: Path) -> None:
    """Create (0755) and check the publish directory and its generations/ directory."""
    try:
        trust.ensure_dir(out_dir, "publish directory")
        trust.ensure_dir(out_dir / GENERATIONS_DIR, "generations directory")
    except OSError as exc:
        raise PublishError(out_dir, exc, action="cannot create directory") from exc


def publish_generation(out_dir: Path, setting: Setting) -> PublishedFiles:
    """Write ``setting`` into ``out_dir`` as its next generation and make it current (see the
    module docstring for the layout, the lock and what a crash leaves). Only the set: the state
    directory's copies and the nccl.conf block are publish_setting's (publisher.py), the one caller;
    every decider and every test of a published set publishes through publish_setting.

    Raises:
        InputError: a name, value or bound is not publishable, or the directory may not be
            trusted (exit 78); nothing was written.
        PublishError: the OS refused a write (exit 1); the published set is the previous one.
        BusyError: another publisher kept the directory locked (exit 75).
    """
    out_dir = Path(out_dir)
    setting.check()
    # Rendered once before anything is written, so a bound or an unreadable plugin changes nothing.
    render_set(setting, out_dir / GENERATIONS_DIR / "0", 0)
    _prepare_out_dir(out_dir)
    gen_dir = out_dir / GENERATIONS_DIR
    with _directory_lock(out_dir):
        remove_dead_temps(out_dir)
        counter = gen_dir / COUNTER_NAME
        numbers = _generation_numbers(gen_dir)
        generation = max([_read_counter(counter), _legacy_generation(out_dir / JSON_NAME), *numbers, 0]) + 1
        # The number is taken before anything else is written: a crash from here on never lets
        # a later publish reuse it.
        replace_file(counter, f"{generation}\n".encode(), 0o644)
        final = gen_dir / str(generation)
        every_job, files = render_set(setting, final, generation)
        building = gen_dir / f".{generation}{TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(building, 0o700)
            _write_generation(building, files)
            os.chmod(building, 0o755)
            os.rename(building, final)
            fsync_dir(gen_dir)
        except BaseException as exc:
            shutil.rmtree(building, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, PublishError):
                raise PublishError(final, exc) from exc
            raise
        # The one switch: readers resolve `current` once and see generation N or N+1, whole.
        _switch_link(out_dir / CURRENT_NAME, f"{GENERATIONS_DIR}/{generation}")
        for name in PUBLISHED_NAMES:
            _switch_link(out_dir / name, f"{CURRENT_NAME}/{name}")
        fsync_dir(out_dir)
        _prune(out_dir, KEEP_GENERATIONS, generation)

    single = dict(setting.single_node_env)
    counts = "".join(f", {len(part)} for jobs of {count}+ nodes" for count, part in sorted(setting.nodes_env.items()))
    log.info("published generation %d (%d variables for every job, %d for single-node jobs%s) into %s",
             generation, len(every_job), len(single), counts, out_dir)
    tuned = setting.tuner is not None
    return PublishedFiles(sh_path=out_dir / SH_NAME, env_path=out_dir / ENV_NAME, json_path=out_dir / JSON_NAME,
                          generation=generation,
                          topology_path=final / TOPOLOGY_NAME if setting.topology_xml is not None else None,
                          single_sh_path=out_dir / SINGLE_SH_NAME, single_env_path=out_dir / SINGLE_ENV_NAME,
                          tuner_plugin_path=final / TUNER_PLUGIN_NAME if tuned else None,
                          tuner_table_path=final / TUNER_TABLE_NAME if tuned else None,
                          env=every_job, single_node_env=single, digest=set_digest(dict(files)[JSON_NAME]),
                          nodes_env={count: dict(part) for count, part in sorted(setting.nodes_env.items())})

