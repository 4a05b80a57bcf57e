"""Every CUDA-only branch of the lab, found in the code, and what runs it on this CPU machine.

The lab is never run on a GPU before a student's session, so each line that only runs with
CUDA is either run by a test (against tests/fake_gpu.py where the device is needed) or named
here with the reason no fake can run it honestly and the ``python -m lab_utils doctor`` check
that does on a node. tests/test_gpu_branches.py keeps this table equal to the code, and
``python tests/gpu_branches.py`` prints it as tests/GPU_BRANCHES.md.

How branches are counted (:func:`scan`, by parsing ``lab_utils/``): a *decision site* is

- an ``if`` / ``elif`` / ``while``, a conditional expression (``a if c else b``) or a
  comprehension's ``if`` whose condition depends on CUDA: it mentions ``torch.cuda``, the
  strings ``"cuda"`` or ``"nccl"``, a GPU count (``gpus``, ``machine.gpus``), ``self.cuda``, or a local flag
  assigned from such a condition in the same function (``cuda = device.type == "cuda"``);
- a CUDA flag that never reaches a condition but is passed on as a value (``non_blocking =
  device.type == "cuda"``, ``pin_memory=torch.cuda.is_available()``).

``lab_utils/core/cuda_builds.py`` (the driver -> torch build table; tests/test_gpu_node.py
and tests/test_install.py) and ``lab_utils/doctor.py`` (the node's checks themselves;
tests/test_doctor.py) are not counted. Each site is then *CUDA-only* (one arm runs only with
a GPU, NCCL or CUDA initialized) or not (both arms run on any machine: input checks, a
``gpus is None`` default); only CUDA-only sites count towards the target.

A site is keyed by file, function, condition text and its occurrence in that function, so
the table survives edits that move lines. ``python tests/gpu_branches.py --verify`` runs
each named test under a line tracer and checks that it executes the branch's CUDA arm
(``arm``: the first line of the ``if`` body or ``else``; for a conditional expression or a
flag, the line of the condition, under the fake GPU).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "lab_utils"
NOT_COUNTED = ("core/cuda_builds.py", "doctor.py")
GPU_COUNT_NAMES = {"gpus"}

# Reasons a branch cannot be run honestly by a fake (the doctor check that covers it is named per row).
STREAMS = "real stream asynchrony"
NCCL = "NCCL itself"
INDUCTOR = "Inductor/Triton"
CUPTI = "CUPTI"
TENSORS = "tensors on a GPU"   # the branch moves real tensors to CUDA: the fake has no device memory
REASONS = (STREAMS, NCCL, INDUCTOR, CUPTI, TENSORS)


@dataclass(frozen=True)
class Site:
    """One decision site found in the code."""

    file: str          # relative to lab_utils/
    function: str      # dotted path of the enclosing function(s)/class(es)
    condition: str     # ast.unparse of the condition (or of the flag's value)
    occurrence: int    # 1 for the first site with this condition in this function
    line: int
    kind: str          # "if" (statement) | "expr" (conditional expression, comprehension) | "flag"
    arm: tuple[int, int, int, int]   # source span of the CUDA arm: line, column, end line, end column
    negated: bool      # the CUDA side is the ``else`` arm (``if dev.type != "cuda"``, ``if not gpus``)

    @property
    def arm_line(self) -> int:
        return self.arm[0]

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.file, self.function, self.condition, self.occurrence)


def _mentions_cuda(node: ast.AST, flags: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and n.value in ("cuda", "nccl"):
            return True
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "cuda" \
                and isinstance(n.value.value, ast.Name) and n.value.value.id == "torch":
            return True
        if isinstance(n, ast.Attribute) and n.attr == "cuda" and isinstance(n.value, ast.Name) \
                and n.value.id == "self":
            return True
        if isinstance(n, ast.Name) and (n.id in flags or n.id in GPU_COUNT_NAMES):
            return True
        if isinstance(n, ast.Attribute) and n.attr in GPU_COUNT_NAMES:   # machine.gpus, self.gpus
            return True
    return False


def _is_cuda_value(node: ast.AST) -> bool:
    """A CUDA test used as a value: a comparison with "cuda"/"nccl", ``torch.cuda.is_available()``,
    or ``not`` / ``and`` / ``or`` of such tests."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _is_cuda_value(node.operand)
    if isinstance(node, ast.BoolOp):
        return all(_is_cuda_value(v) or isinstance(v, ast.Compare | ast.Call) for v in node.values) \
            and any(_is_cuda_value(v) for v in node.values)
    if isinstance(node, ast.Compare):
        return _mentions_cuda(node, set())
    return isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.is_available"


