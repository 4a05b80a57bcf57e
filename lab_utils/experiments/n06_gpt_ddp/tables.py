"""Notebook 06's tables and figure (``gpt_scaling``, ``gpt_compute_vs_comm``, ``gpt_rank_breakdown``,
``gpt_accumulation``) from the records of :mod:`lab_utils.experiments.n06_gpt_ddp.experiment`, the earlier
project's published per-rank numbers (SPEC.md, Part 2), and the inputs of Exercise 06-d's prediction.

Two passes feed them (:mod:`lab_utils.experiments.n06_gpt_ddp.worker`): times, speedups, tokens/s and MFU come
from the uninstrumented epoch (:data:`GPT_T_N`); where the time goes (phases, forward / loss / backward, the
comm hook) from the instrumented pass, per optimizer step (and, beside the epoch's other figures, x the
epoch's steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lab_utils.engine.records import aggregates, ranks_of
from lab_utils.engine.store import Record, ResultStore
from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n06_gpt_ddp.experiment import Settings
from lab_utils.experiments.shared import anchors
from lab_utils.experiments.shared.anchors import GPT_RANK_SECONDS, GPT_REPORTED_MEAN_SECONDS
from lab_utils.experiments.shared.rows import blank, blank_missing, one_device_runs, pair_key, per_step, value
from lab_utils.learn.comm_probe import derived_comm, noise_flag
from lab_utils.learn.flops import mfu, predicted_tokens_per_s
from lab_utils.learn.speedup import efficiency, speedup

#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
SCALING_VIEW = ("per-device batch", "devices", "status", "T(N): epoch (s)", "speedup T1/TN", "efficiency",
                "slowest rank", "tokens/s", "MFU")
#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
ACCUMULATION_VIEW = ("micro-batch", "accumulation steps", "status", "whole run (s)", "training (s)",
                     "tokens/s (epoch 2)", "MFU", "instrumented / plain step", "peak memory (GiB)")

__all__ = ["GPT_T_N", "accumulation_table", "compute_comm_table", "earlier_report_anomalies",
           "earlier_report_frame", "earlier_report_note", "earlier_report_ranks", "mfu_prediction",
           "plot_accumulation", "rank_table",
           "save_accumulation_figure", "save_accumulation_table", "save_scaling_tables", "scaling_table",
           "tokens_per_s_prediction"]

#: T(N) of the GPT: an aggregate's ``epoch_seconds``, the slowest rank's wall time of the uninstrumented
#: pass (device synchronized at its two ends only, loader waits included). Notebooks 02 and 03's T(N) is
#: ``train_seconds`` instead (its median over repeats, lab_utils.experiments.shared.rows.T_N): the sum of
#: synchronized phases, loader and skew waits excluded.
GPT_T_N = "epoch_seconds"


def _ok(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r.status == "ok"]


def earlier_report_frame():
    """The earlier project's per-rank table (:data:`lab_utils.experiments.shared.anchors.GPT_RANK_SECONDS`)
    with its speedup T(1)/T(N) on the report's mean over ranks (as published, three above N) and on the
    SLOWEST rank, which every step waits for. Seconds as published; speedups to 2 decimals, as the report
    gave."""
    ranks = max(len(t) for t in GPT_RANK_SECONDS.values())
    rows = []
    for (b, n), times in sorted(GPT_RANK_SECONDS.items()):
        t1, mean, slow = GPT_REPORTED_MEAN_SECONDS[(b, 1)], GPT_REPORTED_MEAN_SECONDS[(b, n)], max(times)
        row: dict[str, Any] = {"per-GPU batch": b, "GPUs": n}
        row.update({f"rank {r} (s)": times[r] if r < len(times) else None for r in range(ranks)})
        on_mean = speedup(t1, mean)
        row.update({"report's mean (s)": mean, "speedup on the mean (as reported)": round(on_mean, 2),
                    "slowest rank (s)": slow, "speedup on the slowest rank": round(speedup(t1, slow), 2),
                    "note": "super-linear: speedup > N on the mean" if n > 1 and on_mean > n else ""})
        rows.append(row)
    return blank_missing(pd.DataFrame(rows))


def earlier_report_note() -> str:
    """One sentence: the earlier project's published speedups (on the mean over ranks) next to the
    slowest rank's, from :func:`earlier_report_frame`."""
    df = earlier_report_frame()
    parts = []
    for b, g in df[df["GPUs"] > 1].groupby("per-GPU batch"):
        mean = " / ".join(f"{v:.2f}" for v in g["speedup on the mean (as reported)"])
        slow = " / ".join(f"{v:.2f}" for v in g["speedup on the slowest rank"])
        gpus = " / ".join(str(n) for n in g["GPUs"])
        parts.append(f"batch {b} on {gpus} GPUs: {mean} on the mean over ranks, {slow} on the slowest rank")
    return ("Earlier project (SPEC.md, Part 2), speedups T(1)/T(N) as it reported them and recomputed: "
            + "; ".join(parts) + " (earlier_report_frame).")


