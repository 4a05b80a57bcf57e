"""Notebook 04's benchmark and its fit: the all-reduce benchmark's tables and busbw figure
(:func:`report_bench`), the ring bytes per rank (:func:`report_bytes`) and DDP's buckets
(:func:`report_buckets`). ``python -m lab_utils bench allreduce`` is :func:`bench_main`. Table 3:
:mod:`~lab_utils.experiments.n04_allreduce.table3`; the projections to 8..1024 devices:
:mod:`~lab_utils.experiments.n04_allreduce.projection`; the algorithms:
:mod:`~lab_utils.experiments.n04_allreduce.algorithms`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.engine import profiles
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.engine.store import ResultStore
from lab_utils.experiments.n04_allreduce.experiment import (
    ALLREDUCE_BENCH_EXPERIMENT,
    LinkPeak,
    Settings,
)
from lab_utils.experiments.shared.anchors import (
    CIFAR10_TRAIN_IMAGES,
)
from lab_utils.learn.alpha_beta import AlphaBetaFit, fit_alpha_beta
from lab_utils.learn.bucketing import assign_buckets
from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.models import count_parameters
from lab_utils.learn.ring import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    GB,
    gradient_bytes,
    iterations_per_epoch,
    ring_bytes_per_epoch,
    ring_bytes_per_rank,
)

__all__ = ["MAX_FIT_RMS_ERROR", "BenchReport", "bench_frame", "bench_main", "ddp_bucket_sizes", "fit_verdict",
           "format_bench", "report_bench", "report_buckets", "report_bytes"]


def ddp_bucket_sizes(model, bucket_bytes: int = DDP_BUCKET_BYTES,
                     first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[int]:
    """Bytes of each gradient bucket DDP all-reduces per step, in the order they are sent: DDP's rule
    (:func:`lab_utils.learn.bucketing.assign_buckets`: reverse order, a bucket closes once it holds at least
    its cap, 1 MiB for the first and 25 MiB after by default), over the trainable parameters."""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    buckets = assign_buckets(sizes, check_positive_int(bucket_bytes, "bucket bytes"),
                             check_positive_int(first_bucket_bytes, "first bucket bytes"))
    return [sum(sizes[i] for i in bucket) for bucket in buckets]


def bench_frame(records: Iterable):
    """nccl-tests-like columns (size B, count, time us, algbw GB/s, busbw GB/s) from bench records."""
    cols = ["ranks", "backend", "size_bytes", "count", "type", "time_us", "algbw_gb_per_s", "busbw_gb_per_s"]
    rows = [(r.config["world_size"], r.config["backend"], r.config["size_bytes"], r.metrics["count"],
             r.config["dtype"], *(r.metrics[k] for k in cols[5:])) for r in records if r.status == "ok"]
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["ranks", "size_bytes"]).reset_index(drop=True)


def format_bench(df) -> str:
    """The benchmark as nccl-tests prints it: fixed-width columns, one line per size."""
    lines = [f"{'size(B)':>12} {'count':>11} {'type':>7} {'time(us)':>10} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12}"]
    for _, r in df.iterrows():
        lines.append(f"{int(r.size_bytes):>12d} {int(r['count']):>11d} {r.type:>7} {r.time_us:>10.1f} "
                     f"{r.algbw_gb_per_s:>12.3f} {r.busbw_gb_per_s:>12.3f}")
    return "\n".join(lines)


def _fit_records(records: Iterable, failures: dict[int, str] | None = None) -> dict[int, AlphaBetaFit]:
    """One :class:`AlphaBetaFit` per rank count of the ok benchmark records. A rank count whose timings
    cannot be fitted (too few sizes, or timings that do not grow with size: the largest message still
    latency-bound on a noisy machine) gets none; its reason goes into ``failures`` when given."""
    df = bench_frame(records)
    fits = {}
    for p, g in df.groupby("ranks"):
        if int(p) >= 2 and len(g) >= 3:
            try:
                fits[int(p)] = fit_alpha_beta(g.size_bytes.to_numpy(float),
                                              g.time_us.to_numpy(float) * 1e-6, int(p))
            except LabError as e:
                if failures is not None:
                    failures[int(p)] = str(e)
    return fits


def _peak_busbw_gb_per_s(records: Iterable, world_size: int | None = None) -> float | None:
    """The highest busbw measured (on ``world_size`` ranks when given), or None."""
    df = bench_frame(records)
    if world_size is not None:
        df = df[df.ranks == world_size]
    return float(df.busbw_gb_per_s.max()) if len(df) else None


def bench_main(argv: list[str] | None = None) -> int:
    """``python -m lab_utils bench allreduce``: the benchmark's plan (notebook 04's) through
    :func:`lab_utils.engine.plan.measure`, printed with nccl-tests' columns, and the fitted alpha and B."""
    p = argparse.ArgumentParser(prog="python -m lab_utils bench allreduce",
                                description="All-reduce bandwidth with nccl-tests' columns, under torchrun "
                                            "(NCCL on >= 2 GPUs, else gloo between CPU processes).")
    p.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: the profile's rank counts)")
    for name, what in (("max-bytes", "largest message"), ("min-bytes", "smallest message"),
                       ("iters", "timed all-reduces per size"), ("warmup", "untimed all-reduces per size")):
        p.add_argument(f"--{name}", type=int, default=None, help=f"{what} (default: the profile's)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo"], help="gloo: CPU processes")
    p.add_argument("--force", action="store_true", help="re-measure sizes already in the store")
    a = p.parse_args(argv)
    store = ResultStore(a.profile)
    settings = profiles.settings(Settings, store.profile, bench_ranks=(a.nproc,) if a.nproc else None,
                                 max_bytes=a.max_bytes, min_bytes=a.min_bytes, iters=a.iters, warmup=a.warmup)
    here = Machine.here()
    machine = dataclasses.replace(here, gpus=0, gpu_name=None) if a.backend == "gloo" else here
    runs = [r for r in make_plan(ALLREDUCE_BENCH_EXPERIMENT, settings, machine, store.profile)
            if a.nproc is None or r.processes == a.nproc]
    records = measure(store.profile, ALLREDUCE_BENCH_EXPERIMENT, settings, force=a.force, runs=runs)
    failures: dict[int, str] = {}
    fits = _fit_records(records, failures)
    for ranks, group in bench_frame(records).groupby("ranks"):
        print(f"# all-reduce, {ranks} ranks, backend {group.backend.iloc[0]}, profile {store.profile}; "
              "time = mean per all-reduce of the slowest rank; GB/s decimal")
        print(format_bench(group))
        print("# " + (f"fitted ring model T = 2(P-1) alpha + 2(P-1)/P S / B: {fits[ranks].summary()}"
                      if ranks in fits else f"no fitted alpha/B: {failures.get(ranks, 'too few sizes')}"))
    skipped = {r.config["world_size"]: r.reason for r in records if r.status == "skipped"}
    for p, why in sorted(skipped.items()):
        print(f"# {p} ranks: not measured: {why}")
    bad = [r for r in records if r.status not in ("ok", "skipped")]
    for r in bad:
        print(f"{r.config['world_size']} ranks, {r.config['size_bytes']} B: {r.status}: {r.reason}")
    print(f"# records in {store.path(ALLREDUCE_BENCH_EXPERIMENT.name)}")
    return 1 if bad else 0