def _negated(test: ast.AST) -> bool:
    """The CUDA side of ``test`` is its false side (``!= "cuda"``, ``not ...``, ``gpus == 0``)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.BoolOp):
        return _negated(test.values[0])
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, ast.NotEq | ast.NotIn):
            return True
        if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and right.value == 0:
            return True
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
            return True
    return False


def _function_sites(rel: str, func: str, body: list[ast.stmt], out: list[Site], params: set[str],
                    inherited: frozenset[str] = frozenset()) -> frozenset[str]:
    """Sites of one function body (nested functions are their own functions, seeing ``inherited``
    flags of the functions around them). Returns the flags visible inside this function.

    A *flag* is a local name every assignment of which is a CUDA test (and not a parameter);
    a CUDA test assigned to any other name is a site of its own (a value passed on).
    """
    assigned: dict[str, list[ast.Assign]] = {}
    for node in _walk_own(body):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        assigned.setdefault(n.id, []).append(node)
    flags: dict[str, ast.AST] = {}
    values: list[ast.AST] = []
    for name, nodes in assigned.items():
        cuda = [n for n in nodes if isinstance(n, ast.Assign) and _is_cuda_value(n.value)]
        if cuda and len(cuda) == len(nodes) and name not in params:
            flags[name] = cuda[0]
        else:
            values += [n.value for n in cuda]
    visible = set(flags) | set(inherited)
    after: dict[int, ast.stmt] = {}   # an if statement -> the statement that follows it
    for node in [*_walk_own(body), ast.Module(body=body, type_ignores=[])]:
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                for here, nxt in zip(stmts, stmts[1:]):
                    after[id(here)] = nxt
    used: set[str] = set()
    found: list[tuple[str, ast.AST, ast.AST, bool]] = []   # (kind, condition or value, CUDA arm, negated)
    for node in _walk_own(body):
        tests: list[tuple[ast.AST, str, ast.AST]] = []
        if isinstance(node, ast.If | ast.While):
            # the CUDA side: the body, or for a negated test the else (or what follows the if)
            arm = node.body[0]
            if _negated(node.test):
                arm = node.orelse[0] if node.orelse else after.get(id(node), node.test)
            tests.append((node.test, "if", arm))
        elif isinstance(node, ast.IfExp):
            tests.append((node.test, "expr", node.orelse if _negated(node.test) else node.body))
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            elt = node.key if isinstance(node, ast.DictComp) else node.elt
            tests += [(t, "expr", elt) for g in node.generators for t in g.ifs]
        elif isinstance(node, ast.keyword) and node.value is not None and _is_cuda_value(node.value):
            found.append(("flag", node.value, node.value, False))
        for t, kind, arm in tests:
            if _mentions_cuda(t, visible):
                used |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
                found.append((kind, t, arm, _negated(t)))
    nested_tests = {n.id for d in body for sub in ast.walk(d) if isinstance(sub, _SCOPES)
                    for t in ast.walk(sub) if isinstance(t, ast.If | ast.IfExp | ast.While)
                    for n in ast.walk(t.test) if isinstance(n, ast.Name)}
    for name, node in flags.items():
        if name not in used | nested_tests:   # a flag passed on as a value (non_blocking=..., pin_memory=...)
            found.append(("flag", node.value, node.value, False))
    found += [("flag", v, v, False) for v in values]
    counts: Counter = Counter()
    for kind, t, arm, neg in sorted(found, key=lambda f: (f[1].lineno, f[1].col_offset)):
        cond = ast.unparse(t)
        counts[cond] += 1
        span = (arm.lineno, arm.col_offset, arm.end_lineno or arm.lineno, arm.end_col_offset or 0)
        out.append(Site(rel, func, cond, counts[cond], t.lineno, kind, span, neg))
    return frozenset(visible)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _walk_own(body: list[ast.stmt]):
    """Every node of ``body`` except the insides of nested functions and classes."""
    stack = [n for n in reversed(body) if not isinstance(n, _SCOPES)]
    while stack:
        node = stack.pop()
        yield node
        for child in reversed(list(ast.iter_child_nodes(node))):
            if not isinstance(child, _SCOPES + (ast.Lambda,)):
                stack.append(child)


def scan(pkg: Path = PKG) -> list[Site]:
    """Every decision site of ``pkg`` that depends on CUDA (see the module's docstring)."""
    out: list[Site] = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if rel not in NOT_COUNTED:
            _file_sites(rel, ast.parse(path.read_text()), out)
    return out


def _file_sites(rel: str, tree: ast.Module, out: list[Site]) -> None:
    """Sites of one module: every function (nested ones too), then the module's own statements."""
    def visit(node: ast.AST, prefix: str, flags: frozenset[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                params = {a.arg for a in ast.walk(child.args) if isinstance(a, ast.arg)}
                inner = _function_sites(rel, name, child.body, out, params, flags - params)
                visit(child, name + ".", inner)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", frozenset())
            elif not isinstance(child, ast.Lambda):
                visit(child, prefix, flags)

    visit(tree, "", frozenset())
    _function_sites(rel, "<module>", tree.body, out, set())


# --------------------------------------------------------------------------- checking the table against runs


def traced_runs(pytest_args: list[str], timeout_s: float = 5400) -> dict[str, dict[str, set]]:
    """Run pytest with ``pytest_args`` under tests/branch_trace.py: for each test node id, the
    executed instruction positions ``"code"`` (file, line, end line, column, end column) and the lines
    run under the fake
    GPU ``"fake"`` (file, line)."""
    with tempfile.TemporaryDirectory(prefix="branch_trace_") as tmp:
        out = Path(tmp) / "trace.json"
        path = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "LAB_BRANCH_TRACE": str(out), "PYTHONPATH": path}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "branch_trace", "-p", "no:cacheprovider",
                        *pytest_args], cwd=REPO, env=env, timeout=timeout_s, check=False)
        data = json.loads(out.read_text()) if out.exists() else {}
    return {k: {"code": {tuple(x) for x in v["code"]}, "fake": {tuple(x) for x in v["fake"]}}
            for k, v in data.items()}