def earlier_report_anomalies(superlinear: bool = True):
    """Three things a careful reader of the earlier GPT reports notices, each with the report's own
    numbers (:mod:`lab_utils.experiments.shared.anchors`), why it cannot be right, and what this notebook does
    instead: super-linear speedups (left out with ``superlinear=False``: notebook 06 discusses them after
    its exercise), a 1-GPU "communication" time, and accumulation timers that point at an unsynchronized
    GPU."""
    frame = earlier_report_frame()
    above = frame[(frame["GPUs"] > 1) & (frame["speedup on the mean (as reported)"] > frame["GPUs"])]
    superlinear = "; ".join(f"{r['speedup on the mean (as reported)']:.2f} on {r['GPUs']} GPUs at batch "
                            f"{r['per-GPU batch']}" for _, r in above.iterrows())
    one_gpu = " and ".join(f"{t:g} s" for t in anchors.GPT_ONE_GPU_COMMUNICATION_SECONDS)
    fwd_lo, fwd_hi = anchors.ACCUMULATION_FORWARD_MEAN_MS
    loss = anchors.ACCUMULATION_LOSS_MEAN_MS
    mb_lo, mb_hi = min(loss), max(loss)
    rows = [
        {"the report printed": f"speedups above N on the mean over ranks: {superlinear}",
         "why it cannot be right": "with a fixed per-GPU batch no step gets faster on more GPUs; the mean "
                                   "over ranks hides the slowest rank, which every step waits for",
         "this notebook": "T(N) is the slowest rank's time (earlier_report_frame recomputes it)"},
        {"the report printed": f"a 'communication' time of {one_gpu} for its 1-GPU runs",
         "why it cannot be right": "one GPU has no peer: there is nothing to communicate, so whatever that "
                                   "timer held, it was not communication",
         "this notebook": "communication is measured by a DDP comm hook and a no_sync probe, and is "
                          "reported only where there are 2 or more ranks"},
        {"the report printed": f"a forward-pass mean of {fwd_lo:g}-{fwd_hi:g} ms, flat while the "
                               f"micro-batch grew {mb_hi // mb_lo}x from {mb_lo} to {mb_hi}, and a loss-"
                               f"computation mean growing from {loss[mb_lo]:g} to {loss[mb_hi]:g} ms",
         "why it cannot be right": "the forward's work grows with the micro-batch, its time did not; most "
                                   "likely (an inference: the report shows no timer code) its timers were "
                                   "read without synchronizing the GPU: a CUDA launch returns before the "
                                   "kernels run, so such a timer measures the launch, and the next "
                                   "operation that waits (the loss) absorbs the forward's time",
         "this notebook": "every phase timer synchronizes the device at both ends "
                          "(lab_utils.learn.timing.timed), in a pass of its own: tokens/s come from a pass "
                          "synchronized only at its ends"},
    ]
    return pd.DataFrame(rows if superlinear else rows[1:]).reset_index(drop=True)


