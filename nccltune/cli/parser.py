"""The argument parser: every command, its flags, its description and one example."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

from .. import __version__
from ..collectives import NAMES as COLLECTIVE_NAMES
from ..errors import UsageError
from ..trials.launch.registry import CHOICES as LAUNCHER_CHOICES
from .context import DEMO_STATE_DIR


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


# `--demo [SNAPSHOT]` right before one of the command's actions (`topo --demo record OUT`): the word
# is the action the user named, not a snapshot; --demo then stands for the bundled node. A NUL never
# reaches argv from a shell, so the stand-in cannot be a path a user gave.
_DEMO_BUNDLED = "\0bundled"


class _Parser(argparse.ArgumentParser):
    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        actions = {name for action in self._actions if isinstance(action, argparse._SubParsersAction)
                   for name in action.choices}
        if actions and "--demo" in self._option_string_actions:
            words = [f"--demo={_DEMO_BUNDLED}" if word == "--demo" and i + 1 < len(words) and words[i + 1] in actions
                     else word for i, word in enumerate(words)]
        parsed, rest = super().parse_known_args(words, namespace)
        if getattr(parsed, "demo", None) == _DEMO_BUNDLED:
            parsed.demo = True
        return parsed, rest

    def error(self, message: str) -> None:  # type: ignore[override]
        # "nccltune: error: " comes with every error; a subcommand's parser adds its own name.
        where = self.prog.removeprefix("nccltune").strip()
        raise UsageError(f"{where}: {message}" if where else message, hint=_did_you_mean(self, message))


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str | None:
    """One suggestion for a mistyped subcommand, the closest of the parser's commands (difflib)."""
    import difflib
    import re

    m = re.search(r"invalid choice: '?([^' ]+)'?", message)
    if m is None:
        return None
    names = [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
             for name in action.choices]
    close = difflib.get_close_matches(m.group(1), names, n=1)
    return f"did you mean `{parser.prog} {close[0]}`?" if close else None


