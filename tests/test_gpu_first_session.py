"""Issue 33: the defects a read of the CUDA paths found that would crash, hang or mislabel a student's
first session on a GPU node, each run on this CPU machine.

Every test here failed on the code before its fix and passes after it (the commit that fixed each
says so); the fake GPU (tests/fake_gpu.py) stands in for the device, and gloo runs stand in for NCCL
where a launch is needed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from lab_utils.engine import launcher
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
from lab_utils.experiments.n06_gpt_ddp.worker import TrainConfig
from lab_utils.learn.errors import LaunchError

TESTS = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- 2. a failing rank under NCCL


def test_under_nccl_any_error_ends_the_rank_and_under_gloo_it_propagates(monkeypatch, capsys):
    from lab_utils.engine import dist

    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(dist.os, "_exit", fake_exit)
    nccl = dist.DistContext(rank=1, world_size=2, backend="nccl")
    with pytest.raises(SystemExit), dist.failure_ends_rank(nccl):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    assert exits == [1]
    err = capsys.readouterr().err
    assert "RuntimeError on rank 1 of 2: CUDA error: an illegal memory access was encountered; this" in err
    assert "Traceback" in err
    for ctx in (dist.DistContext(rank=1, world_size=2, backend="gloo"), dist.DistContext(backend="nccl")):
        with pytest.raises(ValueError), dist.failure_ends_rank(ctx):
            raise ValueError("propagates")
    assert exits == [1]


def _test_env(worker: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(TESTS) + (os.pathsep + path if path else ""), "LAB_TEST_WORKER": worker}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker", ["ddp", "gpt_train"])
def test_a_rank_failing_under_nccl_ends_at_once_and_the_launch_names_it(worker, tmp_path):
    """Rank 1 of 2 raises a CUDA error (not out of memory) while rank 0 waits in the gradient all-reduce
    (tests/failing_rank_worker.py: the rank says nccl, destroy_process_group blocks as NCCL's can).

    Before: rank 1 ran destroy_process_group() in a finally, which never returned; the launch hung
    until its time limit. Now it writes its error line and leaves with os._exit: torchrun sees it and
    stops rank 0 at once, and the launch error quotes rank 1's line."""
    if worker == "ddp":
        cfg = RunConfig(devices=2, backend="gloo", batch_size=4, epochs=1, width=2, train_images=32,
                        test_images=32, dataset="synthetic").config()
    else:
        cfg = TrainConfig(devices=2, size="tiny", batch_size=2, epochs=1, max_steps=2, steps_per_epoch=2,
                          max_chars=20_000, val_batches=1, corpus="stdlib").validate().config()
    job = {"experiment": "failing", "profile": "quick", "configs": [cfg]}
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as e:
        launcher.launch("failing_rank_worker", job, nproc=2, timeout_s=75, log_dir=tmp_path,
                        env=_test_env(worker), threads_per_rank=1)
    took = time.perf_counter() - t0
    text = str(e.value)
    assert "did not finish within" not in text and took < 60, (took, text[:400])
    assert "failed (torchrun exit code" in text and "Last lines of rank 1" in text
    assert "RuntimeError on rank 1 of 2: CUDA error: an illegal memory access was encountered" in text


# --------------------------------------------------------------------------- 1. a V100 and the torch build

V100 = "Tesla V100-SXM2-16GB"


def test_each_builds_architectures_are_in_the_table_and_a_v100_needs_cu126():
    from lab_utils.engine import cuda_builds as cb

    archs = {v.name: v.archs for v in cb.VARIANTS}
    assert archs["cu126"] == ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
    assert archs["cu130"] == archs["cu132"] == ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120",
                                                 "compute_120")
    assert archs["cpu"] == ()
    # a cubin runs on its major's later minors (sm_86 on an L40S, 8.9); sm_75 does not run on 7.0
    assert cb.arch_runs("8.9", archs["cu130"]) and cb.arch_runs("10.3", archs["cu130"])
    assert cb.arch_runs("12.1", archs["cu130"])                      # sm_120, and the PTX besides
    assert not cb.arch_runs("7.0", archs["cu130"]) and cb.arch_runs("7.0", archs["cu126"])
    assert not cb.arch_runs("3.7", archs["cu126"]) and cb.arch_runs("13.0", ("compute_120",))  # PTX: JIT
    assert cb.arch_runs("9.0", ["sm_90a"]) and not cb.arch_runs("7.0", [])


