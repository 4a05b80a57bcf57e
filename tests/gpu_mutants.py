"""Realistic bugs in the CUDA-only sites, as data: a site counts as tested when its mutant fails a test.

Every CUDA-only site of the inventory (tests/gpu_branches.py) has at least one mutant here, or is left
to a ``python -m lab_utils doctor`` check that runs its code (the inventory names it; the suite checks
that the check reaches the site). A mutant is

- ``site``: the inventory's key (file under ``lab_utils/``, function, condition, occurrence);
- ``original``: text that occurs exactly once in that file, and ``mutated``: what replaces it;
- ``models``: the bug it stands for (drop a synchronize, the wrong device index, ``memory_allocated``
  instead of the peak, bf16 counted with emulation, ms taken for s, a constant changed, a CUDA flag
  forced to False, ...);
- ``tests``: tests to run besides the site's own (``file.py::name``, in tests/), where another test is
  the one that sees the bug.

``make mutants`` (tools/mutants.py) applies each mutant in a scratch copy of the repository, runs its
tests with a time limit, stores the verdicts in tests/gpu_mutants_results.json and rewrites
tests/GPU_BRANCHES.md. ``make test`` does not run them; tests/test_gpu_branches.py checks that this
table and the markdown match the code. When code moves (issue 34), update ``site`` and the snippets
here, run ``make mutants``, and commit the three files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug in one CUDA-only site."""

    site: tuple[str, str, str, int]
    original: str
    mutated: str
    models: str
    tests: tuple[str, ...] = ()

    @property
    def file(self) -> str:
        return self.site[0]

    @property
    def ident(self) -> str:
        """A short, stable name: the file's stem, the function, and a digest of the change."""
        import hashlib

        digest = hashlib.sha1(f"{self.file}\n{self.original}\n{self.mutated}".encode()).hexdigest()[:8]
        return f"{self.file.rsplit('/', 1)[-1].removesuffix('.py')}.{self.site[1]}.{digest}"


def M(file: str, function: str, condition: str, original: str, mutated: str, models: str, *, n: int = 1,
      tests: tuple[str, ...] = ()) -> Mutant:
    return Mutant((file, function, condition, n), original, mutated, models, tests)


FS = "test_gpu_first_session.py::"