# What each subcommand does and one example, shown by `nccltune COMMAND --help`.
_DESCRIBED: dict[str, tuple[str, str]] = {
    "compare": ("Compare run B with run A (ids from `nccltune history`), size by size and collective by "
                "collective. Exit 1 when B is slower than A beyond the noise at any size.",
                "nccltune compare 12 15 --side defaults"),
    "topo": ("Show the topology NCCL will see on this node: GPUs, NICs, the path type between each pair "
             "(the nvidia-smi topo -m matrix) and modelled bandwidths; optionally write NCCL's topology XML.",
             "nccltune topo --xml /tmp/topo.xml"),
    "topo record": ("Capture this node's NVML and sysfs readings as a snapshot that replays anywhere "
                    "(--input, --demo, tests).", "nccltune topo record node.json --description '8x H100 SXM'"),
    "topo check": ("Run a small NCCL job with NCCL_TOPO_FILE set to XML and report whether NCCL loaded it "
                   "and what it saw.", "nccltune topo check /tmp/topo.xml"),
    "topo diff": ("The semantic differences between two topologies (snapshots or NCCL XML); exit 1 when "
                  "they differ.", "nccltune topo diff nodeA.json nodeB.xml"),
    "sweep": ("Measure NCCL's defaults and the candidate settings this topology allows, choose the best "
              "beyond noise, and publish it for jobs (nccl.sh, nccl.env, nccl.json).", "nccltune sweep --plan"),
    "keygen": ("Write a new secret key for sweeps over several nodes: root-only (0600), never replacing an "
               "existing file. Copy the same key to every node of the job, as a Slurm munge key is; the "
               "coordinator and the joining nodes authenticate each other and every message with it.",
               "nccltune keygen /etc/nccltune/multinode.key"),
    "env": ("Print the published environment as a job with the calling environment gets it (its own "
            "variables kept, nothing under NCCLTUNE_DISABLE), after checking the published set.",
            "nccltune env --format env --as-published > /etc/default/nccl"),
    "exec": ("Run a command with the published environment; variables already set in the calling "
             "environment win, NCCLTUNE_DISABLE applies nothing.",
             "nccltune exec -- torchrun --nproc-per-node 8 train.py"),
    "history": ("List past sweeps and verifications, or one run's trials.", "nccltune history --run 3"),
    "daemon": ("The node service (systemd Type=notify): sweeps when the topology, the driver or NCCL "
               "changes, verifies periodically, never while jobs hold the GPUs.",
               "nccltune daemon --demo --max-polls 3"),
    "doctor": ("Find harmful NCCL settings (environment, /etc/nccl.conf, published files) and node problems "
               "on this topology; exit 1 on an error finding.", "nccltune doctor --json"),
    "verify": ("A quick all-reduce with the published environment, compared with what the sweep measured; "
               "exit 1 on drift beyond the threshold.", "nccltune verify --floor 300"),
    "install": ("Install the systemd units, the example config, the torchrun wrapper and the Slurm prolog, "
                "and enable the service.", "nccltune install --dry-run"),
    "uninstall": ("Remove what `nccltune install` wrote, by its manifest: files changed since stay (and are "
                  "named); the state directory (history, published settings) is never touched.",
                  "nccltune uninstall --dry-run"),
    "report": ("The last (or a given) sweep's table size by size, a plot of bus bandwidth against size, or "
               "nccl-tests' JSON document (-J, format version 3) of one collective of a run.",
               "nccltune report --format nccl-tests-json --run 3 > run3.json"),
    "import": ("Read a JSON document an nccl-tests *_perf binary wrote (-J FILE.json, format version 3) into the "
               "history as a run of kind import, for `report` and `compare` beside nccltune's own runs. Never "
               "taken for a sweep's result.", "nccltune import all_reduce_perf.json"),
    "export": ("This node's sweep measurements as one JSON document, the input of `nccltune fleet decide`.",
               "nccltune export --out $(hostname).json"),
    "fleet": ("Decisions for a class of identical nodes, from their exports.",
              "nccltune fleet decide node*.json --out class.json"),
    "fleet decide": ("Pool the exports of one node class into a class profile that `nccltune apply` publishes.",
                     "nccltune fleet decide node1.json node2.json --out class.json"),
    "fleet status": ("Per node class: the NCCL, driver and torch each node runs and what is in force there.",
                     "nccltune fleet status exports/ --profiles profiles/"),
    "fleet upgrade": ("After NCCL or the driver changed on a class: the profile for its new class id by the upgrade "
                      "rule (the upgraded nodes' decision, the old profile kept on the canary's gate, or its safe "
                      "part); exit 78 while nothing was compared.",
                      "nccltune fleet upgrade profiles/old.json exports/ --out profiles/"),
    "device-plugin": ("The kubelet device plugin for Kubernetes nodes: advertises nccltune.io/every-job, "
                      "nccltune.io/single-node and nccltune.io/files, healthy while the published CDI spec has "
                      "the device, and answers a pod's request with the CDI device nccltune.io/tuning=NAME. "
                      "Runs until SIGTERM; needs the k8s extra (grpcio).",
                      "nccltune device-plugin --cdi-dir /var/run/cdi"),
    "apply": ("Publish a class profile on this node after checking that it was decided for this node's class.",
              "nccltune apply /shared/profiles/"),
}


def _describe(parser: argparse.ArgumentParser, path: str = "") -> None:
    """Give every subcommand its description and example (one table above), recursively."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, child in action.choices.items():
            key = f"{path} {name}".strip()
            if key in _DESCRIBED:
                description, example = _DESCRIBED[key]
                child.description = textwrap.fill(description, 100)
                child.epilog = f"example:\n  {example}"
                child.formatter_class = argparse.RawDescriptionHelpFormatter
            _describe(child, key)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="config file (default /etc/nccltune/config.yaml)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory (default /var/lib/nccltune)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    # SUPPRESS: an unset flag here leaves the global one (before the command) in place.
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="warnings and errors only (no progress or notes on stderr)")


def _command(sub: argparse._SubParsersAction[_Parser], name: str, help: str) -> _Parser:
    """A command's parser with the flags every command takes (`_common`)."""
    p = sub.add_parser(name, help=help)
    _common(p)
    return p