@pytest.mark.parametrize("driver, caps, variant", [
    ("580.95.05", ["7.0"], "cu126"),          # a V100 on a CUDA 13 driver: CUDA 13 builds start at sm_75
    ("580.95.05", ["8.0", "8.0"], "cu130"),   # A100s: PyPI's build, as before
    ("580.95.05", ["7.5"], "cu130"),          # T4: sm_75 is in CUDA 13's list
    ("535.183.01", ["7.0"], "cu126"),         # an R535 driver: CUDA 12 anyway
    ("580.95.05", [None], "cu130"),           # nvidia-smi did not say: by driver alone
])
def test_the_build_is_chosen_by_compute_capability_too(driver, caps, variant):
    from lab_utils.engine.cuda_builds import DriverGPU, select_variant

    c = select_variant(driver, gpus=[DriverGPU(i, "GPU", compute_cap=cap) for i, cap in enumerate(caps)])
    assert c.variant == variant, c.reason
    if caps == ["7.0"] and driver.startswith("580"):
        assert "compute capability 7.0 (sm_70)" in c.reason and "cu130" in c.reason
        assert "sm_75" in c.reason and "cu126 has sm_70" in c.reason


def test_a_gpu_no_build_runs_is_refused_with_one_sentence():
    from lab_utils.engine.cuda_builds import DriverGPU, NoVariant, select_variant

    with pytest.raises(NoVariant, match=r"compute capability 3\.7 \(sm_37\).*SYSTEM_TORCH=1") as e:
        select_variant("580.95.05", gpus=[DriverGPU(0, "Tesla K80", compute_cap="3.7")])
    assert "\n" not in str(e.value)


def test_the_driver_query_reads_each_gpus_compute_capability_and_mode(tmp_path, monkeypatch):
    from fake_gpu import FakeGPU

    from lab_utils.engine.cuda_builds import query_driver

    FakeGPU(count=2, name=V100, major=7, driver="580.95.05",
            compute_mode="Exclusive_Process").install_nvidia_smi(tmp_path, monkeypatch)
    d = query_driver(proc_root=tmp_path / "absent")
    got = [(g.name, g.compute_cap, g.compute_mode) for g in d.gpus]
    assert got == [(V100, "7.0", "Exclusive_Process")] * 2
    assert d.version == "580.95.05"


@pytest.fixture
def v100_with_cu130(fake_gpu, monkeypatch, results_dir):
    """A V100 node (driver 580) whose torch is a CUDA 13 build: kernels for sm_75 and later only."""
    from fake_gpu import ARCHS_CU130

    monkeypatch.delenv("LAB_PROFILE", raising=False)
    return fake_gpu(count=2, name=V100, major=7, driver="580.95.05", arch_list=ARCHS_CU130)


def _one_sentence_about_sm70(msg: str) -> None:
    assert "\n" not in msg and msg.count(". ") == 0 and msg.endswith("."), msg
    assert f"{V100} has compute capability 7.0 (sm_70)" in msg, msg
    assert "sm_75, sm_80, sm_86, sm_90, sm_100, sm_120" in msg and "no kernel image is available" in msg
    assert "make venv TORCH_VARIANT=cu126" in msg and "SYSTEM_TORCH=1" in msg


