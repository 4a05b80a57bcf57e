# shellcheck shell=bash disable=SC2034  # status, stopped_by: set here for the scripts that source this file
# How a job of this lab stops, and its job.txt: sourced by run_all.sbatch, experiment.sbatch,
# multinode.sbatch and agent.sh (from the lab's folder, once they are in it).
#
# SLURM stops a job with SIGTERM, and SIGKILL KillWait seconds later (30 by default): at the time
# limit (or earlier, to the batch shell alone, with #SBATCH --signal=B:TERM@<seconds>), on
# scancel and on a requeue. Where it tracks jobs with cgroups (most clusters), every process of
# the job gets the SIGTERM at once; and once the batch shell has ended, SLURM kills whatever is
# left of the job. A shell that runs its command in the foreground dies from the SIGTERM at once,
# without passing it on and without writing another line, taking the command down with it. So
# the scripts run their command through run_forwarding: in the background, with the SIGTERM
# passed on to it, waiting until it has finished (saved what it could).

# job_start DIR: job.txt in DIR gets this start's lines and, however the script ends, its exit
# code. A requeued job runs again under the same job id: each restart adds a line
# (SLURM_RESTART_COUNT) and keeps what was there (the output files too: #SBATCH --open-mode=append).
job_start() {
    JOB_TXT="$1/job.txt"
    mkdir -p "$1"
    local restart="${SLURM_RESTART_COUNT:-0}"
    if [ "$restart" -gt 0 ]; then
        echo "=== restart $restart of job $JOB_ID ($(date -Is)): SLURM started it again; what is in the result store is not measured again" \
            | tee -a "$JOB_TXT"
    fi
    trap job_finish EXIT
    trap 'job_stopped TERM 143' TERM  # before the command runs: stop here (job_finish writes the exit code)
    trap 'job_stopped INT 130' INT
}

# A signal while none of the lab's commands runs (the job's set-up, or after its command ended): one line,
# as the lab's commands give, then the shell's status for it.
job_stopped() {
    echo "SIG$1 received $(date +%FT%T.%3N%:z): no command of the lab running; the job stops" >> "$JOB_TXT"
    echo "interrupted by SIG$1 outside the lab's command (while the job set up or wrapped up): nothing of" \
        "the lab was running; records already stored are kept (run again to resume)." >&2
    exit "$2"
}

# job_torch_cache DIR: torch makes its compile cache, $TMPDIR/torchinductor_<user>/ (empty unless
# something is compiled), in every process that imports torch._dynamo, as every DDP rank does. The
# measure jobs compile nothing: the cache goes to DIR/torchinductor, removed when the job ends, so
# that the job leaves nothing in $TMPDIR (a TORCHINDUCTOR_CACHE_DIR of yours is used and kept).
JOB_CLEAN=()
job_torch_cache() {
    if [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
        export TORCHINDUCTOR_CACHE_DIR="$1/torchinductor"
        JOB_CLEAN+=("$TORCHINDUCTOR_CACHE_DIR")
    fi
}

# The EXIT trap: "finished ... with exit code N", then the lines in JOB_SUMMARY (an array); the
# folders in JOB_CLEAN removed.
job_finish() {
    local code=$?
    trap '' TERM INT  # a second signal must not cut these lines short
    if [ "${#JOB_CLEAN[@]}" -gt 0 ]; then rm -rf "${JOB_CLEAN[@]}"; fi
    {
        echo "finished $(date +%FT%T.%3N%:z) with exit code $code"
        if [ -n "${JOB_SUMMARY+set}" ]; then printf '%s\n' "${JOB_SUMMARY[@]}"; fi
    } | tee -a "$JOB_TXT"
    exit "$code"
}

# run_forwarding [--log FILE] COMMAND...: run COMMAND in the background and wait for it, passing
# SIGTERM and SIGINT on to it (on_signal, each time one comes); sets `status` to its exit code (143
# when a SIGTERM stopped it) and `stopped_by` to the signal that came (empty if none). With --log,
# COMMAND's output goes to FILE (replaced) and is shown live in the job's output too, by the process
# RUN_TAILER (which on_signal may end: what follows then stays in FILE alone).
run_forwarding() {
    local log="" pid caught first=1 code
    if [ "$1" = --log ]; then log="$2"; shift 2; fi
    stopped_by=""
    RUN_TAILER=""
    if [ -n "$log" ]; then
        : > "$log"  # there before tail opens it
        "$@" >> "$log" 2>&1 &
        pid=$!
        tail -n +1 -s 0.5 --pid="$pid" -F "$log" &
        RUN_TAILER=$!
    else
        "$@" &
        pid=$!
    fi
    trap 'caught=SIGTERM; on_signal TERM "$pid"' TERM
    trap 'caught=SIGINT; on_signal INT "$pid"' INT
    while :; do
        caught=""
        if wait "$pid"; then code=0; else code=$?; fi
        # A signal ends `wait` early: wait again, for COMMAND itself (127: it had already ended
        # and been waited for; keep its code).
        if [ "$first" = 1 ] || [ "$code" -ne 127 ]; then status=$code; fi
        first=0
        if [ -z "$caught" ]; then break; fi
        stopped_by="$caught"
    done
    trap 'job_stopped TERM 143' TERM
    trap 'job_stopped INT 130' INT
    if [ -n "$RUN_TAILER" ]; then wait "$RUN_TAILER" || true; fi
}

# A trap's work: one line with the time, then the signal to the command (agent.sh has its own).
on_signal() {
    echo "SIG$1 received $(date +%FT%T.%3N%:z): passed on to process $2; waiting for it to stop" | tee -a "$JOB_TXT"
    kill -"$1" "$2" 2>/dev/null || true
}
