"""How a trial's ranks are started: on this node, across nodes through torchrun, or through srun.

The runner (trials.runner) builds the worker's command and environment for a trial and asks its
`Launch` what to start on this node; it spawns those processes, waits with its hard timeout and
kills them as before. A launch adds what several nodes need:

- `LocalLaunch`: one process per rank on this node (one node). With `loopback=True` every rank
  gets NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 (NCCL_NET_DISABLE_INTRA removed), so traffic
  between local GPUs goes through the NICs and NCCL sees one rank per node. Its results carry the
  shape `<nranks>x1-nic-loopback`, a key of its own that no other shape matches.
- `TorchrunLaunch`: one torchrun agent per node (`python -m torch.distributed.run`, torchrun
  itself, run by the worker's interpreter), joined by c10d rendezvous at HOST:PORT with a fresh
  rendezvous id per trial and `--max-restarts 0`. The coordinating node (the one running the
  sweep) starts its own agent, which hosts the c10d store (`is_host=1`). Every other node runs
  `nccltune sweep --join HOST:PORT` (started by hand, by the site's pdsh/ssh, or by one Slurm
  step per node); it connects to the coordinator's control channel at HOST:PORT+1 and starts one
  agent per trial, on the coordinator's word.
- `SrunLaunch`: inside a Slurm allocation, one `srun` per trial over the allocation's first N nodes
  (task 0 on the first, block distribution), one GPU bound to each task (`--gpus-per-task=1`);
  srun starts every rank and passes this node's environment to all of them (`--export=ALL,NAMES`,
  with the values in srun's own environment: Slurm's --export list cannot hold values with commas,
  NCCL_IB_HCA's can). The options are explained where the command line is built.

Same environment on every rank, by construction (trials.trialenv builds it). With srun there is
one environment, the one srun was started with. With torchrun the coordinator sends each trial's
candidate (validated by publish.validate_env on both ends) with the trial id over the control
channel; a joining node runs its agent with its own base environment plus exactly that candidate
(the same TrialEnv.for_ranks), and the rendezvous id is the trial id, so an agent started for
another trial cannot join. A topology file among the candidate's variables (NCCL_TOPO_FILE, as
the marker publish.OWN_TOPOLOGY) travels as its text and is written on the joining node, which
resolves the variable to its own copy: nodes of one class share one topology. When the
coordinator reads NCCL's log, every node runs its ranks with the same debug variables
(trials.nccllog.debug_env, the log in its own trial directory), and the node where global rank 0
ran sends rank 0's log back with its result.

A trial that fails or hangs on any node ends on all of them, and the sweep goes on:
- a worker that exits non-zero: its agent stops the other local workers, and with --max-restarts
  0 every other agent sees the rendezvous closed and stops its workers too (torchrun's own rule);
  a joiner reports the exit to the coordinator, whose runner kills its own agent.
- a hang: only the coordinator's timeout can tell. It sends {"kill": seq} to every joiner and
  stops its own agent: SIGTERM (torchrun passes it on to its workers), KILL_GRACE_S later SIGKILL
  to the agent and to every process below it (torchrun starts each worker in a session of its
  own, so a process group kill alone would leave them). A joiner does the same to its agent on
  "kill"; without the message (coordinator gone) it does so at the trial's timeout plus
  KILL_GRACE_S by its own clock (the store's death usually makes its agent exit earlier). So every
  node is clear at most timeout_s + KILL_GRACE_S after the trial started when the coordinator is
  alive (measured here: a 20 s timeout, the joining node's agent gone 1.5 s after it), and
  timeout_s + 2 * KILL_GRACE_S when it is not; the coordinator then waits up to 2 * KILL_GRACE_S
  for the other nodes' reports, and the next trial starts.
- an agent killed outright (SIGKILL, the OOM killer) takes its workers with it: each worker dies
  with its parent (rankexec.die_with_parent), and a joiner's agent dies with the joiner.
- with srun, a task that exits non-zero ends the step (--kill-on-bad-exit=1), one that ends while
  the others still run ends them SRUN_WAIT_S later (--wait); srun then exits 143 whichever task
  failed, so the failing task's own report is read from srun's stderr (srun.first_failure). The
  runner's timeout sends srun SIGTERM, on which srun SIGKILLs every task on every node, and the
  runner SIGKILLs srun after KILL_GRACE_S.

The control channel between the coordinator and the joining nodes is described in channel.py.

The modules: base.py (what every launcher imports: the Launch base, the shared types,
resolve_launcher and make_launch), registry.py (the launchers by name, each made by its own
module's factory, loaded when chosen), slurm.py (what an allocation says of itself), one module per
launcher (local.py, torchrun.py, srun.py; hosts.py for verify's one-GPU check), and the control
channel (channel.py, with sealing.py, admission.py and messages.py). This package's names are
re-exported here from base.py, which imports no launcher.
"""

from __future__ import annotations

from .base import *  # noqa: F403  (base.__all__: the names other modules import from this package)
from .base import __all__ as __all__
