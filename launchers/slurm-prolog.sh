#!/bin/sh
# nccltune Slurm TaskProlog: hands the NCCL settings that nccltune published for this node
# (/var/lib/nccltune/nccl.env) to every task of every job step.
#
# Install on each compute node:
#   install -m 0755 launchers/slurm-prolog.sh /etc/slurm/nccltune-task-prolog.sh
# and in slurm.conf:
#   TaskProlog=/etc/slurm/nccltune-task-prolog.sh
# slurm.conf takes a single TaskProlog; if there is one already, run this script from it and
# pass its stdout through. A path given as the first argument replaces the default file.
#
# Protocol (slurm.conf(5), TaskProlog): slurmstepd runs this as the job's user before each task
# and applies every stdout line "export NAME=value" to the task's environment, taking the value
# literally (no shell expansion, no quote removal). So only lines of the form
#   (NCCL|TORCH_NCCL|NCCLTUNE)_NAME=value   with value in [A-Za-z0-9_./:,=+^@%-]
# are passed on, and the file is never sourced or evaluated: a line such as
# NCCL_X=$(cmd) is skipped, not run. The file must be a regular file owned by root and writable
# by nobody else, in a directory only root can change; otherwise nothing is exported. nccltune
# publishes nccl.env as a link into its current generation; the link is resolved once and the
# generation's own file is read (see nccltune_resolve).
# Failure policy (docs/launch-failures.md, the same as nccltune exec/env and nccltune-torchrun):
# a job is never blocked by nccltune. Nothing published, or a set that cannot be used (untrusted
# owner or mode, unreadable, a line nccltune does not write, a mixed or vanished generation, and
# that of nccl-single-node.env and of each nccl-nodes-N.env nccl.env lists too, one that is missing
# included: the set is used whole or not at all), exports nothing of it:
# the task runs untuned, with NCCL's defaults, one print line says why (for a refused set: nothing
# published is not said, see nccltune_untuned), and
# NCCLTUNE_APPLIED=untuned:nothing-published or untuned:refused records it, unless the task
# already has a marker of an earlier launch.
# The exit status is always 0: a missing tuning must not fail a job. Problems are said on stdout
# as "print TEXT" lines, which slurmstepd writes to the task's standard output (slurmd throws a
# TaskProlog's stderr away, so a warning there reaches no one); the checks below write to stderr
# and nccltune_main turns those lines into print lines.
#
# Precedence (docs/what-a-job-gets.md, "Which value wins"; the same rule as nccltune exec and nccltune-torchrun):
# Slurm applies these exports over the task's environment, so the prolog itself leaves out what the
# job decided. It runs with the task's environment (the job's, as sbatch/srun passed it on), so:
# NCCLTUNE_DISABLE set to anything but empty or 0 there exports nothing, and a variable the task
# already has is not exported at all (a differing published value is named in a print line).
#
# What was applied (docs/what-a-job-gets.md, "What the job was given"; nccltune/publish/applied.py): with what it exports
# the prolog also exports NCCLTUNE_APPLIED=GENERATION:DIGEST:NAME,... naming the set (from the
# file's own NCCLTUNE_APPLIED line, which is never passed on as it stands) and the variables it
# exported, so that a sweep run in the job sweeps them instead of taking them for the job's pins.
# A marker the task already has for the same set keeps its names, these added after them (a step
# of a job whose batch step got the set); when nothing is exported it stays as it is.
#
# What a job gets (docs/what-a-job-gets.md and docs/job-shapes.md): nccl.env is the part that fits every job on the node
# (topology file, policy values, pins, the tuner plugin and its table). The parts measured for one
# job shape, files of the same generation next to nccl.env, are added by the job's node count
# (THE rule, nccltune/publish/shapes.py part_for_shape): nccl-single-node.env (measured between
# this node's GPUs only) for a one-node job, and for a job of N nodes nccl-nodes-C.env of the
# largest node count C <= N among those nccl.env's "# node counts:" line lists (none <= N: the
# every-job part alone). The job's node count: SLURM_JOB_NUM_NODES (or, where that is unset,
# SLURM_NNODES; where Slurm says neither, NCCLTUNE_JOB_NNODES). A job whose size is not known
# gets the every-job part only: a multi-node job never receives values measured on one node, nor
# on more nodes than it runs on.

