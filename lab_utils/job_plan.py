"""Launch planning for the SLURM DDP job scripts (``slurm/experiment.sbatch``, ``multinode.sbatch``).

``python -m lab_utils.job_plan plan EXPERIMENT PROFILE WORLD BACKEND SIZES FORCE TAG -- [WORKER ARGS]``
prints four parts, one per line: the per-GPU batch sizes still to measure (smallest
first), why others are not measured now ("in the store", "global batch > training
images"), the worker options (one per line: notebook 02/03's settings for this profile,
then the caller's), and ``end``. A size already in the store, measured or out of memory
on the same kind of device, is skipped: that is how a re-submitted job resumes; after a
stored OOM nothing larger is planned.

``python -m lab_utils.job_plan oom ... SIZE ...`` records the row saying that the launch for
per-GPU batch SIZE ran out of memory.

``python -m lab_utils.job_plan store ... SIZE ... -- [WORKER ARGS] RECORDS_FILE`` stores the records the
worker's rank 0 appended to RECORDS_FILE (its ``--out``): the job script is the parent, and, as
everywhere in the lab, the parent writes the result store (through
:meth:`lab_utils.store.ResultStore.run_many`), the worker never does.
"""

import sys

from lab_utils.core import profiles
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import hardware_summary
from lab_utils.core.records import Record, RecordsReader, canonical_key
from lab_utils.experiments import scaling
from lab_utils.store import ResultStore
from lab_utils.workers.args import WorkerArgs


def main(mode, experiment, profile, world, backend, sizes, force, tag, _dash, *extra):
    world = int(world)
    records_file = None
    if mode == "store":
        *extra, records_file = extra
    s = profiles.settings(scaling.Settings, profile)
    base = scaling.worker_args(s, profile, experiment, backend, (1,),
                               measure_comm=experiment == scaling.COMPUTE_VS_COMM).to_argv()
    i = base.index("--batch-size")
    del base[i:i + 2]  # the batch size is given per launch
    argv = base + (["--tag", tag] if tag else []) + list(extra)
    args = WorkerArgs.from_argv(argv).resolved()
    store = ResultStore(args.profile)
    device = "cuda" if backend == "nccl" else "cpu"
    here = hardware_summary(device, world)
    if mode in ("oom", "store"):
        cfg = args.for_batch(int(sizes)).record_config(world, backend)
        if mode == "oom":  # the launch for batch `sizes` ran out of memory: a row that says so
            got = [Record(experiment, cfg, status="oom", reason="OOM", profile=args.profile,
                          synthetic=args.dataset == "synthetic", dataset=args.dataset, hardware=here)]
        else:
            got = RecordsReader(records_file).new()
            if not any(r.key == canonical_key(cfg) for r in got):
                raise LabError(f"{records_file} holds no record of per-GPU batch {sizes}; check the job's "
                               "log.")
        store.run_many(experiment, [cfg], lambda todo: got, force=True, hardware=here)
        print(f"stored {len(got)} record(s) of per-GPU batch {sizes} in {store.path(experiment)}")
        return
    wanted = sorted({int(b) for b in sizes.split(",") if b} if sizes else
                    {b for b in s.batch_sizes if s.run_batch_sizes is None or b in s.run_batch_sizes})
    todo, notes = [], []
    for b in wanted:
        if b * world > args.train_images:
            notes.append(f"{b}: global batch {b * world} > {args.train_images} training images")
            continue
        # the store's one reuse check: measured on this machine's devices (same name and count)
        rec = store.reusable(experiment, args.for_batch(b).record_config(world, backend), here)
        if force != "1" and rec is not None and rec.status in ("ok", "oom"):
            notes.append(f"{b}: in the store ({rec.status})")
            if rec.status == "oom":
                break  # a larger batch needs more memory still
            continue
        todo.append(b)
    print(" ".join(map(str, todo)))
    print("; ".join(notes) or "-")
    print("\n".join(argv))
    print("end")  # values may be empty (--tag ""): this line keeps the last one


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except (LabError, ValueError) as e:
        sys.exit(f"error: {e}")
