"""Every CUDA-only branch of the lab, found in the code, and what runs it on this CPU machine.

The lab is never run on a GPU before a student's session, so each line that only runs with
CUDA is either run by a test (against tests/fake_gpu.py where the device is needed) or named
here with the reason no fake can run it honestly and the ``python -m lab_utils doctor`` check
that does on a node. tests/test_gpu_branches.py keeps this table equal to the code, and
``python tests/gpu_branches.py`` prints it as tests/GPU_BRANCHES.md.

How sites are counted (:func:`scan`, by parsing ``lab_utils/``): a *decision site* is

- an ``if`` / ``elif`` / ``while``, a conditional expression (``a if c else b``) or a
  comprehension's ``if`` whose condition depends on CUDA: it mentions ``torch.cuda``, the
  strings ``"cuda"`` or ``"nccl"``, a GPU count (``gpus``, ``machine.gpus``), ``self.cuda``, or a local flag
  assigned from such a condition in the same function (``cuda = device.type == "cuda"``);
- a CUDA flag that never reaches a condition but is passed on as a value (``non_blocking =
  device.type == "cuda"``, ``pin_memory=torch.cuda.is_available()``).

A *GPU line* (issue 49) is a line whose effect exists only on a GPU, taken wherever it is (an ``if``
arm or not): the condition column holds the line's own text (``ast.unparse``):

- ``sync``: a call of ``synchronize`` or ``_sync`` (:data:`SYNC_CALLS`: ``timing.synchronize``,
  ``torch.cuda.synchronize``, a worker's own), each synchronize of a timer or a benchmark;
- ``event``: an event's ``.record(...)`` in a function that makes a ``torch.cuda.Event`` (the stream
  it is recorded on is in the line);
- ``reset``: a reset of a peak statistic (:data:`RESET_CALLS`);
- ``device``: a device index given to torch: ``torch.device("cuda", i)``, ``torch.cuda.set_device``,
  a ``device_ids=`` / ``device_id=`` argument (:data:`DEVICE_KEYWORDS`);
- ``peak``: a row of a module-level table of hardware peaks or link bandwidths, whose name ends in
  ``_TFLOPS``, ``_GB_PER_S`` or ``_TB_PER_S`` (:data:`PEAK_SUFFIXES`), keyed ``NAME[row key]``.

To add a GPU line (a synchronize in a new timer, a new peak table): write it, run
``python -m pytest tests/test_gpu_branches.py -k inventory`` (it names the new site's key), add a
:class:`Branch` for it to :data:`INVENTORY` (``B(file, function, the line's text, what it does,
test, n=occurrence)``, or ``reason=`` and ``doctor=`` where no fake can run it), a realistic
:class:`~gpu_mutants.Mutant` to tests/gpu_mutants.py and a test that fails on that bug; then
``make mutants MUTANTS_ARGS="--only <file stem>"`` and ``python tests/gpu_branches.py >
tests/GPU_BRANCHES.md``.

``lab_utils/engine/cuda_builds.py`` (the driver -> torch build table; tests/test_gpu_node.py
and tests/test_install.py) and ``lab_utils/app/doctor.py``, ``doctor_checks.py`` and ``doctor_experiments.py``
(the node's checks themselves; tests/test_doctor.py) are not counted. Each site is then *CUDA-only* (one arm runs only with
a GPU, NCCL or CUDA initialized) or not (both arms run on any machine: input checks, a
``gpus is None`` default); only CUDA-only sites count towards the target.

A site is keyed by file, function, condition text and its occurrence in that function, so
the table survives edits that move lines. ``python tests/gpu_branches.py --verify`` runs
each named test under a line tracer and checks that it executes the branch's CUDA arm
(``arm``: the first line of the ``if`` body or ``else``; for a conditional expression, a
flag or a GPU line, the line itself under the fake GPU; a peak row has no line to run: the
test must run its module's code, and its mutant decides).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "lab_utils"
NOT_COUNTED = ("engine/cuda_builds.py", "app/doctor.py", "app/doctor_checks.py", "app/doctor_experiments.py")
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
    kind: str          # "if" | "expr" (conditional expression, comprehension) | "flag" | a GPU line's:
    #                    "sync" | "event" | "reset" | "device" | "peak" (see the module's docstring)
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
    found += [(kind, node, node, False) for kind, node in _gpu_lines(body)]
    counts: Counter = Counter()
    for kind, t, arm, neg in sorted(found, key=lambda f: (f[1].lineno, f[1].col_offset)):
        cond = ast.unparse(t)
        counts[cond] += 1
        span = (arm.lineno, arm.col_offset, arm.end_lineno or arm.lineno, arm.end_col_offset or 0)
        out.append(Site(rel, func, cond, counts[cond], t.lineno, kind, span, neg))
    return frozenset(visible)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
GPU_LINES = ("sync", "event", "reset", "device")   # kinds of GPU lines inside functions ("peak": tables)

#: Calls that wait for the device (timing.synchronize, torch.cuda.synchronize, a worker's own _sync).
SYNC_CALLS = {"synchronize", "_sync"}
#: Calls that reset a peak statistic of the caching allocator (torch's, and the lab's wrapper).
RESET_CALLS = {"reset_peak_memory_stats", "reset_max_memory_allocated", "reset_peak_memory"}
#: Keyword arguments that give torch a GPU index (DDP's device_ids, init_process_group's device_id, ...).
DEVICE_KEYWORDS = {"device_ids", "device_id"}
#: Module-level tables of hardware peaks and link bandwidths, by the unit their name ends with.
PEAK_SUFFIXES = ("_TFLOPS", "_GB_PER_S", "_TB_PER_S")


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _gpu_lines(body: list[ast.stmt]) -> list[tuple[str, ast.AST]]:
    """The lines of one function body whose effect exists only on a GPU (not decisions; see the module's
    docstring): ``("sync", call)``, ``("event", record call)``, ``("reset", call)``, ``("device", node)``."""
    out: list[tuple[str, ast.AST]] = []
    nodes = list(_walk_own(body))
    has_event = any(isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.Event" for n in nodes)
    for n in nodes:
        if isinstance(n, ast.Call):
            name, text = _callee(n), ast.unparse(n.func)
            if name in SYNC_CALLS:
                out.append(("sync", n))
            elif name in RESET_CALLS:
                out.append(("reset", n))
            elif has_event and name == "record":
                out.append(("event", n))
            elif text == "torch.cuda.set_device" or (
                    text == "torch.device" and len(n.args) == 2 and isinstance(n.args[0], ast.Constant)
                    and n.args[0].value == "cuda"):
                out.append(("device", n))
        elif isinstance(n, ast.keyword) and n.arg in DEVICE_KEYWORDS:
            out.append(("device", n))
    return out


def _peak_rows(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Each row of a module-level peak or link table (a name ending in :data:`PEAK_SUFFIXES`, a list of
    ``(pattern, value)`` rows or a dict): ``("NAME[key]", the row)``."""
    out = []
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        if not (isinstance(target, ast.Name) and target.id.isupper() and target.id.endswith(PEAK_SUFFIXES)):
            continue
        value = stmt.value
        if isinstance(value, ast.List | ast.Tuple):
            rows = [(e.elts[0], e) for e in value.elts if isinstance(e, ast.Tuple) and e.elts]
        elif isinstance(value, ast.Dict):
            rows = [(k, ast.Tuple(elts=[k, v], lineno=k.lineno, col_offset=k.col_offset,
                                  end_lineno=v.end_lineno, end_col_offset=v.end_col_offset))
                    for k, v in zip(value.keys, value.values)]
        else:
            rows = []
        out += [(f"{target.id}[{ast.unparse(key)}]", row) for key, row in rows]
    return out


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
    for cond, row in _peak_rows(tree):
        span = (row.lineno, row.col_offset, row.end_lineno or row.lineno, row.end_col_offset or 0)
        out.append(Site(rel, "<module>", cond, 1, row.lineno, "peak", span, False))


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
    if site.kind in ("flag", *GPU_LINES):
        return (file, site.line) in run["fake"]
    if site.kind == "peak":
        return any(f == file for f, *_ in run["code"])
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
# the GPU lines' tests (issue 49)
BARRIER = BR + "test_a_barrier_on_nccl_names_the_gpu_by_index"
PROBE = BR + "test_the_no_sync_probe_on_a_gpu_measures_the_exposed_all_reduce"
JOIN = BR + "test_init_distributed_joins_nccl_on_its_own_gpu"
PEAKS = "test_hardware.py::test_every_peak_is_its_data_sheets_dense_figure"
LINKS = "test_gpu_numbers.py::test_link_peaks_are_the_data_sheets_per_direction_figures"
DP_GPUS = BR + "test_dataparallel_gets_the_gpus_it_is_given"
EPOCH = BR + "test_an_epoch_and_an_evaluation_time_exactly_their_device_work"
PHASES = BR + "test_phase_timers_time_exactly_the_device_work_inside"
AR_GPU = BR + "test_allreduce_worker_times_its_all_reduces_on_the_ranks_gpu"
STEP = BR + "test_the_compute_step_times_its_steps_alone"
WARM = BR + "test_the_warm_up_times_its_steps_alone"
LOADER = BR + "test_the_loader_benchmark_times_its_batches_alone"
HANDMADE = BR + "test_a_hand_made_replicas_step_is_timed_from_the_barrier_to_its_end"
DECODE = BR + "test_interleaved_decoding_times_each_model_alone"