def _bucket_table(bucket_sizes: Sequence[int], fits: Mapping[int, AlphaBetaFit]):
    """Per DDP bucket: bytes and the fitted ring time / busbw on each benchmarked rank count."""
    rows = []
    for name, s in [*enumerate(bucket_sizes), ("one message", sum(bucket_sizes))]:
        row: dict[str, Any] = {"bucket": name, "bytes": int(s)}
        for p, fit in sorted(fits.items()):
            t = fit.predict_seconds(s)
            row[f"P={p} modelled ms"] = 1e3 * t
            row[f"P={p} latency share"] = 2 * (p - 1) * fit.alpha_seconds / t
        rows.append(row)
    return pd.DataFrame(rows)


def _plot_busbw(records: Iterable, fits: Mapping[int, AlphaBetaFit], link: LinkPeak | None = None):
    """Log-log busbw (GB/s) against message size per rank count, with the fitted model overlaid."""
    import matplotlib.pyplot as plt

    df = bench_frame(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, g in df.groupby("ranks"):
        line, = ax.loglog(g.size_bytes, g.busbw_gb_per_s, "o", ms=4, label=f"measured, {p} ranks")
        fit = fits.get(int(p))
        if fit is not None:
            xs = np.geomspace(g.size_bytes.min(), g.size_bytes.max(), 200)
            label = (f"fit {p} ranks: alpha={fit.alpha_seconds * 1e6:.1f} us, "
                     f"B={fit.bandwidth_gb_per_s:.2f} GB/s")
            model = [fit.predict_busbw_gb_per_s(x) for x in xs]
            ax.loglog(xs, model, "-", color=line.get_color(), label=label)
    if link is not None and link.gb_per_s:
        ax.axhline(link.gb_per_s, color="0.4", ls="--", lw=1,
                   label=f"nominal link {link.gb_per_s:g} GB/s")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("busbw (GB/s, decimal)")
    ax.set_title("All-reduce bus bandwidth vs message size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.16)  # room for the store's provenance label
    return fig


MAX_FIT_RMS_ERROR = 0.25  # a fit whose rms relative error exceeds 25 % projects nothing that counts


def fit_verdict(fit: AlphaBetaFit | None, threshold: float = MAX_FIT_RMS_ERROR) -> str:
    """"" when ``fit`` is good enough to project from, else the label every projected row carries:
    ``not a result: fit error X% rms > Y%`` (the alpha-beta model does not describe the
    measurements, so extrapolating it to 1,024 devices would only extrapolate its error)."""
    if fit is None:
        return "not a result: no fit"
    if fit.rms_relative_error > threshold:
        return (f"not a result: fit error {100 * fit.rms_relative_error:.1f}% rms > "
                f"{100 * threshold:.0f}%")
    return ""


def _gradient_bytes_table(grad_bytes: int, parameters: int, dataset_size: int, batch_sizes: Sequence[int],
                         devices: Sequence[int]):
    """Per (devices, per-device batch): iterations and ring bytes per rank per step and per epoch."""
    return pd.DataFrame([{"devices": p, "per_gpu_batch": b, "parameters": parameters,
                          "grad_bytes": grad_bytes,
                          "steps_per_epoch": iterations_per_epoch(dataset_size, b, p),
                          "bytes_per_rank_per_step": ring_bytes_per_rank(grad_bytes, p),
                          "bytes_per_rank_per_epoch": ring_bytes_per_epoch(grad_bytes, p, dataset_size, b),
                          "if_params_were_bytes": ring_bytes_per_epoch(parameters, p, dataset_size, b)}
                         for p in devices for b in batch_sizes])


def _bench_table(records: Iterable):
    """The benchmark table for the report: nccl-tests columns plus the fitted model's time."""
    df = bench_frame(records)
    fits = _fit_records(records)
    df["model_time_us"] = [fits[int(r.ranks)].predict_seconds(r.size_bytes) * 1e6 if int(r.ranks) in fits
                           else None for r in df.itertuples()]
    return df


def _fit_table(fits: Mapping[int, AlphaBetaFit], peaks: Mapping[int, float | None]):
    return pd.DataFrame([{"ranks": p, "alpha_us": f.alpha_seconds * 1e6,
                          "alpha_stderr_us": f.alpha_stderr_seconds * 1e6, "B_gb_per_s": f.bandwidth_gb_per_s,
                          "B_stderr_gb_per_s": f.bandwidth_stderr_bytes_per_s / GB,
                          "rms_rel_error": f.rms_relative_error, "max_rel_error": f.max_relative_error,
                          "peak_busbw_gb_per_s": peaks.get(p), "sizes": f.n_points,
                          "projection": fit_verdict(f) or "ok to project"} for p, f in sorted(fits.items())])


def report_bytes(store, model):
    """Table ``allreduce_bytes``: ring bytes per rank per step and epoch for ``model`` on all of CIFAR-10, at
    the spec's batch sizes on 2, 4 and 8 devices (saved, returned)."""
    df = _gradient_bytes_table(gradient_bytes(model), count_parameters(model), CIFAR10_TRAIN_IMAGES,
                               (32, 128, 512), (2, 4, 8))
    store.save_table(df, "allreduce_bytes",
                     title=f"Ring all-reduce bytes per rank ({CIFAR10_TRAIN_IMAGES:,} images)",
                     notes=["bytes_per_rank = steps x 2(P-1)/P x grad_bytes; steps = ceil(ceil(N/P)/b).",
                            "if_params_were_bytes: the same formula fed the parameter count "
                            "(the 4x mistake)."])
    return df


@dataclass
class BenchReport:
    """The benchmark's table, fits and peak busbw (GB/s) per rank count, figure, and records measured."""

    table: Any
    fits: dict[int, AlphaBetaFit]
    peaks: dict[int, float | None]
    fit_table: Any
    figure: Any
    records: list = field(default_factory=list)

    @property
    def reference_fit(self) -> AlphaBetaFit | None:
        """The fit on the most ranks (the closest to the projections' regime)."""
        return self.fits[max(self.fits)] if self.fits else None


def report_bench(store, records: Sequence, link: LinkPeak) -> BenchReport:
    """Tables ``allreduce_bench`` and ``allreduce_fit`` and figure ``allreduce_busbw`` (saved); a rank
    count the machine lacks is a note of the fit table."""
    import matplotlib.pyplot as plt

    skipped = {r.config["world_size"]: r.reason for r in records if r.status == "skipped"}
    records = [r for r in records if r.status != "skipped"]
    df = _bench_table(records)
    failures: dict[int, str] = {}
    fits = _fit_records(records, failures)
    peaks = {int(p): _peak_busbw_gb_per_s(records, int(p)) for p in sorted(set(df.ranks))}
    store.save_table(df, "allreduce_bench", records, title="All-reduce benchmark (nccl-tests columns)",
                     notes=["time_us: mean per all-reduce over the timed loop, slowest rank; GB/s decimal.",
                            "busbw = algbw x 2(n-1)/n; model_time_us: the fitted ring model at that size."])
    ft = _fit_table(fits, peaks)
    store.save_table(ft, "allreduce_fit", records, title="Fitted ring model T = 2(P-1) alpha + 2(P-1)/P S/B",
                     notes=[f"link: {link.description}"]
                     + [f"{p} ranks: no fit: {why}" for p, why in sorted(failures.items())]
                     + [f"{p} ranks: not measured: {why}" for p, why in sorted(skipped.items())])
    fig = _plot_busbw(records, fits, link)
    store.save_figure(fig, "allreduce_busbw", records)
    plt.close(fig)
    return BenchReport(df, fits, peaks, ft, fig, records)


def report_buckets(store, model, fits: Mapping[int, AlphaBetaFit], records: Sequence):
    """Table ``allreduce_buckets``: DDP's default buckets for ``model`` and their modelled times."""
    sizes = ddp_bucket_sizes(model)
    if not fits:
        return sizes, None
    df = _bucket_table(sizes, fits)
    store.save_table(df, "allreduce_buckets", records,
                     title="DDP's default gradient buckets, modelled ring time",
                     notes=["buckets in gradient-ready order: first capped at 1 MiB, then 25 MiB."])
    return sizes, df