MUTANTS: tuple[Mutant, ...] = (
    # core/comm_hooks.py
    M("core/comm_hooks.py", "AllReduceTimer.__init__", "dev.type == 'cuda'",
      'self.cuda = dev.type == "cuda"', "self.cuda = False",
      "AllReduceTimer.cuda hard-coded to False: the host clock times asynchronous GPU work"),
    M("core/comm_hooks.py", "AllReduceTimer._stamp", "self.cuda",
      "ev = torch.cuda.Event(enable_timing=True)", "ev = torch.cuda.Event()",
      "a CUDA event made without enable_timing (elapsed_time refuses it)"),
    M("core/comm_hooks.py", "AllReduceTimer._since_ref", "self.cuda",
      "return self._ref.elapsed_time(stamp) / 1e3  # ms -> s", "return self._ref.elapsed_time(stamp)",
      "milliseconds taken for seconds"),
    M("core/comm_hooks.py", "AllReduceTimer.finish_step", "self.cuda",
      "            torch.cuda.synchronize(self.device)\n", "            pass\n",
      "drop the synchronize: the events are read before the device reached them"),
    M("core/comm_hooks.py", "_barrier", "device.type == 'cuda' and dist.get_backend() == 'nccl'",
      "dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])",
      "dist.barrier(device_ids=[0])", "the wrong device index: every rank's barrier on GPU 0"),
    # core/data.py
    M("core/data.py", "make_loaders", "torch.cuda.is_available()",
      "    train_ds, test_ds = _subset(train_ds, train_images), _subset(test_ds, test_images)\n"
      "    if pin_memory is None:\n        pin_memory = torch.cuda.is_available()",
      "    train_ds, test_ds = _subset(train_ds, train_images), _subset(test_ds, test_images)\n"
      "    if pin_memory is None:\n        pin_memory = False",
      "pinned memory forgotten: host-to-device copies cannot overlap"),
    M("core/data.py", "spec_loader", "torch.cuda.is_available()",
      "    g.manual_seed(seed)\n    if pin_memory is None:\n        pin_memory = torch.cuda.is_available()",
      "    g.manual_seed(seed)\n    if pin_memory is None:\n        pin_memory = False",
      "pinned memory forgotten in the spec loader"),
    # core/dist.py
    M("core/dist.py", "choose_backend", "torch.cuda.is_available()",
      "gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0", "gpus = 0",
      "the GPU count read as 0: gloo between CPU processes on a GPU node"),
    M("core/dist.py", "choose_backend", "gpus >= local_world_size and gpus > 0 and dist.is_nccl_available()",
      "if gpus >= local_world_size and gpus > 0", "if gpus > 0",
      "NCCL chosen with more ranks than GPUs (two ranks share a GPU)"),
    M("core/dist.py", "init_distributed", "device == 'cuda'",
      '    elif device == "cuda":\n        backend = "nccl"', '    elif device == "cuda":\n        backend = "gloo"',
      "--device cuda joins gloo: collectives on GPU tensors fail"),
    M("core/dist.py", "init_distributed", "use_cuda",
      'use_cuda = device != "cpu" and torch.cuda.is_available()', "use_cuda = False",
      "a CUDA flag forced to False: one process without torchrun trains on the CPU"),
    M("core/dist.py", "init_distributed", "backend == 'nccl'",
      'dev = torch.device("cuda", local_rank)', 'dev = torch.device("cuda", 0)',
      "the wrong device index: every rank on GPU 0"),
    M("core/dist.py", "init_distributed", "backend == 'nccl'",
      "        torch.cuda.set_device(dev)\n", "",
      "set_device dropped: NCCL and the caching allocator use GPU 0 on every rank"),
    M("core/dist.py", "init_distributed", "torch.cuda.device_count() <= local_rank",
      "if torch.cuda.device_count() <= local_rank:", "if torch.cuda.device_count() < local_rank:",
      "an off-by-one: LOCAL_RANK == GPU count passes the check"),
    M("core/dist.py", "failure_ends_rank", "ctx.backend == 'nccl'",
      'if ctx.backend == "nccl":', 'if ctx.backend == "gloo":',
      "the wrong backend: a failing NCCL rank tears its group down and hangs"),
    # core/environment.py
    M("core/environment.py", "gpu_node_problem", "driver is None or not driver.gpus",
      "_fix(cuda, driver)", "_fix(None, driver)",
      "a CUDA build that is shown no GPU told to reinstall torch (the CPU-only build's fix)"),
    M("core/environment.py", "environment_rows", "driver is not None and driver.gpus",
      '"value": f"{g.name}, {mem} (listed by the driver; torch cannot use it)"', '"value": f"{g.name}, {mem}"',
      "a GPU torch cannot use listed as if the runs used it"),
    # core/handmade.py
    M("core/handmade.py", "memory_use", "device.type == 'cuda'",
      "return MemoryUse(held, torch.cuda.max_memory_allocated(device) - start), it",
      "return MemoryUse(held, torch.cuda.memory_allocated(device) - start), it",
      "notebook 09's peak read as memory_allocated after the step (its temporaries gone)"),
    M("core/handmade.py", "memory_use", "device.type == 'cuda'",
      "        torch.cuda.reset_peak_memory_stats(device)\n        step(it)", "        step(it)",
      "the peak counter not reset before the measured step: the build's spike read as the step's peak"),
    M("core/handmade.py", "memory_use", "device.type == 'cuda'",
      "start = torch.cuda.memory_allocated(device)", "start = 0",
      "what other code held before the build counted as the implementation's bytes"),
    # core/machine.py
    M("core/machine.py", "Machine.device", "self.gpus", 'return "cuda" if self.gpus else "cpu"', 'return "cpu"',
      "a GPU machine's one-device runs planned on the CPU"),
    M("core/machine.py", "Machine.describe", "self.gpus", "return f\"{self.gpus} x {self.gpu_name or 'GPU'}\"",
      "return f\"{self.gpu_name or 'GPU'}\"", "the GPU count dropped from the machine's description"),
    M("core/machine.py", "Machine.here", "gpus", 'gpu_name=device_name("cuda") if gpus else None',
      "gpu_name=None", "the GPU's name not recorded (every GPU looks the same to the reuse check)"),
    M("core/machine.py", "_native_bf16", "not torch.cuda.is_initialized()",
      "    if not torch.cuda.is_initialized():", "    if torch.cuda.is_initialized():",
      "the guard inverted: torch asked before CUDA is up (a context opened), nvidia-smi's answer after"),
    M("core/environment.py", "gpu_node_problem", "torch.cuda.is_available()",
      '        return arch_problem(cuda_builds.query_driver() if driver == "detect" else driver)',
      "        return None",
      "torch sees a GPU, so nothing is checked (a build without the GPU's kernels passes)",
      tests=(FS + "test_notebook_00_and_info_refuse_a_torch_without_this_gpus_architecture",)),
    M("core/environment.py", "check_gpu_node", "torch.cuda.is_available()",
      'if torch.cuda.is_available():  # torch would pick', 'if False:  # torch would pick',
      "the arch refusal skipped for an explicit quick profile (the lab then crashes on the GPU)"),
    # core/hardware.py
    M("core/hardware.py", "bf16_supported", "dev.type != 'cuda' or not torch.cuda.is_available()",
      "return bool(torch.cuda.is_bf16_supported(including_emulation=False))",
      "return bool(torch.cuda.is_bf16_supported())", "bf16 counted with emulation (True on a V100)"),
    M("core/hardware.py", "bf16_supported", "dev.type != 'cuda' or not torch.cuda.is_available()",
      "return torch.cuda.get_device_capability(index)[0] >= 8", "return torch.cuda.get_device_capability(index)[0] >= 7",
      "torch 2.4's capability rule off by one generation: Volta counted as bf16-native"),
    M("core/hardware.py", "cudnn_build_version", "torch.cuda.is_initialized()",
      "            return None, first_line(e, 160)", "            raise",
      "cuDNN's refusal of the GPU escapes as a RuntimeError (doctor's versions row a traceback)"),
    M("core/hardware.py", "device_name", "torch.cuda.is_available()",
      '    if device is None:\n        device = "cuda" if torch.cuda.is_available() else "cpu"\n    dev = torch.device(device)',
      '    if device is None:\n        device = "cpu"\n    dev = torch.device(device)',
      "the default device named as the CPU on a GPU node"),
    M("core/hardware.py", "device_name", "dev.type == 'cuda'",
      "            index = dev.index or 0  # no CUDA context yet", "            index = 0  # no CUDA context yet",
      "the wrong device index: every GPU named as GPU 0"),
    M("core/hardware.py", "device_name", "not torch.cuda.is_initialized()",
      "        if not torch.cuda.is_initialized():\n            names = visible_gpu_names()",
      "        if True:\n            names = visible_gpu_names()",
      "nvidia-smi's names even after CUDA is up (CUDA_VISIBLE_DEVICES reordering ignored by torch's)",
      tests=("test_gpu_branches.py::test_device_name_asks_torch_once_cuda_is_up",)),
    M("core/hardware.py", "gpus", "not torch.cuda.is_available()",
      "out.append(GPUInfo(index=i, name=p.name, memory_bytes=int(p.total_memory)))",
      "out.append(GPUInfo(index=i, name=p.name, memory_bytes=int(p.total_memory) // 2 ** 20))",
      "memory in MiB where bytes are promised"),
    M("core/hardware.py", "gpu_count", "torch.cuda.is_available()",
      "    return torch.cuda.device_count() if torch.cuda.is_available() else 0",
      "    return 1 if torch.cuda.is_available() else 0", "one GPU counted on a multi-GPU node"),
    M("core/hardware.py", "hardware_summary", "torch.cuda.is_available()",
      '    if device is None:\n        device = "cuda" if torch.cuda.is_available() else "cpu"\n    dtype =',
      '    if device is None:\n        device = "cpu"\n    dtype =',
      "a record measured on the GPU says cpu (the store's reuse check then compares CPU names)"),
    M("core/hardware.py", "hardware_summary", "dtype == 'cuda'",
      'device_count = gpu_count() if dtype == "cuda" else 1', "device_count = 1",
      "the device count of a GPU record fixed at 1"),
    # core/loop.py
    M("core/loop.py", "default_device", "torch.cuda.is_available()",
      'return torch.device("cuda" if torch.cuda.is_available() else "cpu")', 'return torch.device("cpu")',
      "the default device is the CPU on a GPU node"),
    M("core/loop.py", "peak_memory", "device.type == 'cuda'",
      "return int(torch.cuda.max_memory_allocated(device))", "return int(torch.cuda.memory_allocated(device))",
      "memory_allocated instead of the peak"),
    M("core/loop.py", "reset_peak_memory", "device.type == 'cuda'",
      "        torch.cuda.reset_peak_memory_stats(device)\n\n\ndef model_devices",
      "        pass\n\n\ndef model_devices", "the peak counter never reset: a later batch reports an earlier peak"),
    M("core/loop.py", "model_devices", "isinstance(model, nn.DataParallel) and device.type == 'cuda' and model.device_ids",
      "return [torch.device(\"cuda\", i) for i in model.device_ids]", "return [device]",
      "DataParallel's peak read on GPU 0 only (the replicas' memory ignored)"),
    M("core/loop.py", "train_steps", "device.type == 'cuda'",
      '    comm_timer = o.comm_timer\n    non_blocking = device.type == "cuda"',
      "    comm_timer = o.comm_timer\n    non_blocking = False",
      "blocking host-to-device copies: the copy of the next batch cannot overlap the step"),
    M("core/loop.py", "evaluate", "device.type == 'cuda'",
      'non_blocking = device.type == "cuda"  # from pinned memory', "non_blocking = False  # from pinned memory",
      "blocking copies in the evaluation loop"),
    # core/memory.py
    M("core/memory.py", "free_device_memory", "on_cuda and torch.cuda.is_available() and torch.cuda.is_initialized()",
      "        torch.cuda.empty_cache()", "        pass",
      "the cache not emptied: the next attempt starts with the failed one's blocks reserved"),
    M("core/memory.py", "resolve_cuda_device", "dev.type != 'cuda'",
      'dev = torch.device("cuda", torch.cuda.current_device())', 'dev = torch.device("cuda", 0)',
      "the wrong device index: the current device ignored"),
    # core/timing.py
    M("core/timing.py", "synchronize", "dev.type == 'cuda'",
      "        torch.cuda.synchronize(dev)", "        torch.cuda.synchronize()",
      "synchronize the current device instead of the timed one"),
    M("core/timing.py", "synchronize", "dev.type == 'cuda'",
      "        torch.cuda.synchronize(dev)", "        pass", "drop a synchronize: the timer measures the launch"),
    # experiments/bench_timers.py
    M("experiments/bench_timers.py", "main", "device.type == 'cuda'",
      'sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES',
      'sizes = CPU_SIZES if device.type == "cuda" else CPU_SIZES',
      "the CPU's tiny models and CPU clock on a GPU"),
    # experiments/comm.py
    M("experiments/comm.py", "plan_bench", "gpus >= 2",
      "    if gpus >= 2:\n        backend, device, most", "    if gpus >= 1:\n        backend, device, most",
      "NCCL planned on one GPU (two ranks would share it)"),
    M("experiments/comm.py", "plan_bench", "gpus >= 2", '"cuda", gpus, {*s.bench_ranks, gpus}',
      '"cuda", gpus, set(s.bench_ranks)', "the full node's rank count missing from the benchmark"),
    M("experiments/comm.py", "plan_bench", "device == 'cuda'", 'lacks = "GPUs" if device == "cuda"',
      'lacks = "devices" if device == "cuda"', "a rank count the node lacks does not say it needs GPUs"),
    M("experiments/comm.py", "plan_compute", "device != 'cuda'", 'in_process=device != "cuda"', "in_process=True",
      "the GPU's compute step planned in the notebook's kernel (a CUDA context before the launches)"),
    # experiments/fastpath_tables.py
    M("experiments/fastpath_tables.py", "trace_notes", "on_gpu",
      "f\"self time = {'GPU kernel' if on_gpu else 'CPU'} time", "f\"self time = {'CPU'} time",
      "the trace's self time called CPU time on a GPU"),
    M("experiments/fastpath_tables.py", "trace_notes", "on_gpu",
      "f\"{'GPU total kernel time' if on_gpu else 'self CPU time of all operators'}. \"",
      "f\"{'self CPU time of all operators'}. \"", "the percentage's base called CPU time on a GPU", n=2),
    # experiments/large_batch.py, large_batch_tables.py
    M("experiments/large_batch.py", "DevicePlan.device", "self.backend == 'nccl'",
      'return "cuda" if self.backend == "nccl" else "cpu"', 'return "cpu"',
      "the large runs on GPUs planned as CPU runs (the reuse check names the CPU)"),
    M("experiments/large_batch.py", "plan_devices", "gpus >= 1",
      'use, backend, kind = _largest_divisor(want, gpus), "nccl", "GPU"',
      'use, backend, kind = _largest_divisor(want, gpus), "gloo", "GPU"',
      "the large batch on GPUs planned with gloo"),
    M("experiments/large_batch.py", "plan_devices", "gpus < want",
      'notes = [f"this machine has {gpus} GPU(s)"] if gpus < want else []', "notes = []",
      "fewer GPUs than asked, silently"),
    M("experiments/large_batch.py", "plan_accounting", "gpus >= 2", 'if gpus >= 2 else (2, "gloo")',
      'if gpus >= 1 else (2, "gloo")', "the ledger on one GPU with NCCL (two ranks would share it)"),
    M("experiments/large_batch.py", "plan_accounting", "backend == 'nccl'",
      'device="cuda" if backend == "nccl" else "cpu"', 'device="cpu"',
      "the ledger on GPUs planned as a CPU run"),
    M("experiments/large_batch_tables.py", "large_batch_table", "rec.config.get('backend') == 'nccl'",
      "\"devices\": f\"{run.devices} x {'GPU' if rec.config.get('backend') == 'nccl' else 'CPU process'}\"",
      "\"devices\": f\"{run.devices} x {'CPU process'}\"", "GPU rows labelled as CPU processes"),
    # workers/quant_variants.py, quant_model.py
    M("workers/quant_variants.py", "check_variant", "dev == 'cuda'",
      'mode = "(TF32 allowed)" if torch.backends.cuda.matmul.allow_tf32 else "(true fp32)"',
      'mode = "(true fp32)"', "the row says true fp32 while TF32 is allowed"),
    M("workers/quant_variants.py", "check_variant", "dev == 'cuda'",
      '            if not bf16_supported("cuda"):', '            if not torch.cuda.is_bf16_supported():',
      "bf16 counted with emulation (a V100's emulated bf16 measured as bf16)", n=2,
      tests=("test_gpu_defects.py::test_bf16_is_not_counted_as_supported_on_a_v100",)),
    M("workers/quant_variants.py", "check_variant", "not bf16_supported('cuda')",
      'return Availability(True, kernel="cuBLAS bf16 GEMM (tensor cores)")',
      'return Availability(False, "no bf16 on this GPU")', "native bf16 refused"),
    M("workers/quant_variants.py", "check_variant", "dev == 'cuda'",
      '            return Availability(False, "CPU only: torch.ao dynamic quantized Linear has no CUDA kernels")',
      "            return ao_dynamic_status()", "torch.ao's CPU-only int8 offered on the GPU", n=3),
    M("workers/quant_variants.py", "check_variant", "dev == 'cuda'",
      "        failed = int_mm_probe(device)", "        failed = None",
      "the int8 row claims cuBLAS int8 without probing torch._int_mm", n=4,
      tests=(FS + "test_int8_on_cuda_probes_int_mm_once_and_labels_what_ran",)),
    M("workers/quant_model.py", "pad_int8_matmul_rows",
      "variant != 'torchao_int8_dynamic' or torch.device(device).type != 'cuda'",
      "    (:func:`float_layers`). Returns the number of layers hooked.\n    \"\"\"\n"
      "    if variant != \"torchao_int8_dynamic\" or torch.device(device).type != \"cuda\":",
      "    (:func:`float_layers`). Returns the number of layers hooked.\n    \"\"\"\n"
      "    if variant != \"torchao_int8_dynamic\" or torch.device(device).type == \"cuda\":",
      "matmuls of <= 16 rows not padded on CUDA (torchao silently multiplies in fp32)"),
    M("workers/quant_model.py", "float_layers",
      "variant != 'torchao_int8_dynamic' or torch.device(device).type != 'cuda'",
      "    true; the row lists it (``kept_in_float``, and in its note).\n    \"\"\"\n"
      "    if variant != \"torchao_int8_dynamic\" or torch.device(device).type != \"cuda\":",
      "    true; the row lists it (``kept_in_float``, and in its note).\n    \"\"\"\n"
      "    if variant != \"torchao_int8_dynamic\" or torch.device(device).type == \"cuda\":",
      "layers int8 mm cannot take (K or N % 8 != 0) not kept in fp32 on CUDA"),
    # experiments/scaling.py
    M("experiments/scaling.py", "place", "machine.gpus >= devices",
      'Placement(DP, devices, DP_BACKEND, "cuda") if machine.gpus >= devices else',
      'Placement(DP, devices, DP_BACKEND, "cuda") if machine.gpus > devices else',
      "an off-by-one: DataParallel on all the node's GPUs refused"),
    M("experiments/scaling.py", "place", "machine.gpus >= devices",
      'return Placement(DDP, devices, "nccl", "cuda")', 'return Placement(DDP, devices, "gloo", "cuda")',
      "DDP on GPUs placed on gloo", n=2),
    M("experiments/scaling.py", "place", "machine.gpus == 0 and devices <= settings.max_cpu_processes",
      "if machine.gpus == 0 and devices <= settings.max_cpu_processes:",
      "if devices <= settings.max_cpu_processes:",
      "a GPU node with too few GPUs runs gloo CPU processes and labels them as its N devices"),
    M("experiments/scaling.py", "methods_here", "machine.gpus",
      "return (DP, DDP) if machine.gpus else (DDP,)", "return (DDP,)", "DataParallel never measured on GPUs"),
    M("experiments/scaling.py", "_runs", "machine.gpus", '("nccl" if machine.gpus else "gloo")', '"gloo"',
      "rows that cannot run labelled gloo on a GPU node"),
    M("experiments/scaling.py", "plan_compute_vs_comm", "machine.gpus",
      "if machine.gpus else []", "if False else []", "DataParallel's rows missing from Table 2 on GPUs"),
    # experiments/gpt.py
    M("experiments/gpt.py", "place", "machine.gpus >= devices", "    if machine.gpus >= devices:",
      "    if machine.gpus > devices:", "an off-by-one: all the node's GPUs refused"),
    M("experiments/gpt.py", "place", "machine.gpus == 0 and devices <= procs",
      "if machine.gpus == 0 and devices <= procs:", "if devices <= procs:",
      "a GPU node with too few GPUs runs gloo CPU processes instead of a row"),
    M("experiments/gpt.py", "place", "machine.gpus", 'has = (f"this machine has {machine.gpus}" if machine.gpus',
      'has = (f"this machine has {machine.gpus}" if not machine.gpus',
      "the row of a GPU node says there is no GPU here"),
    # experiments/sweep.py
    M("experiments/sweep.py", "plan", "not machine.gpus and s.memory_fraction is not None",
      "if not machine.gpus and s.memory_fraction is not None:", "if s.memory_fraction is not None:",
      "memory_fraction refused on a GPU too (notebook 01's MEMORY_FRACTION)"),
    M("experiments/sweep.py", "plan", "machine.gpus", "threads = None if machine.gpus else s.cpu_threads",
      "threads = s.cpu_threads", "a GPU run pinned to the CPU's thread count (and keyed by it)"),
    M("experiments/sweep.py", "plan", "machine.gpus",
      '"device": machine.gpu_name if machine.gpus else device_name("cpu"),', '"device": device_name("cpu"),',
      "a GPU run keyed by the CPU's name", n=2),
    # experiments/quantize.py
    M("experiments/quantize.py", "plan", "machine.gpus", '*(("cuda",) if machine.gpus else ())', "*()",
      "the variants never measured on the GPU"),
    M("experiments/quantize.py", "plan_fallback", "machine.gpus == 0", "in_process=machine.gpus == 0",
      "in_process=machine.gpus <= 1", "an off-by-one: on one GPU the fallback GPT trains in the kernel"),
    # experiments/fastpath.py
    M("experiments/fastpath.py", "waterfall.skip", "opts.bf16 and machine.gpus and (not machine.bf16)",
      "if opts.bf16 and machine.gpus and not machine.bf16:", "if opts.bf16 and machine.gpus:",
      "bf16 skipped on every GPU, Ampere's too"),
    M("experiments/fastpath.py", "plan_loader", "machine.gpus", '"cpu_threads": None if machine.gpus else 1',
      '"cpu_threads": 1', "the GPU's device loader capped to one CPU thread"),
    # plan.py
    M("plan.py", "Run.hardware", "self.device == 'cuda' and (not torch.cuda.is_available())",
      'if self.device == "cuda" and not torch.cuda.is_available():', 'if self.device == "cuda":',
      "GPU runs never named (the reuse check cannot tell an A100 from an H100)"),
    # experiments/build_ddp.py
    M("experiments/build_ddp.py", "plan", "machine.gpus", '("nccl" if machine.gpus else "gloo")', '"gloo"',
      "notebook 09's rows that need more GPUs labelled gloo on a GPU node"),
    # experiments/build_ddp_tables.py
    M("experiments/build_ddp_tables.py", "_lanes", "'nccl' not in e['name'].lower()",
      'compute = [e for e in kernels if "nccl" not in e["name"].lower()]', "compute = kernels",
      "NCCL's kernels drawn as compute: the all-reduce looks hidden behind backward"),
    M("experiments/build_ddp_tables.py", "_lanes", "'nccl' in e['name'].lower()",
      'comm = [e for e in kernels if "nccl" in e["name"].lower()]',
      'comm = [e for e in kernels if e["name"].startswith("nccl:")]',
      "the CPU side's name looked for among GPU kernels: no all-reduce on a GPU"),
    # session.py
    M("session.py", "session_for", "torch.cuda.is_available()",
      "    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0\n    return LabSession(",
      "    gpus = 1 if torch.cuda.is_available() else 0\n    return LabSession(",
      "the session counts one GPU on a multi-GPU node"),
    M("session.py", "session_for", "gpus", 'device=torch.device("cuda" if gpus else "cpu")',
      'device=torch.device("cpu")', "the notebook's device is the CPU on a GPU node"),
    M("session.py", "start", "gpus", "f\"{f' x{gpus}' if gpus else ''}; results:", "f\"; results:",
      "the first line hides the GPU count"),
    # workers
    M("workers/allreduce_bench.py", "_sync", "device.type == 'cuda'",
      "        torch.cuda.synchronize(device)", "        torch.cuda.synchronize()",
      "synchronize the current device instead of the rank's"),
    M("workers/ddp.py", "RunConfig.config", "self.backend == 'nccl'",
      '"device_type": "cuda" if self.backend == "nccl" else "cpu"', '"device_type": "cpu"',
      "NCCL runs keyed as CPU runs (resume mixes GPU and CPU rows)"),
    M("workers/harness.py", "serve", "torch.cuda.is_available()",
      'DistContext(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))',
      'DistContext(device=torch.device("cpu"))', "DataParallel's process left on the CPU on a GPU node"),
    M("workers/fast_train.py", "resolved_sgd", "device.type == 'cuda'",
      'return "foreach" if device.type == "cuda" else "for-loop"', 'return "for-loop"',
      "the GPU's default SGD named for-loop (the table mislabels the baseline)"),
    M("workers/fast_train.py", "to_device", "device.type == 'cuda'",
      'nb = device.type == "cuda"', "nb = False", "blocking copies of host batches on the fast path"),
    M("workers/fastpath.py", "top_operators.self_us", "on_gpu",
      "return float(e.self_device_time_total if on_gpu else e.self_cpu_time_total)",
      "return float(e.self_cpu_time_total)", "the host time where the kernel time is promised"),
    M("workers/fastpath.py", "top_operators", "on_gpu",
      '        kernels = [e for e in events if _device_type_name(e) != "CPU"]',
      "        kernels = list(events)", "kernels counted twice: operators and their kernels summed"),
    M("workers/fastpath.py", "top_operators", "on_gpu",
      'row["self_cpu_ms"] = e.self_cpu_time_total / 1e3', 'row["self_cpu_ms"] = e.self_cpu_time_total',
      "microseconds taken for milliseconds", n=2),
    M("workers/sweep.py", "run_config", "dev.type == 'cuda'",
      "        _cap_gpu_memory(c, dev)\n", "        pass\n", "the GPU memory fraction never applied"),
    M("workers/sweep.py", "run_config", "dev.type == 'cuda'",
      "        set_memory_fraction(min(fractions), device)", "        set_memory_fraction(max(fractions), device)",
      "the looser of memory_fraction and memory_cap_bytes applied"),
    M("workers/sweep.py", "run_config", "dev.type == 'cuda'",
      "    fractions = [] if c[\"memory_fraction\"] is None else [c[\"memory_fraction\"]]",
      "    fractions = []", "memory_fraction ignored when it is the only limit (MEMORY_FRACTION of notebook 01)"),
    M("workers/gpt_train.py", "device_peak", "device.type != 'cuda'",
      'tf32 = torch.backends.cuda.matmul.allow_tf32 and peak_flops_per_s(name, "tf32") is not None',
      'tf32 = peak_flops_per_s(name, "tf32") is not None',
      "the TF32 peak used although matmuls run in true fp32 (MFU 7x too low)"),
    M("workers/gpt_train.py", "device_peak", "device.type != 'cuda'",
      '    if dtype == "bf16":\n        precision = "bf16"', '    if dtype == "bf16":\n        precision = "fp16"',
      "the wrong precision's peak for bf16"),
)