def _demo_state(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo", action="store_true",
                   help=f"read the CPU demo's state in ./{DEMO_STATE_DIR}/ (also the fallback when the state "
                        "directory has no history and ./nccltune-demo/ has)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nccltune", description="Topology-aware NCCL tuning for GPU nodes.",
        epilog="exit codes: 0 ok, 1 check failed or I/O error (disk full), 2 usage, 69 no GPU/NVML/torch, "
               "75 busy (lock held or GPUs in use), 78 bad config or input, 126/127 (exec) command not "
               "runnable/not found, 130 SIGINT, 143 SIGTERM. Without GPUs: `nccltune sweep --demo`.")
    parser.add_argument("--version", action="version", version=f"nccltune {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="warnings and errors only (no progress or notes on stderr)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    topo = _command(sub, "topo", help="show this node's topology, record it, check or diff NCCL XML")
    topo.add_argument("--input", metavar="FILE", help="a recorded snapshot or an NCCL topology XML")
    _demo_snapshot(topo, "the bundled (or given) recorded node, for machines without GPUs")
    topo.add_argument("--xml", metavar="OUT", help="write NCCL's topology XML (for NCCL_TOPO_FILE) to OUT")
    topo.add_argument("--no-nics", action="store_true", help="leave NICs out of the matrix, the JSON and the XML")
    _json(topo)
    tsub = topo.add_subparsers(dest="topo_command", metavar="ACTION", parser_class=_Parser)
    rec = _command(tsub, "record", help="capture this node's raw readings as a replayable snapshot")
    rec.add_argument("out", metavar="OUT", help="the snapshot file to write (JSON)")
    rec.add_argument("--description", help="one line saying what machine this is")
    chk = _command(tsub, "check", help="run a small NCCL job with this XML and report whether NCCL loaded it")
    chk.add_argument("xml", metavar="XML", help="the NCCL topology XML to try (e.g. from `nccltune topo --xml`)")
    _json(chk)
    _worker_python(chk, "worker interpreter (default: bench.python or auto)")
    chk.add_argument("--dump", metavar="OUT", help="also keep NCCL's own re-dump of the topology here")
    dif = _command(tsub, "diff", help="semantic differences between two topologies (snapshot or XML)")
    dif.add_argument("a", metavar="A", help="the first topology: a snapshot, a bundled name or an NCCL XML")
    dif.add_argument("b", metavar="B", help="the second topology, compared with A")
    _json(dif)

    _add_commands(sub)
    _add_fleet_parsers(sub)
    _describe(parser)
    return parser


def enable_completion(parser: argparse.ArgumentParser) -> None:
    """Shell completion where argcomplete is installed (the optional `completion` extra); a no-op
    unless the shell asks for completions, and nothing at all without argcomplete."""
    try:
        import argcomplete  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def _demo_snapshot(p: argparse.ArgumentParser, help: str) -> None:
    """`--demo [SNAPSHOT]`: a recorded node (the bundled one without SNAPSHOT) instead of this one."""
    p.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT", help=help)


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document")


def _worker_python(p: argparse.ArgumentParser, help: str = "worker interpreter (default: bench.python, or auto)"
                   ) -> None:
    p.add_argument("--python", metavar="PY", help=help)


def _nnodes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=_positive_int, metavar="N",
                   help="the job's node count: 1 adds the single-node part (default: NCCLTUNE_JOB_NNODES, "
                        "else the every-job part only)")


def _add_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """Every command but topo's and the fleet's, in the order `nccltune --help` lists them."""
    _add_sweep_parsers(sub)
    _add_job_env_parsers(sub)
    _add_history_parser(sub)
    _add_service_parsers(sub)
    _add_check_parsers(sub)
    _add_install_parsers(sub)
    _add_report_parser(sub)
    _add_compare_parser(sub)
    _add_import_parser(sub)


