"""Issue 25: the defects a read of the CUDA-only branches found, each run on this CPU machine.

Every test here failed on the code before the fix (09a7bdf) and passes after it; the
fake GPU (tests/fake_gpu.py, the ``fake_gpu`` fixture) stands in for the device where a
branch is only taken with CUDA. The slow-rank test with accumulation (defect 7) is in
tests/test_ddp.py next to the one without.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from store_helpers import lab_for
from torch import nn

from lab_utils.engine import hardware, memory, profiles
from lab_utils.engine.store import Record, ResultStore
from lab_utils.learn.errors import LaunchError
from lab_utils.learn.flops import mfu

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
OTHER_GPU = "NVIDIA A100-SXM4-80GB"

# --------------------------------------------------------------------------- 1. cuDNN 9 out of memory

CUDNN9 = ["cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
          "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"]


@pytest.mark.parametrize("message", CUDNN9)
def test_a_cudnn9_allocation_failure_becomes_an_oom_row_not_a_crash(message):
    """cuDNN 9 (cudnn_graph.h) reports an allocation failure as a sub-code of INTERNAL_ERROR."""
    assert memory.is_out_of_memory(RuntimeError(message))
    with memory.catch_oom() as oom:   # what every training path uses
        raise RuntimeError(message + "\nmore lines")
    assert oom.reason == f"OOM: {message}"
    log = f"[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: {message}\n"
    assert memory.mentions_out_of_memory(log)


def test_a_multinode_jobs_cudnn9_out_of_memory_is_a_row_from_the_failure_file_not_the_log(tmp_path, fake_gpu):
    """The SLURM scripts no longer search a log for out-of-memory words: the failing rank writes its failure
    file (the harness turns cuDNN 9's allocation failure into status "oom" through catch_oom, above), and
    ``measure --collect`` (lab_utils.engine.multinode.collect) stores that configuration's oom row, named with
    the
    job's GPU, and does not try the larger ones."""
    import json

    from lab_utils.engine import multinode
    from lab_utils.engine.records import Record, append_records
    from lab_utils.engine.store import ResultStore

    fake_gpu(count=2, name=OTHER_GPU)
    configs = [{"batch_size": b, "record": "aggregate", "rank": None, "tag": "nodes=2"}
               for b in (32, 128, 512)]
    hardware = {"device_type": "cuda", "device_name": OTHER_GPU, "device_count": 2}
    job = {"experiment": "scaling", "profile": "full", "configs": configs, "labels": ["b32", "b128", "b512"],
           "hardware": hardware}
    (tmp_path / "job.json").write_text(json.dumps(job))
    append_records(tmp_path / "records.jsonl", [Record("scaling", configs[0], {"train_seconds": 1.0},
                                                       profile="full", hardware=hardware)])
    (tmp_path / "failure-rank1.json").write_text(json.dumps(
        {"status": "oom", "reason": f"OOM: {CUDNN9[0]}", "rank": 1, "config_index": 1, "time": 1.0}))
    store = ResultStore("full", root=tmp_path / "store")
    rows = multinode.collect(store, tmp_path, "full")
    assert [(label, r.status) for label, r in rows] == [("b32", "ok"), ("b128", "oom"), ("b512", "skipped")]
    assert rows[1][1].reason == f"OOM: {CUDNN9[0]}"
    assert rows[2][1].reason.startswith("not run: configuration 2")
    kept = store.records("scaling")
    assert [r.status for r in kept] == ["ok", "oom"] and kept[1].hardware["device_name"] == OTHER_GPU


# --------------------------------------------------------------------------- 2. GPT out of memory under DDP


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_oom_on_one_gpt_rank_ends_the_run_and_becomes_an_oom_row(store, monkeypatch):
    """2 gloo ranks of the GPT worker; rank 1 runs out of memory in its first step (tests/gpt_oom_worker.py).

    Before: rank 1 swallowed the error and went on to all_gather_object while rank 0 sat in
    DDP's bucket all-reduce: mismatched collectives, a hang until the NCCL timeout (here the
    launch timeout), and the launch error was not caught anyway. Now rank 1 writes its failure file and
    ends itself, torchrun stops rank 0 at once, and THE measure's row says OOM with the allocator's words;
    the larger batch of the same launch is not tried.
    """
    import dataclasses

    import gpt_oom_worker

    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan, measure
    from lab_utils.experiments.n06_gpt_ddp import experiment as gpt

    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + (os.pathsep + path if path else ""))
    s = profiles.settings(gpt.Settings, "quick", scaling_devices=(2,), scaling_batch_sizes=(4, 8),
                          scaling_epochs=1, max_chars=20_000, val_batches=1, timeout_s=120)
    runs = [dataclasses.replace(r, worker=gpt_oom_worker)
            for r in make_plan(gpt.SCALING_EXPERIMENT, s, Machine(gpus=0, cores=2), "quick")]
    t0 = time.perf_counter()
    oom, larger = measure("quick", gpt.SCALING_EXPERIMENT, s, runs=runs)
    assert time.perf_counter() - t0 < 100      # no wait for a collective timeout
    assert oom.status == "oom", oom.reason
    assert oom.reason.startswith("OOM: ") and "CUDA out of memory. Tried to allocate 20.00 GiB" in oom.reason
    assert larger.status == "skipped" and larger.reason.startswith("not tried: batch 4")
    assert [r.status for r in store.records(gpt.SCALING)] == ["oom"]


