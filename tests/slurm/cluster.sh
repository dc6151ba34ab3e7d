#!/usr/bin/env bash
# A two-node Slurm cluster on this machine for the Slurm tests: slurmctld and two slurmd, each
# slurmd a node of its own (its own name and port), with their own munged, all of it under DIR.
#
#   cluster.sh install      install Slurm (Debian's slurm-wlm) unless its programs are there
#   cluster.sh start DIR    install, write DIR/slurm.conf, start the daemons, wait for both nodes
#   cluster.sh stop DIR     kill what start started (by the pids it recorded), keep DIR's logs
#
# Clients find the cluster through SLURM_CONF=DIR/slurm.conf. The nodes are named after this
# machine's host name and `localhost` (both must resolve: nccltune uses an allocation's first node
# name as MASTER_ADDR); Slurm orders them by name, so `localhost` usually comes first, and every
# node has this machine's host name, as nodes sharing a host do.
# DIR/task-prolog is slurm.conf's TaskProlog: it runs DIR/nccltune-task-prolog.sh (a copy of
# launchers/slurm-prolog.sh, as docs/slurm.md installs it) on DIR/published/nccl.env, the way
# docs/slurm.md points the prolog at another state directory. Needs root (slurmd runs tasks as the
# job's user). Exit 0 when the cluster is up; otherwise 1, with the reason and the daemons' logs.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# Fixed ports below the ephemeral range (32768-60999 on Linux), so no client socket takes them.
CTLD_PORT=${NCCLTUNE_TEST_SLURMCTLD_PORT:-6917}
NODE1_PORT=$((CTLD_PORT + 1))
NODE2_PORT=$((CTLD_PORT + 2))

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

have_slurm() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
        && command -v munged >/dev/null
}

install_slurm() {
    have_slurm && return 0
    [ "$(id -u)" = 0 ] || die "Slurm is not installed, and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed, and there is no apt-get to install it with"
    echo "cluster.sh: installing Slurm (slurm-wlm)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq slurm-wlm >&2 || die "apt-get install slurm-wlm failed"
    have_slurm || die "slurm-wlm is installed but slurmctld, slurmd, srun or munged is missing"
}

node_names() {
    NODE1=$(hostname -s)
    NODE2=localhost
    [ "$NODE1" != "$NODE2" ] || die "this machine's host name is localhost: the two nodes need two names"
    for n in "$NODE1" "$NODE2"; do
        getent hosts "$n" >/dev/null || die "the node name $n does not resolve (getent hosts $n)"
    done
}

# alive PIDFILE: 0 when the pid in PIDFILE runs; a zombie (killed, not yet reaped by whoever
# adopted it, which may take its time) does not.
alive() {
    local pid stat
    [ -s "$1" ] && read -r pid < "$1" && read -r stat 2>/dev/null < "/proc/$pid/stat" || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}

logs() {
    for f in "$DIR"/log/*; do
        [ -f "$f" ] || continue
        echo "--- $f (last lines)" >&2
        tail -n 15 "$f" >&2
    done
}

start() {
    install_slurm
    node_names
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    export SLURM_CONF=$DIR/slurm.conf
    if alive "$DIR/run/slurmctld.pid" && sinfo -h -o '%T' 2>/dev/null | grep -qx idle; then
        echo "cluster.sh: already running under $DIR" >&2
        return 0
    fi
    stop_daemons
    umask 022
    mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log" "$DIR/published"
    chmod 0700 "$DIR/munge"
    [ -s "$DIR/munge/munge.key" ] || {
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 0400 "$DIR/munge/munge.key"
    }
    sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$NODE1|g" -e "s|@NODE1@|$NODE1|g" -e "s|@NODE2@|$NODE2|g" \
        -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@NODE1_PORT@|$NODE1_PORT|g" -e "s|@NODE2_PORT@|$NODE2_PORT|g" \
        "$here/slurm.conf.in" > "$DIR/slurm.conf"
    install -m 0755 "$repo/launchers/slurm-prolog.sh" "$DIR/nccltune-task-prolog.sh"
    printf '#!/bin/sh\nexec %s %s\n' "$DIR/nccltune-task-prolog.sh" "$DIR/published/nccl.env" > "$DIR/task-prolog"
    chmod 0755 "$DIR/task-prolog"

    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed" \
        || { logs; die "munged did not start"; }
    # -D: in the foreground (of a background job of ours), so the pid files name the daemons.
    setsid slurmctld -D -i -f "$SLURM_CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 &
    echo $! > "$DIR/run/slurmctld.bg"
    for n in "$NODE1" "$NODE2"; do
        setsid slurmd -D -N "$n" -f "$SLURM_CONF" </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 &
        echo $! > "$DIR/run/slurmd-$n.bg"
    done
    for _ in $(seq 1 120); do
        if [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | wc -l)" = 2 ]; then
            echo "cluster.sh: nodes $NODE1 and $NODE2 idle; SLURM_CONF=$SLURM_CONF" >&2
            return 0
        fi
        for f in "$DIR"/run/*.bg; do
            alive "$f" || { logs; die "$(basename "$f" .bg) exited while starting"; }
        done
        sleep 0.5
    done
    sinfo -N >&2 || true
    logs
    die "the nodes did not become idle within 60 s"
}

# stepds DIR: the pids of the slurmstepd processes of this cluster's slurmd (they inherit its
# SLURM_CONF); one outlives a slurmd that was stopped in the middle of a step.
stepds() {
    local comm
    for p in /proc/[0-9]*; do
        # read, not $(cat ...): no process started for each of the machine's processes
        read -r comm 2>/dev/null < "$p/comm" && [ "$comm" = slurmstepd ] || continue
        tr '\0' '\n' 2>/dev/null < "$p/environ" | grep -qx "SLURM_CONF=$DIR/slurm.conf" && echo "${p#/proc/}"
    done
}

# The daemons are killed (SIGKILL), not asked to stop (a slurmd takes seconds to), and the state
# a clean shutdown would have saved goes with them: the controller's saved state and the nodes'
# spool are removed, so that a start in DIR begins afresh (a controller that reads what a killed
# one left takes a minute to see its nodes idle). The logs are kept.
stop_daemons() {
    [ -d "$DIR/run" ] || return 0
    for f in "$DIR"/run/slurmd-*.bg "$DIR"/run/slurmctld.bg "$DIR"/run/munged.pid; do
        alive "$f" && kill -KILL "$(cat "$f")" 2>/dev/null || true
    done
    for f in "$DIR"/run/slurmd-*.bg "$DIR"/run/slurmctld.bg "$DIR"/run/munged.pid; do
        for _ in $(seq 1 200); do
            alive "$f" || break
            sleep 0.05
        done
        rm -f "$f"
    done
    for pid in $(stepds); do
        kill -KILL "$pid" 2>/dev/null || true
    done
    rm -rf "$DIR/state" "$DIR/spool"
}

case ${1:-} in
    install) install_slurm ;;
    start) [ $# = 2 ] || die "usage: cluster.sh start DIR"; DIR=$2; start ;;
    stop) [ $# = 2 ] || die "usage: cluster.sh stop DIR"; DIR=$(cd "$2" && pwd) || exit 1; stop_daemons ;;
    *) die "usage: cluster.sh install | start DIR | stop DIR" ;;
esac