def test_notebook_00_and_info_refuse_a_torch_without_this_gpus_architecture(v100_with_cu130, capsys):
    """Notebook 00's first call (session.start) and `python -m lab_utils info` stop with one sentence;
    even an explicit quick profile (torch would still pick the GPU, and fail there)."""
    from lab_utils.app.cli import main
    from lab_utils.engine.session import start
    from lab_utils.learn.errors import LabError

    for profile in (None, "quick"):
        with pytest.raises(LabError) as e:
            start(profile)
        _one_sentence_about_sm70(str(e.value))
    assert not v100_with_cu130.initialized       # decided from nvidia-smi and the build: no CUDA context
    assert main(["info"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    _one_sentence_about_sm70(err[0][len("error: "):])


def test_doctor_refuses_a_torch_without_this_gpus_architecture(v100_with_cu130, capsys):
    """`python -m lab_utils doctor`: the sentence first, the versions row fails with it, the GPU checks
    are not attempted (each would fail with 'no kernel image'), exit code 1."""
    from lab_utils.app import doctor, doctor_checks

    assert doctor.main(["--only", "versions,cuda_init,oom_under_memory_fraction"]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[1]
    assert first.startswith("error: ")
    _one_sentence_about_sm70(first[len("error: "):])
    m = doctor_checks.read_machine()
    rows = doctor.run_checks(m, tuple(doctor.BY_NAME[n] for n in ("versions", "cuda_init")))
    assert rows[0].verdict == "fail" and "sm_70" in rows[0].measured
    assert rows[0].measured.startswith("driver 580.95.05, torch ")     # its versions, then the sentence
    assert rows[1].verdict == "skipped: this torch has no kernels for this GPU (see versions)"


def test_doctor_launches_one_kernel_on_every_gpu(fake_gpu):
    """cuda_init used to pass as soon as CUDA initialised: a torch without kernels for the GPU passed it."""
    from lab_utils.app import doctor_checks

    fake_gpu(count=2, name="NVIDIA A100-SXM4-80GB")
    m = doctor_checks.read_machine()
    ran = []
    d = doctor_checks.measure_cuda_init(m, kernel=lambda i: ran.append(i) or doctor_checks.KERNEL_EXPECTED)
    assert ran == [0, 1] and doctor_checks.judge_cuda_init(d, m)[2] == "ok"

    def no_image(i):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    d = doctor_checks.measure_cuda_init(m, kernel=no_image)
    measured, _, verdict = doctor_checks.judge_cuda_init(d, m)
    assert verdict == "fail" and "GPU 0: CUDA error: no kernel image is available" in measured
    wrong = doctor_checks.measure_cuda_init(m, kernel=lambda i: 0.0)         # ran, but computed nonsense
    assert doctor_checks.judge_cuda_init(wrong, m)[2] == "fail"


def test_the_versions_row_survives_cudnn_refusing_the_gpu(monkeypatch):
    """On a V100 with a CUDA 13 torch, torch.backends.cudnn.version() itself raises (cuDNN 9.24 needs
    sm_75): found by doctor under the fake GPU, where the versions row was a RuntimeError."""
    import torch

    from lab_utils.engine import environment

    def refuses():
        raise RuntimeError("cuDNN version 92400 is not compatible with devices with SM < 7.5. Please install")

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", refuses)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)   # in the doctor's CUDA children
    stack = environment.software_stack(driver=None)
    assert stack["cuDNN"].startswith("not usable here: cuDNN version 92400 is not compatible")


def test_reading_the_cudnn_version_opens_no_cuda_context(fake_gpu):
    """Every record the notebook's kernel stores carries software_versions(); torch.backends.cudnn.version()
    initialised CUDA for its compute-capability check, so the kernel held a CUDA context after its first
    stored row (an OOM row, a skipped one), before the next launch (found by the GPT launcher test)."""
    import torch

    from lab_utils.engine import environment, hardware

    gpu = fake_gpu(count=2)
    versions = hardware.software_versions()
    assert versions["cudnn"] == (str(torch._C._cudnn.getVersionInt()) if torch.backends.cudnn.is_available()
                                 else None)
    environment.software_stack(driver=None)
    assert not gpu.initialized and gpu.contexts == set()


# --------------------------------------------------------------------------- 3. no CUDA context in the kernel


def test_the_gpts_one_gpu_run_goes_through_the_launcher_like_the_others(fake_gpu, store, monkeypatch,
                                                                        tmp_path):
    """Notebook 06 on a GPU node: T(1) ran in the Jupyter kernel (a CUDA context on GPU 0 before torchrun:
    on an EXCLUSIVE_PROCESS node rank 0 then cannot start; elsewhere it has less memory). Now every GPU
    run of notebooks 06 and 07, one device too, is a launch of its worker (THE measure's), and the kernel
    opens no context: not for placing the runs, not for checking notebook 07's variants."""
    from store_helpers import lab_for

    from lab_utils.engine import hardware, profiles
    from lab_utils.engine.plan import measure
    from lab_utils.engine.store import Record
    from lab_utils.experiments.n06_gpt_ddp import experiment as gx
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.shared.gpt_checkpoint import save_checkpoint
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    gpu = fake_gpu(count=2, name="NVIDIA A100-SXM4-80GB")
    seen = []

    def stream(module, job, nproc=2, **kw):
        seen.append((module, nproc, gpu.initialized))
        for cfg in job["configs"]:
            yield Record(job["experiment"], cfg, {"tokens_per_s": 1.0}, hardware=hardware.hardware_summary(
                "cuda", nproc))

    monkeypatch.setattr(launcher, "stream", stream)
    monkeypatch.setattr(gx, "checkpoint_path", lambda profile: tmp_path / "gpt.pt")
    s = profiles.settings(gx.Settings, "quick", scaling_devices=(1, 2, 4), scaling_batch_sizes=(8,),
                          micro_batches=(512,), effective_batch=1024)
    lab = lab_for(store, "cuda", 2)
    scaling = measure(lab, gx.SCALING_EXPERIMENT, s, verbose=False)
    assert scaling[-1].reason == "needs 4 GPUs (this machine has 2)"
    measure(lab, gx.ACCUMULATION_EXPERIMENT, s, verbose=False)
    measure(lab, gx.TRAIN_EXPERIMENT, s, verbose=False)
    save_checkpoint(tmp_path / "gpt.pt", GPT(gpt_config("tiny", vocab_size=4)), "abcd", "python-stdlib-x")
    q = profiles.settings(Q.Settings, "quick", devices=("cuda",), checkpoint=str(tmp_path / "gpt.pt"))
    assert [r.status for r in measure(lab, Q.QUANTIZATION_EXPERIMENT, q, verbose=False)] == ["ok"] * 5
    gpt = "lab_utils.experiments.n06_gpt_ddp.worker"
    assert seen == [(gpt, 1, False), (gpt, 2, False), (gpt, 2, False), (gpt, 2, False),
                    ("lab_utils.experiments.n07_quantization.worker", 1, False)]
    assert not gpu.initialized and gpu.contexts == set()


def test_dataparallel_runs_in_a_child_process_through_the_launcher(fake_gpu, store, monkeypatch):
    """Notebooks 02 and 03 (its DataParallel rows) trained nn.DataParallel in the kernel: a CUDA context on
    every GPU it used, before notebook 03's next launch. Now it is one process started by the launcher
    (nproc=1), whose record comes back like a DDP worker's."""
    from types import SimpleNamespace

    import torch

    from lab_utils.engine import config, hardware, profiles
    from lab_utils.engine.plan import make_plan, measure
    from lab_utils.engine.store import Record
    from lab_utils.experiments.n02_scaling import experiment as scaling

    gpu = fake_gpu(count=2, name="NVIDIA A100-SXM4-80GB")
    seen, moved = [], []
    real_cuda = torch.nn.Module.cuda
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: moved.append(type(self).__name__)
                        or real_cuda(self, *a, **k))

    def stream(module, job, nproc=2, **kw):
        seen.append((module, nproc, gpu.initialized))
        for cfg in job["configs"]:
            yield Record(job["experiment"], cfg, {"train_seconds": 1.0, "epoch_seconds": 1.2, "steps": 4,
                                                  "reported_epoch": 2},
                         hardware=hardware.hardware_summary("cuda", 2))

    monkeypatch.setattr(launcher, "stream", stream)
    s = profiles.settings(scaling.Settings, "quick", batch_sizes=(32,), run_batch_sizes=(32,), devices=(2,),
                          dataset="synthetic")
    lab = SimpleNamespace(store=store, profile=config.PROFILES["quick"], gpu_count=2)
    runs = [r for r in make_plan(scaling.SCALING_EXPERIMENT, s, None, "quick")
            if r.config["method"] == scaling.DP]
    recs = measure(lab, scaling.SCALING_EXPERIMENT, s, verbose=False, runs=runs)
    assert moved == [] and not gpu.initialized
    assert seen == [("lab_utils.experiments.n02_scaling.dp_worker", 1, False)]
    assert recs[0].status == "ok" and recs[0].metrics["train_seconds"] == 1.0


# --------------------------------------------------------------------------- 6. what the doctor judges


def _machine(gpus: int = 2, **kw):
    from lab_utils.app import doctor_checks

    return doctor_checks.Machine(gpus=gpus, names=["G"] * gpus, mig=[], driver="1", problem=None,
                                 profile="full", **kw)


def test_a_step_whose_timing_breaks_its_own_invariants_fails():
    """A timer on the wrong stream or device gives phases that do not add up, or an all-reduce longer
    than the step: an experiment's row with such a run fails. An exposed wait longer than the all-reduce,
    or below 0, beyond the noise, is not as expected: a warning (issue 52 C7)."""
    from lab_utils.app import doctor_experiments

    def judge_step(run, m):
        return doctor_experiments.judge_experiment({"runs": [{"label": "step", "status": "ok", **run}]}, m)

    good = {"config": "DDP 2 x 32", "train_seconds": 1.0, "data_movement_seconds": 0.1,
            "compute_seconds": 0.8, "communication_seconds": 0.1, "exposed_comm_seconds": 0.1,
            "allreduce_seconds": 0.4, "loss": 2.3, "backend": "nccl"}
    assert judge_step(good, _machine())[2] == "ok"
    gloo = {**good, "backend": "gloo", "exposed_comm_seconds": 0.6}   # gloo shares the cores with backward
    assert judge_step(gloo, _machine())[2] == "ok"
    bad = {"phases do not add up": ({"compute_seconds": 0.3}, "fail"),
           "exposed > all-reduce": ({"exposed_comm_seconds": 0.6}, "warn"),
           "all-reduce > step": ({"allreduce_seconds": 1.5, "exposed_comm_seconds": 0.1}, "fail"),
           "negative exposed": ({"exposed_comm_seconds": -0.2}, "warn")}
    for what, (change, expected) in bad.items():
        measured, _, verdict = judge_step({**good, **change}, _machine())
        assert verdict == expected, (what, measured)
    assert judge_step({**good, "exposed_comm_seconds": 0.41}, _machine())[2] == "ok"   # within noise


def test_the_all_reduce_check_has_an_expectation_for_pcie_and_says_when_it_has_none():
    from lab_utils.app import doctor_checks

    d = {"busbw_gb_per_s": 8.0, "size_bytes": 2 ** 28, "ranks": 2, "backend": "nccl", "correct": True}
    pcie = {**d, "link_gb_per_s": 31.5, "link_kind": "pcie", "link": "PCIe gen4 x16: 31.5 GB/s"}
    measured, expected, verdict = doctor_checks.judge_nccl(pcie, _machine())
    assert verdict == "ok" and "25 %" in expected          # 8 / 31.5 = 25.4 % over PCIe: as expected
    assert doctor_checks.judge_nccl({**pcie, "busbw_gb_per_s": 4.0}, _machine())[2] == "warn"
    unknown = {**d, "link_gb_per_s": None, "link_kind": "mixed",
               "link": "mixed NVLink/PCIe topology: no nominal peak"}
    measured, expected, verdict = doctor_checks.judge_nccl(unknown, _machine())
    assert verdict == "warn" and "no expectation" in measured and "mixed" in expected   # not a pass


@pytest.mark.timeout(60)
def test_a_check_that_outlives_its_limit_is_stopped_even_with_a_descendant_holding_its_pipes(tmp_path):
    """run_child killed the child's session at the limit, then waited for its pipes without a limit: a
    descendant in a session of its own (NCCL's proxy, a compiler) held them, and the doctor hung."""
    import psutil

    from lab_utils.app import doctor
    from lab_utils.engine import proc

    def _alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    t0 = time.monotonic()
    try:
        with pytest.raises(proc.TimeLimit):
            doctor.run_child([sys.executable, "-c", code], 2, tmp_path / "out.json")
        assert time.monotonic() - t0 < 30
        time.sleep(0.3)
        assert not _alive(int(pid_file.read_text()))       # the escaped descendant was stopped too
    finally:
        if pid_file.exists() and _alive(pid := int(pid_file.read_text())):
            os.kill(pid, 9)


def test_a_check_cut_short_by_the_budget_is_skipped_not_failed():
    from lab_utils.app import doctor, doctor_checks
    from lab_utils.engine import proc

    judge = doctor_checks.judge_timer_overhead
    checks = (doctor.Check("long", lambda m: {}, judge, "x", "child", 1, 100),
              doctor.Check("short", lambda m: {}, judge, "x", "child", 1, 5))

    def measure(c, m, limit):
        raise proc.TimeLimit(f"did not finish within {limit:.0f} s and was stopped")

    rows = doctor.run_checks(_machine(), checks, budget_s=30.0, measure=measure)
    assert rows[0].verdict.startswith("skipped: the doctor's time budget"), rows[0]
    assert rows[1].verdict == "fail"                        # its own limit (5 s < what was left): a fail


def test_the_doctor_runs_notebook_01s_own_code(monkeypatch, tmp_path):
    """01 ran doctor's own copy of a training loop, which proved nothing about the notebook's code: now its
    row is notebook 01's registered plan through plan.measure (one small batch, in this process on a CPU),
    into a scratch store. (02 and 03: test_doctor.py.)"""
    from dataclasses import replace

    from lab_utils.app import doctor_experiments
    from lab_utils.engine.machine import Machine as PlanMachine
    from lab_utils.experiments.n01_batch_sweep import experiment as sweep
    from lab_utils.experiments.n01_batch_sweep import worker as sweep_worker

    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "results"))
    called = []
    real = sweep_worker.run_config
    monkeypatch.setattr(sweep_worker, "run_config", lambda *a, **k: called.append("sweep") or real(*a, **k))

    def small(full):
        return replace(sweep.doctor_settings(full), batch_sizes=(8,), train_images=16, test_images=16,
                       width=4, num_workers=0)

    e = replace(sweep.SWEEP_EXPERIMENT, doctor=small)
    d = doctor_experiments.measure_experiment(e, _machine(0), timeout_s=120,
                                              machine=PlanMachine(gpus=0, cores=2))
    assert called == ["sweep"] and [r["status"] for r in d["runs"]] == ["ok"], d
    assert d["runs"][0]["train_seconds"] > 0
    assert doctor_experiments.judge_experiment(d, _machine(0))[2] == "ok"
    assert not (tmp_path / "results").exists()              # nothing stored in the lab's results