def test_oom_ends_the_rank_only_under_ddp(monkeypatch, capsys):
    from lab_utils.engine import dist

    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(dist.os, "_exit", fake_exit)
    with pytest.raises(SystemExit), dist.failure_ends_rank(dist.DistContext(rank=1, world_size=2)):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
    assert exits == [dist.OOM_EXIT_CODE]
    err = capsys.readouterr().err
    assert "torch.OutOfMemoryError on rank 1 of 2: OOM: CUDA out of memory" in err
    assert memory.mentions_out_of_memory(err)
    with pytest.raises(torch.OutOfMemoryError), dist.failure_ends_rank(dist.DistContext()):  # one process
        raise torch.OutOfMemoryError("x")
    with pytest.raises(ValueError), dist.failure_ends_rank(dist.DistContext(rank=0, world_size=2)):
        raise ValueError("not memory")
    assert exits == [dist.OOM_EXIT_CODE]


# --------------------------------------------------------------------------- 3. bf16 on V100


def test_bf16_is_not_counted_as_supported_on_a_v100(fake_gpu):
    from lab_utils.engine.machine import Machine
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.n08_speed_limits import experiment as fastpath

    gpu = fake_gpu(name="Tesla V100-SXM2-16GB", major=7)
    assert torch.cuda.is_bf16_supported()            # torch's default counts emulation
    assert not hardware.bf16_supported(torch.device("cuda"))
    gpu.initialized = False
    here = Machine.here()                            # the plan's machine: nvidia-smi's capability 7.0
    assert here.gpus == 1 and not here.bf16 and not gpu.initialized
    quick = profiles.settings(fastpath.Settings, "quick")
    plan = fastpath.waterfall(quick, here, "quick")
    bf16 = next(p for p in plan if p[0] == "bf16")
    assert bf16[3] == "this GPU has no bf16 (needs Ampere or newer)" and not plan[-1][2].bf16
    a = Q.check_variant("bf16", "cuda")
    assert not a.ok and "Tesla V100-SXM2-16GB has no native bf16" in a.reason
    assert not hardware.bf16_supported("cuda")
    assert gpu.initialized  # asking torch about bf16 initializes CUDA; no tensor was made


@pytest.mark.parametrize("old_torch", [False, True])
def test_bf16_on_ampere_and_with_torch_24s_signature(fake_gpu, old_torch):
    """torch 2.4 (admitted by requirements.txt) has no including_emulation: capability decides."""
    from lab_utils.experiments.n07_quantization import experiment as Q

    fake_gpu(name=OTHER_GPU, major=8, old_torch=old_torch)
    assert Q.check_variant("bf16", "cuda").ok and hardware.bf16_supported(torch.device("cuda"))
    assert hardware.bf16_supported("cuda") and hardware.bf16_supported(torch.device("cuda", 0))
    fake_gpu(name="Tesla V100-SXM2-16GB", major=7, old_torch=old_torch)
    assert not hardware.bf16_supported(torch.device("cuda")) and not Q.check_variant("bf16", "cuda").ok
    assert not hardware.bf16_supported("cuda")
    assert hardware.bf16_supported("cpu")