def earlier_report_ranks():
    """The earlier project's per-rank epoch times as published, its mean over ranks and the speedup it
    reported on that mean (:func:`earlier_report_frame` without the recomputation on the slowest rank):
    the data of notebook 06's hand-graded question."""
    frame = earlier_report_frame()
    return frame.drop(columns=["slowest rank (s)", "speedup on the slowest rank", "note"])


def scaling_table(records: Sequence[Record]):
    """gpt_scaling: T(N) (:data:`GPT_T_N`), speedup T(1)/T(N), efficiency (no speedup on the mean over
    ranks: the hand-graded question has the student recompute it), and, since ``drop_last`` batches per
    rank need not give every device count the same work (:data:`_SCALING_TIME_BASIS`), the tokens trained
    and the speedup per token, flagged when the work differs."""
    aggs = aggregates(records)
    ones = one_device_runs(aggs)
    rows = []
    for r in aggs:
        bs, n = r.config["batch_size"], r.config["devices"]
        row: dict[str, Any] = {"per-device batch": bs, "devices": n, "status": r.status}
        if r.status == "ok":
            m, one = r.metrics, ones.get(pair_key(r))
            tokens, tokens1 = m.get("tokens"), one.metrics.get("tokens") if one else None
            speed = speedup(value(one, GPT_T_N), value(r, GPT_T_N))
            t1, tn = value(one, GPT_T_N), value(r, GPT_T_N)
            per_token = speedup(t1 / tokens1 if tokens1 else None, tn / tokens)
            row.update({
                "backend": m["backend"] or "one process", "T(N): epoch (s)": m[GPT_T_N],
                "speedup T1/TN": speed, "efficiency": efficiency(speed, n),
                "slowest rank": m["slowest_rank"], "imbalance max/min": m["imbalance"],
                "tokens/s": m["epoch_tokens_per_s"], "MFU": blank(m["mfu"]), "precision": precision_label(r),
                "val loss": m["val_loss"], "reason": None, "tokens trained (epoch)": tokens,
                "work vs 1 device": tokens / tokens1 if tokens1 else None,
                "speedup on tokens/s (equal work)": per_token,
                "efficiency on tokens/s": efficiency(per_token, n),
                "work note": _unequal_work_note(tokens, tokens1, n)})
        else:
            row["reason"] = r.reason
        rows.append(row)
    return with_view(blank_missing(pd.DataFrame(rows)), SCALING_VIEW)


def precision_label(rec: Record) -> str | None:
    """What a run computed in: the worker's ``precision`` (``fp32``, ``tf32``, ``bf16``), with the dtype
    asked for when the worker ran another (bf16 on a GPU without native bf16 runs fp32)."""
    ran, asked = rec.metrics.get("precision"), rec.config.get("dtype")
    if ran is None:
        return asked
    return f"{ran} (bf16 asked)" if rec.metrics.get("precision_note") and asked == "bf16" else ran


def precision_notes(records: Sequence[Record]) -> list[str]:
    """The workers' notes on a precision other than the one asked (one per distinct note)."""
    return sorted({n for r in records if (n := r.metrics.get("precision_note"))})


def _unequal_work_note(tokens: int | None, tokens_one: int | None, devices: int) -> str:
    """"" when an N-device epoch trained as many tokens as the one-device epoch, else a flag
    saying by how much they differ and which speedup to use."""
    if devices == 1 or not tokens or not tokens_one or tokens == tokens_one:
        return ""
    return (f"unequal work: {tokens:,} tokens vs {tokens_one:,} on 1 device ({tokens / tokens_one:.3f}x); "
            "T1/TN compares different work, use the tokens/s speedup")


