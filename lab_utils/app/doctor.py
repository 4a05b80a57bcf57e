"""``python -m lab_utils doctor``: the first session on a new GPU node, checked in minutes.

The tests run the lab's CUDA-only branches against a fake GPU (tests/fake_gpu.py); this command checks,
on the node, what only a real one can show: CUDA events agree with the host clock, an out-of-memory
error under a memory cap is caught and its memory given back, bf16 is native, NCCL moves data at the
links' speed, ``torch.compile`` works, and each notebook's own code runs: every experiment of
:mod:`lab_utils.experiments.registry` measures its smallest full-profile plan (``experiment.doctor``)
through :func:`lab_utils.engine.plan.measure` into a scratch store, and its records are judged (phases sum to
the step and the all-reduce fits in it; 0 <= exposed communication <= all-reduce is expected, a miss
beyond the noise a warning). It prints one table
(``| check | measured | expected | verdict |``) within ``--budget`` seconds (600), also written to
``results/<profile>/doctor.md`` and ``doctor.json``. A verdict is ``ok``, ``warn`` (works, but a number
to look at), ``fail`` (wrong numbers or a crash here: exit code 1) or ``skipped: <why>``.

Every check has a time limit. Those that touch CUDA run in a child process (``python -m
lab_utils.app.doctor --child NAME``) stopped at its limit with everything it started
(:func:`lab_utils.engine.proc.run`), so a hung driver, NCCL or compiler is a ``fail`` row; multi-GPU runs go
through the launcher, whose timeout stops the whole ``torchrun`` tree. The doctor's own process never
opens a CUDA context: it stands in for the notebook's kernel. Without a GPU it runs what applies
(versions, the timers' overhead), marks the rest ``skipped: no GPU`` and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.app.doctor_checks import (
    Machine,
    judge_bf16,
    judge_clock,
    judge_compile,
    judge_cuda_init,
    judge_int8_mm,
    judge_mig,
    judge_nccl,
    judge_oom,
    judge_timer_overhead,
    judge_versions,
    measure_bf16,
    measure_clock,
    measure_compile,
    measure_cuda_init,
    measure_int8_mm,
    measure_mig,
    measure_nccl,
    measure_oom,
    measure_timer_overhead,
    measure_versions,
    read_machine,
)
from lab_utils.app.doctor_experiments import EXPERIMENT_EXPECTED, judge_experiment, measure_experiment
from lab_utils.engine import config, hardware, proc
from lab_utils.engine.store import _atomic_write_text
from lab_utils.experiments import registry
from lab_utils.learn.errors import LabError, LaunchError, error_line, first_line

DEFAULT_BUDGET_S = 600.0
NO_GPU = "skipped: no GPU"


# --------------------------------------------------------------------------- rows and the machine


@dataclass
class Row:
    """One line of the doctor's table."""

    check: str
    measured: str
    expected: str
    verdict: str                      # "ok" | "warn" | "fail" | "skipped: <why>"
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"


@dataclass(frozen=True)
class Check:
    """One row of the doctor: where it runs, its time limit, how it measures and judges."""

    name: str
    measure: Callable[..., dict[str, Any]]
    judge: Callable[[dict[str, Any], Machine], tuple[str, str, str]]
    expected: str                  # shown when skipped
    # "here" (no CUDA: this process), "child" (CUDA: a subprocess), "launch" (torchrun through the
    # launcher), "auto" (a child with GPUs, here without)
    where: str = "child"
    gpus: int = 1                  # GPUs it needs (0: runs anywhere)
    timeout_s: float = 120.0
    no_mig: bool = False           # cannot run on MIG slices