# --------------------------------------------------------------------------- 4. reuse across GPU models


def relabel(store: ResultStore, experiment: str, name: str = OTHER_GPU) -> None:
    """Rewrite every stored record of ``experiment`` as if measured on another GPU model."""
    p = store.path(experiment)
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    for d in rows:
        d["hardware"]["device_name"] = name
    p.write_text("".join(json.dumps(d) + "\n" for d in rows))


def test_the_store_reuses_a_record_only_on_the_same_devices(store):
    here = hardware.hardware_summary("cpu", 1)
    calls = []

    def measure():
        calls.append(1)
        return {"x": len(calls)}

    first = store.run("e", {"a": 1}, measure, hardware=here)
    assert store.run("e", {"a": 1}, measure, hardware=here).metrics == first.metrics == {"x": 1}
    assert first.hardware == here
    relabel(store, "e")
    assert store.reusable("e", {"a": 1}, here) is None
    assert store.run("e", {"a": 1}, measure, hardware=here).metrics == {"x": 2}   # measured again
    two = {**here, "device_count": 2}
    assert store.reusable("e", {"a": 1}, two) is None                              # another count
    assert store.reusable("e", {"a": 1}) is not None   # default: this machine's device, as append records it


def test_fast_path_benchmark_is_measured_again_on_another_gpu_model(store):
    from lab_utils.engine.plan import measure
    from lab_utils.experiments.n08_speed_limits import experiment as fastpath

    s = fastpath.Settings(width=4, train_images=64, data_images=64, batch_size=32, num_workers=0,
                          data_min_seconds=0.0, compile=False, dataset="synthetic").validate()
    first = measure(lab_for(store), fastpath.LOADER_EXPERIMENT, s)
    assert [r.metrics["run_id"] for r in measure(lab_for(store), fastpath.LOADER_EXPERIMENT, s)] == [
        r.metrics["run_id"] for r in first]
    relabel(store, "bench_data")
    again = measure(lab_for(store), fastpath.LOADER_EXPERIMENT, s)
    assert again[0].metrics["run_id"] != first[0].metrics["run_id"]
    assert {r.hardware["device_name"] for r in again} == {hardware.device_name("cpu")}


def test_compute_step_is_measured_again_on_another_gpu_model(store):
    from dataclasses import replace

    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import measure
    from lab_utils.experiments.n04_allreduce import experiment as comm

    s = replace(profiles.settings(comm.Settings, "quick"), batch_sizes=(2,), width=2, compute_steps=1,
                compute_warmup=0)

    def step():
        return measure(lab_for(store), comm.COMPUTE_STEP_EXPERIMENT, s, verbose=False,
                       machine=Machine(gpus=0, cores=2))[0]

    first = step()
    assert step().timestamp == first.timestamp
    relabel(store, comm.COMPUTE)
    step()
    assert len(store.records(comm.COMPUTE)) == 2


def test_gpt_and_quantization_rows_are_measured_again_on_another_gpu_model(store, monkeypatch, tmp_path):
    """THE measure's reuse check, through notebooks 06 and 07's plans (their in-process runs, the workers'
    run_config counted): reused on the same devices, measured again on another GPU model."""
    from lab_utils.engine.plan import measure
    from lab_utils.experiments.n06_gpt_ddp import experiment as gpt
    from lab_utils.experiments.n06_gpt_ddp import worker as gpt_train
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.n07_quantization import worker as quantize
    from lab_utils.experiments.shared.gpt_checkpoint import save_checkpoint
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    calls = []

    def run_config(config, job, ctx, state):
        calls.append(job.experiment)
        return [Record(job.experiment, dict(config), {"m": 1}, hardware=hardware.hardware_summary("cpu", 1))]

    monkeypatch.setattr(gpt_train, "run_config", run_config)
    monkeypatch.setattr(quantize, "run_config", run_config)
    save_checkpoint(tmp_path / "gpt.pt", GPT(gpt_config("tiny", vocab_size=4)), "abcd", "python-stdlib-x")
    acc = profiles.settings(gpt.Settings, "quick", micro_batches=(4,), effective_batch=4)
    q = profiles.settings(Q.Settings, "quick", variants=("fp32",), devices=("cpu",),
                          checkpoint=str(tmp_path / "gpt.pt"))
    for _ in range(2):
        measure(lab_for(store), gpt.ACCUMULATION_EXPERIMENT, acc, verbose=False)
        measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT, q, verbose=False)
    assert calls == [gpt.ACCUMULATION, Q.EXPERIMENT]
    relabel(store, gpt.ACCUMULATION)
    relabel(store, Q.EXPERIMENT)
    measure(lab_for(store), gpt.ACCUMULATION_EXPERIMENT, acc, verbose=False)
    measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT, q, verbose=False)
    assert calls == [gpt.ACCUMULATION, Q.EXPERIMENT] * 2