nccltune_prog=nccltune-task-prolog
nccltune_env_file=${1:-/var/lib/nccltune/nccl.env}
nccltune_gen=
nccltune_set=
nccltune_applied=
nccltune_single=
nccltune_counts=
nccltune_part=
nccltune_why=
# Names and values that Slurm passes through unchanged and that no shell would expand.
nccltune_valid='^(NCCL|TORCH_NCCL|NCCLTUNE)_[A-Z0-9_]+=[A-Za-z0-9_./:,=+^@%-]+$'

# nccltune_warn WHY: why the published set is not used; the first reason is the one said (once).
nccltune_warn() {
    [ -n "$nccltune_why" ] || nccltune_why="not using $nccltune_env_file: $1"
}

# nccltune_untuned WHY REASON: the failure policy: nothing of the set exported, WHY said once,
# and the line export NCCLTUNE_APPLIED=untuned:REASON unless the task has a marker of its own.
# A node that has published nothing yet is not said: the prolog's only voice is every task's
# stdout (a print line), which a job's output, nccltune's own sweep steps included, must not get
# on every node before its first publish; the marker records it.
nccltune_untuned() {
    [ "$2" = nothing-published ] || printf "%s: %s; the job runs untuned (NCCL's defaults)\n" "$nccltune_prog" "$1" >&2
    [ -n "${NCCLTUNE_APPLIED+set}" ] || printf 'export NCCLTUNE_APPLIED=untuned:%s\n' "$2"
}

# nccltune_mode_ok WHAT MODE UID: 0 when MODE and UID (fields of `ls -ldn`) say that only root
# may change WHAT (file or directory); otherwise says why. A sticky directory such as /tmp is
# accepted even if others may write to it: they cannot rename or delete root's file in it.
nccltune_mode_ok() {
    if [ "$3" != 0 ]; then
        nccltune_warn "the $1 is owned by uid $3, not root"
        return 1
    fi
    case $2 in
        ??????????+*) nccltune_warn "the $1 has an ACL ($2) that may grant write access (see getfacl)"; return 1 ;;
        ?????????[tT]*) [ "$1" = directory ] && return 0 ;;
    esac
    case $2 in
        ????????w*) nccltune_warn "the $1 is world-writable ($2)"; return 1 ;;
        ?????w*) nccltune_warn "the $1 is group-writable ($2)"; return 1 ;;
    esac
    return 0
}

# nccltune_ls PATH WHY: sets nccltune_mode and nccltune_uid from `ls -ldn PATH`, or says WHY.
# `ls -ldn` is used because stat(1) options differ between GNU, BSD and busybox.
nccltune_ls() {
    nccltune_meta=$(LC_ALL=C ls -ldn -- "$1" 2>/dev/null) || {
        nccltune_warn "$2"
        return 1
    }
    read -r nccltune_mode nccltune_links nccltune_uid nccltune_rest <<EOF_META
$nccltune_meta
EOF_META
}

