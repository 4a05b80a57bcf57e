"""``python -m lab_utils doctor`` (lab_utils/app/doctor.py): through the command on this CPU machine, and its
GPU checks' logic against the fake GPU (tests/fake_gpu.py).

What only a GPU can show (events against the host clock on real kernels, NCCL's bandwidth,
Inductor/Triton, CUPTI) is what the doctor measures on a node; here each check's measuring
code runs where the fake can carry it (events on the fake's clock, the memory cap and the
allocator's error, bf16's decision, names from nvidia-smi, an all-reduce over gloo in place of
NCCL), and its verdict is computed from those values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab_utils.app import doctor, doctor_checks, doctor_experiments
from lab_utils.engine import proc

REPO = Path(__file__).resolve().parent.parent


def _env(results: Path) -> dict[str, str]:
    return {**os.environ, "LAB_RESULTS_DIR": str(results)}


@pytest.fixture
def cpu_only():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the doctor runs its GPU checks there")


# --------------------------------------------------------------------------- the command, on this CPU


@pytest.mark.timeout(180)
def test_doctor_on_this_cpu_skips_every_gpu_check_and_writes_both_files(tmp_path, cpu_only):
    """As docs/instructor.md types it, from the repository root."""
    res = subprocess.run([sys.executable, "-m", "lab_utils", "doctor"], cwd=REPO,
                         env=_env(tmp_path / "results"), capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "| check | measured | expected | verdict | seconds |" in out
    report = json.loads((tmp_path / "results" / "quick" / "doctor.json").read_text())
    md = (tmp_path / "results" / "quick" / "doctor.md").read_text()
    rows = {r["check"]: r for r in report["rows"]}
    assert list(rows) == [c.name for c in doctor.CHECKS]
    for c in doctor.CHECKS:
        row = rows[c.name]
        if c.gpus:
            assert row["verdict"] == "skipped: no GPU", row
            assert f"| {c.name} |  | {c.expected} | skipped: no GPU |" in md and f"| {c.name} |" in out
        else:   # versions and the timers' overhead apply on a CPU
            assert row["verdict"] == "ok" and row["measured"], row
    assert report["failed"] == [] and report["machine"]["gpus"] == 0
    assert "torch " + torch.__version__ in rows["versions"]["measured"]
    assert rows["timer_overhead"]["details"]["device"] == "cpu"
    assert "no check failed" in md.splitlines()[2]


@pytest.mark.timeout(240)
def test_make_doctor(tmp_path, cpu_only):
    """``make doctor`` (docs/instructor.md, "Headless runs"), when .venv is up to date."""
    if subprocess.run(["make", "-q", "venv"], cwd=REPO, capture_output=True, timeout=60).returncode != 0:
        pytest.skip(".venv is not up to date: `make doctor` would install first")
    res = subprocess.run(["make", "doctor"], cwd=REPO, env=_env(tmp_path / "results"), capture_output=True,
                         text=True, timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no check failed" in res.stdout and (tmp_path / "results" / "quick" / "doctor.json").exists()


@pytest.mark.timeout(120)
def test_a_failed_check_makes_the_exit_code_one(tmp_path, monkeypatch, cpu_only):
    """A driver that reports GPUs torch cannot use (the fake nvidia-smi; this torch sees none)."""
    from fake_gpu import FakeGPU

    FakeGPU(count=2).install_nvidia_smi(tmp_path / "bin", monkeypatch)
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "results"))
    assert doctor.main(["--only", "versions,cuda_init"]) == 1
    report = json.loads((tmp_path / "results" / "quick" / "doctor.json").read_text())
    assert report["failed"] == ["versions"]
    assert report["rows"][1]["verdict"] == "skipped: no GPU"
    assert "driver 550.127.05" in report["rows"][0]["measured"]


def test_bad_input_is_one_sentence(capsys):
    from lab_utils.app.cli import main

    assert main(["doctor", "--only", "versions,nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown doctor check(s) ['nonsense']") and err.count("\n") == 1


# --------------------------------------------------------------------------- time limits


@pytest.mark.timeout(60)
def test_a_hung_check_is_stopped_with_everything_it_started(tmp_path):
    marker = "61.37"
    code = f"import subprocess, time; subprocess.Popen(['sleep', '{marker}']); time.sleep(60)"
    cmd = [sys.executable, "-c", code]
    t0 = time.monotonic()
    with pytest.raises(proc.TimeLimit, match="did not finish within 2 s"):
        doctor.run_child(cmd, 2, tmp_path / "out.json")
    assert time.monotonic() - t0 < 15
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.split()
    assert left == []


def test_the_budget_and_a_failing_check_do_not_stop_the_others():
    """A check that hangs past its limit is a fail row, the next one runs; past the budget the rest are
    skipped."""
    m = doctor_checks.Machine(gpus=1, names=["G"], mig=[], driver="1", problem=None, profile="quick")
    judge = doctor_checks.judge_timer_overhead
    checks = (doctor.Check("hangs", lambda m: {}, judge, "x", "child", 1, 5),
              doctor.Check("broken", lambda m: {}, judge, "x", "here", 0, 5),
              doctor.Check("fine", lambda m: {"per_phase_seconds": 1e-6, "phases": 1, "device": "cpu",
                                               "timed_phases": 1}, judge, "x", "here", 0, 5),
              doctor.Check("slow", lambda m: {}, judge, "x", "here", 0, 5),
              doctor.Check("late", lambda m: {}, judge, "x", "here", 0, 5))

    def measure(c, m, limit):
        if c.name == "hangs":
            raise proc.TimeLimit(f"did not finish within {limit:.0f} s and was stopped")
        if c.name == "slow":
            time.sleep(1.2)
        return c.measure(m)

    rows = doctor.run_checks(m, checks, budget_s=6.0, measure=measure)
    verdicts = [r.verdict for r in rows]
    assert verdicts[:3] == ["fail", "fail", "ok"]
    assert rows[0].measured == "did not finish within 5 s and was stopped"
    assert rows[1].measured.startswith("KeyError")            # a broken check is a row, not a traceback
    assert verdicts[4] == "skipped: the doctor's time budget (6 s) is used up"


@pytest.mark.timeout(90)
def test_a_check_runs_in_a_child_process_and_returns_its_measurement(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "lab_utils.app.doctor", "--child", "timer_overhead", "--device", "cpu",
           "--out", str(out)]
    d = doctor.run_child(cmd, 60, out)
    assert d["device"] == "cpu" and d["timed_phases"] == d["phases"] == 2000 and d["per_phase_seconds"] > 0
    with pytest.raises(RuntimeError, match="unknown doctor check 'nope'"):
        doctor.run_child([sys.executable, "-m", "lab_utils.app.doctor", "--child", "nope", "--out", str(out)],
                         60, tmp_path / "missing.json")


# --------------------------------------------------------------------------- GPU checks against the fake


@pytest.fixture
def two_a100(fake_gpu):
    return fake_gpu(count=2, name="NVIDIA A100-SXM4-80GB", total_memory=80 * 2 ** 30)


def test_the_machine_is_read_without_a_cuda_context(two_a100):
    m = doctor_checks.read_machine("full")
    a100 = "NVIDIA A100-SXM4-80GB"
    assert (m.gpus, m.names, m.mig, m.driver, m.problem) == (2, [a100] * 2, [], "550.127.05", None)
    assert not two_a100.initialized and two_a100.contexts == set()
    assert doctor_checks.judge_versions(doctor_checks.measure_versions(m), m)[2] == "ok"
    assert doctor_checks.judge_mig(doctor_checks.measure_mig(m), m)[2] == "ok"
    assert [doctor.skip_reason(c, m) for c in doctor.CHECKS] == [None] * len(doctor.CHECKS)
    one = doctor_checks.Machine(1, ["x"], [], "1", None, "full")
    assert doctor.skip_reason(doctor.BY_NAME["nccl_allreduce"], one) == (
        "skipped: needs 2 GPUs (this machine has 1)")


def test_cuda_init_compares_torchs_names_with_nvidia_smis(two_a100, monkeypatch):
    from lab_utils.engine import hardware

    m = doctor_checks.read_machine()
    # no kernel runs on the fake
    d = doctor_checks.measure_cuda_init(m, kernel=lambda i: doctor_checks.KERNEL_EXPECTED)
    names = ["NVIDIA A100-SXM4-80GB"] * 2
    assert [g["torch_name"] for g in d["gpus"]] == [g["smi_name"] for g in d["gpus"]] == names
    measured, _, verdict = doctor_checks.judge_cuda_init(d, m)
    assert verdict == "ok" and measured.startswith("2 x NVIDIA A100-SXM4-80GB (sm 8.0), 80 GiB")
    monkeypatch.setattr(hardware, "visible_gpu_names", lambda text=None: ["NVIDIA A100 80GB PCIe"] * 2)
    kernel = {"kernel": lambda i: doctor_checks.KERNEL_EXPECTED}
    measured, _, verdict = doctor_checks.judge_cuda_init(doctor_checks.measure_cuda_init(m, **kernel), m)
    assert verdict == "fail" and "nvidia-smi says 'NVIDIA A100 80GB PCIe'" in measured
    two_a100.allocate(30 * 2 ** 30, 1)  # another process holds memory on GPU 1
    d = doctor_checks.measure_cuda_init(m, **kernel)
    assert doctor_checks.judge_cuda_init(d, m)[2] in ("warn", "fail")


def test_events_and_the_host_clock_agree_on_the_fake_device(two_a100):
    """The workload is 20 ms of queued device work; both clocks must see all of it. Its fp32 matmuls run
    true fp32 (torch.backends.cuda.matmul.allow_tf32 is off by default): 13 TFLOP/s is a realistic A100
    rate, above its 19.5 TFLOP/s fp32 peak the clock missed work (tests/test_gpu_numbers.py: A100, H100,
    V100 PCIe)."""
    m = doctor_checks.read_machine()
    d = doctor_checks.measure_clock(m, workload=lambda: two_a100.launch(0.020), flops=2.6e11,
                                    clock=two_a100.clock)
    assert d["event_seconds"] == pytest.approx(0.020) and d["host_seconds"] == pytest.approx(0.020)
    assert d["precision"] == "fp32"
    measured, _, verdict = doctor_checks.judge_clock(d, m)
    assert verdict == "ok" and "13.0 TFLOP/s fp32" in measured
    assert doctor_checks.judge_clock({**d, "event_seconds": 0.001}, m)[2] == "fail"  # events missed the work
    assert doctor_checks.judge_clock({**d, "flops": 5e11}, m)[2] == "fail"  # 25 TFLOP/s > A100's fp32


def test_timer_overhead_synchronizes_the_gpu_at_both_ends_of_each_phase(two_a100):
    m = doctor_checks.read_machine()
    before = len(two_a100.synchronize_calls)
    d = doctor_checks.measure_timer_overhead(m, device="cuda", phases=50, clock=two_a100.clock)
    assert len(two_a100.synchronize_calls) - before == 1 + 2 * 50
    assert d["timed_phases"] == 50 and doctor_checks.judge_timer_overhead(d, m)[2] == "ok"
    assert doctor_checks.judge_timer_overhead({**d, "per_phase_seconds": 5e-4}, m)[2] == "warn"


def test_oom_under_a_memory_fraction_is_caught_and_the_memory_freed(two_a100):
    gpu = two_a100
    m = doctor_checks.read_machine()
    d = doctor_checks.measure_oom(m, allocate=gpu.tensor)
    assert d["oom"] and d["reason"].startswith("OOM: CUDA out of memory. Tried to allocate 8.00 GiB")
    assert gpu.fraction_calls == [(0.05, 0), (1.0, 0)]       # a float and a device index, as torch needs
    assert d["allocated_after_free_bytes"] == 0 and d["reserved_after_free_bytes"] == 0
    assert gpu.empty_cache_calls == 1
    measured, _, verdict = doctor_checks.judge_oom(d, m)
    assert verdict == "ok" and measured.startswith("oom: OOM: CUDA out of memory")
    leaked = []
    d2 = doctor_checks.measure_oom(m, allocate=lambda n: leaked.append(gpu.allocate(n)))  # never released
    assert doctor_checks.judge_oom(d2, m)[2] == "fail"


def test_bf16_is_checked_natively_or_skipped(fake_gpu):
    fake_gpu(name="Tesla V100-SXM2-16GB", major=7)
    m = doctor_checks.read_machine()
    d = doctor_checks.measure_bf16(m)
    assert d == {"native": False, "device_name": "Tesla V100-SXM2-16GB", "capability": "7.0"}
    assert doctor_checks.judge_bf16(d, m)[2] == "skipped: no native bf16 on this GPU"
    fake_gpu(name="NVIDIA H100 80GB HBM3", major=9)
    d = doctor_checks.measure_bf16(m, math_device="cpu")   # the decision on the (fake) GPU, the matmul here
    assert d["native"] and d["relative_error"] < 1e-2 and doctor_checks.judge_bf16(d, m)[2] == "ok"


def test_a_mig_slice_is_a_warning_and_stops_the_multi_gpu_checks(fake_gpu):
    fake_gpu(count=1, name="NVIDIA A100-SXM4-40GB", mig="1g.5gb")
    m = doctor_checks.read_machine()
    assert m.mig == ["1g.5gb"] and m.names == ["NVIDIA A100-SXM4-40GB MIG 1g.5gb"]
    measured, _, verdict = doctor_checks.judge_mig(doctor_checks.measure_mig(m), m)
    assert verdict == "warn" and "MIG slice(s): 1g.5gb" in measured
    assert doctor.skip_reason(doctor.BY_NAME["nccl_allreduce"], m).startswith("skipped: needs 2 GPUs")
    m2 = doctor_checks.Machine(2, m.names * 2, ["1g.5gb"] * 2, "1", None, "full")
    assert doctor.skip_reason(doctor.BY_NAME["nccl_allreduce"], m2).startswith("skipped: MIG slices")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_nccl_check_runs_its_all_reduce_over_gloo_and_judges_it_against_nvlink(two_a100):
    """plan_bench answers nccl on the (fake) 2 GPUs; the launch runs the lab's benchmark worker with
    gloo standing in (subprocesses do not see the fake), and the verdict compares its busbw with
    the A100 NVLink's 300 GB/s from the fake topology."""
    m = doctor_checks.read_machine()
    d = doctor_checks.measure_nccl(m, timeout_s=120, backend="gloo", max_bytes=2 ** 20)
    assert d["planned_backend"] == "nccl" and d["backend"] == "gloo" and d["ranks"] == 2
    assert d["correct"] and d["size_bytes"] == 2 ** 20 and d["busbw_gb_per_s"] > 0
    assert d["link_gb_per_s"] == 300.0 and "NVLink" in d["link"]
    measured, expected, verdict = doctor_checks.judge_nccl(d, m)
    share = d["busbw_gb_per_s"] / 300.0
    assert verdict == ("ok" if share >= 0.4 else "warn" if share >= 0.1 else "fail")
    assert expected.startswith(">= 40 % and <= 2x of NVLink") and f"{share:.0%} of the link" in measured
    assert doctor_checks.judge_nccl({**d, "busbw_gb_per_s": 200.0}, m)[2] == "ok"
    assert doctor_checks.judge_nccl({**d, "correct": False, "busbw_gb_per_s": 200.0}, m)[2] == "fail"