def test_large_batch_and_allreduce_rows_are_measured_again_on_another_gpu_model(store, monkeypatch):
    from lab_utils.engine import launcher
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import measure
    from lab_utils.experiments.n04_allreduce import experiment as comm
    from lab_utils.experiments.n05_large_batch import experiment as lb

    launched = []

    def fake_launch(module, job, nproc=2, **kw):  # what the worker's rank 0 hands back: a record per config
        launched.append(module)
        for cfg in job["configs"]:
            yield Record(job["experiment"], cfg, {"count": 2},
                         hardware=hardware.hardware_summary("cpu", nproc))

    monkeypatch.setattr(launcher, "stream", fake_launch)
    cpu = Machine(gpus=0, cores=2)
    tiny = {"epochs": 1, "width": 2, "train_images": 64, "test_images": 20, "small_batch": 8,
            "large_batch_per_device": 16}
    s = profiles.settings(lb.Settings, "quick", **tiny)
    for _ in range(2):
        measure(lab_for(store), lb.LARGE_BATCH_EXPERIMENT, s, verbose=False, machine=cpu)
    assert len(launched) == 2  # the reference, then the four large runs in one launch; then reused
    relabel(store, lb.EXPERIMENT)
    measure(lab_for(store), lb.LARGE_BATCH_EXPERIMENT, s, verbose=False, machine=cpu)
    assert len(launched) == 4

    bs = profiles.settings(comm.Settings, "quick", bench_ranks=(2,), max_bytes=16, iters=1, warmup=0)
    launched.clear()
    for _ in range(2):
        measure(lab_for(store), comm.ALLREDUCE_BENCH_EXPERIMENT, bs, verbose=False, machine=cpu)
    # the two sizes, one launch, then reused
    assert launched == ["lab_utils.experiments.n04_allreduce.allreduce_worker"]
    relabel(store, comm.BENCH)
    measure(lab_for(store), comm.ALLREDUCE_BENCH_EXPERIMENT, bs, verbose=False, machine=cpu)
    assert launched == ["lab_utils.experiments.n04_allreduce.allreduce_worker"] * 2


# --------------------------------------------------------------------------- 5. MIG slices

MIG_NAME = "NVIDIA A100-SXM4-40GB MIG 1g.5gb"