CHECKS: tuple[Check, ...] = (
    Check("versions", measure_versions, judge_versions, "driver, torch, CUDA, cuDNN, NCCL", "here", 0, 60),
    Check("mig", measure_mig, judge_mig, "whole GPUs", "here", 1, 60),
    Check("cuda_init", measure_cuda_init, judge_cuda_init, "each GPU starts, names agree", timeout_s=90),
    Check("event_vs_host_clock", measure_clock, judge_clock, "equal within 5 % + 0.5 ms", timeout_s=90),
    Check("timer_overhead", measure_timer_overhead, judge_timer_overhead, "< 100 us a phase", "auto", 0, 60),
    Check("oom_under_memory_fraction", measure_oom, judge_oom, "an 'oom' row, memory freed", timeout_s=90),
    Check("bf16", measure_bf16, judge_bf16, "native bf16, or its rows skipped", timeout_s=90),
    Check("int8_matmul", measure_int8_mm, judge_int8_mm, "cuBLAS int8 exact at 17 rows", timeout_s=90),
    Check("nccl_allreduce", measure_nccl, judge_nccl, "busbw >= 40 % and <= 2x of the link's nominal peak",
          "launch", 2, 240, no_mig=True),
    # each registered experiment's row, NN_name: its plan measured in this process (the launcher starts
    # its GPU work)
    *(Check(f"{e.notebook}_{e.name}", functools.partial(measure_experiment, e), judge_experiment,
            EXPERIMENT_EXPECTED, "launch", 1, 240.0)
      for e in sorted(registry.EXPERIMENTS, key=lambda e: e.notebook)),
    # last: a first Inductor/Triton compilation can take minutes; it must not crowd out the steps above
    Check("torch_compile", measure_compile, judge_compile, "compiles and steps", timeout_s=360),
)
BY_NAME = {c.name: c for c in CHECKS}


def skip_reason(check: Check, m: Machine) -> str | None:
    """``skipped: <why>`` when ``check`` cannot run on ``m``, else None."""
    if check.gpus and m.gpus == 0:
        return NO_GPU
    if check.gpus and m.no_kernels and check.where != "here":
        return "skipped: this torch has no kernels for this GPU (see versions)"
    if check.gpus > m.gpus:
        return f"skipped: needs {check.gpus} GPUs (this machine has {m.gpus})"
    if check.no_mig and m.mig:
        return "skipped: MIG slices (NCCL and DataParallel need whole GPUs)"
    return None


# --------------------------------------------------------------------------- running them


def run_child(cmd: list[str], timeout_s: float, out_file: Path, what: str = "") -> dict[str, Any]:
    """Run ``cmd`` (it writes JSON to ``out_file``) through :func:`lab_utils.engine.proc.run` (at
    ``timeout_s`` it and all it started are stopped: :class:`lab_utils.engine.proc.TimeLimit`); a failed
    child raises ``RuntimeError`` with its last error line."""
    res = proc.run(cmd, timeout_s, text=True, what=what or "the check")
    if res.returncode != 0 or not out_file.exists():
        lines = [ln for ln in (res.stderr or "").strip().splitlines() if ln.strip()]
        raise RuntimeError(lines[-1][:200] if lines else f"exit code {res.returncode}")
    return json.loads(out_file.read_text())


def _measure(check: Check, m: Machine, timeout_s: float) -> dict[str, Any]:
    if check.where == "here" or (check.where == "auto" and m.gpus == 0):
        return check.measure(m)
    if check.where == "launch":  # launcher.launch bounds the torchrun tree by timeout_s
        return check.measure(m, timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="lab_doctor_") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "lab_utils.app.doctor", "--child", check.name, "--out", str(out),
               "--profile", m.profile]
        return run_child(cmd, timeout_s, out, what=f"the {check.name} check")


def run_checks(m: Machine, checks: tuple[Check, ...] = CHECKS, budget_s: float = DEFAULT_BUDGET_S,
               measure: Callable[[Check, Machine, float], dict[str, Any]] = _measure,
               echo: Callable[[Row], None] | None = None) -> list[Row]:
    """Run ``checks`` on ``m`` in order within ``budget_s`` seconds; one :class:`Row` each."""
    deadline = time.monotonic() + budget_s
    rows = []
    for c in checks:
        why = skip_reason(c, m)
        left = deadline - time.monotonic()
        if why is None and left < 5:
            why = f"skipped: the doctor's time budget ({budget_s:.0f} s) is used up"
        t0 = time.monotonic()
        if why is not None:
            row = Row(c.name, "", c.expected, why)
        else:
            limit = min(c.timeout_s, left)
            budget = (f"skipped: the doctor's time budget ({budget_s:.0f} s) cut it short after "
                      f"{limit:.0f} s (its own limit is {c.timeout_s:.0f} s)")
            cut = limit < c.timeout_s   # a time-out now is the budget's, not the check's
            try:
                data = measure(c, m, limit)
                measured, expected, verdict = c.judge(data, m)
                row = Row(c.name, measured, expected, verdict, details=data)
            except proc.TimeLimit as e:
                row = Row(c.name, str(e), c.expected, budget if cut else "fail")
            except LaunchError as e:
                first = first_line(e)
                timed_out = "did not finish within" in first
                row = Row(c.name, f"launch failed: {first}", c.expected,
                          budget if cut and timed_out else "fail", details={"error": str(e)})
            except Exception as e:  # a broken check is a failed check, never a traceback
                row = Row(c.name, error_line(e), c.expected, "fail")
        row.seconds = time.monotonic() - t0
        rows.append(row)
        if echo is not None:
            echo(row)
    return rows