_SCALING_TIME_BASIS = [
    "Time basis (names as in lab_utils.learn.metrics): T(N) is epoch_seconds, the slowest rank's wall time "
    "of the reported epoch's training pass, run uninstrumented (the device synchronized at its two ends "
    "only; loader waits included, validation excluded). Notebooks 02 and 03 take T(N) = train_seconds "
    "instead, the sum of synchronized phases without the loader and skew waits; this GPT's instrumented pass "
    "has those phases (gpt_rank_breakdown). 'speedup T1/TN' = T(1)/T(N), 'efficiency' = speedup / N. "
    "'tokens/s': all ranks' tokens / T(N) (epoch_tokens_per_s); MFU on it. 'speedup on tokens/s (equal "
    "work)' = tokens/s(N) / tokens/s(1). Every speedup: lab_utils.learn.speedup.speedup.",
    "tokens trained (epoch): all ranks' tokens in the reported epoch; work vs 1 device: that / the "
    "one-device run's (drop_last batches per rank: e.g. 13 steps x 4,096 = 53,248 tokens on 1 device, "
    "2 x 6 x 4,096 = 49,152 on 2).",
]


def _per_epoch(m: dict, name: str) -> float | None:
    """``name`` of the run's instrumented pass per optimizer step, x the reported epoch's steps (seconds);
    None without a breakdown."""
    bd = m.get("breakdown") or {}
    v = bd.get(name)
    return None if v is None or not bd.get("steps") else v / bd["steps"] * m["steps"]


def _per_step_ms(bd: dict | None, name: str) -> float | None:
    """``name`` of an instrumented pass in milliseconds per optimizer step; None without one."""
    if not bd or bd.get(name) is None or not bd.get("steps"):
        return None
    return 1e3 * bd[name] / bd["steps"]


def compute_comm_table(records: Sequence[Record]):
    """gpt_compute_vs_comm: measured compute and communication (the instrumented pass's, per step x the
    reported epoch's steps; the probe's, likewise) of each run on N > 1 devices, and the derived method on
    T(N) (:func:`lab_utils.learn.comm_probe.derived_comm`)."""
    aggs = _ok(aggregates(records))
    ones = one_device_runs(aggs)
    rows = []
    for r in (r for r in aggs if r.config["devices"] > 1):
        m, n, one = r.metrics, r.config["devices"], ones.get(pair_key(r))
        d_comp, d_comm = derived_comm(one.metrics[GPT_T_N], m[GPT_T_N], n) if one else (None, None)
        comp, comm = _per_epoch(m, "compute_seconds"), _per_epoch(m, "communication_seconds")
        noise = blank(m.get("exposed_comm_noise_seconds"))
        rows.append({
            "per-device batch": r.config["batch_size"], "devices": n,
            "compute (s)": comp, "communication (s), exposed wait": comm,
            "comm / compute": comm / comp if comp and comm is not None else None,
            "all-reduce in flight (s)": _per_epoch(m, "epoch_allreduce_seconds"),
            "exposed by no_sync probe (s)": m.get("exposed_comm_seconds"), "probe noise ± (s)": noise,
            "noise flag": noise_flag(m.get("exposed_comm_seconds"), noise),
            "overlap fraction": blank(m.get("overlap_fraction")), "buckets": m.get("allreduce_buckets"),
            "derived compute T1/N (s)": d_comp, "derived comm TN - T1/N (s)": d_comm,
        })
    return blank_missing(pd.DataFrame(rows))


_BREAKDOWN_MS = {"data loading": "data_loading_seconds", "data movement": "data_movement_seconds",
                 "compute": "compute_seconds", "communication": "communication_seconds",
                 "skew wait": "skew_wait_seconds"}