# nccltune_resolve FILE: sets nccltune_real to the file to read. A published set (FILE a link to
# current/NAME, DIR/current a link to generations/N) is resolved once, here: the file read is
# DIR/generations/N/NAME, every directory on the way must pass the trust check, and the file must
# say "# generation: N", so a mixed set is refused. Any other FILE is checked as it is.
nccltune_resolve() {
    nccltune_real=$1
    [ -L "$1" ] || return 0
    nccltune_name=$(basename -- "$1")
    nccltune_pub=$(dirname -- "$1")
    nccltune_ls "$1" "cannot stat it" || return 1
    [ "${nccltune_meta##* -> }" = "current/$nccltune_name" ] || return 0
    nccltune_ls "$nccltune_pub/current" "cannot stat $nccltune_pub/current" || return 1
    nccltune_gen=${nccltune_meta##* -> generations/}
    case $nccltune_meta in
        *" -> generations/"*) ;;
        *) nccltune_warn "$nccltune_pub/current is not a link to generations/N"; return 1 ;;
    esac
    case $nccltune_gen in
        ''|*[!0-9]*) nccltune_warn "$nccltune_pub/current is not a link to generations/N"; return 1 ;;
    esac
    for nccltune_d in "$nccltune_pub" "$nccltune_pub/generations"; do
        nccltune_ls "$nccltune_d/." "cannot stat the directory $nccltune_d" || return 1
        nccltune_mode_ok directory "$nccltune_mode" "$nccltune_uid" || return 1
    done
    nccltune_real=$nccltune_pub/generations/$nccltune_gen/$nccltune_name
    if ! LC_ALL=C grep -q -x -e "# generation: $nccltune_gen" -- "$nccltune_real" 2>/dev/null; then
        nccltune_warn "$nccltune_real is not of generation $nccltune_gen, which current names (a mixed set)"
        return 1
    fi
}

# nccltune_trusted FILE: 0 when FILE is a regular root-owned file that only root may change.
nccltune_trusted() {
    nccltune_ls "$1" "cannot stat it" || return 1
    case $nccltune_mode in
        -*) ;;
        *) nccltune_warn "it is not a regular file ($nccltune_mode); symlinks are not followed"; return 1 ;;
    esac
    nccltune_mode_ok file "$nccltune_mode" "$nccltune_uid" || return 1
    nccltune_dir=$(dirname -- "$1")
    nccltune_ls "$nccltune_dir/." "cannot stat its directory $nccltune_dir" || return 1
    nccltune_mode_ok directory "$nccltune_mode" "$nccltune_uid"
}

# nccltune_lines_ok FILE: 0 when FILE is readable and holds only comments and NAME=value lines
# with a plain value (a file with any other line is not used at all).
nccltune_lines_ok() {
    if [ ! -r "$1" ]; then
        nccltune_warn "it is not readable by uid $(id -u)"
        return 1
    fi
    # LC_ALL=C: in other locales [A-Z] can match lower-case and accented letters.
    nccltune_bad=$(LC_ALL=C grep -E -v -c -e "$nccltune_valid" -e '^[[:space:]]*(#.*)?$' -- "$1")
    if [ "${nccltune_bad:-0}" != 0 ]; then
        nccltune_warn "it holds $nccltune_bad line(s) that are not NAME=value with a plain value (see: nccltune env)"
        return 1
    fi
}

