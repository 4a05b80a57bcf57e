"""Notebook 06's tables and figure, from the records of :mod:`lab_utils.experiments.gpt`
(``gpt_scaling``, ``gpt_compute_vs_comm``, ``gpt_rank_breakdown``, ``gpt_accumulation``), and the
earlier project's published per-rank numbers (SPEC.md, Part 2). Every function takes the records
(and the :class:`~lab_utils.experiments.gpt.Settings` where a note needs them); metric names and
units are those of :mod:`lab_utils.core.metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lab_utils.core import anchors
from lab_utils.core.anchors import GPT_RANK_SECONDS, GPT_REPORTED_MEAN_SECONDS
from lab_utils.core.comm_hooks import derived_comm, noise_flag
from lab_utils.experiments.gpt import Settings
from lab_utils.store import Record, ResultStore

__all__ = ["accumulation_table", "compute_comm_table", "earlier_report_anomalies",
           "earlier_report_frame", "earlier_report_note", "plot_accumulation", "rank_table",
           "save_accumulation_figure", "save_accumulation_table", "save_scaling_tables", "scaling_table"]


def _ok(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r.status == "ok"]


def _num(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _blanks(df):
    """Missing numbers print as blanks in the Markdown tables, not as 'nan'."""
    return df.astype(object).where(df.notna(), None)


def earlier_report_frame():
    """The earlier project's per-rank table (:data:`lab_utils.core.anchors.GPT_RANK_SECONDS`) with its
    speedups recomputed two ways: T(1)/T(N) with the report's mean over ranks (what it published,
    three of them above N) and with the SLOWEST rank. Every step waits for the slowest rank, so that
    is the epoch's real length. Seconds as published; speedups rounded to 2 decimals, as the report
    gave them."""
    import pandas as pd

    ranks = max(len(t) for t in GPT_RANK_SECONDS.values())
    rows = []
    for (b, n), times in sorted(GPT_RANK_SECONDS.items()):
        t1, mean, slow = GPT_REPORTED_MEAN_SECONDS[(b, 1)], GPT_REPORTED_MEAN_SECONDS[(b, n)], max(times)
        row: dict[str, Any] = {"per-GPU batch": b, "GPUs": n}
        row.update({f"rank {r} (s)": times[r] if r < len(times) else None for r in range(ranks)})
        row.update({"report's mean (s)": mean, "speedup on the mean (as reported)": round(t1 / mean, 2),
                    "slowest rank (s)": slow, "speedup on the slowest rank": round(t1 / slow, 2),
                    "note": "super-linear: speedup > N on the mean" if n > 1 and t1 / mean > n else ""})
        rows.append(row)
    return _blanks(pd.DataFrame(rows))


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


def earlier_report_anomalies():
    """Three things a careful reader of the earlier GPT reports notices, each with the report's own
    numbers (:mod:`lab_utils.core.anchors`), why it cannot be right, and what this notebook does
    instead: super-linear speedups, a 1-GPU "communication" time, and accumulation timers that point
    at an unsynchronized GPU."""
    import pandas as pd

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
         "why it cannot be right": "the forward's work grows with the micro-batch; a CUDA launch returns "
                                   "before the kernels run, so a timer read without synchronizing measures "
                                   "the launch, and the next operation that waits (the loss) absorbs the "
                                   "forward's time",
         "this notebook": "every phase timer synchronizes the device at both ends "
                          "(lab_utils.core.timing.timed)"},
    ]
    return pd.DataFrame(rows)


def scaling_table(records: Sequence[Record]):
    """gpt_scaling: time (slowest rank), speedup T(1)/T(N), efficiency, and what averaging would say.

    Runs on different device counts need not do the same work: ``drop_last`` batches per rank
    make, e.g., 13 steps on one device (53,248 tokens) but 2 x 6 on two (49,152). So beside the
    epoch-time speedup the table gives the tokens each run trained and the speedup on
    training tokens/s (work-equalized), and flags unequal work.
    """
    import pandas as pd

    base: dict[int, Record] = {r.config["batch_size"]: r for r in _ok(records) if r.config["devices"] == 1}
    rows = []
    for r in records:
        bs, n = r.config["batch_size"], r.config["devices"]
        row: dict[str, Any] = {"per-device batch": bs, "devices": n, "status": r.status}
        if r.status == "ok":
            m = r.metrics
            t = m["epoch_seconds"]
            one = base.get(bs)
            t1 = one.metrics["epoch_seconds"] if one else None
            speed = t1 / t if t1 else None
            mean_speed = t1 / m["epoch_seconds_mean"] if t1 else None
            tokens, tokens1 = m.get("tokens"), (one.metrics.get("tokens") if one else None)
            tps1 = one.metrics.get("tokens_per_s") if one else None
            tps_speed = m["tokens_per_s"] / tps1 if tps1 and m.get("tokens_per_s") else None
            row.update({
                "backend": m["backend"] or "one process", "epoch (s), slowest rank": t,
                "speedup T1/TN": speed, "efficiency": speed / n if speed else None,
                "speedup if averaged over ranks": mean_speed, "slowest rank": m["slowest_rank"],
                "imbalance max/min": m["imbalance"], "tokens/s": m["tokens_per_s"], "MFU": _num(m["mfu"]),
                "precision": precision_label(r),
                "val loss": m["val_loss"], "reason": None,
                "tokens trained (epoch)": tokens,
                "work vs 1 device": tokens / tokens1 if tokens and tokens1 else None,
                "speedup on tokens/s (equal work)": tps_speed,
                "efficiency on tokens/s": tps_speed / n if tps_speed else None,
                "work note": _unequal_work_note(tokens, tokens1, n)})
        else:
            row["reason"] = r.reason
        rows.append(row)
    return _blanks(pd.DataFrame(rows))


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
    "Time basis of each column (names as in lab_utils.core.metrics). 'epoch (s), slowest rank': "
    "epoch_seconds, the slowest rank's training pass over the reported epoch, loader waits included, "
    "validation EXCLUDED (wall seconds; until issue 26 it included validation). 'speedup T1/TN' and "
    "'efficiency': ratios of those epoch times (they compare different work when the token counts differ). "
    "'speedup if averaged over ranks': T1 over the MEAN over ranks of that epoch time. 'tokens/s': "
    "tokens_per_s, all ranks' training tokens / the slowest rank's train_seconds (data movement + compute "
    "+ communication: loader waits and validation EXCLUDED; until issue 26 loader waits were included). "
    "'speedup on tokens/s (equal work)': tokens/s(N) / tokens/s(1), the same basis, independent of how "
    "many tokens each run did.",
    "tokens trained (epoch): all ranks' tokens in the reported epoch; work vs 1 device: that / the "
    "one-device run's (drop_last batches per rank: e.g. 13 steps x 4,096 = 53,248 tokens on 1 device, "
    "2 x 6 x 4,096 = 49,152 on 2).",
]


def compute_comm_table(records: Sequence[Record]):
    """gpt_compute_vs_comm: measured compute and communication (hook and probe), and the derived method."""
    import pandas as pd


    base = {r.config["batch_size"]: r for r in _ok(records) if r.config["devices"] == 1}
    rows = []
    for r in _ok(records):
        n = r.config["devices"]
        if n == 1:
            continue
        m = r.metrics
        one = base.get(r.config["batch_size"])
        d_comp, d_comm = (derived_comm(one.metrics["epoch_seconds"], m["epoch_seconds"], n) if one
                          else (None, None))
        comp, comm = m["compute_seconds"], m["communication_seconds"]
        rows.append({
            "per-device batch": r.config["batch_size"], "devices": n,
            "compute (s)": comp, "communication (s), exposed wait": comm,
            "comm / compute": comm / comp if comp else None,
            "all-reduce in flight (s)": m["allreduce_seconds"],
            "exposed by no_sync probe (s)": m["exposed_comm_seconds"],
            "probe noise ± (s)": _num(m.get("exposed_comm_noise_seconds")),
            "noise flag": noise_flag(m["exposed_comm_seconds"], _num(m.get("exposed_comm_noise_seconds"))),
            "overlap fraction": _num(m.get("overlap_fraction")), "buckets": m.get("buckets"),
            "derived compute T1/N (s)": d_comp, "derived comm TN - T1/N (s)": d_comm,
        })
    return _blanks(pd.DataFrame(rows))


def rank_table(records: Sequence[Record]):
    """gpt_rank_breakdown: every rank's phases in the reported epoch, the slowest marked."""
    import pandas as pd

    rows = []
    for r in _ok(records):
        m = r.metrics
        if r.config["devices"] == 1:
            continue
        for rk in m["ranks"]:
            rows.append({
                "per-device batch": r.config["batch_size"], "devices": r.config["devices"],
                "rank": rk["rank"],
                "slowest": "yes" if rk["rank"] == m["slowest_rank"] else "",
                "epoch (s)": rk["epoch_seconds"], "training (s)": rk["train_seconds"],
                "data loading (s)": rk["data_loading_seconds"],
                "data movement (s)": rk["data_movement_seconds"],
                "compute (s)": rk["compute_seconds"], "communication (s)": rk["communication_seconds"],
                "validation (s)": rk["validation_seconds"], "train loss": rk["train_loss_rank"],
                "tokens/s": rk["tokens_per_s"]})
        rows.append({"per-device batch": r.config["batch_size"], "devices": r.config["devices"],
                     "rank": "mean", "slowest": "", "epoch (s)": m["epoch_seconds_mean"],
                     "training (s)": m["train_seconds_mean"],
                     "data loading (s)": m["data_loading_seconds_mean"],
                     "data movement (s)": m["data_movement_seconds_mean"],
                     "compute (s)": m["compute_seconds_mean"],
                     "communication (s)": m["communication_seconds_mean"],
                     "validation (s)": m["validation_seconds_mean"], "train loss": m["train_loss"],
                     "tokens/s": None})
    return _blanks(pd.DataFrame(rows))