def test_a_mig_slice_gets_no_peak_and_says_why():
    assert hardware.peak_flops_per_s("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    for precision in ("fp32", "tf32", "bf16", "fp16"):
        assert hardware.peak_flops_per_s(MIG_NAME, precision) is None
    assert mfu(10e12, 1.0, hardware.peak_flops_per_s(MIG_NAME, "bf16"), 1) is None
    assert hardware.mig_profile(MIG_NAME) == "1g.5gb"
    assert "MIG slice 1g.5gb: no peak" in hardware.peak_note(MIG_NAME)
    assert hardware.peak_note("NVIDIA A100-SXM4-40GB") is None and hardware.peak_note("cpu (x)") is None


def test_a_mig_slice_is_named_as_torch_names_it_and_has_no_mfu(fake_gpu):
    from lab_utils.experiments.n00_environment.tables import environment_rows
    from lab_utils.experiments.n06_gpt_ddp.worker import device_peak
    from lab_utils.experiments.n08_speed_limits import tables as fastpath_tables

    gpu = fake_gpu(name="NVIDIA A100-SXM4-40GB", mig="1g.5gb", total_memory=5 * 2 ** 30)
    name, peak, precision = device_peak(torch.device("cuda", 0), "bf16")
    assert (name, peak, precision) == (MIG_NAME, None, "bf16")   # MFU None, not 7x too low
    gpu.initialized = False
    assert hardware.device_name("cuda") == MIG_NAME and not gpu.initialized  # nvidia-smi -L: no context
    assert hardware.visible_gpu_names() == [MIG_NAME]
    rows = environment_rows("quick", "test")
    gpu_rows = [r for r in rows if str(r.get("item", "")).startswith("GPU 0")]
    assert gpu_rows and "MIG slice 1g.5gb: no peak" in gpu_rows[0]["value"]
    rec = Record("bench_train", {"step": "spec", "position": 0}, metrics={"images_per_s": 1.0},
                 hardware={"device_name": MIG_NAME})
    assert fastpath_tables.waterfall_table([rec])["percent_of_peak"][0] == "none (MIG slice)"


# --------------------------------------------------------------------------- 6. int8 with M <= 16 on CUDA


def test_int8_matmuls_of_few_rows_are_padded_to_what_cublas_needs(monkeypatch, fake_gpu, int_mm_on_cpu):
    """torch._int_mm on CUDA refuses M <= 16 rows and torchao then silently multiplies in fp32.
    Here torch._int_mm is wrapped to refuse like cuBLAS (this CPU's _int_mm takes any M), the
    model is the quantized GPT on the CPU, and the padding is the one quantize_model adds on CUDA."""
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.n07_quantization import quant_model as QM
    from lab_utils.experiments.n07_quantization import quant_timing as QT
    from lab_utils.experiments.n07_quantization import quant_variants as QV
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=64)).eval()
    qm = Q.quantize_model(model, "torchao_int8_dynamic", "cpu")
    prompt = torch.randint(0, 64, (1, 8))
    reference = QT.greedy_decode(qm, prompt, 3, 64)   # unpadded, on the CPU's _int_mm
    ref_logits = QT._logits(qm, prompt)
    rows, real = [], torch._int_mm

    def cublas_int_mm(a, b):
        rows.append(a.shape[0])
        if a.shape[0] <= 16:
            raise RuntimeError(f"self.size(0) needs to be greater than 16, but got {a.shape[0]}")
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", cublas_int_mm)
    hooked = QM.pad_int8_matmul_rows(qm, "torchao_int8_dynamic", torch.device("cuda"))
    assert hooked == sum(isinstance(m, nn.Linear) for m in qm.modules())
    assert torch.equal(QT.greedy_decode(qm, prompt, 3, 64), reference)   # same tokens
    assert torch.equal(QT._logits(qm, prompt), ref_logits)                # bit-identical logits
    assert rows and min(rows) == QV.INT_MM_MIN_ROWS                      # every int8 matmul ran padded
    assert QM.pad_int8_matmul_rows(model, "torchao_int8_dynamic", "cpu") == 0   # the CPU takes any M
    assert QM.pad_int8_matmul_rows(model, "torchao_int8_weight_only", "cuda") == 0
    fake_gpu()
    assert "padded to 17 rows" in Q.check_variant("torchao_int8_dynamic", "cuda").kernel


# --------------------------------------------------------------------------- 8. compiled timed epoch


@pytest.mark.timeout(180)
def test_the_compiled_timed_epoch_runs_static_graphs_only(monkeypatch):
    """The warm-up compiles the full and the last, partial batch shape. Without dynamic=False the
    second compile is a dynamic-shape graph (symbolic batch size), which the timed epoch then runs
    for every batch. A backend that records each graph's input shapes tells them apart."""
    from lab_utils.experiments.n08_speed_limits import fast_train
    from lab_utils.experiments.shared import data

    graphs = []

    def recording_backend(gm, example_inputs):
        dynamic = any(isinstance(s, torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder"
                      for v in [n.meta.get("example_value")] if v is not None
                      for s in (v.shape if isinstance(v, torch.Tensor) else [v]))
        graphs.append(dynamic)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=recording_backend, **kw))
    torch._dynamo.reset()
    trainer = fast_train.build_trainer(fast_train.TrainOptions(loader="device", compile=True), 4, "cpu")
    split = data.load_split(True, 40, "synthetic")
    loader = data.device_loader(split, torch.device("cpu"), 16, seed=0)
    fast_train.warm_up(trainer, loader, 1, len(split) % 16)
    before = fast_train.compiled_graphs()
    trainer.epoch(loader)
    assert fast_train.compiled_graphs() == before          # nothing compiled inside the timed epoch
    assert graphs == [False, False]                       # one static graph per shape
    torch._dynamo.reset()