def arm_ran(site: Site, run: dict[str, set]) -> bool:
    """Whether ``run`` (one test's trace) executed ``site``'s CUDA arm: an instruction inside the
    arm's source span; for a flag (a value passed on), its line under the fake GPU."""
    file = str(PKG / site.file)
    if site.kind == "flag":
        return (file, site.line) in run["fake"]
    l0, c0, l1, c1 = site.arm
    # an instruction whose whole source span lies inside the arm's (a conditional expression's own
    # jumps span the whole expression, which starts where its first arm does)
    return any(f == file and (ln, col) >= (l0, c0) and (end_ln, end_col) <= (l1, c1)
               for f, ln, end_ln, col, end_col in run["code"] if end_ln is not None and end_col is not None)


def _matching(runs: dict[str, dict[str, set]], test: str) -> list[str]:
    """The traced node ids of ``test`` (``file::name``; parametrized ids included)."""
    file, _, name = test.partition("::")
    return [k for k in runs if k.startswith(f"tests/{file}::{name}") and k[len(f"tests/{file}::{name}"):][:1]
            in ("", "[")]


def discover(pytest_args: list[str]) -> dict[tuple, list[str]]:
    """For every site, the tests among ``pytest_args`` that execute its CUDA arm."""
    runs = traced_runs(pytest_args)
    return {s.key: sorted(t for t, run in runs.items() if arm_ran(s, run)) for s in scan()}


def verify() -> list[str]:
    """Run every test the inventory names, traced; the rows whose test does not execute the arm."""
    sites = {s.key: s for s in scan()}
    named = sorted({b.test for b in INVENTORY if b.test})
    runs = traced_runs([f"tests/{t}" for t in named])
    bad = []
    for b in INVENTORY:
        if not b.test:
            continue
        site = sites.get(b.key)
        hits = _matching(runs, b.test)
        if site is None or not hits or not any(arm_ran(site, runs[h]) for h in hits):
            bad.append(f"{b.file} {b.function} [{b.condition}]: {b.test} "
                       + ("did not run" if not hits else "does not reach the CUDA arm"))
    return bad


# --------------------------------------------------------------------------- the inventory


@dataclass(frozen=True)
class Branch:
    """One decision site: what its CUDA arm does, and the test that runs it (or why none can)."""

    file: str
    function: str
    condition: str
    what: str
    test: str = ""          # "test_file.py::test_name" (in tests/)
    reason: str = ""        # one of REASONS when no test runs it
    doctor: str = ""        # the doctor check that runs it on a node
    occurrence: int = 1
    cuda_only: bool = True  # False: both arms run on any machine (an input check, a default)

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.file, self.function, self.condition, self.occurrence)


def B(file: str, function: str, condition: str, what: str, test: str = "", *, n: int = 1, reason: str = "",
      doctor: str = "", cuda_only: bool = True) -> Branch:
    return Branch(file, function, condition, what, test, reason, doctor, n, cuda_only)


BR = "test_gpu_branches.py::"
HANDIN = "test_handin.py::"
DF = "test_gpu_defects.py::"
DR = "test_doctor.py::"
FS = "test_gpu_first_session.py::"
EVENTS = BR + "test_allreduce_timer_reads_cuda_events_in_seconds"
QUERIES = BR + "test_device_queries_name_count_and_default_device"
COMM = BR + "test_comm_plans_on_gpus"
QUANT = BR + "test_quantization_variants_on_a_gpu"
SCALING = BR + "test_scaling_plans_and_rows_on_gpus"
SWEEP = BR + "test_the_sweep_worker_caps_the_gpu_memory"
SESSION = BR + "test_a_session_on_a_gpu_node"
LB = BR + "test_large_batch_and_accounting_on_gpus"
BENCH = BR + "test_bench_timers_default_sizes_on_a_gpu"
NCCL_RUN = "nccl_allreduce"
CHOOSE = BR + "test_choose_backend_answers_nccl_with_a_gpu_per_rank"
NO_GPU = BR + "test_asking_for_cuda_without_a_gpu_is_one_sentence"
COPIES = BR + "test_host_to_device_copies_are_non_blocking_on_a_gpu"
BDDP = "test_build_ddp.py::test_merged_trace_one_row_per_rank_and_the_lanes_of_cpu_and_gpu_traces"
MEMORY_USE = "test_build_ddp.py::test_memory_use_on_a_gpu_reads_the_allocators_counters_from_before_the_build"
MACHINE = BR + "test_the_machine_here_names_its_gpus_and_their_bf16"
GPT_PLAN = BR + "test_gpt_runs_are_placed_on_the_gpus"
SWEEP_PLAN = BR + "test_the_sweep_plan_on_a_gpu"
QUANT_PLAN = BR + "test_quantization_plans_on_a_gpu"
FAST_PLAN = BR + "test_fast_path_plans_on_a_gpu"
RUN = BR + "test_a_run_on_gpus_names_them_and_is_never_run_in_the_kernel"