def rank_table(records: Sequence[Record]):
    """gpt_rank_breakdown: every rank's reported epoch (its per-rank record: the uninstrumented pass's wall
    time, validation, loss) and its instrumented pass's phases in ms per optimizer step, the slowest rank
    marked, then the means over ranks the aggregate holds."""
    rows = []
    for agg in (a for a in _ok(aggregates(records)) if a.config["devices"] > 1):
        ranks = ranks_of(agg, records)
        m, key = agg.metrics, {"per-device batch": agg.config["batch_size"], "devices": agg.config["devices"]}
        for rk in ranks:
            rows.append({**key, "rank": rk.config["rank"],
                         "slowest": "yes" if rk.config["rank"] == m["slowest_rank"] else "",
                         "epoch (s)": rk.metrics["epoch_seconds"],
                         "validation (s)": rk.metrics["validation_seconds"],
                         **{f"{col} (ms/step)": _per_step_ms(rk.metrics.get("breakdown"), name)
                            for col, name in _BREAKDOWN_MS.items()},
                         "train loss": rk.metrics["train_loss_rank"]})
        bd = m.get("breakdown") or {}
        mean = {name: bd.get(f"{name}_mean") for name in _BREAKDOWN_MS.values()}
        rows.append({**key, "rank": "mean", "slowest": "", "epoch (s)": m["epoch_seconds_mean"],
                     "validation (s)": m["validation_seconds_mean"],
                     **{f"{col} (ms/step)": _per_step_ms({**mean, "steps": bd.get("steps")}, name)
                        for col, name in _BREAKDOWN_MS.items()},
                     "train loss": m["train_loss"]})
    return blank_missing(pd.DataFrame(rows))


def _timer(m: dict, name: str, key: str) -> float | None:
    """``key`` (total_seconds | mean_seconds) of the nested timer ``name``; None when it did not run."""
    return next((row[key] for row in m.get("timers", []) if row["timer"] == name), None)


def accumulation_table(records: Sequence[Record]):
    """gpt_accumulation: per micro-batch the nested timers of the run (the uninstrumented training passes,
    validation), tokens/s and MFU of the reported epoch, the instrumented pass's forward / loss / backward
    means per micro-step and optimizer mean per step, what the instrumentation cost (its time per step over
    the plain pass's), and memory."""
    rows = []
    for r in aggregates(records):
        c = r.config
        row: dict[str, Any] = {"micro-batch": c["batch_size"], "accumulation steps": c["accumulation_steps"],
                               "devices": c["devices"], "status": r.status}
        if r.status == "ok":
            m = r.metrics
            row.update({col: _timer(m, name, "total_seconds") for col, name in (
                ("whole run (s)", "run"), ("training (s)", "run/epoch/training"),
                ("validation (s)", "run/epoch/validation"))})
            row.update({f"tokens/s (epoch {m['reported_epoch']})": m["epoch_tokens_per_s"],
                        "MFU": blank(m["mfu"])})
            for phase in ("forward", "loss", "backward", "optimizer"):
                mean = _timer(m, f"run/breakdown/{phase}", "mean_seconds")
                row[f"{phase} mean (ms)"] = None if mean is None else 1e3 * mean
            row.update({
                "instrumented / plain step": blank(m.get("timer_overhead_ratio")),
                "precision": precision_label(r),
                "peak memory (GiB)": None if (peak := m.get("peak_memory_bytes")) is None else peak / 2**30,
                "activations per micro-batch (MiB)": (m["saved_activation_bytes"] / 2**20
                                                      if m.get("saved_activation_bytes") else None),
                "val loss": m["val_loss"], "reason": None})
        else:
            row["reason"] = r.reason
        rows.append(row)
    return with_view(blank_missing(pd.DataFrame(rows)), ACCUMULATION_VIEW)


def tokens_per_s_prediction(scaling: Sequence[Record], accumulation: Sequence[Record]):
    """Exercise 06-d's cases from this run: ``(cases, measured, labels)`` for
    :func:`lab_utils.app.grading.predict.prediction_table` (the notebook's cell calls it, with the lab's model
    :func:`lab_utils.learn.flops.predicted_tokens_per_s`). The inputs: the one-device scaling runs' seconds
    per optimizer step (the reported epoch's uninstrumented wall time / its steps) at the two smallest batch
    sizes; the measurement: each accumulation run's tokens/s per device. Empty lists when the one-device
    runs are missing."""
    one = sorted(one_device_runs(scaling).values(), key=lambda r: r.config["batch_size"])[:2]
    if len(one) < 2:
        return [], [], []
    batches = [r.config["batch_size"] for r in one]
    seconds = [per_step(r, GPT_T_N) for r in one]
    block = round(one[0].metrics["tokens"] / (one[0].metrics["steps"] * batches[0]))
    cases, measured, labels = [], [], []
    for r in aggregates(accumulation):
        c = r.config
        cases.append({"batch_sizes": batches, "step_seconds": seconds, "micro_batch": c["batch_size"],
                      "effective_batch": c["batch_size"] * c["accumulation_steps"], "block_size": block})
        measured.append(r.metrics["epoch_tokens_per_s"] / c["devices"] if r.status == "ok" else None)
        labels.append(f"{c['batch_size']} x {c['accumulation_steps']} on {c['devices']}")
    return cases, measured, labels