# nccltune_print FILE: the lines of FILE (checked by nccltune_lines_ok) as "export NAME=value",
# less what the task already has.
nccltune_print() {
    nccltune_lines=$(LC_ALL=C grep -E -e "$nccltune_valid" -- "$1")
    while IFS= read -r nccltune_line; do
        [ -n "$nccltune_line" ] || continue
        nccltune_name=${nccltune_line%%=*}
        if [ "$nccltune_name" = NCCLTUNE_APPLIED ]; then
            # The file's marker: only which set it names (GENERATION:DIGEST) is taken.
            nccltune_value=${nccltune_line#*=}
            [ -n "$nccltune_set" ] || nccltune_set=${nccltune_value%:*}
            continue
        fi
        # The name matched nccltune_valid, so it is safe to expand through eval.
        eval "nccltune_isset=\${$nccltune_name+set} nccltune_own=\${$nccltune_name-}"
        if [ -z "$nccltune_isset" ]; then
            printf 'export %s\n' "$nccltune_line"
            nccltune_applied=${nccltune_applied:+$nccltune_applied,}$nccltune_name
        elif [ "$nccltune_own" != "${nccltune_line#*=}" ]; then
            printf '%s: %s set by the job is kept (published: %s)\n' \
                "$nccltune_prog" "$nccltune_name=$nccltune_own" "${nccltune_line#*=}" >&2
        fi
    done <<EOF_LINES
$nccltune_lines
EOF_LINES
}

# nccltune_job_nnodes: sets nccltune_nnodes to the job's node count: SLURM_JOB_NUM_NODES, else
# SLURM_NNODES, else NCCLTUNE_JOB_NNODES; nothing where none says (see the header).
nccltune_job_nnodes() {
    nccltune_count "${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${NCCLTUNE_JOB_NNODES:-}}}"
}

# nccltune_check_part NAME [optional]: 0 when NAME, a file of the generation nccl.env came from,
# passes every check (trusted, of that generation, only lines nccltune writes); a missing file is
# refused unless optional is given. The file is named in the message of a refusal.
nccltune_check_part() {
    nccltune_path=$(dirname -- "$nccltune_real")/$1
    if [ ! -e "$nccltune_path" ] && [ ! -L "$nccltune_path" ]; then
        [ -n "${2:-}" ] && return 0
        nccltune_env_file=$nccltune_path
        nccltune_warn "it is missing, and $(basename -- "$nccltune_real") lists its part (a mixed or edited set)"
        return 1
    fi
    nccltune_env_file=$nccltune_path
    nccltune_trusted "$nccltune_path" || return 1
    # A file named as it is (the CDI files device's): the generation its own header gives.
    [ -n "${nccltune_gen:-}" ] || \
        nccltune_gen=$(LC_ALL=C sed -n 's/^# generation: \([0-9][0-9]*\)$/\1/p' -- "$nccltune_real" | head -n 1)
    if [ -n "${nccltune_gen:-}" ] && \
        ! LC_ALL=C grep -q -x -e "# generation: $nccltune_gen" -- "$nccltune_path" 2>/dev/null; then
        nccltune_warn "it is not of generation $nccltune_gen, which current names (a mixed set)"
        return 1
    fi
    nccltune_lines_ok "$nccltune_path"
}

# nccltune_check_parts: every file of a part by job shape of the set nccl.env came from passes
# every check, whatever the job's size, before anything is applied (a set is used whole or not at
# all): nccl-single-node.env (none there: a set without it; else nccltune_single names it) and
# nccl-nodes-N.env for each node count N the "# node counts:" line of nccl.env lists
# (nccltune_counts), each of which must be there.
nccltune_check_parts() {
    nccltune_check_part nccl-single-node.env optional || return 1
    [ ! -e "$nccltune_path" ] || nccltune_single=$nccltune_path
    nccltune_counts=$(LC_ALL=C sed -n 's/^# node counts: \([0-9 ]*\)$/\1/p' -- "$nccltune_real" | head -n 1)
    for nccltune_c in $nccltune_counts; do
        case $nccltune_c in
            [1-9]|[1-9][0-9]|[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9]|[1-9][0-9][0-9][0-9][0-9]|[1-9][0-9][0-9][0-9][0-9][0-9]) ;;
            *) nccltune_warn "its node count $nccltune_c is not one nccltune writes"; return 1 ;;
        esac
        nccltune_check_part "nccl-nodes-$nccltune_c.env" || return 1
    done
}

# nccltune_count VALUE: sets nccltune_nnodes to VALUE as a number of nodes (leading zeros dropped),
# or to nothing when VALUE is not a positive whole number (a job that does not say).
nccltune_count() {
    nccltune_nnodes=
    case $1 in
        ''|*[!0-9]*) return 0 ;;
    esac
    nccltune_n=$1
    while :; do
        case $nccltune_n in
            0?*) nccltune_n=${nccltune_n#0} ;;
            *) break ;;
        esac
    done
    [ "$nccltune_n" = 0 ] || nccltune_nnodes=$nccltune_n
}