INVENTORY: tuple[Branch, ...] = (
    # core/comm_hooks.py: DDP's communication hook and the no_sync probe
    B("core/comm_hooks.py", "AllReduceTimer.__init__", "dev.type == 'cuda'",
      "the hook's clock is CUDA events on a GPU", EVENTS),
    B("core/comm_hooks.py", "AllReduceTimer._stamp", "self.cuda", "records a timing CUDA event", EVENTS),
    B("core/comm_hooks.py", "AllReduceTimer._since_ref", "self.cuda",
      "event.elapsed_time (ms) -> seconds", EVENTS),
    B("core/comm_hooks.py", "AllReduceTimer.finish_step", "self.cuda",
      "synchronizes the device before reading the events", EVENTS),
    B("core/comm_hooks.py", "_barrier", "device.type == 'cuda' and dist.get_backend() == 'nccl'",
      "NCCL barrier with device_ids=[index]", BR + "test_a_barrier_on_nccl_names_the_gpu_by_index"),
    # core/data.py
    B("core/data.py", "make_loaders", "torch.cuda.is_available()", "pinned host memory for the GPU",
      BR + "test_loaders_pin_memory_when_a_gpu_is_there"),
    B("core/data.py", "spec_loader", "torch.cuda.is_available()", "pinned host memory for the GPU",
      BR + "test_loaders_pin_memory_when_a_gpu_is_there"),
    # core/dist.py
    B("core/dist.py", "choose_backend", "torch.cuda.is_available()", "counts the GPUs", CHOOSE),
    B("core/dist.py", "choose_backend", "gpus >= local_world_size and gpus > 0 and dist.is_nccl_available()",
      "NCCL when every local rank has its GPU", CHOOSE),
    B("core/dist.py", "init_distributed", "device == 'cuda' and (not torch.cuda.is_available())",
      "--device cuda without a GPU: one sentence", NO_GPU, cuda_only=False),
    B("core/dist.py", "init_distributed", "device == 'cuda'", "--device cuda forces NCCL",
      BR + "test_init_distributed_joins_nccl_on_its_own_gpu"),
    B("core/dist.py", "init_distributed", "use_cuda", "one process without torchrun uses the GPU",
      BR + "test_init_distributed_without_torchrun_on_a_gpu"),
    B("core/dist.py", "init_distributed", "backend == 'nccl'",
      "cuda:LOCAL_RANK, set_device, init_process_group('nccl', device_id=...)",
      BR + "test_init_distributed_joins_nccl_on_its_own_gpu"),
    B("core/dist.py", "init_distributed", "torch.cuda.device_count() <= local_rank",
      "more ranks than GPUs: one sentence", BR + "test_init_distributed_joins_nccl_on_its_own_gpu"),
    B("core/dist.py", "failure_ends_rank", "ctx.backend == 'nccl'",
      "under NCCL any error ends the rank (its line, then os._exit)",
      FS + "test_under_nccl_any_error_ends_the_rank_and_under_gloo_it_propagates"),
    # core/environment.py
    B("core/environment.py", "gpu_node_problem", "torch.cuda.is_available()",
      "torch sees the GPUs: their compute capabilities against its architecture list", SESSION),
    B("core/environment.py", "check_gpu_node", "torch.cuda.is_available()",
      "no kernels for this GPU: refused whatever the profile",
      FS + "test_notebook_00_and_info_refuse_a_torch_without_this_gpus_architecture"),
    B("core/environment.py", "gpu_node_problem", "driver is None or not driver.gpus",
      "the driver lists GPUs torch cannot see: what is wrong and the fix for this build",
      "test_gpu_node.py::test_a_fitting_torch_that_cannot_see_gpus_gets_a_different_fix"),
    B("core/environment.py", "environment_rows", "driver is not None and driver.gpus",
      "the driver's GPUs listed, saying torch cannot use them",
      "test_gpu_node.py::test_environment_rows_on_a_gpu_node_torch_cannot_use"),
    # core/handmade.py: notebook 09's memory of each implementation
    B("core/handmade.py", "memory_use", "device.type == 'cuda'",
      "memory_allocated before the build and after the warm-up, max_memory_allocated over the measured step "
      "after reset_peak_memory_stats", MEMORY_USE),
    # core/hardware.py
    B("core/hardware.py", "bf16_supported", "dev.type != 'cuda' or not torch.cuda.is_available()",
      "is_bf16_supported(including_emulation=False), capability on torch 2.4",
      DF + "test_bf16_on_ampere_and_with_torch_24s_signature"),
    B("core/hardware.py", "cudnn_build_version", "torch.cuda.is_initialized()",
      "CUDA already up: torch's checked version (its refusal on sm < 7.5 said)",
      FS + "test_the_versions_row_survives_cudnn_refusing_the_gpu"),
    B("core/hardware.py", "device_name", "torch.cuda.is_available()", "the default device: GPU", QUERIES),
    B("core/hardware.py", "device_name", "dev.type == 'cuda'", "names the GPU", QUERIES),
    B("core/hardware.py", "device_name", "not torch.cuda.is_initialized()",
      "nvidia-smi -L's name while CUDA is not initialized (no context); torch's after", QUERIES),
    B("core/hardware.py", "gpus", "not torch.cuda.is_available()", "lists GPUs: name, memory", QUERIES),
    B("core/hardware.py", "gpu_count", "torch.cuda.is_available()", "torch.cuda.device_count()", QUERIES),
    B("core/hardware.py", "hardware_summary", "torch.cuda.is_available()", "the record's device is the GPU",
      QUERIES),
    B("core/hardware.py", "hardware_summary", "dtype == 'cuda'", "device_count = the visible GPUs", QUERIES),
    # core/loop.py
    B("core/loop.py", "default_device", "torch.cuda.is_available()", "cuda", BENCH),
    B("core/loop.py", "peak_memory", "device.type == 'cuda'", "max_memory_allocated (bytes)",
      BR + "test_peak_memory_is_read_and_reset_on_the_gpu"),
    B("core/loop.py", "reset_peak_memory", "device.type == 'cuda'", "reset_peak_memory_stats",
      BR + "test_peak_memory_is_read_and_reset_on_the_gpu"),
    B("core/loop.py", "model_devices", "isinstance(model, nn.DataParallel) and device.type == 'cuda' and "
      "model.device_ids", "DataParallel: each GPU's peak",
      DF + "test_dataparallel_peak_memory_is_every_gpus"),
    B("core/loop.py", "train_steps", "device.type == 'cuda'", "non_blocking host-to-device copies", COPIES),
    B("core/loop.py", "evaluate", "device.type == 'cuda'", "non_blocking copies from pinned memory", COPIES),
    # core/machine.py: the machine a plan is made for
    B("core/machine.py", "Machine.device", "self.gpus", "a one-device experiment's runs go to cuda", MACHINE),
    B("core/machine.py", "Machine.describe", "self.gpus", "'N x <GPU name>'", MACHINE),
    B("core/machine.py", "Machine.here", "gpus", "the GPU's name (nvidia-smi's, no CUDA context)", MACHINE),
    B("core/machine.py", "_native_bf16", "not torch.cuda.is_initialized()",
      "CUDA already up: torch's bf16 answer (nvidia-smi's compute capability before)", MACHINE),
    # core/memory.py
    B("core/memory.py", "free_device_memory", "on_cuda and torch.cuda.is_available() and "
      "torch.cuda.is_initialized()", "empty_cache after gc", BR + "test_memory_cap_and_cleanup_on_a_gpu"),
    B("core/memory.py", "resolve_cuda_device", "dev.type != 'cuda'", "an index for torch's memory calls",
      BR + "test_memory_cap_and_cleanup_on_a_gpu"),
    # core/timing.py
    B("core/timing.py", "synchronize", "dev.type == 'cuda'", "torch.cuda.synchronize at every timer boundary",
      BR + "test_timers_synchronize_so_a_phase_includes_its_queued_device_work"),
    # experiments/bench_timers.py
    B("experiments/bench_timers.py", "main", "device.type == 'cuda'",
      "the GPU's models, batches and wall clock", BENCH),
    # experiments/comm.py
    B("experiments/comm.py", "plan_bench", "gpus >= 2", "NCCL, one rank per GPU, every GPU of the node too",
      COMM),
    B("experiments/comm.py", "plan_bench", "device == 'cuda'", "a rank count the node lacks: 'needs N GPUs'",
      COMM),
    B("experiments/comm.py", "plan_compute", "device != 'cuda'", "the compute step is launched",
      COMM),
    # experiments/fastpath.py
    B("experiments/fastpath.py", "waterfall.skip", "opts.bf16 and machine.gpus and (not machine.bf16)",
      "a GPU without native bf16: the bf16 steps are rows that say so", FAST_PLAN),
    B("experiments/fastpath.py", "plan_loader", "machine.gpus", "the device loader without a CPU thread cap",
      FAST_PLAN),
    # experiments/fastpath_tables.py
    B("experiments/fastpath_tables.py", "_machine", "device == 'cuda' and (not here.gpus)",
      "--device cuda without a GPU: one sentence", NO_GPU, cuda_only=False),
    B("experiments/fastpath_tables.py", "trace_notes", "on_gpu", "self time = GPU kernel time",
      BR + "test_fast_path_choices_on_a_gpu"),
    B("experiments/fastpath_tables.py", "trace_notes", "on_gpu", "percent of the GPU's kernel time",
      BR + "test_fast_path_choices_on_a_gpu", n=2),
    # experiments/gpt.py
    B("experiments/gpt.py", "place", "machine.gpus >= devices", "the ranks on as many GPUs", GPT_PLAN),
    B("experiments/gpt.py", "place", "machine.gpus == 0 and devices <= procs",
      "too few GPUs: a row (no gloo CPU processes on a GPU node)", GPT_PLAN),
    B("experiments/gpt.py", "place", "machine.gpus", "the row says how many GPUs the node has", GPT_PLAN),
    # experiments/large_batch.py
    B("experiments/large_batch.py", "DevicePlan.device", "self.backend == 'nccl'", "runs on the GPUs", LB),
    B("experiments/large_batch.py", "plan_devices", "gpus >= 1", "NCCL ranks on the GPUs", LB),
    B("experiments/large_batch.py", "plan_devices", "gpus < want", "fewer GPUs than asked: says so", LB),
    B("experiments/large_batch.py", "plan_accounting", "gpus >= 2", "the ledger on the GPUs (NCCL)", LB),
    B("experiments/large_batch.py", "plan_accounting", "backend == 'nccl'", "the ledger's device is the GPU",
      LB),
    B("experiments/large_batch_tables.py", "large_batch_table", "rec.config.get('backend') == 'nccl'",
      "'N x GPU' in the table", BR + "test_the_large_batch_table_says_gpu"),
    # experiments/quantize.py, workers/quant_variants.py, workers/quant_model.py
    B("experiments/quantize.py", "plan_fallback", "machine.gpus == 0",
      "the fallback GPT trained on the GPU through the launcher", QUANT_PLAN),
    B("experiments/quantize.py", "plan", "machine.gpus", "every variant on the GPU too", QUANT_PLAN),
    B("experiments/quantize.py", "Settings.validate", "d not in ('cpu', 'cuda')", "an unknown device",
      "test_quantize.py::test_settings_validation", cuda_only=False),
    B("workers/quant_variants.py", "check_variant", "dev == 'cuda' and (not torch.cuda.is_available())",
      "no CUDA device: a row that says so", "test_quantize.py::test_no_cuda_row_and_unknown_variant",
      cuda_only=False),
    B("workers/quant_variants.py", "check_variant", "dev == 'cuda'", "cuBLAS fp32 (TF32 or not)", QUANT),
    B("workers/quant_variants.py", "check_variant", "dev == 'cuda'", "bf16 on the GPU", QUANT, n=2),
    B("workers/quant_variants.py", "check_variant", "not bf16_supported('cuda')", "native bf16 only",
      QUANT),
    B("workers/quant_variants.py", "check_variant", "dev == 'cuda'", "torch.ao int8 is CPU only", QUANT,
      n=3),
    B("workers/quant_variants.py", "check_variant", "dev == 'cuda'",
      "cuBLAS int8 (torch._int_mm), padded",
      QUANT, n=4),
    B("workers/quant_model.py", "pad_int8_matmul_rows", "variant != 'torchao_int8_dynamic' or "
      "torch.device(device).type != 'cuda'", "pads M <= 16 rows to 17 for torch._int_mm",
      DF + "test_int8_matmuls_of_few_rows_are_padded_to_what_cublas_needs"),
    B("workers/quant_model.py", "float_layers", "variant != 'torchao_int8_dynamic' or "
      "torch.device(device).type != 'cuda'", "layers whose K or N % 8 != 0 stay fp32", QUANT),
    # experiments/scaling.py
    B("experiments/scaling.py", "place", "machine.gpus >= devices", "DataParallel on the GPUs", SCALING),
    B("experiments/scaling.py", "place", "machine.gpus >= devices", "DDP on NCCL", SCALING, n=2),
    B("experiments/scaling.py", "place", "machine.gpus == 0 and devices <= settings.max_cpu_processes",
      "more devices than GPUs: needs N GPUs", SCALING),
    B("experiments/scaling.py", "methods_here", "machine.gpus", "DataParallel and DDP side by side", SCALING),
    B("experiments/scaling.py", "_runs", "machine.gpus", "a row that cannot run keeps its NCCL label",
      SCALING),
    B("experiments/scaling.py", "plan_compute_vs_comm", "machine.gpus", "DataParallel rows in Table 2",
      SCALING),
    # experiments/sweep.py
    B("experiments/sweep.py", "plan", "not machine.gpus and s.memory_fraction is not None",
      "memory_fraction accepted on a GPU", SWEEP_PLAN),
    B("experiments/sweep.py", "plan", "machine.gpus", "no CPU thread pin on a GPU", SWEEP_PLAN),
    B("experiments/sweep.py", "plan", "machine.gpus", "the GPU's name in the key", SWEEP_PLAN, n=2),
    # plan.py
    B("plan.py", "Run.hardware", "self.device == 'cuda' and (not torch.cuda.is_available())",
      "without the GPUs here no name; with them, the GPU's name for the reuse check", RUN),
    B("plan.py", "measure", "run.device == 'cuda' and run.in_process",
      "a GPU run marked in_process: one sentence", RUN, cuda_only=False),
    # session.py
    B("session.py", "session_for", "torch.cuda.is_available()", "counts the GPUs", SESSION),
    B("session.py", "session_for", "gpus", "the notebook's device is cuda", SESSION),
    B("session.py", "start", "gpus", "'cuda x N' in the first line", SESSION),
    # time_budget.py (the plans are made for the budget's 4-GPU node on any machine: both arms run here)
    B("time_budget.py", "plan_parts", "run.device == 'cuda'", "a run's GPUs in the budget table",
      "test_time_budget.py::test_a_registered_notebook_is_the_sum_over_its_plan_by_hand", cuda_only=False),
    B("time_budget.py", "_gpus", "p.gpus", "the GPUs column of the budget table",
      "test_time_budget.py::test_table_has_every_notebook_and_a_total", cuda_only=False),
    # workers/sweep.py
    B("workers/sweep.py", "run_config", "dev.type == 'cuda'", "the GPU memory fraction, before training",
      SWEEP),
    # workers/allreduce_bench.py
    B("workers/allreduce_bench.py", "_sync", "device.type == 'cuda'", "synchronize around the timed loop",
      BR + "test_allreduce_worker_waits_for_the_gpu"),
    # workers/comm_accounting.py
    B("workers/comm_accounting.py", "run_accounting.ddp_wrap", "cuda", "DDP with device_ids=[index]",
      reason=NCCL, doctor="05_comm_accounting"),
    B("workers/comm_accounting.py", "run_accounting.steps", "cuda", "synchronize after each step",
      reason=NCCL, doctor="05_comm_accounting"),
    # experiments/build_ddp.py
    B("experiments/build_ddp.py", "plan", "machine.gpus", "rows that need more GPUs named nccl on a GPU node",
      "test_build_ddp.py::test_the_plan_on_two_cpu_cores_and_on_the_budget_node"),
    # experiments/build_ddp_tables.py: notebook 09's trace figure reads a GPU trace's kernels
    B("experiments/build_ddp_tables.py", "_lanes", "'nccl' in e['name'].lower()",
      "NCCL's kernels of a GPU trace are the all-reduce lane", BDDP),
    B("experiments/build_ddp_tables.py", "_lanes", "'nccl' not in e['name'].lower()",
      "the other kernels of a GPU trace are the compute lane", BDDP),
    # workers/ddp.py
    B("workers/ddp.py", "run_config", "cuda", "DDP with device_ids=[index]",
      reason=NCCL, doctor="02_scaling"),
    B("workers/ddp.py", "RunConfig.config", "self.backend == 'nccl'", "device_type cuda in the key",
      BR + "test_worker_records_name_the_gpu"),
    # workers/harness.py
    B("workers/harness.py", "serve", "torch.cuda.is_available()",
      "one process without a group (DataParallel) drives the GPUs",
      BR + "test_a_worker_without_a_process_group_drives_the_gpus"),
    # workers/fast_train.py, workers/fastpath.py
    B("workers/fast_train.py", "resolved_sgd", "device.type == 'cuda'", "torch's default SGD is foreach",
      BR + "test_fast_path_choices_on_a_gpu"),
    B("workers/fast_train.py", "to_device", "device.type == 'cuda'",
      "non_blocking copies of a host batch", COPIES),
    B("workers/fastpath.py", "_trace", "dev.type == 'cuda'", "the profiler's CUDA activity",
      reason=CUPTI, doctor="08_fastpath_trace"),
    B("workers/fastpath.py", "top_operators.self_us", "on_gpu", "device (kernel) time per operator",
      "test_fastpath.py::test_top_operators_on_a_gpu_count_each_kernel_once"),
    B("workers/fastpath.py", "top_operators", "on_gpu", "kernels counted once, operators as rows",
      "test_fastpath.py::test_top_operators_on_a_gpu_count_each_kernel_once"),
    B("workers/fastpath.py", "top_operators", "on_gpu", "the host time next to the kernel time",
      "test_fastpath.py::test_top_operators_on_a_gpu_count_each_kernel_once", n=2),
    # workers/gpt_train.py
    B("workers/gpt_train.py", "device_peak", "device.type != 'cuda'", "the GPU's peak for MFU (TF32 rule)",
      BR + "test_gpt_device_peak_on_a_gpu"),
    B("workers/gpt_train.py", "_train", "device.type == 'cuda'", "DDP with device_ids=[local_rank]",
      reason=NCCL, doctor="06_gpt_scaling"),
    B("workers/gpt_train.py", "_train", "device.type == 'cuda'", "pinned loader memory",
      reason=TENSORS, doctor="06_gpt_scaling", n=2),
    # handin.py and grading/provenance.py read the device type STORED in records and handin.json (a
    # string): both arms run on any machine, driven by hand-made records of a GPU and of a CPU run
    B("handin.py", "Provenance.problems", "self.device_type != 'cuda'", "no GPU: not ready to hand in",
      HANDIN + "test_quick_cpu_synthetic_numbers_fail_the_check", cuda_only=False),
    B("handin.py", "provenance", "h.get('device_type') == 'cuda'", "the GPU records name the devices",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", cuda_only=False),
    B("handin.py", "provenance", "p.device_type == 'cuda'", "the CUDA version of a GPU run",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", cuda_only=False),
    B("handin.py", "provenance", "p.device_type == 'cuda'", "NCCL's version of a GPU run",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", n=2, cuda_only=False),
    B("handin.py", "provenance", "sw.get('cudnn') and p.device_type == 'cuda'", "cuDNN's version, GPU run",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", cuda_only=False),
    B("grading/provenance.py", "describe", "prov['device_type'] != 'cuda'", "the CPU (no GPU) flag",
      HANDIN + "test_make_grade_reads_the_handin_json_make_report_writes", cuda_only=False),
)


def counts() -> dict[str, int]:
    """Sites, CUDA-only sites, and how many of those a test runs."""
    cuda = [b for b in INVENTORY if b.cuda_only]
    return {"sites": len(INVENTORY), "cuda_only": len(cuda), "run": sum(1 for b in cuda if b.test),
            "not_run": sum(1 for b in cuda if not b.test)}


# --------------------------------------------------------------------------- mutants (tests/gpu_mutants.py)

RESULTS = REPO / "tests" / "gpu_mutants_results.json"
KILLED = ("killed", "killed (time limit)")


def load_results(path: Path = RESULTS) -> dict:
    """The last ``make mutants`` run: ``{"ran_at", "commit", "seconds", "mutants": {ident: verdict}}``."""
    return json.loads(path.read_text()) if path.exists() else {"mutants": {}}


def tests_of(mutant) -> list[str]:
    """The tests a mutant runs: its site's test (the inventory), then its own extra ones."""
    site = next(b for b in INVENTORY if b.key == mutant.site)
    return list(dict.fromkeys(([site.test] if site.test else []) + list(mutant.tests)))


def mutant_counts(results: dict | None = None) -> dict[str, int]:
    """Mutants, killed, survived, not run (no verdict for the mutant as it is written now), others."""
    from gpu_mutants import MUTANTS

    got = (results if results is not None else load_results())["mutants"]
    verdicts = [got.get(m.ident, {}).get("verdict", "not run") for m in MUTANTS]
    killed = sum(v in KILLED for v in verdicts)
    survived, not_run = verdicts.count("survived"), verdicts.count("not run")
    return {"mutants": len(MUTANTS), "killed": killed, "survived": survived, "not_run": not_run,
            "other": len(verdicts) - killed - survived - not_run}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(results: dict | None = None) -> str:
    """The inventory and the mutants' last verdicts as tests/GPU_BRANCHES.md (``python tests/gpu_branches.py``
    writes it from the stored verdicts; ``make mutants`` rewrites it after each run)."""
    from gpu_mutants import MUTANTS

    results = results if results is not None else load_results()
    got = results["mutants"]
    c, mc = counts(), mutant_counts(results)
    ran = (f"last run {results['ran_at']} at commit {results.get('commit', '?')}, "
           f"{results.get('seconds', 0) / 60:.0f} min" if results.get("ran_at") else "never run")
    lines = [
        "# CUDA-only sites, the bugs planted in them, and the tests that catch them",
        "",
        "Generated from tests/gpu_branches.py (the inventory), tests/gpu_mutants.py (the mutants) and",
        "tests/gpu_mutants_results.json (their last verdicts): `make mutants` runs the mutants and rewrites",
        "this file; `python tests/gpu_branches.py > tests/GPU_BRANCHES.md` rewrites it from the stored",
        "verdicts. tests/test_gpu_branches.py keeps all three equal to the code (every decision site the",
        "scanner finds is listed, every CUDA-only site has a mutant or a doctor check that runs its code,",
        "every mutant's original text is in its file once, this file is what the data gives).",
        "",
        "**Sites.** A decision site is an `if`/`while`, a conditional expression or a comprehension's `if`",
        "whose condition depends on CUDA (`torch.cuda`, `\"cuda\"`, `\"nccl\"`, a GPU count, or a local",
        "flag set from such a test), or such a flag passed on as a value (`non_blocking=`, `pin_memory=`).",
        "`core/cuda_builds.py` (the driver -> build table) and `doctor.py` (the node's checks) are not",
        f"counted. The scanner found 108 sites at 09a7bdf; now {c['sites']} sites, {c['cuda_only']}",
        f"CUDA-only (one arm runs only with a GPU, NCCL or CUDA initialized): {c['run']} run by a test",
        f"against the fake GPU (tests/fake_gpu.py), {c['not_run']} left to `python -m lab_utils doctor`,",
        "each with the reason and the check that runs its code on a node.",
        "",
        "**Mutants.** A test that runs a line has not tested it: each tested site has at least one",
        "realistic bug written as data (tests/gpu_mutants.py), planted alone in a scratch copy of the",
        "repository, and the site's tests run against it; killed: a test failed.",
        f"**{mc['killed']} of {mc['mutants']} mutants killed ({mc['killed'] / max(mc['mutants'], 1):.0%})**, "
        f"{mc['survived']} survived, {mc['not_run']} not run, {mc['other']} other ({ran}).",
        "",
        "| file | function | condition | the CUDA arm | mutant: the bug it models | tests | result |",
        "|---|---|---|---|---|---|---|",
    ]
    by_site: dict[tuple, list] = {}
    for m in MUTANTS:
        by_site.setdefault(m.site, []).append(m)
    for b in INVENTORY:
        if not b.cuda_only:
            continue
        n = f" (#{b.occurrence})" if b.occurrence > 1 else ""
        head = f"| {b.file} | `{b.function}` | `{_cell(b.condition)}`{n} | {_cell(b.what)} "
        if not b.test:
            lines.append(f"{head}| none here: {b.reason} | doctor `{b.doctor}` runs it on a node | doctor |")
            continue
        for m in by_site.get(b.key, []):
            r = got.get(m.ident, {})
            verdict = r.get("verdict", "not run")
            by = f" by `{r['by']}`" if r.get("by") and verdict in KILLED else ""
            tests = ", ".join(f"`{t}`" for t in tests_of(m))
            lines.append(f"{head}| `{m.ident}`: {_cell(m.models)} | {tests} | {verdict}{by} |")
    lines += ["", "Not CUDA-only (both arms run on any machine; tested all the same):", "",
              "| file | function | condition | what | test |", "|---|---|---|---|---|"]
    for b in INVENTORY:
        if not b.cuda_only:
            lines.append(f"| {b.file} | `{b.function}` | `{_cell(b.condition)}` | {_cell(b.what)} "
                         f"| `{b.test}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--discover"]:
        for key, tests in discover(args[1:]).items():
            print(" | ".join(map(str, key)), "->", ", ".join(tests) or "NONE")
    elif args[:1] == ["--verify"]:
        problems = verify()
        print("\n".join(problems) or f"every one of the {counts()['run']} tested branches ran its CUDA arm")
        sys.exit(1 if problems else 0)
    else:
        sys.stdout.write(markdown())