@dataclass(frozen=True)
class MfuPrediction:
    """Exercise 06-d's MFU columns: the measured MFU of each accumulation run (the cases' order), the lab's
    model (the lab's tokens/s model through :func:`lab_utils.learn.flops.mfu`) and the student's (their
    tokens/s prediction through their Exercise 06-b), each called with a case's keywords."""

    measured: list[float | None]
    lab: Callable[..., float | None]
    student: Callable[..., float | None]


def mfu_prediction(accumulation: Sequence[Record], predict: Callable | None,
                   student_mfu: Callable | None) -> MfuPrediction | None:
    """The MFU a tokens/s prediction implies (one device: FLOPs per token x tokens/s / its peak), beside each
    accumulation run's measured MFU; None when no run has a peak FLOP/s (a CPU, a GPU the lab's table
    lacks): no MFU, never a guessed one."""
    accs = aggregates(accumulation)  # the order of tokens_per_s_prediction's cases
    ok = [r for r in accs if r.status == "ok" and r.metrics.get("peak_flops_per_s")]
    if not ok:
        return None
    fpt, peak = ok[0].metrics["flops_per_token"], ok[0].metrics["peak_flops_per_s"]

    def lab(**case):
        return mfu(fpt, predicted_tokens_per_s(**case), peak, 1)

    def student(**case):
        tokens = predict(**case) if predict is not None else None
        return None if tokens is None or student_mfu is None else student_mfu(fpt, tokens, peak, 1)

    return MfuPrediction([r.metrics.get("mfu") if r.status == "ok" else None for r in accs], lab, student)


