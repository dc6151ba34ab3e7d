#!/usr/bin/env bash
# The main job (README): set up a local virtual environment idempotently and run `nccltune sweep`.
#
# On a node with NVIDIA GPUs the environment sees the system's packages, so the sweep measures
# the torch and NCCL that the node's jobs use (set bench.python to point at another one).
# Without GPUs it installs the CPU build of torch and runs the same pipeline as a CPU demo
# (gloo backend, a recorded 2-GPU topology), labelled as such: those are not NCCL numbers.
# Extra arguments go to `nccltune sweep` (e.g. --state-dir DIR, --plan, --json).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

# After a sweep that ended well: where the CLI is and the commands to type next (on stderr, so
# `--json` output stays one document). $1: the venv, $2: "--demo" or "", then the sweep's arguments.
next_steps() {
  local venv=$1 demo=$2 state=""
  shift 2
  while [ $# -gt 0 ]; do
    case $1 in
      --plan) return 0 ;;  # nothing was measured yet
      --state-dir) state=" --state-dir $(printf '%q' "${2:-}")"; shift ;;
      --state-dir=*) state=" --state-dir $(printf '%q' "${1#--state-dir=}")" ;;
    esac
    shift
  done
  local cli="$PWD/$venv/bin/nccltune" where=$PWD
  {
    echo
    echo "nccltune is installed at $cli"
    echo "Next steps (from $where, or put $PWD/$venv/bin on PATH):"
    echo "  $cli history$state            # the runs so far"
    echo "  $cli report$state             # the sweep's table, size by size"
    echo "  $cli topo${demo:+ $demo}               # the topology the sweep saw"
    echo "  $cli doctor${demo:+ $demo}             # harmful NCCL settings and node problems"
    if [ -n "$demo" ]; then
      echo "(The demo's state is in $where/nccltune-demo; history, report and env read it by themselves"
      echo " when the state directory has none, and say so.)"
    else
      echo "  sudo $cli install      # the systemd units, so the node stays tuned"
    fi
  } >&2
}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  venv=.venv-node
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$venv"
  fi
  # Where $PYTHON itself runs in a virtual environment (a node's torch often lives in one),
  # --system-site-packages reaches only the base interpreter's packages: a .pth file adds that
  # environment's own, after the venv's. Rewritten each time, so a moved environment is followed.
  parent_sites=$("$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
  site_dir=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  pth="$site_dir/nccltune-node-packages.pth"
  if [ -n "$parent_sites" ]; then printf '%s\n' "$parent_sites" > "$pth"; else rm -f "$pth"; fi
  deps='import pynvml, lxml, psutil, yaml, prometheus_client'
  if ! "$venv/bin/python" -c "$deps" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q --no-build-isolation -e . \
      || { echo "bringup: nccltune needs nvidia-ml-py, lxml, psutil, pyyaml and prometheus_client next to the node's torch" \
                "($PYTHON); install them there, or give this node a package index" >&2; exit 1; }
  fi
  # The console script is the proof of an install: `import nccltune` also works from this directory.
  if [ ! -x "$venv/bin/nccltune" ]; then
    if ! "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e . 2>"$venv/pip-editable.log"; then
      # Offline nodes may lack what an editable build needs (the `wheel` package under older
      # setuptools). nccltune is pure Python: point the venv at this source tree and write the
      # same entry point pip would.
      echo "bringup: editable install failed (see $venv/pip-editable.log); linking the source tree instead" >&2
      printf '%s\n' "$PWD" > "$site_dir/nccltune-source.pth"
      printf '#!%s\nimport sys\nfrom nccltune.cli import main\nsys.exit(main())\n' "$PWD/$venv/bin/python" > "$venv/bin/nccltune"
      chmod 0755 "$venv/bin/nccltune"
    fi
  fi
  "$venv/bin/nccltune" sweep "$@"
  next_steps "$venv" "" "$@"
  exit 0
fi
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
if [ ! -x "$venv/bin/nccltune" ] || ! "$venv/bin/python" -c 'import torch, pynvml, lxml, psutil, yaml' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.13.0   # the CPU build; see docs/runbook.md
  "$venv/bin/python" -m pip install -q -e .
fi
echo "No NVIDIA GPU here: running the CPU demo (gloo backend) over a recorded 2-GPU topology." >&2
"$venv/bin/nccltune" sweep --demo "$@"
next_steps "$venv" --demo "$@"
