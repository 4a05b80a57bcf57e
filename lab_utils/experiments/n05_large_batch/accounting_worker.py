"""What a DDP run communicates besides gradients, counted byte by byte on a real run.

A worker of :mod:`lab_utils.engine.harness` under ``torchrun`` (the plan:
:func:`lab_utils.experiments.n05_large_batch.experiment.plan_accounting`). Its configuration: ``width``,
``batch_size``, ``steps``, ``broadcast_buffers``, ``zero``, ``devices``, ``backend``, ``seed``. Rank 0
returns one record with every rank's ledger.

How DDP really communicates (``torch/nn/parallel/distributed.py`` and
``torch/distributed/utils.py`` of the installed torch), and how each item is counted:

- **At construction** DDP checks that every rank has the same parameter shapes
  (``dist._verify_params_across_processes``: an all-gather of shape metadata in C++) and
  then broadcasts rank 0's parameters *and buffers* to every rank
  (``_sync_module_states`` -> ``dist._broadcast_coalesced``: the tensors are packed into
  buckets of ``broadcast_bucket_size`` bytes and broadcast bucket by bucket).
- **Before every forward in training** (``broadcast_buffers=True``, the default) DDP
  broadcasts rank 0's buffers (BatchNorm running mean/var and ``num_batches_tracked``)
  to all ranks (``_sync_buffers`` -> ``dist._broadcast_coalesced``).
- **During backward** the gradients are all-reduced bucket by bucket (a communication
  hook sees each bucket).
- **The training loop's own reductions**: the global loss for logging, the metric sums
  of an evaluation (and the buffer broadcast before evaluating, which the lab's DDP
  worker does so that every rank evaluates rank 0's BatchNorm statistics).
- **ZeRO-1** (``torch.distributed.optim.ZeroRedundancyOptimizer``): each rank keeps the
  optimizer state of its shard of the parameters only; after ``step()`` each owner
  broadcasts its updated parameters (``dist.broadcast``); a checkpoint gathers the
  sharded optimizer state onto one rank (``consolidate_state_dict``).

The Python-level entry points above (``dist._broadcast_coalesced``,
``dist._verify_params_across_processes``, ``dist.broadcast``, ``dist.all_reduce``) are
looked up on the ``torch.distributed`` module at call time, so this worker wraps them
for the duration of the run and adds up the bytes of the tensors handed to them (the
*payload*: ``numel x element_size``, what each rank contributes to the collective); the
gradient buckets are counted by a comm hook that then does exactly what DDP's default
hook does. What crosses the wire depends on the algorithm: a ring all-reduce of S bytes
sends 2(P-1)/P x S per rank; a broadcast sends S from the root. With gloo (CPU) the
worker also reads how many bytes the process *wrote* (``wchar`` of ``/proc/self/io``:
socket writes included; gloo writes with ``writev``) over each phase, an independent
cross-check that also reveals what the payload count cannot see: the C++ control
messages (the shape check, DDP's bucket-order sync after the first step, gloo headers).

The inputs are random tensors: what is communicated does not depend on the data.
Bytes are bytes (not parameter counts); no timing is done here.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.dist import DistContext, gather
from lab_utils.engine.hardware import software_versions
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.records import Record
from lab_utils.learn.errors import LabError
from lab_utils.learn.loop import StepOptions, make_optimizer, train_steps
from lab_utils.learn.models import ResNet18

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1

# Ledger kinds: which collective entry point carried the bytes.
BROADCAST_COALESCED = "broadcast_coalesced"
SHAPE_CHECK = "verify_params_across_processes"
BROADCAST = "broadcast"
ALL_REDUCE = "all_reduce"
GRAD_BUCKET = "gradient_bucket_all_reduce"


def tensor_bytes(tensors) -> int:
    """Payload bytes of a tensor or a list of tensors (numel x element size)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class ModelBytes:
    """The model's state in bytes: what DDP's broadcasts and all-reduces are made of."""

    parameters: int            # number of parameters (all)
    parameter_bytes: int       # all parameters
    trainable_parameter_bytes: int
    buffer_bytes: int          # BatchNorm running stats (fp32) + num_batches_tracked (int64)
    buffers: int               # number of buffer tensors
    floating_buffer_bytes: int  # running mean/var only