# --------------------------------------------------------------------------- 9. smaller ones


def test_the_ddp_worker_frees_the_optimizer_before_emptying_the_cache(monkeypatch):
    """The LR scheduler holds the optimizer (and the parameters and momentum through it): deleting
    the model and the optimizer alone left all of it alive when the cache was emptied."""
    import torch.distributed as dist

    from lab_utils.engine import dist as labdist
    from lab_utils.engine.harness import Job
    from lab_utils.experiments.n02_scaling import ddp_worker as ddp
    from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
    from lab_utils.learn import loop

    refs, alive_at_free = [], []
    real_make = loop.make_optimizer

    def make_optimizer(model, **kw):
        opt = real_make(model, **kw)
        refs.append(weakref.ref(opt))
        return opt

    def free_device_memory(device=None):
        gc.collect()
        alive_at_free.append([r() is not None for r in refs])

    monkeypatch.setattr(ddp, "make_optimizer", make_optimizer)
    monkeypatch.setattr(ddp, "free_device_memory", free_device_memory)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(labdist.free_port())}.items():
        monkeypatch.setenv(k, v)
    config = RunConfig(devices=1, backend="gloo", batch_size=8, epochs=1, width=2, train_images=16,
                       dataset="synthetic", num_workers=0).config()
    job = Job("scaling", "quick", [config])
    ctx = labdist.init_distributed("gloo")
    try:
        recs = ddp.run_config(config, job, ctx, ddp.prepare(job, ctx))
    finally:
        dist.destroy_process_group()
    assert recs and recs[0].status == "ok"
    assert alive_at_free == [[False]]


def test_dataparallel_peak_memory_is_every_gpus(fake_gpu):
    from lab_utils.learn import devices

    gpu = fake_gpu(count=2)
    dp = nn.DataParallel(nn.Linear(2, 2))
    gpus = devices.model_devices(dp, torch.device("cuda", 0))
    assert gpus == [torch.device("cuda", 0), torch.device("cuda", 1)]
    gpu.allocate(3 * 2 ** 30, 0)
    gpu.allocate(5 * 2 ** 30, 1)
    assert [devices.peak_memory(d) for d in gpus] == [3 * 2 ** 30, 5 * 2 ** 30]
    assert devices.model_devices(nn.Linear(2, 2), torch.device("cuda", 0)) == [torch.device("cuda", 0)]


def test_the_kernel_opens_no_cuda_context_before_ddp_launches(store, monkeypatch, fake_gpu):
    """Notebook 02 on 2 GPUs: the kernel names the GPU for the store's reuse check (nvidia-smi -L) and
    launches every run, DDP and DataParallel (a process of its own), through the launcher; at each launch
    CUDA is not initialized in the kernel, so rank 0 has as much memory as rank 1."""
    from lab_utils.engine import config, launcher
    from lab_utils.engine.plan import measure
    from lab_utils.experiments.n02_scaling import experiment as scaling

    gpu = fake_gpu(count=2, name="Fake GPU")
    seen = []

    def launch(module, job, nproc=2, **kw):
        seen.append((module, nproc, gpu.initialized, set(gpu.contexts)))
        yield from ()

    monkeypatch.setattr(launcher, "stream", launch)
    lab = SimpleNamespace(store=store, profile=config.PROFILES["quick"], gpu_count=2)
    s = profiles.settings(scaling.Settings, "quick", batch_sizes=(32,), run_batch_sizes=(32,), devices=(2,),
                          dataset="synthetic")
    with pytest.raises(LaunchError):   # the fake launches write no record: the runs are rows that say so
        measure(lab, scaling.SCALING_EXPERIMENT, s)
    assert sorted(seen) == [("lab_utils.experiments.n02_scaling.ddp_worker", 2, False, set()),
                            ("lab_utils.experiments.n02_scaling.dp_worker", 1, False, set())]