def plot_accumulation(records: Sequence[Record], settings: Settings):
    """Tokens/s and memory against micro-batch (log x), constant effective batch."""
    import matplotlib.pyplot as plt

    records = aggregates(records)
    ok = _ok(records)
    xs = [r.config["batch_size"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(xs, [r.metrics["epoch_tokens_per_s"] for r in ok], "o-")
    ax1.set_ylabel("training tokens/s (reported epoch, uninstrumented)")
    gpu = [r.metrics.get("peak_memory_bytes") for r in ok]
    if ok and all(g is not None for g in gpu):
        ax2.plot(xs, [g / 2**30 for g in gpu], "o-", color="tab:red", label="peak GPU memory")
    ax2.plot(xs, [(r.metrics.get("saved_activation_bytes") or 0) / 2**30 for r in ok], "s--",
             color="tab:purple", label="activations kept for backward (one micro-batch)")
    ax2.set_ylabel("GiB")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"micro-batch (x steps = {settings.effective_batch} sequences per device)")
        ax.grid(True, which="both", alpha=0.3)
        if xs:
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
        for r in records:
            if r.status == "oom":
                ax.axvline(r.config["batch_size"], color="tab:red", ls=":")
    fig.suptitle(f"Gradient accumulation at a constant effective batch ({settings.label})")
    fig.tight_layout()
    return fig


def save_scaling_tables(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save gpt_scaling, gpt_compute_vs_comm and gpt_rank_breakdown (md + csv); return them."""
    recs = aggregates(records)
    ep = settings.scaling_epochs
    scaling = scaling_table(records)
    notes = [f"{settings.label}; epoch {ep} of {ep} reported (epoch 1 warms up); an epoch is one pass "
             "over the training windows shared among the devices (strong scaling of the epoch).",
             "T(N) = the SLOWEST rank's time (each step waits for it).", *_SCALING_TIME_BASIS,
             earlier_report_note(), *precision_notes(recs)]
    threads = sorted({r.metrics["threads_per_rank"] for r in _ok(recs)
                      if r.metrics.get("device_type") == "cpu"})
    if threads:
        notes.append(f"No GPU: each 'device' is a CPU process with {', '.join(map(str, threads))} "
                     "thread(s) (gloo between processes) on a shared machine; the numbers show the mechanics "
                     "of DDP, not GPU scaling.")
    store.save_table(scaling, "gpt_scaling", _ok(recs) or recs,
                     title="GPT: DDP scaling at a fixed per-device batch", notes=notes)
    comm = compute_comm_table(records)
    store.save_table(comm, "gpt_compute_vs_comm", _ok(recs),
                     title="GPT: compute vs communication (measured)",
                     notes=["From the instrumented pass (every phase synchronized; its seconds per "
                            "optimizer step x the reported epoch's steps), slowest rank: compute = forward + "
                            "loss + backward + optimizer minus the exposed wait; communication = the wait at "
                            "the end of backward for all-reduces still running (timing comm hook, "
                            "lab_utils.learn.comm_hooks).",
                            "all-reduce in flight: time any bucket's all-reduce was running during the "
                            "pass's steps (epoch_allreduce_seconds; mostly hidden behind backward); no_sync "
                            "probe: sync step minus no_sync step x steps (exposed_comm_seconds), with the "
                            "standard error of that difference (x steps) as its noise; overlap fraction: the "
                            "probe's, slowest rank.",
                            "noise flag 'noise >= effect: not a result': 2 x the probe noise >= the probe's "
                            "exposed time; then that time and the overlap fraction are not results (repeat "
                            "with more probe steps).",
                            "derived: the assignment's method on T(N) = epoch_seconds, compute = T(1)/N and "
                            "comm = T(N) - T(1)/N; "
                            "it calls every inefficiency communication and goes negative when "
                            "T(N) < T(1)/N."])
    ranks = rank_table(records)
    store.save_table(ranks, "gpt_rank_breakdown", _ok(recs),
                     title="GPT: per-rank breakdown of the reported epoch",
                     notes=["Every rank's record: epoch = its uninstrumented training pass (loader waits "
                            "included), validation; 'mean' is the average over ranks.",
                            "ms/step: the rank's instrumented pass "
                            "(lab_utils.experiments.n06_gpt_ddp.worker, "
                            "breakdown), each phase synchronized; skew wait = the loop's barrier before each "
                            "synchronizing micro-step, waiting for the other ranks (as in notebooks 02 and "
                            "03)."])
    return scaling, comm, ranks


def save_accumulation_table(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save gpt_accumulation (md + csv); return it."""
    records = aggregates(records)
    table = accumulation_table(records)
    s = settings
    notes = [f"{s.label}; effective batch {s.effective_batch} sequences per device = micro-batch x "
             "accumulation steps; gradients are all-reduced once per optimizer step (no_sync on the other "
             "micro-steps).",
             "Slowest rank. whole run, training (every epoch's uninstrumented pass), validation: nested "
             "timers (s); tokens/s and MFU: the reported epoch, uninstrumented (synchronized at its ends).",
             "forward, loss, backward: mean ms per micro-step, optimizer: per optimizer step, from the "
             "instrumented pass (every timer synchronizes the device); instrumented / plain step: its wall "
             "time per optimizer step over the reported epoch's, what those synchronizations cost.",
             "Peak memory: torch.cuda.max_memory_allocated (GPU only); activations: bytes autograd keeps for "
             "backward for one micro-batch (measured with saved-tensor hooks, any device).",
             *precision_notes(list(records))]
    store.save_table(table, "gpt_accumulation", list(records), title="GPT: gradient accumulation trade-off",
                     notes=notes)
    return table


def save_accumulation_figure(store: ResultStore, records: Sequence[Record], settings: Settings):
    """:func:`plot_accumulation`, saved as ``gpt_accumulation.png``."""
    fig = plot_accumulation(records, settings)
    store.save_figure(fig, "gpt_accumulation", aggregates(records))
    return fig