# --------------------------------------------------------------------------- output


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table: check, measured, expected, verdict, seconds."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| check | measured | expected | verdict | seconds |", "|---|---|---|---|---:|"]
    for r in rows:
        lines.append(f"| {' | '.join(cell(x) for x in (r.check, r.measured, r.expected, r.verdict))} "
                     f"| {r.seconds:.1f} |")
    return "\n".join(lines)


def summary(rows: list[Row], seconds: float) -> str:
    failed = [r.check for r in rows if r.failed]
    return f"{len(rows)} checks in {seconds:.0f} s; " + (f"FAILED: {', '.join(failed)}" if failed
                                                          else "no check failed")


def write_report(rows: list[Row], m: Machine, seconds: float, root: Path) -> tuple[Path, Path]:
    """``doctor.md`` and ``doctor.json`` under ``root`` (``results/<profile>/``), each written atomically."""
    root.mkdir(parents=True, exist_ok=True)
    head = (f"# lab doctor: {m.gpus} GPU(s){' x ' + m.name if m.name else ''}, driver {m.driver or 'none'}, "
            f"profile {m.profile}\n\n{summary(rows, seconds)}\n\n")
    md, js = root / "doctor.md", root / "doctor.json"
    _atomic_write_text(md, head + table(rows) + "\n")
    payload = {"machine": asdict(m), "software": hardware.software_versions(), "seconds": seconds,
               "failed": [r.check for r in rows if r.failed], "rows": [asdict(r) for r in rows]}
    _atomic_write_text(js, json.dumps(payload, indent=2, default=str) + "\n")
    return md, js


def main(argv: list[str] | None = None) -> int:
    """``python -m lab_utils doctor [--profile P] [--budget S] [--only NAMES]``; 1 if a check failed."""
    p = argparse.ArgumentParser(prog="python -m lab_utils doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None, help="the report goes to results/<profile>/ (default: auto)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all checks (600)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BY_NAME)}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # one check, in a child process
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)  # a notebook step on another device
    a = p.parse_args(argv)
    if a.child:
        return _child(a.child, a.out, a.profile, a.device)
    checks = CHECKS
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise LabError(f"Unknown doctor check(s) {unknown}; choose from: {', '.join(BY_NAME)}.")
        checks = tuple(BY_NAME[n] for n in names)
    if not a.budget > 0:
        raise LabError(f"--budget must be a positive number of seconds, got {a.budget!r}.")
    t0 = time.monotonic()
    m = read_machine(a.profile)
    print(f"lab doctor: {m.gpus} GPU(s){' (' + m.name + ')' if m.name else ''}, driver {m.driver or 'none'}, "
          f"{len(checks)} checks within {a.budget:.0f} s", flush=True)
    if m.problem:  # the versions row fails with it; said first, in one sentence
        print(f"error: {m.problem}", flush=True)

    def echo(row: Row) -> None:
        print(f"  {row.check:<30} {row.verdict:<8} {row.measured}"[:160], flush=True)

    rows = run_checks(m, checks, a.budget, echo=echo)
    seconds = time.monotonic() - t0
    md, js = write_report(rows, m, seconds, config.results_dir(m.profile))
    print(f"\n{table(rows)}\n\n{summary(rows, seconds)}. Report: {md} and {js.name}")
    return 1 if any(r.failed for r in rows) else 0


def _child(name: str, out: str | None, profile: str | None, device: str | None) -> int:
    """Run one check's measurement here and write its JSON to ``out``."""
    check = BY_NAME.get(name)
    if check is None or out is None:
        print(f"error: unknown doctor check {name!r} or no --out", file=sys.stderr)
        return 2
    m = read_machine(profile)
    Path(out).write_text(json.dumps(check.measure(m, **({"device": device} if device else {})), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