def _timer(m: dict, name: str) -> dict:
    for row in m.get("timers", []):
        if row["timer"] == name:
            return row
    return {"count": 0, "total_seconds": None, "mean_seconds": None}


def accumulation_table(records: Sequence[Record]):
    """gpt_accumulation: nested timers, tokens/s and memory per micro-batch."""
    import pandas as pd

    rows = []
    for r in records:
        c = r.config
        row: dict[str, Any] = {"micro-batch": c["batch_size"], "accumulation steps": c["accumulation_steps"],
                               "devices": c["devices"], "status": r.status}
        if r.status == "ok":
            m = r.metrics
            tr = "run/epoch/training"
            row.update({
                "whole run (s)": _timer(m, "run")["total_seconds"],
                "epochs (s)": _timer(m, "run/epoch")["total_seconds"],
                "training (s)": _timer(m, tr)["total_seconds"],
                "validation (s)": _timer(m, "run/epoch/validation")["total_seconds"],
                "forward total (s)": _timer(m, f"{tr}/forward")["total_seconds"],
                "forward mean (ms)": _ms(_timer(m, f"{tr}/forward")["mean_seconds"]),
                "loss total (s)": _timer(m, f"{tr}/loss")["total_seconds"],
                "loss mean (ms)": _ms(_timer(m, f"{tr}/loss")["mean_seconds"]),
                "backward total (s)": _timer(m, f"{tr}/backward")["total_seconds"],
                "backward mean (ms)": _ms(_timer(m, f"{tr}/backward")["mean_seconds"]),
                f"tokens/s (epoch {m['reported_epoch']})": m["tokens_per_s"],
                "precision": precision_label(r),
                "peak memory (GiB)": _gib(m.get("peak_memory_bytes")),
                "activations per micro-batch (MiB)": (m["saved_activation_bytes"] / 2**20
                                                      if m.get("saved_activation_bytes") else None),
                "val loss": m["val_loss"], "reason": None})
        else:
            row["reason"] = r.reason
        rows.append(row)
    return _blanks(pd.DataFrame(rows))