def test_the_doctor_reads_the_compute_mode_and_launches_in_the_notebooks_order(fake_gpu, monkeypatch):
    """Notebook 02's plan launches DataParallel (a process of its own) and DDP on the GPUs, then notebook 03's
    launches DDP again, with this process (the kernel) naming GPUs and storing records in between. On an
    EXCLUSIVE_PROCESS node a context left in the kernel stops the next launch: the row fails."""
    from lab_utils.app import doctor, doctor_checks, doctor_experiments
    from lab_utils.engine import launcher
    from lab_utils.engine.records import Record

    gpu = fake_gpu(count=2, compute_mode="Exclusive_Process")
    m = doctor_checks.read_machine("full")
    assert m.compute_modes == ["Exclusive_Process"] * 2
    seen = []

    def stream(module, job, nproc=2, **kw):
        seen.append((module.rsplit(".", 1)[-1], nproc, gpu.initialized))
        metrics = {"train_seconds": 1.0, "data_movement_seconds": 0.1, "compute_seconds": 0.9,
                   "communication_seconds": 0.0, "train_loss": 2.3}
        for cfg in job["configs"]:
            yield Record(job["experiment"], cfg, metrics, profile="full")

    monkeypatch.setattr(launcher, "stream", stream)
    checks = [c for c in doctor.CHECKS if c.name in ("02_scaling", "03_compute_vs_comm")]
    rows = doctor.run_checks(m, tuple(checks), measure=lambda c, m, limit: c.measure(m, timeout_s=limit))
    assert [r.verdict for r in rows] == ["ok", "ok"], [r.measured for r in rows]
    # 02: DataParallel on 1 and 2 GPUs, DDP on 1 and 2 (4: a row "needs 4 GPUs"); 03: T(1), DataParallel and
    # DDP with the probe on 2 (its own scratch store: T(1) again)
    dp, ddp = "dp_worker", "ddp_worker"
    assert seen == [(dp, 1, False), (dp, 1, False), (ddp, 1, False),
                    (ddp, 2, False), (ddp, 1, False), (dp, 1, False), (ddp, 2, False)]
    assert "compute mode Exclusive_Process" in rows[0].measured and "needs 4 GPUs" in rows[0].measured
    # a kernel that opened a context before the launches: the row fails
    real = doctor_experiments._cuda_initialized
    monkeypatch.setattr(doctor_experiments, "_cuda_initialized", lambda: True)
    d = checks[0].measure(m, timeout_s=60)
    measured, _, verdict = doctor_experiments.judge_experiment(d, m)
    assert verdict == "fail" and "CUDA was initialised in this process" in measured
    assert real() is False and not gpu.initialized