def _add_sweep_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    sw = _command(sub, "sweep", help="measure NCCL defaults and candidates, choose, publish")
    sw.add_argument("--plan", action="store_true", help="print the plan (measured, pruned and why, ETA) and stop")
    sw.add_argument("--profile", metavar="NAME", help="objective: balanced (default), large, small, ddp, fsdp, moe, "
                    "pipeline, or a custom one (sweep.profiles)")
    _json(sw)
    _demo_snapshot(sw, "run on the CPU (gloo) over a recorded topology (default: the bundled 2-GPU node)")
    sw.add_argument("--force", action="store_true", help="sweep even while compute processes use the GPUs")
    sw.add_argument("--over-profile", action="store_true",
                    help="publish this node's own result even while a class profile is in force (by default "
                         "the result is recorded, and the profile stays published)")
    sw.add_argument("--exhaustive", action="store_true", help="measure the full grid instead of the staged search")
    sw.add_argument("--unpin", action="append", default=[], metavar="NAME",
                    help="sweep a variable although the environment or config sets it")
    _worker_python(sw)
    sw.add_argument("--nodes", type=int, default=1, metavar="N",
                    help="measure jobs of N nodes (this one coordinates; see --join)")
    sw.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                    help="this node's address for the other nodes: torchrun's c10d rendezvous on PORT, the "
                         "authenticated control channel on PORT+1 (needed with --nodes N and torchrun)")
    sw.add_argument("--join", metavar="HOST:PORT",
                    help="run the trials of the sweep coordinated at HOST:PORT (its --rdzv-endpoint)")
    sw.add_argument("--loopback", action="store_true",
                    help="single-node NIC loopback: P2P and SHM off, so traffic goes through the NICs")
    sw.add_argument("--launcher", choices=LAUNCHER_CHOICES, default="auto",
                    help="how ranks start (auto: srun inside a Slurm allocation of several nodes, torchrun "
                         "with --nodes > 1, else local)")

    kg = _command(sub, "keygen", help="write a new secret key for sweeps over several nodes (copy it to every node)")
    kg.add_argument("path", nargs="?", metavar="PATH", help="where (default: multinode.key_file, "
                    "/etc/nccltune/multinode.key); an existing file is never replaced")


def _add_job_env_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    env = _command(sub, "env", help="print the published environment")
    _demo_state(env)
    env.add_argument("--format", choices=("sh", "env", "json"), default="sh",
                     help="nccl.sh (to source, default), nccl.env (EnvironmentFile=, --env-file) or nccl.json")
    env.add_argument("--json", action="store_true", help="the same as --format json: both parts, labelled")
    _nnodes(env)
    env.add_argument("--as-published", action="store_true",
                     help="print the files as published, whatever the calling environment sets (for a file "
                          "others read: EnvironmentFile=, --env-file); default: as a job with this environment "
                          "gets them (its own variables and NCCLTUNE_DISABLE respected)")

    ex = _command(sub, "exec", help="run a command (e.g. torchrun) with the published environment")
    _nnodes(ex)
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...",
                    help="the command and its arguments, after --")


def _add_history_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    hist = _command(sub, "history", help="past sweeps and verifications")
    _demo_state(hist)
    hist.add_argument("--limit", type=_positive_int, default=20, help="newest N runs (a positive number)")
    hist.add_argument("--run", type=int, metavar="ID", help="show one run's trials")
    _json(hist)


def _add_service_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    dm = _command(sub, "daemon", help="the node service (systemd Type=notify)")
    _demo_snapshot(dm, "the same service loop on the CPU over a recorded topology")
    _worker_python(dm)
    dm.add_argument("--poll-interval", type=float, metavar="S", help="seconds between polls (daemon.poll_interval_s)")
    dm.add_argument("--max-polls", type=int, metavar="N", help="stop after N polls (bring-up scripts, tests)")

    dp = _command(sub, "device-plugin", help="the kubelet device plugin that hands pods nccltune's CDI devices")
    dp.add_argument("--cdi-dir", metavar="DIR", help="the CDI spec directory the daemon publishes to "
                    "(default publish.cdi_dir)")
    dp.add_argument("--plugin-dir", metavar="DIR", default="/var/lib/kubelet/device-plugins",
                    help="the kubelet's device-plugins directory (default /var/lib/kubelet/device-plugins)")
    dp.add_argument("--units", type=_positive_int, default=110, metavar="N",
                    help="units per resource: how many containers of the node may hold one at once (default 110)")
    dp.add_argument("--interval", type=float, default=5.0, metavar="S",
                    help="seconds between reading the CDI spec and checking the registration (default 5)")
    dp.add_argument("--cdi-annotations", action="store_true",
                    help="name the CDI device in cdi.k8s.io/ annotations instead of CDIDevices (kubelet before "
                         "1.28, or the DevicePluginCDIDevices gate off)")