def _ms(s: float | None) -> float | None:
    return None if s is None else 1e3 * s


def _gib(b: int | None) -> float | None:
    return None if b is None else b / 2**30


def plot_accumulation(records: Sequence[Record], settings: Settings):
    """Tokens/s and memory against micro-batch (log x), constant effective batch."""
    import matplotlib.pyplot as plt

    ok = _ok(records)
    xs = [r.config["batch_size"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(xs, [r.metrics["tokens_per_s"] for r in ok], "o-")
    ax1.set_ylabel("training tokens/s (reported epoch)")
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
    recs = list(records)
    ep = settings.scaling_epochs
    scaling = scaling_table(records)
    cpu = any(r.metrics.get("device_type") == "cpu" for r in _ok(records))
    notes = [f"{settings.label}; epoch {ep} of {ep} reported (epoch 1 warms up); an epoch is one pass "
             "over the training windows shared among the devices (strong scaling of the epoch).",
             "Epoch time = the SLOWEST rank's training pass (validation excluded); 'if averaged' divides by "
             "the mean over ranks instead, which flatters the speedup.",
             "speedup = T(1)/T(N); efficiency = speedup / N.", *_SCALING_TIME_BASIS, earlier_report_note(),
             *precision_notes(recs)]
    if cpu:
        threads = {r.metrics.get("threads_per_process") for r in _ok(records)}
        notes.append(f"No GPU: each 'device' is a CPU process with {', '.join(map(str, sorted(threads)))} "
                     "thread(s) (gloo between processes) on a shared machine; the numbers show the mechanics "
                     "of DDP, not GPU scaling.")
    store.save_table(scaling, "gpt_scaling", recs, title="GPT: DDP scaling at a fixed per-device batch",
                     notes=notes)
    comm = compute_comm_table(records)
    store.save_table(comm, "gpt_compute_vs_comm", _ok(records),
                     title="GPT: compute vs communication (measured)",
                     notes=["compute = forward + loss + backward + optimizer minus the exposed wait; "
                            "communication = the wait at the end of backward for all-reduces still running "
                            "(timing comm hook, lab_utils.core.comm_hooks), summed over the epoch, "
                            "slowest rank.",
                            "all-reduce in flight: time any bucket's all-reduce was running (mostly hidden "
                            "behind backward); no_sync probe: sync step minus no_sync step x steps, with "
                            "the standard error of that difference (x steps) as its noise.",
                            "noise flag 'noise >= effect: not a result': 2 x the probe noise >= the probe's "
                            "exposed time; then that time and the overlap fraction are not results (repeat "
                            "with more probe steps).",
                            "derived: the assignment's method, compute = T(1)/N and comm = T(N) - T(1)/N; "
                            "it calls every inefficiency communication and goes negative when "
                            "T(N) < T(1)/N."])
    ranks = rank_table(records)
    store.save_table(ranks, "gpt_rank_breakdown", _ok(records),
                     title="GPT: per-rank breakdown of the reported epoch",
                     notes=["Every rank's phases (seconds); 'mean' is the average over ranks, which hides "
                            "the slowest rank that everyone waits for."])
    return scaling, comm, ranks


def save_accumulation_table(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save gpt_accumulation (md + csv); return it."""
    table = accumulation_table(records)
    s = settings
    notes = [f"{s.label}; effective batch {s.effective_batch} sequences per device = micro-batch x "
             "accumulation steps; gradients are all-reduced once per optimizer step (no_sync on the other "
             "micro-steps).",
             "Nested timers of rank 0 over the whole run (both epochs): run > epoch > training (forward, "
             "loss, backward per micro-step) and validation; means are per micro-step.",
             "Peak memory: torch.cuda.max_memory_allocated (GPU only); activations: bytes autograd keeps for "
             "backward for one micro-batch (measured with saved-tensor hooks, any device).",
             *precision_notes(list(records))]
    store.save_table(table, "gpt_accumulation", list(records), title="GPT: gradient accumulation trade-off",
                     notes=notes)
    return table


def save_accumulation_figure(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Plot tokens/s and memory against micro-batch, save it as ``gpt_accumulation.png``; return it."""
    fig = plot_accumulation(records, settings)
    store.save_figure(fig, "gpt_accumulation", list(records))
    return fig