# --------------------------------------------------------------------------- 4. bf16 on a V100 (notebook 06)


def test_the_gpt_worker_runs_fp32_where_bf16_is_not_native_and_says_so(monkeypatch):
    """The full profile asks for bf16; torch.autocast accepts it on sm70 by emulation and the rows said bf16.
    The worker itself (this CPU standing in for a V100: bf16_supported answers False) now runs fp32
    and its record says so; the MFU is then against the fp32 peak."""
    import torch

    from lab_utils.engine.dist import DistContext
    from lab_utils.engine.harness import Job, execute
    from lab_utils.experiments.n06_gpt_ddp import worker as gpt_train

    monkeypatch.setattr(gpt_train, "bf16_supported", lambda device: False)
    autocasts = []
    real = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: autocasts.append(k.get("dtype")) or real(*a, **k))
    cfg = TrainConfig(size="tiny", batch_size=2, epochs=1, max_steps=1, steps_per_epoch=1, dtype="bf16",
                      max_chars=20_000, val_batches=1, corpus="stdlib")
    job = Job("gpt_scaling", "quick", [cfg.config()])
    [[rec, _]] = list(execute(gpt_train, job, DistContext()))
    assert rec.status == "ok" and autocasts == []
    assert rec.metrics["precision"] == "fp32" and rec.config["dtype"] == "bf16"     # asked bf16, ran fp32
    assert rec.metrics["precision_note"].startswith("bf16 asked; ") and "no native bf16" in rec.metrics[
        "precision_note"] and "fp32 ran" in rec.metrics["precision_note"]
    monkeypatch.setattr(gpt_train, "bf16_supported", lambda device: True)
    [[rec, _]] = list(execute(gpt_train, job, DistContext()))
    assert rec.metrics["precision"] == "bf16" and rec.metrics.get("precision_note") is None and autocasts


