"""The doctor's check of each notebook's own code: every experiment measures its smallest
full-profile plan into a scratch store (:func:`measure_experiment`), and its records are judged
(:func:`judge_experiment`: phases sum to the step, the all-reduce fits in it, 0 <= exposed
communication <= all-reduce, within :data:`TIMING_TOLERANCE`)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import torch

from lab_utils.app.doctor_checks import Machine, plan_machine, scratch_lab
from lab_utils.engine import plan, profiles
from lab_utils.engine.machine import Machine as PlanMachine
from lab_utils.engine.plan import Experiment, aggregates, make_plan
from lab_utils.learn.errors import LaunchError, first_line
from lab_utils.learn.spread import NOISE_SIGMAS

#: How far a step's timings may stray from their invariants (fraction of the step, plus seconds):
#: timer reads and the probe's pairs are noisy, a timer on the wrong stream or device is not.
TIMING_TOLERANCE = (0.05, 1e-3)


def _num(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _tolerance(d: dict[str, Any]) -> float:
    return TIMING_TOLERANCE[0] * (_num(d, "train_seconds") or 0.0) + TIMING_TOLERANCE[1]


def timing_violations(d: dict[str, Any]) -> list[str]:
    """The invariants a step's timing must keep, each broken one as a phrase (seconds, per epoch):
    data movement + compute + communication = training time; all-reduce time (c) <= training time.
    Missing figures are not checked."""
    t, tol = _num(d, "train_seconds"), _tolerance(d)
    out = []
    phases = [_num(d, k) for k in ("data_movement_seconds", "compute_seconds", "communication_seconds")]
    if t is not None and None not in phases and abs(sum(phases) - t) > tol:
        out.append(f"phases sum to {sum(phases):.4f} s, the training time is {t:.4f} s")
    c = _num(d, "allreduce_seconds")
    if c is not None and t is not None and c > t + tol:
        out.append(f"all-reduce time {c:.4f} s > training time {t:.4f} s")
    return out


def timing_expectations(d: dict[str, Any]) -> list[str]:
    """What a step's communication figures are expected to keep, each one missed beyond the noise as a
    phrase: 0 <= exposed communication (b) <= all-reduce time (c). An expectation, not a law: (b) also
    holds the bucket copies and synchronization that (c) does not, so with one bucket, or with NCCL
    slowing the compute kernels, (b) > (c) happens; over gloo the all-reduce thread takes turns with
    backward on the same cores (Table 2 says so), so (b) <= (c) is not expected there. The noise: the
    timers' tolerance, or :data:`~lab_utils.learn.spread.NOISE_SIGMAS` standard errors of (b)
    (``exposed_comm_noise_seconds``), whichever is larger."""
    b, c = _num(d, "exposed_comm_seconds"), _num(d, "allreduce_seconds")
    noise = max(_tolerance(d), NOISE_SIGMAS * (_num(d, "exposed_comm_noise_seconds") or 0.0))
    out = []
    if b is not None and b < -noise:
        out.append(f"exposed communication {b:.4f} s < 0 beyond the noise ({noise:.4f} s)")
    if b is not None and c is not None and b > c + noise and d.get("backend") != "gloo":
        out.append(f"exposed communication {b:.4f} s > all-reduce time {c:.4f} s beyond the noise "
                   f"({noise:.4f} s)")
    return out


#: What an experiment's row expects (shown when it is skipped).
EXPERIMENT_EXPECTED = ("the notebook's own plan at its smallest full-profile settings runs, each run's "
                       "timing keeps its invariants (0 <= exposed <= all-reduce expected: a warning "
                       "beyond the noise); no CUDA context in this process (the notebook's kernel)")
#: The keys of an aggregate record's metrics that the judge reads (timing invariants, loss, backend).
_JUDGED = ("train_seconds", "data_movement_seconds", "compute_seconds", "communication_seconds",
           "exposed_comm_seconds", "exposed_comm_noise_seconds", "allreduce_seconds", "backend",
           "train_loss", "loss", "test_loss")


def measure_experiment(experiment: Experiment, m: Machine, timeout_s: float = 240.0,
                       machine: PlanMachine | None = None) -> dict[str, Any]:
    """The notebook's own code: ``experiment.doctor(full settings)`` measured through
    :func:`lab_utils.engine.plan.measure` as the notebook does, into a scratch store, one launch group after
    another within ``timeout_s`` seconds; each aggregate record's status, reason and timing figures
    (seconds). This process stands in for the notebook's kernel: whether it had opened a CUDA context
    before the launches is recorded (on an EXCLUSIVE_PROCESS node that stops them)."""
    machine = machine or plan_machine(m)
    settings = experiment.doctor(profiles.settings(experiment.settings, "full"))
    runs = make_plan(experiment, settings, machine, "full")
    deadline = time.monotonic() + timeout_s
    context = _cuda_initialized()
    out: list[dict[str, Any]] = []
    with scratch_lab() as lab:
        for members in ([runs[i] for i in group] for group in plan.groups(runs)):
            left = deadline - time.monotonic()
            if left < 5:
                out += [{"label": r.name, "status": "skipped", "reason": "not run: the check's time limit"}
                        for r in members]
                continue
            bounded = [replace(r, timeout_s=min(r.timeout_s, left)) for r in members]
            try:
                got = plan.measure(lab, experiment, settings, force=True, verbose=False, machine=machine,
                                   runs=bounded)
            except LaunchError as e:
                out += [{"label": r.name, "status": "error", "reason": first_line(e)} for r in members]
                continue
            by_key = {rec.key: rec for rec in aggregates(got)}
            for r in members:
                rec = by_key.get(r.key)
                metrics = rec.metrics if rec is not None else {}
                out.append({"label": r.name, "status": rec.status if rec else "error",
                            "reason": rec.reason if rec else "no record",
                            **{k: metrics.get(k) for k in _JUDGED if k in metrics}})
    return {"experiment": experiment.name, "notebook": experiment.notebook, "kernel_context": context,
            "compute_modes": list(m.compute_modes), "runs": out}


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())


def judge_experiment(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    """Every run that could run here ran ("ok"), with finite losses and its timing invariants
    (:func:`timing_violations`; a missed expectation, :func:`timing_expectations`, is a warning);
    runs that need more GPUs are rows that say so, not failures."""
    ran, skipped, broken, missed = [], [], [], []
    for r in d["runs"]:
        if r["status"] == "ok":
            problems = timing_violations(r) + [f"{k} not finite" for k in ("train_loss", "loss", "test_loss")
                                               if isinstance(r.get(k), float) and not math.isfinite(r[k])]
            seconds = r.get("train_seconds")
            ran.append(f"{r['label']}" + (f" {seconds:.2f} s" if isinstance(seconds, int | float) else ""))
            broken += [f"{r['label']}: {p}" for p in problems]
            missed += [f"{r['label']}: {p}" for p in timing_expectations(r)]
        elif r["status"] == "skipped" and not str(r.get("reason", "")).startswith("not run"):
            skipped.append(f"{r['label']} ({r['reason']})")
        else:
            broken.append(f"{r['label']}: {r['status']}: {r.get('reason')}")
    modes = sorted(set(d.get("compute_modes") or []))
    parts = [f"ran {', '.join(ran) or 'nothing'}"] + ([f"skipped {', '.join(skipped)}"] if skipped else [])
    if modes and modes != ["Default"]:
        parts.append(f"compute mode {', '.join(modes)}")
    verdict = "ok" if ran and not broken else "fail"
    if d.get("kernel_context"):
        parts.append("CUDA was initialised in this process (the notebook's kernel) before the launches")
        verdict = "fail"
    if broken:
        parts.append("FAILED " + "; ".join(broken))
    if missed:
        parts.append("NOT AS EXPECTED " + "; ".join(missed))
        verdict = "warn" if verdict == "ok" else verdict
    return "; ".join(parts), EXPERIMENT_EXPECTED, verdict