def test_the_doctors_table_under_the_fake_gpu(two_a100, tmp_path):
    """The in-process GPU checks, each measured against the fake, judged and written as the command does."""
    gpu = two_a100
    m = doctor_checks.read_machine("full")
    fakes = {"event_vs_host_clock": {"workload": lambda: gpu.launch(0.01), "flops": 1e11, "clock": gpu.clock},
             "timer_overhead": {"device": "cuda", "clock": gpu.clock},
             "oom_under_memory_fraction": {"allocate": gpu.tensor}, "bf16": {"math_device": "cpu"},
             "cuda_init": {"kernel": lambda i: doctor_checks.KERNEL_EXPECTED}}
    names = ["versions", "mig", "cuda_init", "event_vs_host_clock", "timer_overhead",
             "oom_under_memory_fraction", "bf16", "int8_matmul"]

    def measure(c, m, limit):
        if c.name == "int8_matmul":
            return c.measure(m, device="cpu")  # torch._int_mm's exactness, here on the CPU's kernel
        return c.measure(m, **fakes.get(c.name, {}))

    rows = doctor.run_checks(m, tuple(doctor.BY_NAME[n] for n in names), measure=measure)
    assert [r.verdict for r in rows] == ["ok"] * len(names), [(r.check, r.verdict, r.measured) for r in rows]
    md, js = doctor.write_report(rows, m, 1.0, tmp_path)
    assert "lab doctor: 2 GPU(s) x NVIDIA A100-SXM4-80GB, driver 550.127.05" in md.read_text()
    assert json.loads(js.read_text())["rows"][3]["details"]["event_seconds"] == pytest.approx(0.01)