def model_bytes(model: torch.nn.Module) -> ModelBytes:
    """Count the bytes of ``model``'s parameters and buffers."""
    params = list(model.parameters())
    bufs = list(model.buffers())
    return ModelBytes(
        parameters=sum(p.numel() for p in params),
        parameter_bytes=tensor_bytes(params),
        trainable_parameter_bytes=tensor_bytes([p for p in params if p.requires_grad]),
        buffer_bytes=tensor_bytes(bufs),
        buffers=len(bufs),
        floating_buffer_bytes=tensor_bytes([b for b in bufs if b.is_floating_point()]),
    )


def _io_written_bytes() -> int | None:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``); None where unavailable."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class CommLedger:
    """Payload bytes and calls per (phase, kind); ``phase`` is set by the training loop."""

    def __init__(self):
        self.phase = "other"
        self.muted = False  # set while a counted operation calls a wrapped one (no double count)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.sent_by_src: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int, src: int | None = None) -> None:
        if self.muted:
            return
        key = (self.phase, kind)
        self.bytes[key] += int(nbytes)
        self.calls[key] += 1
        if src is not None:
            self.sent_by_src[key][int(src)] += int(nbytes)

    @contextmanager
    def in_phase(self, phase: str):
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    @contextmanager
    def mute(self):
        old, self.muted = self.muted, True
        try:
            yield
        finally:
            self.muted = old

    def as_rows(self) -> list[dict[str, Any]]:
        return [{"phase": p, "kind": k, "bytes": b, "calls": self.calls[(p, k)],
                 "bytes_by_src": dict(self.sent_by_src.get((p, k), {}))}
                for (p, k), b in sorted(self.bytes.items())]


@contextmanager
def instrument_collectives(ledger: CommLedger):
    """Wrap the ``torch.distributed`` entry points DDP and ZeRO use; restore them on exit."""
    names = ("_broadcast_coalesced", "_verify_params_across_processes", "broadcast", "all_reduce")
    orig = {n: getattr(dist, n) for n in names}

    def broadcast_coalesced(process_group, tensors, buffer_size, src=0, *a, **kw):
        ledger.add(BROADCAST_COALESCED, tensor_bytes(tensors), src)
        return orig["_broadcast_coalesced"](process_group, tensors, buffer_size, src, *a, **kw)

    def verify(process_group, tensors, *a, **kw):
        ledger.add(SHAPE_CHECK, 0)  # C++ all-gather of shape metadata: bytes seen on the wire only
        return orig["_verify_params_across_processes"](process_group, tensors, *a, **kw)

    def broadcast(tensor, *a, **kw):
        src = kw.get("src", a[0] if a else None)
        ledger.add(BROADCAST, tensor_bytes(tensor), src)
        return orig["broadcast"](tensor, *a, **kw)

    def all_reduce(tensor, *a, **kw):
        ledger.add(ALL_REDUCE, tensor_bytes(tensor))
        return orig["all_reduce"](tensor, *a, **kw)

    wrappers = {"_broadcast_coalesced": broadcast_coalesced, "_verify_params_across_processes": verify,
                "broadcast": broadcast, "all_reduce": all_reduce}
    for n, w in wrappers.items():
        setattr(dist, n, w)
    try:
        yield ledger
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)


def counting_allreduce_hook(ledger: CommLedger):
    """A DDP comm hook: count the bucket's bytes, then average it like DDP's default hook."""
    def hook(state, bucket):  # no annotations: DDP inspects them
        buf = bucket.buffer()
        ledger.add(GRAD_BUCKET, tensor_bytes(buf))
        with ledger.mute():  # the default hook calls dist.all_reduce, already counted as the bucket
            return default_hooks.allreduce_hook(state, bucket)

    return hook


# --------------------------------------------------------------------------- the worker


