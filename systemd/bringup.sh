#!/usr/bin/env bash
# The main job (README): set up a local virtual environment idempotently and run `nccltune sweep`.
#
# On a node with NVIDIA GPUs the environment sees the system's packages, so the sweep measures
# the torch and NCCL that the node's jobs use (set bench.python to point at another one).
# Without GPUs it installs the CPU build of torch and runs the same pipeline as a CPU demo
# (gloo backend, a recorded 2-GPU topology), labelled as such: those are not NCCL numbers.
# Extra arguments go to `nccltune sweep` (e.g. --state-dir DIR, --plan, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  venv=.venv-node
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$venv"
  fi
  if ! "$venv/bin/python" -c 'import nccltune, pynvml, lxml, psutil, yaml' 2>/dev/null; then
    # --no-build-isolation: GPU nodes often have no route to a package index, and setuptools is there.
    "$venv/bin/python" -m pip install -q --no-build-isolation -e . \
      || "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
  fi
  exec "$venv/bin/nccltune" sweep "$@"
fi
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import nccltune, torch, pynvml, lxml, psutil, yaml' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.13.0   # the CPU build; see README
  "$venv/bin/python" -m pip install -q -e .
fi
echo "No NVIDIA GPU here: running the CPU demo (gloo backend) over a recorded 2-GPU topology." >&2
exec "$venv/bin/nccltune" sweep --demo "$@"