# --------------------------------------------------------------------------- the notebooks' own plans


def test_every_registered_experiment_is_a_row_in_notebook_order():
    """Each experiment of the registry is one row, NN_name, in notebook order, and every notebook 01-08 has
    one: doctor runs the notebooks' own plans, it keeps no copies of their steps."""
    from lab_utils.experiments import registry

    names = [c.name for c in doctor.CHECKS]
    rows = [f"{e.notebook}_{e.name}" for e in registry.EXPERIMENTS]
    assert rows and all(r in names for r in rows)
    notebook_rows = [n for n in names if n[:2].isdigit()]
    assert notebook_rows == sorted(notebook_rows, key=lambda n: n[:2]) and len(notebook_rows) == len(rows)
    assert {f"{i:02d}" for i in range(1, 9)} <= {n[:2] for n in notebook_rows}
    assert not [n for n in vars(doctor) if n.startswith("step_") or n == "_LEGACY"]


def _exp_data(**run) -> dict:
    ok = {"label": "DDP 2 x 32", "status": "ok", "reason": None, "train_seconds": 1.0,
          "data_movement_seconds": 0.1, "compute_seconds": 0.8, "communication_seconds": 0.1,
          "exposed_comm_seconds": 0.1,
          "allreduce_seconds": 0.4, "backend": "nccl", "train_loss": 2.3}
    return {"experiment": "x", "notebook": "02", "kernel_context": False, "compute_modes": ["Default"],
            "runs": [{**ok, **run}, {"label": "DDP 4 x 32", "status": "skipped", "reason": "needs 4 GPUs"}]}


