#!/bin/bash
# One node's part of a multinode.sbatch job (its srun step starts this on every node): the node's
# torchrun agent, its output (rank 0's progress, torchrun's own lines) in LOG_DIR/<node>.log and
# shown live in the job's output.
#
# SLURM stops a job's step with SIGTERM to every process of it (scancel, a time limit or its
# warning passed on by the batch script, a requeue). This node then stops showing the log (what
# torchrun prints as it is stopped, its tracebacks, stays in the log), says so in one line, at once
# (srun may SIGKILL the step soon after: on scancel, or once another node's agent has exited, with
# --kill-on-bad-exit), passes the signal on to torchrun, waits for it and its ranks to end, and
# exits 143. A torchrun that fails by itself has its output shown as it comes, and its exit code.
#
#   bash slurm/agent.sh LOG_DIR COMMAND...         (from the lab's folder; COMMAND: the torchrun line)

set -uo pipefail

log_dir="$1"
shift
node="${SLURMD_NODENAME:-$(hostname -s)}"
log="$log_dir/$node.log"
mkdir -p "$log_dir"
JOB_TXT=/dev/null  # job.sh's own lines belong to the batch script's job.txt, not to every node

# shellcheck source=slurm/job.sh
source slurm/job.sh

said=""
# job.sh's hook, for each signal that comes (SLURM may send more than one): the line once, then the
# signal to torchrun.
# shellcheck disable=SC2317  # called by run_forwarding's traps
on_signal() {
    if [ -z "$said" ]; then
        if [ -n "$RUN_TAILER" ]; then kill "$RUN_TAILER" 2>/dev/null || true; fi
        # builtins only (printf's own clock): the line must be out before srun's SIGKILL can come
        printf '%s: stopped by SLURM (SIG%s, %(%T)T): its torchrun agent and ranks stop; their output: %s\n' \
            "$node" "$1" -1 "$log"
        said=1
    fi
    kill -"$1" "$2" 2>/dev/null || true
}

run_forwarding --log "$log" "$@"
case "$stopped_by" in
    SIGTERM) exit 143 ;;
    SIGINT) exit 130 ;;
esac
if [ "$status" -ne 0 ]; then echo "$node: torchrun exited with code $status (its output: $log)" >&2; fi
exit "$status"