class _WireMeter:
    """Bytes written by this process over named phases (gloo on CPU only; None otherwise)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and _io_written_bytes() is not None
        self.bytes: dict[str, list[int]] = defaultdict(list)

    @contextmanager
    def measure(self, name: str):
        start = _io_written_bytes() if self.enabled else None
        try:
            yield
        finally:
            if start is not None:
                self.bytes[name].append(_io_written_bytes() - start)  # type: ignore[operator]


def run_accounting(c: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
    """Train ``steps`` DDP steps (then ``steps`` ZeRO-1 steps) of configuration ``c`` and count everything.

    Returns this rank's ledger rows, wire bytes per phase (:func:`wire_summary`) and optimizer-state bytes.
    """
    apply_training_backends()  # as every training path (bytes do not depend on it; the record says it)
    device = ctx.device
    cuda = device.type == "cuda"
    ledger = CommLedger()
    wire = _WireMeter(enabled=ctx.backend == "gloo")
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(c["seed"] + 7 * ctx.rank)
    batches = [(torch.randn(c["batch_size"], 3, 32, 32, generator=gen).to(device),
                torch.randint(0, 10, (c["batch_size"],), generator=gen).to(device))
               for _ in range(c["steps"])]
    torch.manual_seed(c["seed"] + ctx.rank)  # different initial weights: the broadcast makes them equal
    model = ResNet18(width=c["width"]).to(device)
    sizes = model_bytes(model)

    def ddp_wrap(m):
        return DDP(m, device_ids=[device.index] if cuda else None, broadcast_buffers=c["broadcast_buffers"])

    def steps(ddp, optimizer, phase: str, log_loss: bool):
        """One optimizer step per batch through the lab's one loop, each counted on its own."""
        for i, (x, y) in enumerate(batches):
            dist.barrier()
            with ledger.in_phase(phase), wire.measure(f"{phase}:{i + 1}"):
                # no skew barrier: its all-reduce would be counted; the barrier above aligns the ranks
                sums = train_steps(ddp, [(x, y)], 1, optimizer, loss_fn, None, device,
                                   StepOptions(count_correct=False))
                if log_loss:  # the global loss for logging: one fp32 float all-reduced
                    with ledger.in_phase("loss_logging"):
                        dist.all_reduce((sums.loss_sum / y.shape[0]).float())
                if cuda:
                    torch.cuda.synchronize(device)

    with instrument_collectives(ledger):
        dist.barrier()
        with ledger.in_phase("construction"), wire.measure("construction:1"):
            ddp = ddp_wrap(model)
        ddp.register_comm_hook(None, counting_allreduce_hook(ledger))
        same = _parameters_equal_across_ranks(model, ctx)
        opt = make_optimizer(ddp, lr=0.01)
        steps(ddp, opt, "step", log_loss=True)
        sgd_state = tensor_bytes([s["momentum_buffer"] for s in opt.state.values()
                                  if s.get("momentum_buffer") is not None])

        # evaluation: rank 0's BatchNorm statistics to every rank, then the metric sums
        dist.barrier()
        with ledger.in_phase("evaluation"), wire.measure("evaluation:1"), torch.no_grad():
            for b in model.buffers():
                dist.broadcast(b, src=0)
            model.eval()
            x, y = batches[0]
            out = model(x)
            sums = torch.stack([loss_fn(out, y).double() * y.shape[0], (out.argmax(1) == y).sum().double(),
                                torch.tensor(float(y.shape[0]), device=device, dtype=torch.float64)])
            dist.all_reduce(sums)
            model.train()

        zero_state = zero_full_state = None
        if c["zero"]:
            # imported here: torch.distributed.optim loads FSDP and DTensor (0.5 s), and every process that
            # imports the experiments' registry (notebook kernels, measure, doctor) imports this module
            from torch.distributed.optim import ZeroRedundancyOptimizer

            with ledger.in_phase("zero_construction"):
                ddp2 = ddp_wrap(ResNet18(width=c["width"]).to(device))
            ddp2.register_comm_hook(None, counting_allreduce_hook(ledger))
            zero = ZeroRedundancyOptimizer(ddp2.parameters(), optimizer_class=torch.optim.SGD, lr=0.01,
                                           momentum=0.9, weight_decay=5e-4)
            steps(ddp2, zero, "zero_step", log_loss=False)
            zero_state = tensor_bytes([s["momentum_buffer"] for s in zero.optim.state.values()
                                       if s.get("momentum_buffer") is not None])
            dist.barrier()
            with ledger.in_phase("zero_checkpoint"), wire.measure("zero_checkpoint:1"):
                zero.consolidate_state_dict(to=0)
            if ctx.rank == 0:
                full = zero.state_dict()
                zero_full_state = tensor_bytes([st["momentum_buffer"] for st in full["state"].values()
                                                if isinstance(st, dict) and "momentum_buffer" in st])
    rows = ledger.as_rows()
    wired = wire_summary(rows, wire.bytes, ctx.rank, ctx.world_size)
    return {"rank": ctx.rank, "ledger": rows, "wire": wired,
            "wire_measured": wire.enabled, "model_bytes": asdict(sizes), "parameters_equal_after_init": same,
            "sgd_state_bytes": sgd_state, "zero_state_bytes": zero_state,
            "zero_consolidated_state_bytes": zero_full_state}