def test_the_gpt_tables_show_the_precision_that_ran():
    from lab_utils.engine import profiles
    from lab_utils.engine.store import Record
    from lab_utils.experiments.n06_gpt_ddp import experiment as gpt
    from lab_utils.experiments.n06_gpt_ddp import tables as gpt_tables

    note = "bf16 asked; Tesla V100-SXM2-16GB has no native bf16 (compute capability 8.0+), so fp32 ran"
    m = {"epoch_seconds": 2.0, "epoch_seconds_mean": 2.0, "backend": None, "slowest_rank": 0, "tokens": 20,
         "imbalance": 1.0, "epoch_tokens_per_s": 10.0, "mfu": None, "val_loss": 3.0, "precision": "fp32",
         "precision_note": note}
    rec = Record(gpt.SCALING, {"batch_size": 8, "devices": 1, "dtype": "bf16"}, m)
    table = gpt_tables.scaling_table([rec])
    assert list(table["precision"]) == ["fp32 (bf16 asked)"]
    assert note in gpt_tables.precision_notes([rec])[0]
    assert profiles.settings(gpt.Settings, "full").dtype == "bf16"


# --------------------------------------------------------------------------- 7. int8 on CUDA, what ran


def test_int8_on_cuda_probes_int_mm_once_and_labels_what_ran(fake_gpu, int_mm_on_cpu, monkeypatch):
    """torchao's safe_int_mm catches any torch._int_mm error and multiplies in fp32, while the row said
    cuBLAS int8. torch._int_mm is now probed once on the device (17 rows, as padded) and a failure makes
    the row say fp32 ran. The fake GPU's device is the CPU here: the operands are made on it."""
    import torch

    from lab_utils.experiments.n07_quantization import quant_variants as QV

    fake_gpu(name="NVIDIA A100-SXM4-80GB")
    calls, real = [], torch._int_mm

    def refuses(a, b):
        calls.append(a.shape[0])
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    monkeypatch.setattr(torch, "_int_mm", refuses)
    first = QV.check_variant("torchao_int8_dynamic", "cuda")
    again = QV.check_variant("torchao_int8_dynamic", "cuda")
    assert calls == [QV.INT_MM_MIN_ROWS]                                   # probed once
    assert first.ok and first.kernel == again.kernel
    assert "multiplies in fp32" in first.kernel and "CUBLAS_STATUS_NOT_SUPPORTED" in first.kernel
    assert "via torch._int_mm (cuBLAS)" not in first.kernel
    monkeypatch.setattr(QV, "_INT_MM_PROBES", {})
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    works = QV.check_variant("torchao_int8_dynamic", "cuda")
    assert "int8 x int8 -> int32 via torch._int_mm (cuBLAS)" in works.kernel
    assert "multiplies in fp32" not in works.kernel


