"""Notebook 04's projections to 8..1024 devices (under :data:`PROJECTION_ASSUMPTIONS`): the compute
side measured on one device (:func:`projection_compute`), the projected epoch and its efficiency
figure (:func:`report_projection`), and which inputs were measured and which assumed
(:func:`report_inputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd

from lab_utils.engine.config import CIFAR10_TRAIN_SIZE
from lab_utils.experiments.n04_allreduce.experiment import (
    LinkPeak,
    Settings,
)
from lab_utils.experiments.n04_allreduce.tables import MAX_FIT_RMS_ERROR, bench_frame, fit_verdict
from lab_utils.learn.alpha_beta import AlphaBetaFit
from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.models import ResNet18
from lab_utils.learn.ring import (
    DDP_BUCKET_BYTES,
    _check_pos,
    _check_world_size,
    bucketed_ring_seconds,
    gradient_bytes,
    iterations_per_epoch,
    samples_per_rank,
)

__all__ = ["PROJECTION_ASSUMPTIONS", "projection_compute", "report_inputs", "report_projection"]


PROJECTION_ASSUMPTIONS = (
    "As in the assignment, the per-device batch b is fixed (global batch P x b) and an epoch is the "
    "whole data set, ceil(ceil(N/P)/b) steps per device (DistributedSampler padding, last partial "
    "batch kept): each step is weak-scaled, the epoch time strong-scaled (speedup T(1)/T(P)).",
    "Compute time per step is the measured single-device step time at batch b; the last partial "
    "step costs its share (samples/b) of it. Every device computes at that speed (no stragglers).",
    "Every step all-reduces the whole gradient S with a ring, at the fitted alpha and B measured on this "
    "machine, for every P: no slower inter-node links, no hierarchical or tree algorithms, no contention.",
    "DDP buckets: the gradient is sent as ceil(S / 25 MiB) ring all-reduces (each pays the latency term).",
    "Two bounds on overlap: 'no overlap' adds communication after compute; 'full overlap' hides it "
    "behind compute (step = max of the two). Real DDP lies between.",
    "Data loading, evaluation, start-up and the optimizer's own cost beyond the measured step are ignored.",
)


def _epoch_compute_seconds(dataset_size: int, per_device_batch: int, world_size: int,
                          step_seconds: float) -> float:
    """Compute seconds of one rank's epoch: full steps at ``step_seconds``, the partial one pro rata."""
    n = samples_per_rank(dataset_size, world_size)
    b = check_positive_int(per_device_batch, "per-device batch size")
    t = _check_pos(step_seconds, "compute seconds per step")
    full, rest = divmod(n, b)
    return full * t + (rest / b) * t


def _project_scaling(fit: AlphaBetaFit, grad_bytes: int, dataset_size: int,
                    compute_seconds_per_step: Mapping[int, float],
                    devices: Sequence[int] = Settings.projection_devices,
                    bucket_bytes: float | None = DDP_BUCKET_BYTES):
    """Predicted epoch (seconds), speedup T_epoch(1)/T_epoch(P) and efficiency speedup/P, one row per
    (per-device batch, device count), as a DataFrame (see PROJECTION_ASSUMPTIONS).
    ``compute_seconds_per_step`` maps per-device batch -> measured seconds of one step on one device."""
    check_positive_int(grad_bytes, "gradient bytes")
    if not compute_seconds_per_step:
        raise LabError("Projections need a measured compute time per step for at least one batch size.")
    rows = []
    for b, t_step in sorted(compute_seconds_per_step.items()):
        base = _epoch_compute_seconds(dataset_size, b, 1, t_step)
        for p in devices:
            _check_world_size(p)
            steps = iterations_per_epoch(dataset_size, b, p)
            compute = _epoch_compute_seconds(dataset_size, b, p, t_step)
            comm_step = (0.0 if p == 1 else fit.predict_seconds(grad_bytes, p) if not bucket_bytes else
                         bucketed_ring_seconds(grad_bytes, p, fit.alpha_seconds, fit.bandwidth_bytes_per_s,
                                               bucket_bytes))
            comm = steps * comm_step
            epoch = compute + comm
            # Full overlap: each step costs max(compute, comm); the partial step is pro rata.
            overlap = steps * max(compute / steps, comm_step)
            rows.append(dict(
                per_device_batch=b, devices=p, global_batch=b * p, steps_per_epoch=steps,
                compute_seconds=compute, comm_seconds_per_step=comm_step, comm_seconds=comm,
                epoch_seconds=epoch, epoch_seconds_full_overlap=overlap,
                speedup=base / epoch, efficiency=base / epoch / p,
                speedup_full_overlap=base / overlap, efficiency_full_overlap=base / overlap / p,
                comm_fraction=comm / epoch if epoch else 0.0))
    return pd.DataFrame(rows)