def test_an_experiment_row_is_judged_by_its_records():
    m = doctor_checks.Machine(gpus=2, names=["G", "G"], mig=[], driver="1", problem=None, profile="full")
    measured, _, verdict = doctor_experiments.judge_experiment(_exp_data(), m)
    assert verdict == "ok" and measured == "ran DDP 2 x 32 1.00 s; skipped DDP 4 x 32 (needs 4 GPUs)"
    for bad in ({"compute_seconds": 0.3}, {"allreduce_seconds": 1.5},
                {"train_loss": float("nan")}, {"status": "oom", "reason": "OOM: CUDA out of memory"},
                {"status": "error", "reason": "no record"}):
        measured, _, verdict = doctor_experiments.judge_experiment(_exp_data(**bad), m)
        assert verdict == "fail" and "FAILED DDP 2 x 32" in measured, (bad, measured)
    # an expectation
    measured, _, verdict = doctor_experiments.judge_experiment(_exp_data(exposed_comm_seconds=0.6), m)
    assert verdict == "warn" and "NOT AS EXPECTED DDP 2 x 32: exposed communication" in measured
    assert doctor_experiments.judge_experiment({**_exp_data(), "kernel_context": True}, m)[2] == "fail"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_experiment_row_runs_the_notebooks_own_plan_over_gloo_here(tmp_path, monkeypatch):
    """Notebook 02's row on this CPU: its doctor settings (the smallest full-profile configuration) with a
    narrow model and gloo CPU processes in place of GPUs go through lab_utils.engine.plan.measure, the DDP
    worker
    under torchrun, into a scratch store: the lab's results get nothing, the records are judged."""
    from dataclasses import replace

    from lab_utils.engine.machine import Machine as PlanMachine
    from lab_utils.experiments.n02_scaling import experiment as scaling

    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "results"))

    def small(full):
        return replace(scaling.doctor_settings(full), width=4, devices=(1, 2), max_cpu_processes=2,
                       dataset="synthetic", num_workers=0)

    e = replace(scaling.SCALING_EXPERIMENT, doctor=small)
    m = doctor_checks.Machine(gpus=0, names=[], mig=[], driver=None, problem=None, profile="full")
    d = doctor_experiments.measure_experiment(e, m, timeout_s=240, machine=PlanMachine(gpus=0, cores=2))
    assert [(r["label"], r["status"]) for r in d["runs"]] == [("DDP 1 x 32", "ok"), ("DDP 2 x 32", "ok")]
    assert all(r["train_seconds"] > 0 and r["backend"] == "gloo" for r in d["runs"])
    measured, _, verdict = doctor_experiments.judge_experiment(d, m)
    assert verdict == "ok" and measured.startswith("ran DDP 1 x 32"), measured
    assert not (tmp_path / "results").exists()