def _add_check_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    doc = _command(sub, "doctor", help="find harmful NCCL settings and node problems")
    doc.add_argument("--input", metavar="FILE", help="judge a recorded snapshot instead of this node")
    _demo_snapshot(doc, "judge the bundled (or given) snapshot, for machines without GPUs")
    _json(doc)

    ver = _command(sub, "verify", help="quick run of the profile's collectives with the published environment "
                                       "against the last sweep")
    ver.add_argument("--profile", metavar="NAME", help="whose collectives to check (default: sweep.profile)")
    ver.add_argument("--floor", type=float, metavar="GBPS", help="fail below this busbw at the largest size")
    ver.add_argument("--current", action="store_true", help="check the calling environment, not the published one")
    ver.add_argument("--threshold", type=float, metavar="PCT", help="allowed drift (daemon.drift_threshold_pct)")
    _demo_snapshot(ver, "verify the CPU demo's published setting (state in ./nccltune-demo)")
    ver.add_argument("--force", action="store_true", help="verify even while compute processes use the GPUs")
    _worker_python(ver)
    _json(ver)
    ver.add_argument("--baseline", type=int, metavar="RUN",
                     help="also fail (exit 1) when slower than run RUN beyond noise at any size (upgrade pipelines)")
    ver.add_argument("--quick", action="store_true",
                     help="for a per-job prolog: the profile's first collective at the smallest and largest "
                          "size, one run (NCCL's log still read); says what it checked")


def _add_install_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    ins = _command(sub, "install", help="install the systemd units and enable the service")
    ins.add_argument("--prefix", metavar="DIR",
                     help="install below DIR as a DESTDIR (packages, images, tests): every path written "
                          "inside the files is the final one; implies --no-enable unless --enable")
    ins.add_argument("--no-enable", action="store_true", help="do not run systemctl daemon-reload/enable")
    ins.add_argument("--enable", action="store_true", help="run systemctl even with --prefix")
    ins.add_argument("--binary", metavar="PATH",
                     help="ExecStart's nccltune (default: this one; below --prefix, /usr/local/bin/nccltune)")
    ins.add_argument("--dry-run", action="store_true", help="print what would be written and run; write nothing")

    uns = _command(sub, "uninstall", help="remove what install wrote (unchanged files only; never the state)")
    uns.add_argument("--prefix", metavar="DIR", help="uninstall below DIR; implies --no-disable")
    uns.add_argument("--no-disable", action="store_true", help="do not run systemctl disable/daemon-reload")
    uns.add_argument("--dry-run", action="store_true", help="print what would be removed and run; remove nothing")


def _add_report_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    rep = _command(sub, "report", help="the last sweep's table, or a plot of bus bandwidth against size")
    _demo_state(rep)
    rep.add_argument("--run", type=int, metavar="ID", help="a run id from `nccltune history`")
    rep.add_argument("--plot", metavar="OUT.png", help="write a plot (needs matplotlib)")
    rep.add_argument("--json", action="store_true", help="print one JSON document (the same as --format json)")
    rep.add_argument("--format", choices=("text", "json", "nccl-tests-json"),
                     help="text (default), json, or nccl-tests-json: the document all_reduce_perf -J writes "
                          "(format version 3), for one collective of the run")
    rep.add_argument("--collective", choices=COLLECTIVE_NAMES, metavar="NAME",
                     help=f"with --format nccl-tests-json: which collective ({', '.join(COLLECTIVE_NAMES)}; "
                          "default all_reduce): nccl-tests writes one document per binary")
    rep.add_argument("--setting", choices=("published", "defaults"),
                     help="with --format nccl-tests-json: the trials of the published setting (default) or of NCCL's "
                          "defaults, per size the median over them (what report and compare show)")
    rep.add_argument("--trial", type=_positive_int, metavar="SEQ",
                     help="with --format nccl-tests-json: one trial's numbers (SEQ from `nccltune history --run ID`)")


