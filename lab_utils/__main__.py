"""The lab's command line: ``python -m lab_utils {run,prepare,bench,info} ...``.

- ``run [NOTEBOOK ...] [--profile quick|full] [--timeout S]``: execute notebooks headless
  and write ``results/<profile>/report.md``.
- ``prepare``: download CIFAR-10 and the text corpus into ``data/`` (needs internet).
- ``bench NAME [args]``: benchmarks that print ratios measured side by side in one run
  (``timers``, ``allreduce``, ``data``, ``train``).
- ``info``: the machine, versions, chosen profile and data status.

Bad input is reported as one ``error:`` line (exit code 2), without a traceback. So is a GPU
node whose GPUs this torch cannot use: ``info`` and ``run`` stop before any work instead of
running on the CPU (``lab_utils.environment.check_gpu_node``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from lab_utils.errors import LabError

# Benchmarks live next to what they measure; each entry is "module:function(argv) -> int".
BENCHES = {
    "timers": ("lab_utils.bench_timers:main", "overhead of the phase timers on a training loop"),
    "allreduce": ("lab_utils.comm:bench_main", "all-reduce bandwidth (nccl-tests columns) under torchrun"),
    "data": ("lab_utils.fastpath:bench_data_main", "spec DataLoader vs device-resident loader, images/s"),
    "train": ("lab_utils.fastpath:bench_train_main", "spec training vs each fast-path step, images/s"),
}


def _call(target: str, argv: list[str]) -> int:
    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise LabError(f"This lab has no {module} ({e}); update the checkout.") from None
    return int(getattr(mod, func)(argv) or 0)


def _prepare(args) -> int:
    from pathlib import Path

    from lab_utils import data

    root = Path(args.data_dir) if args.data_dir else None
    path = data.prepare_cifar10(root)
    print(f"CIFAR-10 ready in {path}")
    try:
        text_data = importlib.import_module("lab_utils.text_data")
    except ModuleNotFoundError:
        return 0
    corpus = text_data.prepare_corpus(root)
    print(f"text corpus ready: {corpus}")
    return 0


def _gpu_node_guard(profile: str | None) -> None:
    """Stop before any work when the driver reports GPUs that torch cannot use (LabError)."""
    from lab_utils import config
    from lab_utils.environment import check_gpu_node

    check_gpu_node(*config.resolve_profile_name(profile))


def _info(args) -> int:
    from lab_utils import config, data, hardware

    _gpu_node_guard(args.profile)
    name, why = config.resolve_profile_name(args.profile)
    out = {"profile": name, "why": why, "machine": hardware.describe_machine(),
           "dataset": data.dataset_status()}
    print(json.dumps(out, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab_utils", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="execute notebooks headless and write the report")
    r.add_argument("notebooks", nargs="*", help="notebook paths or names (default: all, in order)")
    r.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    r.add_argument("--timeout", type=float, default=3600, help="per-cell timeout in seconds")

    pr = sub.add_parser("prepare", help="download the datasets into data/ (needs internet)")
    pr.add_argument("--data-dir", default=None)

    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    b.add_argument("name", choices=sorted(BENCHES), metavar="NAME",
                   help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for that benchmark (--help)")

    i = sub.add_parser("info", help="machine, versions, profile and data status")
    i.add_argument("--profile", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            from lab_utils import runner

            _gpu_node_guard(args.profile)
            return runner.main(args.notebooks, args.profile, args.timeout)
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "bench":
            return _call(BENCHES[args.name][0], args.args)
        if args.command == "info":
            return _info(args)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: results already recorded are kept in results/.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
