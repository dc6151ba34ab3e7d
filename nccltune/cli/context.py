"""What every command shares: the config with the flags folded in, the history, --quiet and output."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckFailed, NccltuneError

if TYPE_CHECKING:
    from ..config import Config
    from ..store import Store

log = logging.getLogger(__name__)


# Where a demo (`sweep --demo`, bringup.sh without GPUs) keeps its state, relative to the working directory.
DEMO_STATE_DIR = "nccltune-demo"


# A command ended by a signal exits 128 + its number, as shells report it.
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM during a sweep: unwinds like Ctrl-C (ranks killed, run recorded as interrupted),
    but is named for what it is in the history and exits 143."""

    def __str__(self) -> str:
        return "terminated (SIGTERM)"


# --quiet: warnings and errors only. Set once by main(); notes and progress on stderr look at it.
QUIET = False


def note(text: str) -> None:
    """An informational line on stderr (what a command chose for the user), silenced by --quiet."""
    if not QUIET:
        print(f"nccltune: {text}", file=sys.stderr, flush=True)


def out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def load_cfg(args: argparse.Namespace, *, demo: bool = False) -> Config:
    """Config file plus every command-line flag that has a config twin, folded in here once:
    nothing further down merges a flag with its setting. A demo keeps its state in ./nccltune-demo.
    """
    from ..config import DEFAULT_CONFIG_PATH, load_config, with_overrides

    cfg = load_config(Path(args.config) if args.config else DEFAULT_CONFIG_PATH, required=bool(args.config))
    overrides: dict[str, object] = {}
    state_dir = state_dir_flag(args, demo=demo)
    if state_dir is not None:
        overrides["state_dir"] = state_dir
    if getattr(args, "python", None):
        overrides["bench.python"] = args.python
    if getattr(args, "profile", None):
        overrides["sweep.profile"] = args.profile
    if getattr(args, "exhaustive", False):
        overrides["sweep.strategy"] = "exhaustive"
    if args.command == "sweep" and args.force:
        overrides["sweep.force"] = True
    unpin = [n for n in dict.fromkeys(getattr(args, "unpin", None) or []) if n not in cfg.sweep.unpin]
    if unpin:
        # --unpin sweeps a variable "although the environment or config sets it": a config pin of
        # the same name gives way (the config file itself may not name one variable in both).
        overrides["sweep.unpin"] = [*cfg.sweep.unpin, *unpin]
        if any(n in cfg.sweep.pin for n in unpin):
            overrides["sweep.pin"] = {k: v for k, v in cfg.sweep.pin.items() if k not in unpin}
    return with_overrides(cfg, **overrides) if overrides else cfg


def absolute(path: str | Path) -> Path:
    """``path`` made absolute against the working directory, its links kept: the trust rule
    (files/trust.py) walks them where the path is used, which a resolved string would hide."""
    return Path(os.path.abspath(path))


def state_dir_flag(args: argparse.Namespace, *, demo: bool = False) -> str | None:
    """The state directory the command line names: `--state-dir`, else with `demo` the demo's
    ./nccltune-demo, absolute and unresolved (see `absolute`); None: the config's."""
    if args.state_dir:
        return str(absolute(args.state_dir))
    return str(absolute(DEMO_STATE_DIR)) if demo else None


def output_file(path: str | Path, what: str) -> Path:
    """Where a command's `--out FILE` is written, checked before any work (files/trust.py's
    trusted_target: every directory and link on its way; the name itself is replaced by a rename).
    Write the path returned.

    Raises:
        InputError: a component on its way may not be trusted (exit 78).
        FileError: its directory does not exist or cannot be read (exit 1).
    """
    from ..errors import InputError
    from ..files.atomicfile import FileError
    from ..files.trust import trusted_target

    try:
        return trusted_target(absolute(path), what, follow_last=False)
    except InputError:
        raise
    except OSError as exc:
        raise FileError(path, exc, action="cannot write") from None


def reading_cfg(args: argparse.Namespace) -> Config:
    """The config of a command that only reads the state (history, report, env, topo's fallback).

    `--demo` reads ./nccltune-demo. Without it and without `--state-dir`, a state directory that
    has no history while ./nccltune-demo has one is the situation right after `bash bringup.sh`
    on a machine without GPUs: the demo's state is read, and stderr says so, so the commands a
    newcomer types next find what the sweep wrote.
    """
    demo = bool(getattr(args, "demo", False))
    cfg = load_cfg(args, demo=demo)
    if demo or args.state_dir:
        return cfg
    demo_dir = absolute(DEMO_STATE_DIR)
    if not cfg.state_path("history.db").exists() and (demo_dir / "history.db").exists():
        note(f"no history in {cfg.state_dir}; reading the CPU demo's state in {demo_dir} "
             "(--state-dir DIR to choose another)")
        return with_state_dir(cfg, demo_dir)
    return cfg


def with_state_dir(cfg: Config, directory: Path) -> Config:
    from ..config import with_overrides

    return with_overrides(cfg, state_dir=str(directory))


def open_history(args: argparse.Namespace) -> Store:
    """The results store of the configured state directory; CheckFailed when there is none yet."""
    from ..store import Store

    path = reading_cfg(args).state_path("history.db")
    if not path.exists():
        raise CheckFailed(f"no history at {path}", hint="run `nccltune sweep` first")
    store = Store(path)
    _mark_dead_runs(store, path.with_name("sweep.lock"), reading_cfg(args).publish_dir)
    return store


def _mark_dead_runs(store: Store, lock_path: Path, publish_dir: Path) -> None:
    """A run still 'running' while nobody holds the sweep lock was killed (kill -9, power loss):
    close it now rather than at the next sweep, by the sweep's own rule (close_dead_runs: the run
    the current generation names as published, the others as interrupted). Taking the lock proves
    no sweep or verify is live; a user who may not take it (or write the history) just sees the
    record as is."""
    from ..files.lock import SweepLock, is_held
    from ..trials.session import close_dead_runs

    if is_held(lock_path):
        return
    try:
        with SweepLock(lock_path):
            close_dead_runs(store, publish_dir)
    except (NccltuneError, OSError) as exc:
        log.debug("cannot check for interrupted runs: %s", exc)


def setup_logging(verbosity: int) -> None:
    from ..logsetup import setup_logging as setup

    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    setup(level)
