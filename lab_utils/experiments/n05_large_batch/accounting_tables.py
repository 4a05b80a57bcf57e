"""Notebook 05's tables for Q6 and Q7, from the record of
:data:`lab_utils.experiments.n05_large_batch.experiment.COMM_ACCOUNTING_EXPERIMENT` (the ledger of a few DDP
steps, :mod:`lab_utils.experiments.n05_large_batch.accounting_worker`): what DDP communicates besides the
gradients, in bytes (``comm_accounting``, ``comm_accounting_wire``), and whether at 4 x 512 the gradients
alone would be enough (``comm_gradients_only``). Payload bytes are what each rank hands to a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lab_utils.engine.store import Record, ResultStore
from lab_utils.experiments.n05_large_batch import accounting_worker as ca
from lab_utils.experiments.n05_large_batch.experiment import COMM_EXPERIMENT
from lab_utils.experiments.n05_large_batch.tables import ASKED_LARGE
from lab_utils.experiments.shared.data import CIFAR10_TRAIN_SIZE
from lab_utils.experiments.shared.rows import blank
from lab_utils.learn.models import ResNet18

__all__ = ["GRADIENTS_ONLY_TABLE", "NEEDS", "CommItem", "Need", "accounting_checks", "comm_items",
           "comm_table", "gradients_only_table", "optimizer_state_rows", "save_comm_tables",
           "save_gradients_only_table", "wire_table"]


@dataclass(frozen=True)
class CommItem:
    """One row of the accounting: what, when, how, bytes per occurrence, and what it should equal."""

    what: str
    when: str
    collective: str
    calls_per_occurrence: float | None
    payload_bytes: float | None       # per occurrence, what each rank hands to the collective
    expected_bytes: int | None        # from the model's parameter/buffer sizes
    expected_from: str

    @property
    def matches(self) -> bool | None:
        if self.payload_bytes is None or self.expected_bytes is None:
            return None
        return self.payload_bytes == self.expected_bytes


def comm_items(rec: Record) -> list[CommItem]:
    """The accounting of rank 0 (payloads are the same on every rank), item by item."""
    m, c = rec.metrics, rec.config
    mb, steps, world = m["model_bytes"], c["steps"], m["world_size"]
    ledger = {(row["phase"], row["kind"]): row for row in m["ranks"][0]["ledger"]}
    params, bufs, grads = mb["parameter_bytes"], mb["buffer_bytes"], mb["trainable_parameter_bytes"]
    on = c.get("broadcast_buffers", True)
    # (phase, kind, per step, what, when, collective, expected bytes, expected from)
    spec = [
        ("construction", ca.SHAPE_CHECK, False, "parameter shape check", "once, DDP construction",
         "all-gather of shape metadata (C++; bytes seen on the wire only)", None, ""),
        ("construction", ca.BROADCAST_COALESCED, False, "initial parameter + buffer broadcast",
         "once, DDP construction", "broadcast from rank 0, coalesced into buckets", params + bufs,
         "parameter bytes + buffer bytes"),
        ("step", ca.BROADCAST_COALESCED, True, f"BatchNorm buffers (broadcast_buffers={on})",
         "every training step (forward)", "broadcast from rank 0, coalesced", bufs if on else 0,
         "buffer bytes" if on else "nothing"),
        ("step", ca.GRAD_BUCKET, True, "gradients", "every training step (backward)",
         "all-reduce per bucket (comm hook)", grads, "trainable parameter bytes"),
        ("loss_logging", ca.ALL_REDUCE, True, "global loss for logging", "every step, if logged",
         "all-reduce of one float32", 4, "one float32"),
        ("evaluation", ca.BROADCAST, False, "rank 0's BatchNorm statistics before evaluating",
         "every evaluation", "broadcast per buffer", bufs, "buffer bytes"),
        ("evaluation", ca.ALL_REDUCE, False, "test metric sums (loss, correct, count)", "every evaluation",
         "all-reduce of three float64", 24, "three float64"),
    ]
    if c.get("zero"):
        spec += [
            ("zero_step", ca.GRAD_BUCKET, True, "ZeRO-1: gradients (still all of them)", "every step",
             "all-reduce per bucket (DDP)", grads, "trainable parameter bytes"),
            ("zero_step", ca.BROADCAST, True,
             f"ZeRO-1: updated parameter shards, each owner to the other {world - 1}",
             "every step (after optimizer.step)", "broadcast per parameter from its owner", params,
             "parameter bytes (sum over owners)"),
            ("zero_checkpoint", ca.BROADCAST, False,
             "ZeRO-1: optimizer state gathered on rank 0 (consolidate_state_dict)", "each checkpoint",
             "broadcast of pickled state from each owner", None,
             "pickled momentum of the other ranks' shards (+ header)"),
        ]
    items = []
    for phase, kind, per_step, what, when, collective, expected, source in spec:
        row, n = ledger.get((phase, kind)), steps if per_step else 1
        calls, payload = (None, None) if row is None else (row["calls"] / n, row["bytes"] / n)
        if kind == ca.SHAPE_CHECK:  # C++'s own messages: no payload the Python wrappers can count
            payload = None
        elif (phase, kind) == ("step", ca.BROADCAST_COALESCED) and not on:  # nothing broadcast per step
            calls, payload = 0, 0.0 if payload is None else payload
        items.append(CommItem(what, when, collective, calls, payload, expected, source))
    return items


def _whole(v: Any) -> Any:
    """Whole numbers as int, missing as None (so tables print 705608, not 7.056e+05)."""
    if blank(v) is None:
        return None
    return int(round(v)) if float(v).is_integer() or abs(v) >= 100 else v


def _object_columns(df, columns):
    for c in columns:
        df[c] = pd.Series([_whole(v) for v in df[c]], index=df.index, dtype=object)
    return df


def comm_table(rec: Record):
    """The accounting as a DataFrame: what, when, collective, calls, bytes, expected, equal."""
    rows = [{"what": it.what, "when": it.when, "collective": it.collective, "calls": it.calls_per_occurrence,
             "payload bytes": it.payload_bytes, "expected bytes": it.expected_bytes,
             "expected from": it.expected_from, "equal": {True: "yes", False: "NO", None: ""}[it.matches]}
            for it in comm_items(rec)]
    return _object_columns(pd.DataFrame(rows), ["calls", "payload bytes", "expected bytes"])


def optimizer_state_rows(rec: Record) -> list[dict[str, Any]]:
    """Optimizer state (SGD momentum) each rank holds: plain DDP vs ZeRO-1 (bytes)."""
    return [{"rank": g["rank"], "DDP + SGD: momentum bytes held": g.get("sgd_state_bytes"),
             "ZeRO-1: momentum bytes held": g.get("zero_state_bytes")} for g in rec.metrics["ranks"]]


_PHASE_LABELS = {
    "construction": "DDP construction (shape check + initial broadcast)",
    "step": "one training step (buffers + gradients + logged loss)",
    "evaluation": "one evaluation (buffers + metric sums)",
    "zero_step": "one ZeRO-1 step (buffers + gradients + parameter shards)",
    "zero_checkpoint": "ZeRO-1 checkpoint (consolidate_state_dict)",
}


def wire_table(rec: Record):
    """Cross-check (gloo only): payload counted vs bytes each rank wrote to its sockets, per phase, per
    occurrence, as the worker summed them
    (:func:`lab_utils.experiments.n05_large_batch.accounting_worker.wire_summary`). The
    excess is gloo's per-message headers and the control messages the payload count cannot see (shape
    check, bucket-order sync). None when not measured (NCCL)."""
    ranks = rec.metrics["ranks"]
    if not all(g.get("wire_measured") and g.get("wire") for g in ranks):
        return None
    rows = []
    for phase, label in _PHASE_LABELS.items():
        if phase not in ranks[0]["wire"]:
            continue
        row: dict[str, Any] = {"phase": label,
                               "payload counted (bytes)": ranks[0]["wire"][phase]["payload_bytes"]}
        for g in ranks:
            w = g["wire"][phase]
            if w["expected_written_bytes"] is not None:
                row[f"rank {g['rank']} expected (bytes)"] = w["expected_written_bytes"]
            row[f"rank {g['rank']} wrote (bytes)"] = w["written_bytes"]
        rows.append(row)
    df = pd.DataFrame(rows)
    return _object_columns(df, [c for c in df.columns if c != "phase"])


def accounting_checks(rec: Record) -> dict[str, bool]:
    """Each accounted item with an expected size: does the payload equal it (on every rank)?"""
    out = {}
    for g in rec.metrics["ranks"]:
        for it in comm_items(Record(rec.experiment, rec.config, {**rec.metrics, "ranks": [g]})):
            if it.matches is not None:
                out[f"rank {g['rank']}: {it.what}"] = it.matches
    return out


def save_comm_tables(store: ResultStore, rec: Record):
    """Save ``comm_accounting`` (and ``comm_accounting_wire`` when measured); return the main table."""
    table = comm_table(rec)
    mb = rec.metrics["model_bytes"]
    cfg = rec.config
    notes = [f"Measured on a real DDP run: {cfg['devices']} x {cfg['backend']}, "
             f"ResNet-18 width {cfg['width']} "
             f"({mb['parameters']:,} parameters = {mb['parameter_bytes']:,} bytes fp32; buffers "
             f"{mb['buffer_bytes']:,} bytes), batch {cfg['batch_size']} per rank, {cfg['steps']} steps; "
             "random inputs (bytes do not depend on the data).",
             "payload bytes: numel x element size of what each rank hands to the collective, per "
             "occurrence (per step: total / steps), counted by wrapping torch.distributed's entry points "
             "(_broadcast_coalesced, broadcast, all_reduce) and a gradient comm hook.",
             "Bytes on the wire depend on the algorithm: ring all-reduce sends 2(P-1)/P x payload per rank; "
             "a broadcast sends the payload from the root.",
             "ZeRO-1 = torch.distributed.optim.ZeroRedundancyOptimizer over SGD with momentum."]
    store.save_table(table, COMM_EXPERIMENT, [rec], title="What DDP communicates besides gradients",
                     notes=notes)
    wire = wire_table(rec)
    if wire is not None:
        store.save_table(wire, f"{COMM_EXPERIMENT}_wire", [rec],
                         title="Cross-check: payload counted vs bytes written to the sockets (gloo)",
                         notes=["wrote: change of wchar in /proc/self/io over the phase (mean over "
                                "occurrences); includes gloo's headers and C++ control messages.",
                                "expected (2 ranks): ring all-reduce 2(P-1)/P x payload = payload per rank; "
                                "broadcast: the payload, written by its root only."])
    return table


GRADIENTS_ONLY_TABLE = "comm_gradients_only"


@dataclass(frozen=True)
class Need:
    """One thing the replicas must agree on, how the ledger calls it, and what it costs in a run."""

    what: str
    when: str
    ledger_item: str | None    # prefix of the :func:`comm_items` row that carries it; None: no message
    spec_bytes: str            # "gradients" | "parameters+buffers" | "buffers" | a number of bytes
    per: str                   # "run" | "step" | "epoch" | "evaluation"
    why: str


# What a DDP run at 4 x 512 needs, besides and including the gradients (notebook 05, Q7).
NEEDS: tuple[Need, ...] = (
    Need("gradients", "every step (backward)", "gradients", "gradients", "step",
         "the same averaged gradient on every rank, so every rank makes the same update"),
    Need("initial parameter + buffer broadcast", "once, DDP construction", "initial parameter + buffer",
         "parameters+buffers", "run",
         "replicas start identical; without it the same update moves different weights forever"),
    Need("BatchNorm buffers (rank 0's running mean/var)", "every step (forward)", "BatchNorm buffers",
         "buffers", "step",
         "running statistics are not gradients: each rank's come from its own 512 images; without the "
         "broadcast the 4 replicas evaluate (and save) 4 different models"),
    Need("global loss for logging", "every step, if logged", "global loss", "4", "step",
         "the loss of the whole 2,048-image batch; without it each rank logs its own 512"),
    Need("rank 0's BatchNorm statistics before evaluating", "every evaluation", "rank 0's BatchNorm",
         "buffers", "evaluation", "every rank evaluates the same model"),
    Need("test metric sums (loss, correct, count)", "every evaluation", "test metric sums", "24",
         "evaluation", "accuracy over the whole test set; without it each rank reports its own shard"),
    Need("learning rate (linear scaling, warm-up, decay)", "every step", None, "0", "step",
         "no message: every rank computes the same lr from the step number (lab_utils.learn.schedules)"),
    Need("data order (DistributedSampler + set_epoch)", "every epoch", None, "0", "epoch",
         "no message: every rank draws the same permutation from seed + epoch (Q5) and keeps its shard"),
    Need("optimizer state (SGD momentum)", "every step", None, "0", "step",
         "no message: replicated, identical because every update is (torch's ZeroRedundancyOptimizer "
         "shards it and then broadcasts parameters, Q6)"),
)


def gradients_only_table(rec: Record, epochs: int = 5):
    """Q7 from the communication ledger: what the assignment's 4 x 512 run (:data:`ASKED_LARGE`) of
    ``epochs`` epochs (one evaluation each) hands to collectives, item by item, for the spec ResNet-18.

    Each ledger item's payload was measured in ``rec`` (the accounting run, its own model) and
    compared with the model's sizes; the spec column applies those sizes to the spec ResNet-18
    (width 64). Bytes per item do not depend on the batch; only the number of steps does:
    epochs x ceil(ceil(50,000 / 4) / 512). Payload bytes (what each rank hands to the
    collective; a ring all-reduce sends 2(P-1)/P of it per rank). Returns (DataFrame, verdict).
    """
    devices, per_device_batch = ASKED_LARGE
    steps = epochs * math.ceil(math.ceil(CIFAR10_TRAIN_SIZE / devices) / per_device_batch)
    times = {"run": 1, "step": steps, "epoch": epochs, "evaluation": epochs}
    spec = ca.model_bytes(ResNet18())
    buffers_on = rec.config.get("broadcast_buffers", True)
    sizes = {"gradients": spec.trainable_parameter_bytes, "buffers": spec.buffer_bytes,
             "parameters+buffers": spec.parameter_bytes + spec.buffer_bytes}
    items = comm_items(rec)
    equal = {True: "yes", False: "NO", None: "not measured"}
    measured_col = "payload per time, measured here (bytes)"
    spec_col = "payload per time, spec ResNet-18 (bytes)"
    rows = []
    for need in NEEDS:
        item = next((it for it in items if need.ledger_item and it.what.startswith(need.ledger_item)), None)
        per_time = sizes[need.spec_bytes] if need.spec_bytes in sizes else int(need.spec_bytes)
        if need.ledger_item == "BatchNorm buffers" and not buffers_on:
            per_time = 0
        rows.append({"what": need.what, "when": need.when,
                     f"times in the run ({devices} x {per_device_batch})": times[need.per],
                     measured_col: None if item is None else item.payload_bytes,
                     "measured = model's sizes": "" if item is None else equal[item.matches],
                     spec_col: per_time, "spec payload in the run (bytes)": per_time * times[need.per],
                     "why": need.why})
    df = pd.DataFrame(rows)
    total = float(df["spec payload in the run (bytes)"].sum())
    df["share of the run's bytes %"] = 100 * df["spec payload in the run (bytes)"] / total if total else None
    df = df[[c for c in df.columns if c != "why"] + ["why"]]
    grads = float(df.loc[df["what"] == "gradients", "spec payload in the run (bytes)"].iloc[0])
    other = total - grads
    checked = [r for r in rows if r["measured = model's sizes"] in ("yes", "NO")]
    wrong = [r["what"] for r in checked if r["measured = model's sizes"] == "NO"]
    c = rec.config
    measured = ("The ledger of this run found payloads that differ from the model's sizes: "
                + ", ".join(wrong) if wrong else
                f"The ledger of this run ({c['devices']} x {c['backend']}, ResNet-18 width {c['width']}) "
                f"found every payload equal to the model's sizes ({len(checked)} of {len(checked)} items)")
    verdict = (f"**No: gradients alone are not enough.** At {devices} x {per_device_batch} for {epochs} "
               f"epochs ({steps} steps, spec ResNet-18), the gradient all-reduces carry {grads / 1e9:.3f} GB "
               f"({grads / total:.1%} of the run's payload); the other {other / 1e6:.1f} MB "
               f"({other / total:.2%}) are what keeps the replicas one model: the initial broadcast, rank "
               "0's BatchNorm buffers before every forward, and the loss and metric reductions. Few bytes, "
               "but without them the replicas start apart, evaluate different BatchNorm statistics, and "
               "report their own shard's numbers. The large-batch remedies (linear scaling, warm-up) and the "
               "data order need no message: every rank computes them from the step and the epoch. "
               f"{measured}; the spec column applies those sizes to the spec ResNet-18.")
    return _object_columns(df, [measured_col, spec_col, "spec payload in the run (bytes)"]), verdict


def save_gradients_only_table(store: ResultStore, rec: Record, epochs: int = 5):
    """Save ``comm_gradients_only`` (md + csv), Q7's table; return (table, verdict). The saved table is the
    measurement only: its ``why`` column and the verdict answer Q7 (hand-graded), so they are returned for
    the notebook's discussion and stay out of the file a student's hand-in copies."""
    table, verdict = gradients_only_table(rec, epochs)
    n, b = ASKED_LARGE
    store.save_table(table.drop(columns="why"), GRADIENTS_ONLY_TABLE, [rec],
                     title=f"Q7: at {n} GPUs x {b} per GPU, are the gradients enough?",
                     notes=["payload: bytes each rank hands to the collective (a ring all-reduce sends "
                            "2(P-1)/P x payload per rank, a broadcast sends it from rank 0).",
                            "measured here: the accounting run's own model (the ledger of notebook 05, Q6); "
                            "spec ResNet-18: the same items sized from the spec model (11,173,962 "
                            "parameters, 20 BatchNorm layers), times the occurrences in the assignment's "
                            "run (one evaluation per epoch)."])
    return table, verdict