def _add_import_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    imp = _command(sub, "import", help="read an nccl-tests -J document into the history (for report and compare)")
    imp.add_argument("--demo", action="store_true",
                     help=f"store it in the CPU demo's history in ./{DEMO_STATE_DIR}/ (also where it goes when the "
                          "state directory has no history and ./nccltune-demo/ has)")
    imp.add_argument("file", metavar="FILE",
                     help="the JSON document a *_perf binary wrote with -J FILE.json (format version 3)")
    imp.add_argument("--collective", choices=COLLECTIVE_NAMES, metavar="NAME",
                     help="the collective measured, where the document's binary (args[0]) is no *_perf binary "
                          "nccltune knows (a renamed build)")
    _json(imp)


def _add_compare_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    cmp = _command(sub, "compare", help="two runs side by side: faster, slower or the same beyond noise per size")
    cmp.add_argument("a", type=int, metavar="RUN_A", help="the reference run")
    cmp.add_argument("b", type=int, metavar="RUN_B", help="the run judged against it")
    cmp.add_argument("--side", choices=("published", "defaults"), default="published",
                     help="compare the published setting's trials (default) or NCCL's defaults'")
    _json(cmp)


def _add_fleet_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    exp = _command(sub, "export", help="this node's sweep measurements as one JSON document (for fleet decide)")
    exp.add_argument("--run", type=int, metavar="ID", help="one run (default: every ok sweep of this topology)")
    _demo_snapshot(exp, "a demo node: its state in ./nccltune-demo, its topology from the snapshot")
    exp.add_argument("--out", metavar="FILE", help="write here (atomically) instead of standard output")

    fl = sub.add_parser("fleet", help="decide for a class of nodes from their exports")
    fsub = fl.add_subparsers(dest="fleet_command", metavar="ACTION", parser_class=_Parser, required=True)
    dec = _command(fsub, "decide", help="pool the exports of one node class into a class profile")
    dec.add_argument("exports", nargs="+", metavar="EXPORT", help="files written by `nccltune export` on each node")
    dec.add_argument("--out", required=True, metavar="PROFILE", help="the class profile to write")
    dec.add_argument("--profile", metavar="NAME", help="objective (default: the one the nodes swept for)")
    dec.add_argument("--parts", action="store_true",
                     help="exports of sweeps over different node counts: one part per measured node count, "
                          "each decided from its own sweeps (docs/job-shapes.md)")
    st = _command(fsub, "status", help="per class: each node's NCCL/driver/torch and what is in force")
    st.add_argument("exports", nargs="+", metavar="EXPORT",
                    help="files written by `nccltune export` on each node, or directories of them")
    st.add_argument("--profiles", metavar="PROFILES",
                    help="a class profile, or a directory of them named <class id>.json")
    _json(st)
    up = _command(fsub, "upgrade", help="after an NCCL or driver upgrade: the profile for the class's new class id")
    up.add_argument("old_profile", metavar="OLD_PROFILE", help="the class profile under the old versions")
    up.add_argument("exports", nargs="+", metavar="EXPORT",
                    help="the upgraded nodes' exports (the canary's with its upgrade_gate), or directories of them")
    up.add_argument("--out", required=True, metavar="PROFILE",
                    help="the profile to write, or a directory of profiles (written as <new class id>.json)")
    up.add_argument("--decide", action="store_true",
                    help="decide the upgraded nodes' sweeps by fleet decide's rule (outcome new) instead of "
                         "keeping the old profile or its safe part on the canary's gate")
    up.add_argument("--profile", metavar="NAME", help="with --decide: objective (default: the one the nodes swept for)")
    up.add_argument("--parts", action="store_true", help="with --decide: one part per measured node count")

    app = _command(sub, "apply", help="publish a class profile on this node after checking it is for it")
    # Not `profile`: that name is the sweep objective (sweep.profile) everywhere else.
    # Optional to argparse only: `apply --demo class.json` gives --demo the profile, which
    # cmd_apply takes back (publish_cmds.profile_and_demo).
    app.add_argument("profile_path", metavar="PROFILE", nargs="?",
                     help="a class profile, or a directory of them named <class id>.json")
    _demo_snapshot(app, "a demo node: its state in ./nccltune-demo, its class from the snapshot")
    _worker_python(app, "interpreter whose NCCL the node's jobs load (default: bench.python)")