def _parameters_equal_across_ranks(model, ctx: DistContext) -> bool:
    """True when every rank holds rank 0's parameters (checked after DDP's broadcast; not counted)."""
    flat = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    gathered = gather((float(flat.double().sum()), float((flat.double() ** 2).sum())), ctx)
    return all(g == gathered[0] for g in gathered)


# Which ledger phases a wire-measured phase holds (a step's logged loss is inside its step).
_LEDGER_PHASES = {"step": ("step", "loss_logging"), "zero_step": ("zero_step",)}


def wire_summary(ledger_rows: list[dict[str, Any]], wire_bytes: dict[str, list[int]], rank: int,
                 world: int) -> dict[str, dict[str, Any]]:
    """Per phase the wire was measured over (gloo): ``occurrences``, the ``payload_bytes`` counted and the
    ``written_bytes`` this process wrote (``wchar``), both per occurrence, and with 2 ranks the
    ``expected_written_bytes`` the algorithms imply: a ring all-reduce of S bytes writes 2(P-1)/P x S,
    a broadcast S x (P-1) on its root and nothing elsewhere."""
    phases: dict[str, list[int]] = defaultdict(list)
    for key, vals in wire_bytes.items():
        phases[key.split(":")[0]] += vals
    out = {}
    for phase, vals in phases.items():
        rows = [r for r in ledger_rows if r["phase"] in _LEDGER_PHASES.get(phase, (phase,))]
        expected = 0.0
        for r in rows:
            if r["kind"] in (ALL_REDUCE, GRAD_BUCKET):
                expected += r["bytes"] * 2 * (world - 1) / world
            elif r["kind"] in (BROADCAST, BROADCAST_COALESCED):
                expected += r["bytes_by_src"].get(rank, 0) * (world - 1)
        n = len(vals)
        out[phase] = {"occurrences": n, "payload_bytes": sum(r["bytes"] for r in rows) / n,
                      "written_bytes": statistics.fmean(vals),
                      "expected_written_bytes": expected / n if world == 2 else None}
    return out


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: Any) -> list[Record]:
    """Count one configuration on every rank; rank 0 returns the record with every rank's ledger."""
    if config["devices"] != ctx.world_size:
        raise LabError(f"The configuration is for {config['devices']} ranks; the job has {ctx.world_size}.")
    gathered = gather(run_accounting(config, ctx), ctx)
    if ctx.rank != 0:
        return []
    return [build_record(config, job, ctx, gathered)]


def build_record(config: dict[str, Any], job: Job, ctx: DistContext, gathered: list[dict[str, Any]]
                 ) -> Record:
    """Rank 0: one record with every rank's ledger."""
    metrics = {"ranks": gathered, "model_bytes": gathered[0]["model_bytes"], "world_size": ctx.world_size}
    return Record(job.experiment, dict(config), metrics, profile=job.profile, synthetic=True,
                  dataset="random tensors", hardware=ctx.hardware(), software=software_versions())


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
