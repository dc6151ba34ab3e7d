"""The command line: `main(argv=None) -> int`. The parser is parser.py; each command family has
its own module, which parses nothing and holds no step that also runs elsewhere (afterrun.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ..errors import EXIT_OK, NccltuneError, UsageError
from . import context, fleet, k8s, node_cmds, publish_cmds, results, sweep, topo
from .context import DEMO_STATE_DIR, EXIT_SIGINT, EXIT_SIGTERM, Terminated, load_cfg, setup_logging
from .parser import build_parser, enable_completion
from .sweep import sweep_launch_request

__all__ = ["DEMO_STATE_DIR", "build_parser", "load_cfg", "main", "sweep_launch_request"]

HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "topo": topo.cmd_topo,
    "sweep": sweep.cmd_sweep,
    "keygen": sweep.cmd_keygen,
    "history": results.cmd_history,
    "report": results.cmd_report,
    "compare": results.cmd_compare,
    "import": results.cmd_import,
    "export": results.cmd_export,
    "env": publish_cmds.cmd_env,
    "exec": publish_cmds.cmd_exec,
    "apply": publish_cmds.cmd_apply,
    "daemon": node_cmds.cmd_daemon,
    "doctor": node_cmds.cmd_doctor,
    "device-plugin": k8s.cmd_device_plugin,
    "verify": node_cmds.cmd_verify,
    "install": node_cmds.cmd_install,
    "uninstall": node_cmds.cmd_uninstall,
    "fleet": fleet.cmd_fleet,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    enable_completion(parser)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        if args.command is None:
            parser.print_help()
            return EXIT_OK
        context.QUIET = bool(args.quiet)
        setup_logging(-1 if context.QUIET else getattr(args, "verbose", 0))
        return dispatch(args)
    except NccltuneError as exc:
        print(f"nccltune: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("nccltune: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        print("nccltune: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except BrokenPipeError:
        return EXIT_OK


def dispatch(args: argparse.Namespace) -> int:
    handler = HANDLERS.get(args.command)
    if handler is None:  # pragma: no cover - argparse only accepts known commands
        raise UsageError(f"unknown command {args.command}")
    return handler(args)