def _plot_projection(df, verdict: str = ""):
    """Predicted efficiency against devices, one colour per per-device batch (both overlap bounds).
    A non-empty ``verdict`` (:func:`fit_verdict`) is written across the axes and into the title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, g in df.groupby("per_device_batch"):
        line, = ax.semilogx(g.devices, g.efficiency, "o-", base=2, label=f"batch {b}/device, no overlap")
        ax.semilogx(g.devices, g.efficiency_full_overlap, "--", base=2, color=line.get_color(),
                    label=f"batch {b}/device, full overlap")
    ax.set_xlabel("devices P")
    ax.set_ylabel("predicted efficiency = speedup / P")
    ax.set_ylim(0, 1.05)
    title = "Projected efficiency per epoch (ring all-reduce, fitted alpha and B)"
    ax.set_title(title)
    if verdict:
        ax.set_title(f"{title}\n{verdict.upper()}", fontsize=10, color="#a03000")
        ax.text(0.5, 0.5, verdict.upper(), transform=ax.transAxes, ha="center", va="center", fontsize=14,
                color="#a03000", alpha=0.35, rotation=20)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.16)  # room for the store's provenance label
    return fig


@dataclass
class _ProjectionCompute:
    """The compute side of a projection: seconds per step per batch, and the model and data behind them."""

    seconds_per_step: dict[int, float]
    grad_bytes: int
    dataset_size: int
    width: int
    source: str
    records: list = field(default_factory=list)

    @property
    def description(self) -> str:
        per = ", ".join(f"batch {b}: {t * 1e3:.1f} ms" for b, t in sorted(self.seconds_per_step.items()))
        return (f"compute per step ({self.source}): {per}; ResNet-18 width {self.width}, "
                f"{self.grad_bytes:,} gradient bytes; projected data set {self.dataset_size:,} images")


def projection_compute(records: Sequence, settings: Settings) -> _ProjectionCompute:
    """The projection's compute side from ``COMPUTE_STEP_EXPERIMENT``'s records (ok ones; one device,
    random tensors): seconds per forward+backward+SGD step at each per-device batch."""
    ok = [r for r in records if r.status == "ok"]
    device = ok[0].config["device_type"] if ok else "?"
    return _ProjectionCompute(
        seconds_per_step={r.config["batch_size"]: r.metrics["compute_seconds_per_step"] for r in ok},
        grad_bytes=gradient_bytes(ResNet18(width=settings.width)), dataset_size=CIFAR10_TRAIN_SIZE,
        width=settings.width, records=list(records),
        source=f"measured on one {device} device: forward+backward+SGD step on random tensors, "
               f"{settings.compute_steps} timed steps after {settings.compute_warmup} warm-up")


def _inputs_table(fits: Mapping[int, AlphaBetaFit], ref_fit: AlphaBetaFit | None,
                 compute: _ProjectionCompute | None, link: LinkPeak, bench_records: Sequence):
    """Which inputs of notebook 04 were measured, and which were assumed."""
    df = bench_frame(bench_records)
    backend = ", ".join(sorted(set(df.backend))) if len(df) else "none"
    rows = [("gradient bytes S", "sum numel x element size over trainable params", "computed exactly",
             "model definition"),
            ("all-reduce time per size", f"{len(df)} points, ranks {sorted(set(df.ranks))}", "measured",
             f"benchmark ({backend}), slowest rank, after warm-up")]
    rows += [(f"alpha, B ({p} ranks)", f"{f.alpha_seconds * 1e6:.2f} us, {f.bandwidth_gb_per_s:.3f} GB/s",
              "fitted to measurements", f"least squares, rms rel. error {100 * f.rms_relative_error:.1f}%")
             for p, f in sorted(fits.items())]
    rows.append(("link nominal bandwidth", link.gb_per_s or "unknown",
                 "data sheet" if link.gb_per_s else "not available", link.description))
    if compute is not None:
        per = ", ".join(f"b={b}: {t * 1e3:.1f} ms" for b, t in sorted(compute.seconds_per_step.items()))
        rows += [("compute seconds per step", per, "measured", compute.source),
                 ("data set size for the projection", compute.dataset_size, "assumed",
                  "CIFAR-10 training set")]
    if ref_fit is not None:
        rows.append(("alpha, B at 8..1024 devices", f"those fitted on {ref_fit.world_size} ranks", "assumed",
                     "no measurement beyond this machine exists"))
    rows += [(f"projection assumption {i + 1}", a, "assumed", "comm_projection.PROJECTION_ASSUMPTIONS")
             for i, a in enumerate(PROJECTION_ASSUMPTIONS)]
    return pd.DataFrame(rows, columns=["input", "value", "kind", "source"])


def report_projection(store, fit: AlphaBetaFit | None, compute: _ProjectionCompute,
                      records: Sequence, devices: Sequence[int] = Settings.projection_devices,
                      max_rms_error: float = MAX_FIT_RMS_ERROR):
    """Table ``allreduce_projection`` and figure ``allreduce_projection_efficiency`` (saved and returned;
    ``(None, None)`` without a fit or a compute time). With a fit whose rms relative error exceeds
    ``max_rms_error`` every row's ``status`` (and the figure) says ``not a result: fit error X% rms > Y%``."""
    import matplotlib.pyplot as plt

    if fit is None or not compute.seconds_per_step:
        return None, None
    df = _project_scaling(fit, compute.grad_bytes, compute.dataset_size, compute.seconds_per_step,
                           devices=devices)
    verdict = fit_verdict(fit, max_rms_error)
    df.insert(0, "status", verdict or "ok")
    recs = list(records) + list(compute.records)
    fit_note = (f"Fit quality: rms relative error {100 * fit.rms_relative_error:.1f}% (threshold "
                f"{100 * max_rms_error:.0f}%). " + (f"Every row is {verdict}: the model does not describe "
                                                   "this machine's measurements, so projecting it is not a "
                                                   "result." if verdict else "Within the threshold."))
    store.save_table(df, "allreduce_projection", recs,
                     title=f"Projected epoch (ring, alpha and B fitted on {fit.world_size} ranks)"
                           + (f": {verdict.upper()}" if verdict else ""),
                     notes=[fit_note] + list(PROJECTION_ASSUMPTIONS) + [compute.description])
    fig = _plot_projection(df, verdict)
    store.save_figure(fig, "allreduce_projection_efficiency", recs)
    plt.close(fig)
    return df, fig


def report_inputs(store, fits: Mapping[int, AlphaBetaFit], ref_fit: AlphaBetaFit | None,
                  compute: _ProjectionCompute | None, link: LinkPeak, records: Sequence):
    """Table ``allreduce_inputs``: which inputs were measured and which assumed (saved, returned)."""
    df = _inputs_table(fits, ref_fit, compute, link, records)
    store.save_table(df, "allreduce_inputs", list(records) + list(compute.records if compute else []),
                     title="Notebook 04's inputs: measured, fitted or assumed")
    return df