# --------------------------------------------------------------------------- 5. one machine's records

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def _store_run(store, experiment, cfg, seconds, name, count, **metrics):
    """A record as a launch on ``count`` x ``name`` would have stored it (the config is the same on both)."""
    from lab_utils.engine.store import Record

    hw = {"device_type": "cuda", "device_name": name, "device_count": count}
    m = {"train_seconds": seconds, "steps": 10, "gradient_bytes": 4000, **metrics}
    return store.run(experiment, cfg, lambda: Record(experiment, cfg, m, hardware=hw), force=True,
                     hardware=hw)


def test_tables_pair_records_of_this_machines_gpus_only_and_say_so(fake_gpu, store):
    """A results folder shared by an H100 partition (this machine) and an A100 one: both stored T(1) and
    T(2) under the same configuration, the A100's last. Tables 2 and 3, the projection and notebook 05's
    per-rank orders used to select by method, batch and device type: the H100's T(2) met the A100's T(1).
    (Notebooks 04 and 05 now take their own records from plan.measure, reused only from these devices.)"""
    from lab_utils.experiments.n02_scaling import experiment as scaling
    from lab_utils.experiments.n03_compute_vs_comm import tables as compute_vs_comm
    from lab_utils.experiments.n04_allreduce import table3 as comm_table3

    fake_gpu(count=4, name=H100)
    one = {"method": "DDP", "record": "aggregate", "rank": None, "devices": 1, "batch_size": 32,
           "backend": "nccl", "device_type": "cuda", "width": 64}
    two = {**one, "devices": 2}
    probe = {"exposed_comm_seconds": 0.1, "allreduce_seconds": 0.3}
    for name, t1, t2 in ((H100, 10.0, 6.0), (A100, 30.0, 16.0)):
        _store_run(store, scaling.SCALING, one, t1, name, 1)
        _store_run(store, scaling.COMPUTE_VS_COMM, two, t2, name, 2, **probe)
    [row] = compute_vs_comm.comm_measurements(store)
    assert (row.t1_seconds, row.tn_seconds) == (10.0, 6.0)              # the H100's pair
    assert row.comm_a_seconds == pytest.approx(6.0 - 10.0 / 2)
    here = store.latest_here(scaling.SCALING)
    assert [r.hardware["device_name"] for r in here.records] == [H100]
    assert here.note() == (f"Records of this machine's devices only ({H100}, up to 4): 1 record of other "
                           f"devices left out ({A100} x 1).")
    # Table 3 (notebook 04) reads notebook 03's records through the same rule: the H100's (a) = 6 - 10 / 2
    derived = comm_table3._COMM_SOURCES[0]
    [a] = [m for m in comm_table3._measurements(store, devices=(2,))
           if (m.per_device_batch, m.source) == (32, derived) and m.method.startswith("DDP")]
    assert a.seconds == pytest.approx(1.0) and a.steps_per_epoch == 10