INVENTORY: tuple[Branch, ...] = (
    # learn/comm_hooks.py, learn/comm_probe.py: DDP's communication hook and the no_sync probe
    B("learn/comm_hooks.py", "AllReduceTimer.__init__", "dev.type == 'cuda'",
      "the hook's clock is CUDA events on a GPU", EVENTS),
    B("learn/comm_hooks.py", "AllReduceTimer._stamp", "self.cuda", "records a timing CUDA event", EVENTS),
    B("learn/comm_hooks.py", "AllReduceTimer._since_ref", "self.cuda",
      "event.elapsed_time (ms) -> seconds", EVENTS),
    B("learn/comm_hooks.py", "AllReduceTimer.finish_step", "self.cuda",
      "synchronizes the device before reading the events", EVENTS),
    B("learn/comm_probe.py", "_barrier", "device.type == 'cuda' and dist.get_backend() == 'nccl'",
      "NCCL barrier with device_ids=[index]", BR + "test_a_barrier_on_nccl_names_the_gpu_by_index"),
    # experiments/shared/data.py
    B("experiments/shared/data.py", "make_loaders", "torch.cuda.is_available()", "pinned host memory for the GPU",
      BR + "test_loaders_pin_memory_when_a_gpu_is_there"),
    B("experiments/shared/data.py", "spec_loader", "torch.cuda.is_available()", "pinned host memory for the GPU",
      BR + "test_loaders_pin_memory_when_a_gpu_is_there"),
    # engine/dist.py
    B("engine/dist.py", "choose_backend", "torch.cuda.is_available()", "counts the GPUs", CHOOSE),
    B("engine/dist.py", "choose_backend", "gpus >= local_world_size and gpus > 0 and dist.is_nccl_available()",
      "NCCL when every local rank has its GPU", CHOOSE),
    B("engine/dist.py", "init_distributed", "device == 'cuda' and (not torch.cuda.is_available())",
      "--device cuda without a GPU: one sentence", NO_GPU, cuda_only=False),
    B("engine/dist.py", "init_distributed", "device == 'cuda'", "--device cuda forces NCCL",
      BR + "test_init_distributed_joins_nccl_on_its_own_gpu"),
    B("engine/dist.py", "init_distributed", "use_cuda", "one process without torchrun uses the GPU",
      BR + "test_init_distributed_without_torchrun_on_a_gpu"),
    B("engine/dist.py", "init_distributed", "backend == 'nccl'",
      "cuda:LOCAL_RANK, set_device, init_process_group('nccl', device_id=...)",
      BR + "test_init_distributed_joins_nccl_on_its_own_gpu"),
    B("engine/dist.py", "init_distributed", "torch.cuda.device_count() <= local_rank",
      "more ranks than GPUs: one sentence", BR + "test_init_distributed_joins_nccl_on_its_own_gpu"),
    B("engine/dist.py", "failure_ends_rank", "ctx.backend == 'nccl'",
      "under NCCL any error ends the rank (its line, then os._exit)",
      FS + "test_under_nccl_any_error_ends_the_rank_and_under_gloo_it_propagates"),
    # engine/environment.py
    B("engine/environment.py", "gpu_node_problem", "torch.cuda.is_available()",
      "torch sees the GPUs: their compute capabilities against its architecture list", SESSION),
    B("engine/environment.py", "check_gpu_node", "torch.cuda.is_available()",
      "no kernels for this GPU: refused whatever the profile",
      FS + "test_notebook_00_and_info_refuse_a_torch_without_this_gpus_architecture"),
    B("engine/environment.py", "gpu_node_problem", "driver is None or not driver.gpus",
      "the driver lists GPUs torch cannot see: what is wrong and the fix for this build",
      "test_gpu_node.py::test_a_fitting_torch_that_cannot_see_gpus_gets_a_different_fix"),
    B("experiments/n00_environment/tables.py", "environment_rows", "driver is not None and driver.gpus",
      "the driver's GPUs listed, saying torch cannot use them",
      "test_gpu_node.py::test_environment_rows_on_a_gpu_node_torch_cannot_use"),
    # experiments/n09_build_ddp/replica_memory.py: notebook 09's memory of each implementation
    B("experiments/n09_build_ddp/replica_memory.py", "memory_use", "device.type == 'cuda'",
      "memory_allocated before the build and after the warm-up, max_memory_allocated over the measured step "
      "after reset_peak_memory_stats", MEMORY_USE),
    # engine/hardware.py
    B("engine/hardware.py", "bf16_supported", "dev.type != 'cuda' or not torch.cuda.is_available()",
      "is_bf16_supported(including_emulation=False), capability on torch 2.4",
      DF + "test_bf16_on_ampere_and_with_torch_24s_signature"),
    B("engine/hardware.py", "cudnn_build_version", "torch.cuda.is_initialized()",
      "CUDA already up: torch's checked version (its refusal on sm < 7.5 said)",
      FS + "test_the_versions_row_survives_cudnn_refusing_the_gpu"),
    B("engine/hardware.py", "device_name", "torch.cuda.is_available()", "the default device: GPU", QUERIES),
    B("engine/hardware.py", "device_name", "dev.type == 'cuda'", "names the GPU", QUERIES),
    B("engine/hardware.py", "device_name", "not torch.cuda.is_initialized()",
      "nvidia-smi -L's name while CUDA is not initialized (no context); torch's after", QUERIES),
    B("engine/hardware.py", "gpus", "not torch.cuda.is_available()", "lists GPUs: name, memory", QUERIES),
    B("engine/hardware.py", "gpu_count", "torch.cuda.is_available()", "torch.cuda.device_count()", QUERIES),
    B("engine/hardware.py", "hardware_summary", "torch.cuda.is_available()", "the record's device is the GPU",
      QUERIES),
    B("engine/hardware.py", "hardware_summary", "dtype == 'cuda'", "device_count = the visible GPUs", QUERIES),
    # learn/loop.py, learn/devices.py, learn/evaluation.py
    B("learn/devices.py", "default_device", "torch.cuda.is_available()", "cuda", BENCH),
    B("learn/devices.py", "peak_memory", "device.type == 'cuda'", "max_memory_allocated (bytes)",
      BR + "test_peak_memory_is_read_and_reset_on_the_gpu"),
    B("learn/devices.py", "reset_peak_memory", "device.type == 'cuda'", "reset_peak_memory_stats",
      BR + "test_peak_memory_is_read_and_reset_on_the_gpu"),
    B("learn/devices.py", "model_devices", "isinstance(model, nn.DataParallel) and device.type == 'cuda' and "
      "model.device_ids", "DataParallel: each GPU's peak",
      DF + "test_dataparallel_peak_memory_is_every_gpus"),
    B("learn/loop.py", "train_steps", "device.type == 'cuda'", "non_blocking host-to-device copies", COPIES),
    B("learn/evaluation.py", "evaluate", "device.type == 'cuda'", "non_blocking copies from pinned memory", COPIES),
    # engine/machine.py: the machine a plan is made for
    B("engine/machine.py", "Machine.device", "self.gpus", "a one-device experiment's runs go to cuda", MACHINE),
    B("engine/machine.py", "Machine.describe", "self.gpus", "'N x <GPU name>'", MACHINE),
    B("engine/machine.py", "Machine.here", "gpus", "the GPU's name (nvidia-smi's, no CUDA context)", MACHINE),
    B("engine/machine.py", "_native_bf16", "not torch.cuda.is_initialized()",
      "CUDA already up: torch's bf16 answer (nvidia-smi's compute capability before)", MACHINE),
    # engine/memory.py
    B("engine/memory.py", "free_device_memory", "on_cuda and torch.cuda.is_available() and "
      "torch.cuda.is_initialized()", "empty_cache after gc", BR + "test_memory_cap_and_cleanup_on_a_gpu"),
    B("engine/memory.py", "resolve_cuda_device", "dev.type != 'cuda'", "an index for torch's memory calls",
      BR + "test_memory_cap_and_cleanup_on_a_gpu"),
    # learn/timing.py
    B("learn/timing.py", "synchronize", "dev.type == 'cuda'", "torch.cuda.synchronize at every timer boundary",
      BR + "test_timers_synchronize_so_a_phase_includes_its_queued_device_work"),
    # app/bench_timers.py
    B("app/bench_timers.py", "main", "device.type == 'cuda'",
      "the GPU's models, batches and wall clock", BENCH),
    # experiments/n04_allreduce/experiment.py
    B("experiments/n04_allreduce/experiment.py", "plan_bench", "gpus >= 2", "NCCL, one rank per GPU, every GPU of the node too",
      COMM),
    B("experiments/n04_allreduce/experiment.py", "plan_bench", "device == 'cuda'", "a rank count the node lacks: 'needs N GPUs'",
      COMM),
    B("experiments/n04_allreduce/experiment.py", "plan_compute", "device != 'cuda'", "the compute step is launched",
      COMM),
    # experiments/n08_speed_limits/experiment.py
    B("experiments/n08_speed_limits/experiment.py", "waterfall.skip", "opts.bf16 and machine.gpus and (not machine.bf16)",
      "a GPU without native bf16: the bf16 steps are rows that say so", FAST_PLAN),
    B("experiments/n08_speed_limits/experiment.py", "plan_loader", "machine.gpus", "the device loader without a CPU thread cap",
      FAST_PLAN),
    # experiments/n08_speed_limits/tables.py
    B("experiments/n08_speed_limits/tables.py", "_machine", "device == 'cuda' and (not here.gpus)",
      "--device cuda without a GPU: one sentence", NO_GPU, cuda_only=False),
    B("experiments/n08_speed_limits/tables.py", "trace_notes", "on_gpu", "self time = GPU kernel time",
      BR + "test_fast_path_choices_on_a_gpu"),
    B("experiments/n08_speed_limits/tables.py", "trace_notes", "on_gpu", "percent of the GPU's kernel time",
      BR + "test_fast_path_choices_on_a_gpu", n=2),
    # experiments/n06_gpt_ddp/experiment.py
    B("experiments/n06_gpt_ddp/experiment.py", "place", "machine.gpus >= devices", "the ranks on as many GPUs", GPT_PLAN),
    B("experiments/n06_gpt_ddp/experiment.py", "place", "machine.gpus == 0 and devices <= procs",
      "too few GPUs: a row (no gloo CPU processes on a GPU node)", GPT_PLAN),
    B("experiments/n06_gpt_ddp/experiment.py", "place", "machine.gpus", "the row says how many GPUs the node has", GPT_PLAN),
    # experiments/n05_large_batch/experiment.py
    B("experiments/n05_large_batch/experiment.py", "DevicePlan.device", "self.backend == 'nccl'", "runs on the GPUs", LB),
    B("experiments/n05_large_batch/experiment.py", "plan_devices", "gpus >= 1", "NCCL ranks on the GPUs", LB),
    B("experiments/n05_large_batch/experiment.py", "plan_devices", "gpus < want", "fewer GPUs than asked: says so", LB),
    B("experiments/n05_large_batch/experiment.py", "plan_accounting", "gpus >= 2", "the ledger on the GPUs (NCCL)", LB),
    B("experiments/n05_large_batch/experiment.py", "plan_accounting", "backend == 'nccl'", "the ledger's device is the GPU",
      LB),
    B("experiments/n05_large_batch/tables.py", "large_batch_table", "rec.config.get('backend') == 'nccl'",
      "'N x GPU' in the table", BR + "test_the_large_batch_table_says_gpu"),
    # experiments/n07_quantization/experiment.py, experiments/n07_quantization/quant_variants.py,
    # experiments/n07_quantization/quant_model.py
    B("experiments/n07_quantization/experiment.py", "plan_fallback", "machine.gpus == 0",
      "the fallback GPT trained on the GPU through the launcher", QUANT_PLAN),
    B("experiments/n07_quantization/experiment.py", "plan", "machine.gpus", "every variant on the GPU too", QUANT_PLAN),
    B("experiments/n07_quantization/experiment.py", "Settings.validate", "d not in ('cpu', 'cuda')", "an unknown device",
      "test_quantize.py::test_settings_validation", cuda_only=False),
    B("experiments/n07_quantization/quant_variants.py", "check_variant", "dev == 'cuda' and (not torch.cuda.is_available())",
      "no CUDA device: a row that says so", "test_quantize.py::test_no_cuda_row_and_unknown_variant",
      cuda_only=False),
    B("experiments/n07_quantization/quant_variants.py", "check_variant", "dev == 'cuda'", "cuBLAS fp32 (TF32 or not)", QUANT),
    B("experiments/n07_quantization/quant_variants.py", "check_variant", "dev == 'cuda'", "bf16 on the GPU", QUANT, n=2),
    B("experiments/n07_quantization/quant_variants.py", "check_variant", "not bf16_supported('cuda')", "native bf16 only",
      QUANT),
    B("experiments/n07_quantization/quant_variants.py", "check_variant", "dev == 'cuda'", "torch.ao int8 is CPU only", QUANT,
      n=3),
    B("experiments/n07_quantization/quant_variants.py", "check_variant", "dev == 'cuda'",
      "cuBLAS int8 (torch._int_mm), padded",
      QUANT, n=4),
    B("experiments/n07_quantization/quant_model.py", "pad_int8_matmul_rows", "variant != 'torchao_int8_dynamic' or "
      "torch.device(device).type != 'cuda'", "pads M <= 16 rows to 17 for torch._int_mm",
      DF + "test_int8_matmuls_of_few_rows_are_padded_to_what_cublas_needs"),
    B("experiments/n07_quantization/quant_model.py", "float_layers", "variant != 'torchao_int8_dynamic' or "
      "torch.device(device).type != 'cuda'", "layers whose K or N % 8 != 0 stay fp32", QUANT),
    # experiments/n02_scaling/experiment.py
    B("experiments/n02_scaling/experiment.py", "place", "machine.gpus >= devices", "DataParallel on the GPUs", SCALING),
    B("experiments/n02_scaling/experiment.py", "place", "machine.gpus >= devices", "DDP on NCCL", SCALING, n=2),
    B("experiments/n02_scaling/experiment.py", "place", "machine.gpus == 0 and devices <= settings.max_cpu_processes",
      "more devices than GPUs: needs N GPUs", SCALING),
    B("experiments/n02_scaling/experiment.py", "methods_here", "machine.gpus", "DataParallel and DDP side by side", SCALING),
    B("experiments/n02_scaling/experiment.py", "_runs", "machine.gpus", "a row that cannot run keeps its NCCL label",
      SCALING),
    B("experiments/n02_scaling/experiment.py", "plan_compute_vs_comm", "machine.gpus", "DataParallel rows in Table 2",
      SCALING),
    # experiments/n01_batch_sweep/experiment.py
    B("experiments/n01_batch_sweep/experiment.py", "plan", "not machine.gpus and s.memory_fraction is not None",
      "memory_fraction accepted on a GPU", SWEEP_PLAN),
    B("experiments/n01_batch_sweep/experiment.py", "plan", "machine.gpus", "no CPU thread pin on a GPU", SWEEP_PLAN),
    B("experiments/n01_batch_sweep/experiment.py", "plan", "machine.gpus", "the GPU's name in the key", SWEEP_PLAN, n=2),
    # engine/plan.py
    B("engine/plan.py", "Run.hardware", "self.device == 'cuda' and (not torch.cuda.is_available())",
      "without the GPUs here no name; with them, the GPU's name for the reuse check", RUN),
    B("engine/plan.py", "measure", "run.device == 'cuda' and run.in_process",
      "a GPU run marked in_process: one sentence", RUN, cuda_only=False),
    # engine/session.py
    B("engine/session.py", "session_for", "torch.cuda.is_available()", "counts the GPUs", SESSION),
    B("engine/session.py", "session_for", "gpus", "the notebook's device is cuda", SESSION),
    B("engine/session.py", "start", "gpus", "'cuda x N' in the first line", SESSION),
    # app/time_budget.py (the plans are made for the budget's 4-GPU node on any machine: both arms run here)
    B("app/time_budget.py", "plan_parts", "run.device == 'cuda'", "a run's GPUs in the budget table",
      "test_time_budget.py::test_a_registered_notebook_is_the_sum_over_its_plan_by_hand", cuda_only=False),
    B("app/time_budget.py", "_gpus", "p.gpus", "the GPUs column of the budget table",
      "test_time_budget.py::test_table_has_every_notebook_and_a_total", cuda_only=False),
    # experiments/n01_batch_sweep/worker.py
    B("experiments/n01_batch_sweep/worker.py", "run_config", "dev.type == 'cuda'", "the GPU memory fraction, before training",
      SWEEP),
    # experiments/n04_allreduce/allreduce_worker.py
    B("experiments/n04_allreduce/allreduce_worker.py", "_sync", "device.type == 'cuda'", "synchronize around the timed loop",
      BR + "test_allreduce_worker_waits_for_the_gpu"),
    # experiments/n05_large_batch/accounting_worker.py
    B("experiments/n05_large_batch/accounting_worker.py", "run_accounting.ddp_wrap", "cuda", "DDP with device_ids=[index]",
      reason=NCCL, doctor="05_comm_accounting"),
    B("experiments/n05_large_batch/accounting_worker.py", "run_accounting.steps", "cuda", "synchronize after each step",
      reason=NCCL, doctor="05_comm_accounting"),
    # experiments/n09_build_ddp/experiment.py
    B("experiments/n09_build_ddp/experiment.py", "plan", "machine.gpus", "rows that need more GPUs named nccl on a GPU node",
      "test_build_ddp.py::test_the_plan_on_two_cpu_cores_and_on_the_budget_node"),
    # experiments/n09_build_ddp/tables.py: notebook 09's trace figure reads a GPU trace's kernels
    B("experiments/n09_build_ddp/tables.py", "_lanes", "'nccl' in e['name'].lower()",
      "NCCL's kernels of a GPU trace are the all-reduce lane", BDDP),
    B("experiments/n09_build_ddp/tables.py", "_lanes", "'nccl' not in e['name'].lower()",
      "the other kernels of a GPU trace are the compute lane", BDDP),
    # experiments/n02_scaling/ddp_worker.py
    B("experiments/n02_scaling/ddp_worker.py", "run_config", "cuda", "DDP with device_ids=[index]",
      reason=NCCL, doctor="02_scaling"),
    B("experiments/n02_scaling/ddp_worker.py", "RunConfig.config", "self.backend == 'nccl'", "device_type cuda in the key",
      BR + "test_worker_records_name_the_gpu"),
    # engine/harness.py
    B("engine/harness.py", "serve", "torch.cuda.is_available()",
      "one process without a group (DataParallel) drives the GPUs",
      BR + "test_a_worker_without_a_process_group_drives_the_gpus"),
    # experiments/n08_speed_limits/fast_train.py, experiments/n08_speed_limits/worker.py
    B("experiments/n08_speed_limits/fast_train.py", "resolved_sgd", "device.type == 'cuda'", "torch's default SGD is foreach",
      BR + "test_fast_path_choices_on_a_gpu"),
    B("experiments/n08_speed_limits/fast_train.py", "to_device", "device.type == 'cuda'",
      "non_blocking copies of a host batch", COPIES),
    B("experiments/n08_speed_limits/worker.py", "_trace", "dev.type == 'cuda'", "the profiler's CUDA activity",
      reason=CUPTI, doctor="08_fastpath_trace"),
    B("experiments/n08_speed_limits/worker.py", "top_operators.self_us", "on_gpu", "device (kernel) time per operator",
      "test_fastpath.py::test_top_operators_on_a_gpu_count_each_kernel_once"),
    B("experiments/n08_speed_limits/worker.py", "top_operators", "on_gpu", "kernels counted once, operators as rows",
      "test_fastpath.py::test_top_operators_on_a_gpu_count_each_kernel_once"),
    B("experiments/n08_speed_limits/worker.py", "top_operators", "on_gpu", "the host time next to the kernel time",
      "test_fastpath.py::test_top_operators_on_a_gpu_count_each_kernel_once", n=2),
    # experiments/n06_gpt_ddp/worker.py
    B("experiments/n06_gpt_ddp/worker.py", "device_peak", "device.type != 'cuda'", "the GPU's peak for MFU (TF32 rule)",
      BR + "test_gpt_device_peak_on_a_gpu"),
    B("experiments/n06_gpt_ddp/worker.py", "_train", "device.type == 'cuda'", "DDP with device_ids=[local_rank]",
      reason=NCCL, doctor="06_gpt_scaling"),
    B("experiments/n06_gpt_ddp/worker.py", "_train", "device.type == 'cuda'", "pinned loader memory",
      reason=TENSORS, doctor="06_gpt_scaling", n=2),
    # app/handin.py and app/grading/provenance.py read the device type STORED in records and handin.json (a
    # string): both arms run on any machine, driven by hand-made records of a GPU and of a CPU run
    B("app/handin.py", "Provenance.problems", "self.device_type != 'cuda'", "no GPU: not ready to hand in",
      HANDIN + "test_quick_cpu_synthetic_numbers_fail_the_check", cuda_only=False),
    B("app/handin.py", "provenance", "h.get('device_type') == 'cuda'", "the GPU records name the devices",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", cuda_only=False),
    B("app/handin.py", "provenance", "p.device_type == 'cuda'", "the CUDA version of a GPU run",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", cuda_only=False),
    B("app/handin.py", "provenance", "p.device_type == 'cuda'", "NCCL's version of a GPU run",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", n=2, cuda_only=False),
    B("app/handin.py", "provenance", "sw.get('cudnn') and p.device_type == 'cuda'", "cuDNN's version, GPU run",
      HANDIN + "test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes", cuda_only=False),
    B("app/grading/provenance.py", "describe", "prov['device_type'] != 'cuda'", "the CPU (no GPU) flag",
      HANDIN + "test_make_grade_reads_the_handin_json_make_report_writes", cuda_only=False),

    # ------------------------------------------------------------------ GPU lines (issue 49)
    # learn/comm_hooks.py, learn/comm_probe.py
    B("learn/comm_hooks.py", "AllReduceTimer._stamp", "ev.record()",
      "the event on the current stream (in a callback: the stream that waits for NCCL)", EVENTS),
    B("learn/comm_hooks.py", "AllReduceTimer.finish_step", "torch.cuda.synchronize(self.device)",
      "waits for the rank's GPU before the events are read", EVENTS),
    B("learn/comm_probe.py", "_barrier",
      "device_ids=[device.index if device.index is not None else torch.cuda.current_device()]",
      "NCCL's barrier on the rank's GPU (no index: the current one)", BARRIER),
    B("learn/comm_probe.py", "_barrier", "synchronize(device)", "the device idle before the probe's clock",
      PROBE),
    B("learn/comm_probe.py", "probe_exposed_comm.one", "synchronize(device)",
      "a probe step ends when its kernels and all-reduces do", PROBE),
    # experiments/n09_build_ddp/replica_memory.py: notebook 09's memory of each implementation
    *(B("experiments/n09_build_ddp/replica_memory.py", "memory_use", "torch.cuda.synchronize(device)", what, MEMORY_USE, n=n)
      for n, what in ((1, "the device idle before the first counter is read"),
                      (2, "the warm-up done before the held bytes are read"),
                      (3, "the measured step done before its peak is read"))),
    B("experiments/n09_build_ddp/replica_memory.py", "memory_use", "torch.cuda.reset_peak_memory_stats(device)",
      "the measured GPU's peak reset before the measured step",
      BR + "test_memory_use_resets_the_measured_gpus_peak"),
    # app/bench_timers.py: each arm of the paired timer overhead
    B("app/bench_timers.py", "arms.timed", "synchronize(device)",
      "the timed step ends when its kernels do", BR + "test_bench_timers_arms_end_when_the_gpus_step_does"),
    B("app/bench_timers.py", "arms.plain", "synchronize(device)",
      "the plain step ends when its kernels do", BR + "test_bench_timers_arms_end_when_the_gpus_step_does"),
    # engine/dist.py
    B("engine/dist.py", "init_distributed", "torch.device('cuda', local_rank)",
      "a rank's GPU is its LOCAL_RANK",
      JOIN),
    B("engine/dist.py", "init_distributed", "torch.cuda.set_device(dev)", "the rank's GPU made current", JOIN),
    B("engine/dist.py", "init_distributed", "device_id=dev", "NCCL's communicator made now, on the rank's GPU",
      JOIN),
    # engine/hardware.py: the peak table (tests/test_hardware.py pins every number to its data sheet)
    *(B("engine/hardware.py", "<module>", f"PEAK_TFLOPS[{pattern!r}]", f"{pattern}'s dense peaks", PEAKS)
      for pattern in ("H100 NVL", "H100 PCIe", "H100", "H200 NVL", "H200", "A100", "L40S", "A10", "V100-SXM2",
                      "V100-PCIE", "V100S", "RTX 8000", "T4")),
    # learn/loop.py, learn/devices.py, learn/evaluation.py
    B("learn/devices.py", "wrap_data_parallel", "device_ids=device_ids", "DataParallel on the GPUs it is given",
      DP_GPUS),
    B("learn/devices.py", "reset_peak_memory", "torch.cuda.reset_peak_memory_stats(device)",
      "the peak of that GPU reset", BR + "test_peak_memory_is_read_and_reset_on_the_gpu"),
    B("learn/devices.py", "model_devices", "torch.device('cuda', i)", "each DataParallel replica's GPU by index",
      DF + "test_dataparallel_peak_memory_is_every_gpus"),
    B("learn/loop.py", "run_epoch", "reset_peak_memory(d)", "every GPU's peak reset before the epoch",
      BR + "test_an_epoch_reports_each_gpus_peak_of_that_epoch"),
    B("learn/loop.py", "run_epoch", "synchronize(device)", "the epoch's clock starts on an idle device",
      EPOCH),
    B("learn/loop.py", "run_epoch", "synchronize(device)", "the epoch ends when its kernels do", EPOCH, n=2),
    B("learn/evaluation.py", "evaluate", "synchronize(device)", "the evaluation's clock starts on an idle device",
      EPOCH),
    B("learn/evaluation.py", "evaluate", "synchronize(device)", "the evaluation ends when its kernels do",
      EPOCH, n=2),
    # engine/memory.py
    B("engine/memory.py", "resolve_cuda_device", "torch.device('cuda', device)", "an int is that GPU's index",
      BR + "test_memory_cap_and_cleanup_on_a_gpu"),
    B("engine/memory.py", "resolve_cuda_device", "torch.device('cuda', torch.cuda.current_device())",
      "no index: the current GPU's", BR + "test_memory_cap_and_cleanup_on_a_gpu"),
    # learn/timing.py
    B("learn/timing.py", "synchronize", "torch.cuda.synchronize(dev)",
      "waits for every stream of the device (NCCL's too)", PHASES),
    B("learn/timing.py", "timed", "synchronize(device)", "a timer starts on an idle device", PHASES),
    B("learn/timing.py", "timed", "synchronize(device)", "a timer ends when its kernels do", PHASES, n=2),
    B("learn/timing.py", "PhaseTimer.iterate", "synchronize(self.device)",
      "a batch wait starts when the step's kernels are done", PHASES),
    B("learn/timing.py", "PhaseTimer.iterate", "synchronize(self.device)",
      "a batch wait ends when the loader's kernels do", PHASES, n=2),
    # experiments/n04_allreduce/experiment.py: the link tables (tests/test_gpu_numbers.py pins each to its
    # data sheet)
    *(B("experiments/n04_allreduce/experiment.py", "<module>", f"_NVLINK_GB_PER_S[{pattern!r}]",
        f"{pattern}'s NVLink, per direction", LINKS)
      for pattern in ("H100 NVL", "H100 PCIe", "H100", "H200", "A100", "V100")),
    *(B("experiments/n04_allreduce/experiment.py", "<module>", f"_PCIE_LANE_GB_PER_S[{gen}]",
        f"a PCIe gen{gen} lane, per direction",
        LINKS) for gen in range(1, 6)),
    # workers
    B("experiments/n04_allreduce/allreduce_worker.py", "_sync", "torch.cuda.synchronize(device)", "waits for the rank's GPU",
      AR_GPU),
    B("experiments/n04_allreduce/allreduce_worker.py", "measure_size", "_sync(device)", "the warm-up all-reduces done", AR_GPU),
    B("experiments/n04_allreduce/allreduce_worker.py", "measure_size", "_sync(device)", "the device idle when the clock starts",
      AR_GPU, n=2),
    B("experiments/n04_allreduce/allreduce_worker.py", "measure_size", "_sync(device)",
      "the clock stops when the all-reduces end",
      AR_GPU, n=3),
    B("experiments/n05_large_batch/accounting_worker.py", "run_accounting.ddp_wrap", "device_ids=[device.index] if cuda else None",
      "DDP on the rank's GPU", reason=NCCL, doctor="05_comm_accounting"),
    B("experiments/n05_large_batch/accounting_worker.py", "run_accounting.steps", "torch.cuda.synchronize(device)",
      "a ledger step ends when its collectives do", reason=NCCL, doctor="05_comm_accounting"),
    B("experiments/n04_allreduce/compute_step_worker.py", "measure_compute_step_seconds", "synchronize(dev)",
      "the warm-up done before the clock starts", STEP),
    B("experiments/n04_allreduce/compute_step_worker.py", "measure_compute_step_seconds", "synchronize(dev)",
      "the clock stops when the steps' kernels end", STEP, n=2),
    B("experiments/n02_scaling/dp_worker.py", "run_config", "device_ids=list(range(n))", "DataParallel on GPUs 0..n-1",
      DP_GPUS),
    B("experiments/n02_scaling/ddp_worker.py", "run_config", "device_ids=[device.index] if cuda else None", "DDP on the rank's GPU",
      reason=NCCL, doctor="02_scaling"),
    B("experiments/n02_scaling/ddp_worker.py", "run_config", "synchronize(device)",
      "start-up time includes DDP's parameter broadcast",
      reason=NCCL, doctor="02_scaling"),
    B("experiments/n08_speed_limits/fast_train.py", "warm_up", "synchronize(trainer.device)",
      "the warm-up starts on an idle device",
      WARM),
    B("experiments/n08_speed_limits/fast_train.py", "warm_up", "synchronize(trainer.device)",
      "the warm-up ends when its kernels do",
      WARM, n=2),
    B("experiments/n08_speed_limits/worker.py", "time_loader", "synchronize(device)", "the untimed first batch done", LOADER),
    B("experiments/n08_speed_limits/worker.py", "time_loader", "synchronize(device)", "a pass ends when its kernels do", LOADER,
      n=2),
    B("experiments/n08_speed_limits/worker.py", "timed_epoch", "reset_peak_memory(device)", "the row's peak is its epoch's",
      BR + "test_a_waterfall_rows_peak_memory_is_its_epochs"),
    B("experiments/n08_speed_limits/worker.py", "_trace", "synchronize(dev)", "the trace holds the last step's kernels",
      reason=CUPTI, doctor="08_fastpath_trace"),
    B("experiments/n06_gpt_ddp/worker.py", "_train", "device_ids=[ctx.local_rank] if device.type == 'cuda' else None",
      "DDP on the rank's GPU", reason=NCCL, doctor="06_gpt_scaling"),
    B("experiments/n09_build_ddp/worker.py", "Replica.timed_step", "synchronize(device)",
      "a step ends when its kernels do",
      HANDMADE),
    B("experiments/n09_build_ddp/worker.py", "_barrier", "synchronize(device)", "the barrier's all-reduce done",
      HANDMADE),
    B("experiments/n09_build_ddp/worker.py", "_trace", "synchronize(ctx.device)",
      "each traced step's kernels in its range",
      reason=CUPTI, doctor="09_build_ddp"),
    B("experiments/n07_quantization/quant_timing.py", "time_interleaved", "synchronize(dev)",
      "a repetition starts on an idle device",
      DECODE),
    B("experiments/n07_quantization/quant_timing.py", "time_interleaved", "synchronize(dev)",
      "a repetition ends when its kernels do",
      DECODE, n=2),
)


def counts() -> dict[str, int]:
    """Sites, CUDA-only sites, how many of those a test runs, and the sites of each kind (``if``,
    ``expr``, ``flag``: decisions; ``sync``, ``event``, ``reset``, ``device``, ``peak``: GPU lines)."""
    cuda = [b for b in INVENTORY if b.cuda_only]
    kinds = Counter(s.kind for s in scan())
    return {"sites": len(INVENTORY), "cuda_only": len(cuda), "run": sum(1 for b in cuda if b.test),
            "not_run": sum(1 for b in cuda if not b.test),
            "decisions": sum(kinds[k] for k in ("if", "expr", "flag")), **kinds}


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
    if results.get("ran_at") and results.get("only"):   # a partial run: the other verdicts are older
        ran += f", only the mutants matching {results['only']!r}; the others' verdicts from earlier runs"
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
        *textwrap.wrap(
            "**Sites.** A decision site is an `if`/`while`, a conditional expression or a comprehension's "
            "`if` whose condition depends on CUDA (`torch.cuda`, `\"cuda\"`, `\"nccl\"`, a GPU count, or a "
            "local flag set from such a test), or such a flag passed on as a value (`non_blocking=`, "
            "`pin_memory=`). A GPU line (issue 49) is a line whose effect exists only on a GPU, wherever it "
            "is: each synchronize of a timer or benchmark (`sync`), each event record and the stream it is "
            "on (`event`), each reset of a peak statistic (`reset`), each device index given to torch "
            "(`device`: `torch.device(\"cuda\", i)`, `set_device`, `device_ids=`, `device_id=`), each row of "
            "a peak or link table (`peak`: a module-level name ending in `_TFLOPS`, `_GB_PER_S` or "
            "`_TB_PER_S`); its site column is the line's own text. `engine/cuda_builds.py` (the driver -> "
            "build table) and `app/doctor.py`, `app/doctor_checks.py` and `app/doctor_experiments.py` (the node's "
            "checks) are not counted. The scanner found 108 sites "
            f"at 09a7bdf and 113 at e53e80e; now {c['decisions']} decision sites and "
            f"{c['sites'] - c['decisions']} GPU lines ({c.get('sync', 0)} sync, {c.get('event', 0)} event, "
            f"{c.get('reset', 0)} reset, {c.get('device', 0)} device, {c.get('peak', 0)} peak): "
            f"{c['sites']} sites, {c['cuda_only']} CUDA-only (one arm runs only with a GPU, NCCL or CUDA "
            f"initialized): {c['run']} run by a test against the fake GPU (tests/fake_gpu.py), "
            f"{c['not_run']} left to `python -m lab_utils doctor`, each with the reason and the check that "
            "runs its code on a node.", 100, break_on_hyphens=False),
        "",
        *textwrap.wrap(
            "**Adding a site** (a synchronize in a new timer, a peak read on a GPU, a new peak table): the "
            "scanner finds it and `tests/test_gpu_branches.py -k inventory` names its key (file, function, "
            "the condition or the line's text, its occurrence in the function). Add a `B(...)` row for it "
            "to `INVENTORY` in tests/gpu_branches.py (what its CUDA side does, and the test that runs it; "
            "or `reason=` and `doctor=` where no fake can), a realistic bug for it to tests/gpu_mutants.py "
            "(`M(...)`: its site, a text that occurs once in the file, what replaces it, the bug it models) "
            "and a test that fails on that bug (a known answer on the fake GPU: the time it queued, the GPU "
            "it used); then `make mutants MUTANTS_ARGS=\"--only <file stem>\"` and commit the three files.",
            100, break_on_hyphens=False),
        "",
        "**Mutants.** A test that runs a line has not tested it: each tested site has at least one",
        "realistic bug written as data (tests/gpu_mutants.py), planted alone in a scratch copy of the",
        "repository, and the site's tests run against it; killed: a test failed.",
        f"**{mc['killed']} of {mc['mutants']} mutants killed ({mc['killed'] / max(mc['mutants'], 1):.0%})**, "
        f"{mc['survived']} survived, {mc['not_run']} not run, {mc['other']} other ({ran}).",
        "",
        "| file | function | condition or GPU line | the CUDA arm | mutant: the bug it models | tests "
        "| result |",
        "|---|---|---|---|---|---|---|",
    ]
    kinds = {s.key: s.kind for s in scan()}
    by_site: dict[tuple, list] = {}
    for m in MUTANTS:
        by_site.setdefault(m.site, []).append(m)
    for b in INVENTORY:
        if not b.cuda_only:
            continue
        n = f" (#{b.occurrence})" if b.occurrence > 1 else ""
        kind = kinds.get(b.key)
        n += f" ({kind})" if kind in (*GPU_LINES, "peak") else ""
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
    survivors = [m for m in MUTANTS if got.get(m.ident, {}).get("verdict") == "survived"]
    lines += ["", f"Survivors of the last run ({len(survivors)}), and why:", ""]
    lines += [f"- `{m.ident}` ({m.file}, `{m.site[1]}`): {_cell(m.models)}. Why: "
              f"{_cell(m.survives) if m.survives else 'no test sees it: one is missing'}." for m in survivors]
    lines += ["none"] if not survivors else []
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
