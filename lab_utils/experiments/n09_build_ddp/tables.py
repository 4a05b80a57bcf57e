"""Notebook 09's tables and figures, from the records :func:`lab_utils.engine.plan.measure` returned.

Tables select and rename what the worker measured (:mod:`lab_utils.experiments.n09_build_ddp.worker`); the one
number they add, the alpha-beta prediction, spans records (the fit comes from notebook 04's
benchmark in the store, else from this run's own all-reduce timing) and is computed in one place,
:func:`predictions`, with :func:`lab_utils.learn.traffic.predicted_seconds`; Exercise 09-d's inputs per
bucket size come from :func:`overlap_cases`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd

from lab_utils.engine.records import aggregates
from lab_utils.engine.store import Record, ResultStore
from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n09_build_ddp.worker import IMPLEMENTATIONS
from lab_utils.learn.alpha_beta import fit_alpha_beta
from lab_utils.learn.errors import LabError
from lab_utils.learn.ring import MIB
from lab_utils.learn.traffic import optimal_bucket_bytes, predicted_seconds

#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
COMPARE_VIEW = ("devices", "per_device_batch", "implementation", "step_ms", "comm_exposed_ms",
                "collectives", "bytes_per_rank_per_step", "predicted_exposed_ms")

__all__ = ["best_bucket_args", "check_table", "check_verdict", "compare_table", "compression_table", "fits",
           "memory_table", "merge_traces", "notes", "overlap_cases", "sweep_figure", "sweep_table",
           "trace_figure"]

NO_FIT = "no fit: run notebook 04 first"
_COMM = tuple(f"{backend}:{op}" for backend in ("gloo", "nccl")
              for op in ("all_reduce", "reduce_scatter", "all_gather"))


def _ok(records: Sequence[Record], kind: str) -> list[Record]:
    return [r for r in aggregates(records) if r.status == "ok" and r.config.get("kind") == kind]


def _not_measured(records: Sequence[Record], kind: str) -> list[dict[str, Any]]:
    """A row per run of ``kind`` that was not measured, saying why ("needs 4 GPUs", an error)."""
    return [{"devices": r.config["devices"], "per_device_batch": r.config["batch_size"],
             "implementation": f"not measured: {r.reason or r.status}"}
            for r in aggregates(records) if r.status != "ok" and r.config.get("kind") == kind]


#: What each table of notebook 09 measured (:func:`notes`).
_TABLE_NOTES = {
    "compare": [
        "step_ms: from a barrier to the end of the optimizer step (forward, loss, backward, gradient "
        "sync, step; the batch already on the device), the slowest rank's, median over the timed steps; "
        "p10 and p90 beside it. The implementations run interleaved, one step each per round.",
        "comm_exposed_ms: per round, the step minus the no-communication step of the same round (each "
        "rank steps on its own gradient); median and p10-p90 over the rounds (negative: noise).",
        "bytes_per_rank_per_step: what one rank sends in ring collectives, 2(P-1)/P x S per all-reduce, "
        "half that per reduce-scatter or all-gather; collectives: messages per step.",
        "predicted_*_ms: the alpha-beta ring model, every collective one after the other; exposed: all of"
        " it, but for (e), (c) and DDP the queue behind backward (a collective starts once backward, "
        "taking backward_seconds of the no-communication replica, has produced its bytes at a steady "
        "rate, and once the one before it is done).",
        "Not like for like: DDP broadcasts the BatchNorm buffers from rank 0 at the start of every "
        "forward (inside its timed step), (a)-(e) do not (each rank keeps its own running statistics); "
        "all start from rank 0's weights. (d)'s comm_exposed_ms also subtracts the update it no longer "
        "does (it steps 1/N of the parameters, the no-communication step all of them).",
        "(c) and DDP bucket by the same rule (torch's compute_bucket_assignment_by_size: last layer "
        "first, a bucket closes once it reaches its cap); at the same explicit cap, the same buckets."],
    "memory": [
        "held_bytes: tensor bytes an implementation keeps between steps on one rank (model, gradients, "
        "optimizer state, its buffers); peak_bytes: the most at once during one step; both counted from "
        "before it was built, after two warm-up steps, the largest over ranks. GPU: "
        "torch.cuda.memory_allocated and max_memory_allocated; CPU: every tensor an op creates, counted "
        "until it is freed (replica_memory.memory_use). A collective's own buffers are not tensors of these "
        "ops and are not counted."],
    "overlap": [
        "measured_seconds: (c)'s comm_exposed_seconds in the bucket sweep; lab_model_seconds: "
        "traffic.overlap_exposed_seconds, equal buckets produced at a steady rate over backward_seconds "
        "(the no-communication replica's backward, measured), all-reduces one at a time by the alpha-beta"
        " fit; your_prediction_seconds: your exposed_seconds on the same inputs. The real buckets follow "
        "parameter boundaries (bucket_sizes_mb in the sweep)."],
}

def notes(records: Sequence[Record], table: str = "compare") -> list[str]:
    """What a table of notebook 09 measured (``table``: ``compare`` for the step tables, ``memory``,
    ``overlap``), and on what (CPU runs and oversubscription said)."""
    out = list(_TABLE_NOTES[table])
    cpu = [r for r in aggregates(records)
           if r.status == "ok" and (r.hardware or {}).get("device_type") == "cpu"]
    if cpu:
        cores = max((r.hardware or {}).get("cpu_cores") or 0 for r in cpu)
        out.append(f"CPU: gloo between single-thread processes on {cores or 'these'} cores; more ranks than "
                   "cores take turns (oversubscribed), so their times measure time-sharing too.")
    return out


def fits(store: ResultStore, records: Sequence[Record]) -> dict[int, tuple[Any, str]]:
    """Per rank count: ``(fit, where it comes from)``. Notebook 04's benchmark (experiment
    ``allreduce_bench``, this machine's records, the same backend) when it holds 3 or more sizes that
    can be fitted, else this run's own all-reduce timing (its ``bench`` record), else ``(None, why)``:
    no bench record (NO_FIT), or timings that do not fit (``no fit: ...``)."""
    out: dict[int, tuple[Any, str]] = {}
    bench04 = [r for r in store.latest_here("allreduce_bench").records if r.status == "ok"]
    for rec in _ok(records, "bench"):
        n, backend = rec.config["devices"], rec.config["backend"]
        points = sorted((r.config["size_bytes"], r.metrics["time_us"] * 1e-6) for r in bench04
                        if r.config.get("world_size") == n and r.config.get("backend") == backend)
        if len(points) >= 3:
            try:
                out[n] = (fit_alpha_beta([s for s, _ in points], [t for _, t in points], n),
                          f"notebook 04's benchmark ({len(points)} sizes)")
                continue
            except LabError:  # its timings cannot be fitted: this run's own, below
                pass
        own = rec.metrics["fit"]
        if "problem" in own:
            out[n] = (None, f"no fit: {own['problem']}")
        else:  # the two numbers of the stored fit that the prediction needs
            out[n] = (SimpleNamespace(**{k: own[k] for k in ("alpha_seconds", "bandwidth_bytes_per_s")}),
                      f"this run's all-reduce timing ({len(rec.config['sizes_bytes'])} sizes)")
    return out


def predictions(row: dict[str, Any], devices: int, found: dict[int, tuple[Any, str]],
                backward_seconds: float | None = None) -> dict[str, Any]:
    """THE prediction of one implementation's row: alpha-beta communication and exposed ms per step
    (exposed behind a backward of ``backward_seconds`` where the row overlaps)."""
    fit, source = found.get(devices, (None, NO_FIT))
    if fit is None:
        return {"predicted_comm_ms": None, "predicted_exposed_ms": None, "fit": source}
    comm, exposed = predicted_seconds(row["messages"], devices, fit.alpha_seconds, fit.bandwidth_bytes_per_s,
                                      row["overlaps"], backward_seconds)
    return {"predicted_comm_ms": 1e3 * comm, "predicted_exposed_ms": 1e3 * exposed, "fit": source}


def _timing(row: dict[str, Any]) -> dict[str, Any]:
    ms = {f"{k.replace('_seconds', '_ms')}": 1e3 * row[k] for k in
          ("step_seconds", "step_seconds_p10", "step_seconds_p90", "comm_exposed_seconds",
           "comm_exposed_seconds_p10", "comm_exposed_seconds_p90") if k in row}
    return {**ms, "collectives": len(row["messages"]),
            "bytes_per_rank_per_step": row["bytes_per_rank_per_step"]}


def compare_table(store: ResultStore, records: Sequence[Record]) -> pd.DataFrame:
    """The comparison: per (ranks, per-device batch) and implementation, the step (median, p10, p90 of
    the slowest rank), its exposed communication, the bytes sent and the alpha-beta prediction."""
    found = fits(store, records)
    rows = []
    sweep = _sweep_record(records)
    for rec in _ok(records, "compare"):
        if rec is sweep:
            continue  # the bucket sweep: its own table
        n = rec.config["devices"]
        for row in rec.metrics["implementations"]:
            rows.append({"devices": n, "per_device_batch": rec.config["batch_size"],
                         "implementation": IMPLEMENTATIONS[row["implementation"]], **_timing(row),
                         **predictions(row, n, found, rec.metrics.get("backward_seconds"))})
    return with_view(pd.DataFrame(rows + _not_measured(records, "compare")), COMPARE_VIEW)


def _sweep_record(records: Sequence[Record]) -> Record | None:
    """The bucket sweep's record (the comparison that ends with DDP's bf16 hook)."""
    return next((r for r in _ok(records, "compare") if r.config["implementations"][-1][0] == "ddp_bf16"),
                None)


def _bucket_list_mb(messages: Sequence[Sequence[Any]]) -> str:
    return " + ".join(f"{size / 1e6:.4g}" for _, size in messages)


def sweep_table(store: ResultStore, records: Sequence[Record]) -> pd.DataFrame:
    """(c) at each bucket size (and one bucket), then DDP at the comparison's cap, each with its buckets
    (MB, in the order sent) and the prediction: more buckets pay more alpha, bigger ones leave more of the
    all-reduce after backward. (c) and DDP at the same cap: the same buckets."""
    rec = _sweep_record(records)
    if rec is None:
        return pd.DataFrame()
    found, n, backward = fits(store, records), rec.config["devices"], rec.metrics.get("backward_seconds")
    return pd.DataFrame([{"implementation": IMPLEMENTATIONS[row["implementation"]],
                          "bucket_mb": "one bucket" if row["bucket_mb"] is None else row["bucket_mb"],
                          "buckets": len(row["messages"]),
                          "bucket_sizes_mb": _bucket_list_mb(row["messages"]),
                          **{k: v for k, v in _timing(row).items() if k != "collectives"},   # = buckets
                          **predictions(row, n, found, backward)}
                         for row in rec.metrics["implementations"]
                         if row["implementation"] in ("bucketed", "ddp")])


def overlap_cases(store: ResultStore,
                  records: Sequence[Record]) -> tuple[list[dict[str, Any]], list[float], list[str]]:
    """Exercise 09-d's cases from the sweep: per (c) row, the inputs of
    :func:`lab_utils.learn.traffic.overlap_exposed_seconds` (its bucket cap, or the whole gradient for one
    bucket; the gradient bytes; the ranks; the fit's alpha and bandwidth; the measured backward), its
    measured ``comm_exposed_seconds`` and a label. Empty without a sweep, a fit or a backward time."""
    rec = _sweep_record(records)
    if rec is None:
        return [], [], []
    fit, _ = fits(store, records).get(rec.config["devices"], (None, NO_FIT))
    backward = rec.metrics.get("backward_seconds")
    if fit is None or backward is None:
        return [], [], []
    grad = rec.metrics["gradient_bytes"]
    cases, measured, labels = [], [], []
    for row in rec.metrics["implementations"]:
        if row["implementation"] == "bucketed":
            cap = grad if row["bucket_mb"] is None else row["bucket_mb"] * MIB
            cases.append({"bucket_bytes": cap, "gradient_bytes": grad, "world_size": rec.config["devices"],
                          "alpha_seconds": fit.alpha_seconds,
                          "bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s, "backward_seconds": backward})
            measured.append(row["comm_exposed_seconds"])
            labels.append("(c), one bucket" if row["bucket_mb"] is None
                          else f"(c) at {row['bucket_mb']:g} MB")
    return cases, measured, labels


def best_bucket_args(exposed: Any, cases: Sequence[dict[str, Any]],
                     measured: Sequence[float]) -> tuple[Any, list[dict[str, Any]], list[float], Any]:
    """The arguments of a ``prediction_table`` of the best bucket size (MB of 2^20 bytes): the size with
    the least exposed communication by ``exposed`` (a student's model of one bucket size: the best of
    ``k`` equal buckets, k = 1 ... 4096; None while it returns None), the inputs (one case: those of
    :func:`overlap_cases` but the bucket size), the sweep's best (measured) and the lab's model
    (:func:`lab_utils.learn.traffic.optimal_bucket_bytes`). Empty lists without cases."""
    def yours(**c: Any) -> float | None:
        tried = [(exposed(bucket_bytes=c["gradient_bytes"] / k, **c), k) for k in range(1, 4097)]
        return None if any(t is None for t, _ in tried) else c["gradient_bytes"] / min(tried)[1] / MIB

    def lab_model(**c: Any) -> float:
        return optimal_bucket_bytes(**c) / MIB

    if not cases:
        return yours, [], [], lab_model
    best = min(range(len(cases)), key=lambda i: measured[i])
    case = {k: v for k, v in cases[0].items() if k != "bucket_bytes"}
    return yours, [case], [cases[best]["bucket_bytes"] / MIB], lab_model


def memory_table(records: Sequence[Record]) -> pd.DataFrame:
    """Per rank count and implementation (with SGD, and ZeRO-1 and DDP with Adam too): the bytes it holds
    between steps, its peak during a step and its optimizer state, one rank's (the largest over ranks)."""
    rows = []
    for rec in _ok(records, "memory"):
        for row in rec.metrics["implementations"]:
            rows.append({"devices": rec.config["devices"], "per_device_batch": rec.config["batch_size"],
                         "implementation": IMPLEMENTATIONS[row["implementation"]],
                         "optimizer": row["optimizer"],
                         "held_bytes": row["held_bytes"], "peak_bytes": row["peak_bytes"],
                         "optimizer_state_bytes_per_rank": row["optimizer_state_bytes"]})
    return pd.DataFrame(rows + _not_measured(records, "memory"))


def sweep_figure(table: pd.DataFrame):
    """Measured step and exposed communication per bucket count, with the predicted curves."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    t = table[table["implementation"] == IMPLEMENTATIONS["bucketed"]].sort_values("buckets")
    x = t["buckets"]
    ax.errorbar(x, t["comm_exposed_ms"], yerr=[t["comm_exposed_ms"] - t["comm_exposed_ms_p10"],
                                               t["comm_exposed_ms_p90"] - t["comm_exposed_ms"]],
                fmt="o-", capsize=3, label="measured exposed communication (median, p10-p90)")
    if t["predicted_comm_ms"].notna().all():
        ax.plot(x, t["predicted_comm_ms"], "s--", label="predicted all-reduce time (alpha-beta)")
        ax.plot(x, t["predicted_exposed_ms"], "^:", label="predicted exposed (last bucket only)")
    ax.set_xscale("log")
    ax.set_xlabel("buckets per step (bucket size falls to the right)")
    ax.set_ylabel("ms per step")
    ax.set_title("(c) bucketed: bucket size vs communication")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def check_table(records: Sequence[Record]) -> pd.DataFrame:
    """Each implementation after K steps against one process on the global batch, and the optimizer
    state each rank holds (ZeRO-1's shard next to DDP's whole)."""
    rows = []
    for rec in _ok(records, "check"):
        for row in rec.metrics["implementations"]:
            tolerance = (f"{row['dtype']} gradients: lossy, not expected equal" if row["equal"] is None
                         else f"{row['dtype']}: rtol {row['rtol']:g}, atol {row['atol']:g}")
            rows.append({"devices": rec.config["devices"],
                         "implementation": IMPLEMENTATIONS[row["implementation"]],
                         "steps": rec.metrics["check_steps"], "max_abs_diff": row["max_abs_diff"],
                         "tolerance": tolerance, "equal": row["equal"],
                         "last_step_loss": row["last_step_loss"],
                         "optimizer_state_bytes_per_rank": max(row["sgd_state_bytes"])})
    return pd.DataFrame(rows + _not_measured(records, "check"))


def check_verdict(table: pd.DataFrame) -> str:
    """One sentence: every implementation that must equal one process does; else AssertionError naming
    the ones that do not (the notebook stops there: a wrong implementation makes every time meaningless)."""
    judged = table[table["equal"].notna()] if "equal" in table else table.iloc[0:0]
    if judged.empty:
        raise AssertionError("No correctness check was measured here (see the table's rows for why).")
    wrong = judged[judged["equal"] != True]  # noqa: E712 -- a column of True/False/None
    if len(wrong):
        raise AssertionError("Not equal to one process: " + "; ".join(
            f"{r.implementation} on {r.devices} ranks (max |diff| {r.max_abs_diff:.3g})"
            for r in wrong.itertuples()))
    ranks = sorted(judged["devices"].unique())
    return (f"passed: (a)-(e) and torch's DDP equal one process trained on the global batch after "
            f"{int(judged['steps'].iloc[0])} steps, on {', '.join(map(str, ranks))} ranks.")


def compression_table(records: Sequence[Record]) -> pd.DataFrame:
    """DDP with fp32 buckets and with the bf16 compression hook: the step (sweep record), the loss and
    the distance from one process after K steps (the check)."""
    rec = _sweep_record(records)
    check = {(r.config["devices"], row["implementation"]): row for r in _ok(records, "check")
             for row in r.metrics["implementations"]}
    rows = []
    for row in (rec.metrics["implementations"] if rec else []):
        if row["implementation"] in ("ddp", "ddp_bf16"):
            after = check.get((rec.config["devices"], row["implementation"]), {})
            rows.append({"implementation": IMPLEMENTATIONS[row["implementation"]], **_timing(row),
                         "loss_after_k_steps": after.get("last_step_loss"),
                         "max_abs_diff_after_k_steps": after.get("max_abs_diff")})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- traces


def merge_traces(records: Sequence[Record], out: Path) -> Path | None:
    """The per-rank Chrome traces of the ``trace`` record merged into one file, one process row per
    rank (``pid`` = rank): the ranks share this machine's clock, so their rows line up. None when
    there is no trace."""
    rec = next(iter(_ok(records, "trace")), None)
    if rec is None or not all(Path(p).exists() for p in rec.metrics["trace_paths"]):
        return None
    events: list[dict[str, Any]] = []
    for rank, path in enumerate(rec.metrics["trace_paths"]):
        trace = json.loads(Path(path).read_text())
        for e in trace["traceEvents"]:
            if e.get("ph") == "M" and e.get("name", "").startswith("process_"):
                continue  # the rank's own process row replaces them
            events.append({**e, "pid": rank})
        events += [{"ph": "M", "name": name, "pid": rank, "tid": 0, "args": args} for name, args in
                   (("process_name", {"name": f"rank {rank}"}), ("process_sort_index", {"sort_index": rank}))]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                               "otherData": {"ranks": len(rec.metrics["trace_paths"]),
                                             "steps_traced": rec.metrics["steps_traced"]}}))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _lanes(events: list[dict[str, Any]], start: float, end: float) -> tuple[list, list]:
    """(compute, communication) intervals of one rank inside [start, end]: GPU kernels where the trace
    has them (NCCL's kernels are the communication), else the CPU's autograd functions and the
    backend's collectives (gloo's run in its own threads)."""
    inside = [e for e in events
              if e.get("ph") == "X" and start <= e["ts"] and e["ts"] + e.get("dur", 0) <= end]
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    if kernels:
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    else:
        comm = [e for e in inside if e["name"].startswith(_COMM)]
        compute = [e for e in inside if e["name"].startswith("autograd::engine::evaluate_function")]
    return (_union([(e["ts"], e["ts"] + e["dur"]) for e in compute]),
            _union([(e["ts"], e["ts"] + e["dur"]) for e in comm]))


def trace_figure(path: Path):
    """Per implementation (its last traced step) and rank: backward compute against all-reduce in
    flight, on the ranks' common clock (ms from the first rank's start of that step)."""
    import matplotlib.pyplot as plt

    events = json.loads(Path(path).read_text())["traceEvents"]
    ranks = sorted({e["pid"] for e in events if isinstance(e.get("pid"), int)})
    names = [IMPLEMENTATIONS[k] for k in ("flat", "bucketed", "ddp")]
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.1 + 0.9 * len(ranks) * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        steps = {r: max((e for e in events if e.get("pid") == r and e.get("name") == name
                         and e.get("ph") == "X"), key=lambda e: e["ts"], default=None) for r in ranks}
        if any(s is None for s in steps.values()):
            ax.set_title(f"{name}: not in the trace")
            continue
        t0 = min(s["ts"] for s in steps.values())
        for i, r in enumerate(ranks):
            s = steps[r]
            compute, comm = _lanes([e for e in events if e.get("pid") == r], s["ts"], s["ts"] + s["dur"])
            y = 2 * (len(ranks) - 1 - i)
            for lane, spans, colour in ((1, compute, "tab:blue"), (0, comm, "tab:orange")):
                bars = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in spans]
                ax.broken_barh(bars, (y + lane, 0.8), color=colour)
        ax.set_yticks([2 * (len(ranks) - 1 - i) + k + 0.4 for i in range(len(ranks)) for k in (1, 0)])
        ax.set_yticklabels([f"rank {r} {lane}" for r in ranks for lane in ("backward", "all-reduce")],
                           fontsize=7)
        ax.set_title(f"{name}: one step", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's start on the first rank")
    fig.tight_layout()
    return fig
