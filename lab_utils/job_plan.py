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
"""

import sys

from lab_utils.core.errors import LabError
from lab_utils.core.hardware import hardware_summary
from lab_utils.experiments import scaling
from lab_utils.store import ResultStore
from lab_utils.workers.ddp import parse_args


def main(mode, experiment, profile, world, backend, sizes, force, tag, _dash, *extra):
    world = int(world)
    s = scaling.settings_for(profile)
    base = scaling.worker_args(s, profile, experiment, backend, (1,),
                               measure_comm=experiment == scaling.COMPUTE_VS_COMM).to_argv()
    i = base.index("--batch-size")
    del base[i:i + 2]  # the batch size is given per launch
    argv = base + (["--tag", tag] if tag else []) + list(extra)
    args = parse_args(argv).resolved()
    store = ResultStore(args.profile)
    device = "cuda" if backend == "nccl" else "cpu"
    if mode == "oom":  # the launch for batch `sizes` ran out of memory: a row that says so
        store.add(experiment, args.for_batch(int(sizes)).record_config(world, backend), status="oom",
                  reason="OOM", profile=args.profile, synthetic=args.dataset == "synthetic",
                  dataset=args.dataset, hardware=hardware_summary(device, world))
        return
    wanted = sorted({int(b) for b in sizes.split(",") if b} if sizes else
                    {b for b in s.batch_sizes if s.run_batch_sizes is None or b in s.run_batch_sizes})
    todo, notes, here = [], [], hardware_summary(device, world)
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