# nccltune_pick N: sets nccltune_part to the file of the part a job of N nodes gets beside the
# every-job file (N empty: the job does not say; then none), THE rule of docs/job-shapes.md
# (nccltune/publish/shapes.py): for one node the single-node file, for more the file of the
# largest listed node count <= N, none when every listed count is larger.
nccltune_pick() {
    nccltune_part=
    case $1 in
        '') return 0 ;;
        1) nccltune_part=$nccltune_single; return 0 ;;
    esac
    nccltune_best=
    for nccltune_c in $nccltune_counts; do
        # A count of more than 9 digits is beyond every listed one (at most 6): no shell arithmetic on it.
        if [ "${#1}" -gt 9 ] || [ "$nccltune_c" -le "$1" ]; then
            [ -n "$nccltune_best" ] && [ "$nccltune_best" -ge "$nccltune_c" ] || nccltune_best=$nccltune_c
        fi
    done
    [ -z "$nccltune_best" ] || nccltune_part=$(dirname -- "$nccltune_real")/nccl-nodes-$nccltune_best.env
}

# nccltune_prior NAMES: sets nccltune_names to NAMES when it is a list a marker may hold (NCCL_*,
# TORCH_NCCL_* and NCCLTUNE_* names joined by commas, or nothing), else to nothing.
nccltune_prior() {
    nccltune_names=
    case $1 in
        *[!ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_,]*|,*|*,|*,,*) return 0 ;;
    esac
    nccltune_ifs=$IFS
    IFS=,
    for nccltune_n in $1; do
        case $nccltune_n in
            NCCL_?*|TORCH_NCCL_?*|NCCLTUNE_?*) ;;
            *) IFS=$nccltune_ifs; return 0 ;;
        esac
    done
    IFS=$nccltune_ifs
    nccltune_names=$1
}

# nccltune_mark: when something was exported, the line export NCCLTUNE_APPLIED=SET:NAMES, the
# names of the task's own marker of the same set first (see the header).
nccltune_mark() {
    [ -n "$nccltune_set" ] && [ -n "$nccltune_applied" ] || return 0
    nccltune_names=
    case ${NCCLTUNE_APPLIED-} in
        "$nccltune_set":*) nccltune_prior "${NCCLTUNE_APPLIED#"$nccltune_set":}" ;;
    esac
    nccltune_ifs=$IFS
    IFS=,
    for nccltune_n in $nccltune_applied; do
        case ,$nccltune_names, in
            *,"$nccltune_n",*) ;;
            *) nccltune_names=${nccltune_names:+$nccltune_names,}$nccltune_n ;;
        esac
    done
    IFS=$nccltune_ifs
    printf 'export NCCLTUNE_APPLIED=%s\n' "$nccltune_set:$nccltune_names"
}

# NCCLTUNE_DISABLE (anything but empty or 0): the job opted out; nothing is read or exported.
case ${NCCLTUNE_DISABLE:-0} in
    0) ;;
    *) exit 0 ;;
esac

nccltune_main() {
    if [ ! -e "$nccltune_env_file" ] && [ ! -L "$nccltune_env_file" ]; then
        nccltune_untuned "nothing is published at $nccltune_env_file" nothing-published
    elif nccltune_resolve "$nccltune_env_file" && nccltune_trusted "$nccltune_real" && \
            nccltune_lines_ok "$nccltune_real" && nccltune_check_parts; then
        nccltune_print "$nccltune_real"
        nccltune_job_nnodes
        nccltune_pick "$nccltune_nnodes"
        [ -z "$nccltune_part" ] || nccltune_print "$nccltune_part"
        nccltune_mark
    else
        nccltune_untuned "$nccltune_why" refused
    fi
}

# stdout (the export lines) goes straight out; stderr becomes "print" lines beside them.
{ nccltune_main 2>&1 >&3 3>&- | LC_ALL=C sed 's/^/print /' >&3 3>&-; } 3>&1

exit 0
