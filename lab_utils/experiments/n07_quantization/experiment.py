"""Int8 quantization of a trained language model for inference, measured honestly (notebook 07).

Each *variant* is one way of storing and running the model's ``nn.Linear`` layers:

==========================  =====================================================================
``fp32``                    the trained model as it is (the baseline of every speedup)
``bf16``                    weights and activations in bfloat16 (2 bytes per weight)
``ao_dynamic_int8``         ``torch.ao.quantization.quantize_dynamic``: int8 weights (per tensor),
                            activations quantized to 8 bits on the fly per call, int8 GEMM from
                            the CPU quantized engine (fbgemm/x86 or qnnpack). CPU only, and
                            deprecated upstream: the warning torch emits is detected and shown.
``torchao_int8_weight_only``  torchao ``quantize_(model, Int8WeightOnlyConfig())``: int8 weights
                            with one fp32 scale per output row; activations stay in float.
``torchao_int8_dynamic``    torchao ``quantize_(model, Int8DynamicActivationInt8WeightConfig())``:
                            int8 weights per row and activations quantized per token on the fly.
==========================  =====================================================================

The variants of a device are measured side by side by :mod:`lab_utils.experiments.n07_quantization.worker`
(which says what a row holds) on notebook 06's checkpoint, or one this notebook trains
(:func:`model_checkpoint`). Tables, figure and findings:
:mod:`~lab_utils.experiments.n07_quantization.tables`.

The GPT of this lab has no KV cache: every generated token re-runs the model over the whole
context (cropped to ``block_size``), so a decoding step multiplies each weight matrix by ``batch x
context`` rows; ``weight_flops_per_byte`` turns that into the arithmetic intensity against the
weights (2 x rows / bytes per weight) that decides whether a step is memory- or compute-bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from lab_utils.engine import config, profiles
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run, measure
from lab_utils.engine.session import session_for
from lab_utils.experiments.n06_gpt_ddp import worker as gpt_train
from lab_utils.experiments.n06_gpt_ddp.experiment import checkpoint_path
from lab_utils.experiments.n06_gpt_ddp.worker import TrainConfig
from lab_utils.experiments.n07_quantization import worker as quantize
from lab_utils.experiments.n07_quantization.quant_model import payload_bytes, quantize_model
from lab_utils.experiments.n07_quantization.quant_variants import (
    VARIANTS,
    check_variant,
    cpu_has_native_bf16,
    torchao_version,
)
from lab_utils.experiments.n07_quantization.worker import (
    EXPERIMENT,
    ModelUnderTest,
    file_sha256,
    load_model_under_test,
)
from lab_utils.experiments.shared.text_data import resolve_corpus
from lab_utils.learn.errors import LabError, check_positive_int

# VARIANTS, check_variant, quantize_model and payload_bytes are also this module's: notebook 07 and its
# exercise call them as quantize.<name>.
__all__ = ["EXPERIMENT", "EXPERIMENTS", "ModelUnderTest", "QUANTIZATION_EXPERIMENT", "Settings",
           "VARIANTS", "check_variant", "cost", "describe", "doctor_settings", "load_model_under_test",
           "model_checkpoint", "payload_bytes", "plan", "quantize_model"]

DISABLED = "disabled by configuration (the notebook's DISABLE parameter)"


@dataclass(frozen=True)
class Settings:
    """Per-profile knobs of notebook 07.

    ``eval_tokens``: held-out tokens scored per variant (``None``: the whole validation
    split). ``prompt_tokens`` / ``new_tokens``: prompt length and tokens generated per
    timed repetition. ``large_batch`` / ``cpu_large_batch``: sequences decoded together for
    the throughput measurement on a GPU / on the CPU. ``disabled``: variants treated as
    unavailable (to see, or test, what an unavailable path looks like). ``compile``: wrap
    every variant (the fp32 baseline too) in ``torch.compile`` before measuring.
    ``fallback_*``: the GPT trained here when notebook 06's checkpoint is absent.
    ``checkpoint``: another checkpoint to quantize (None: notebook 06's).
    """

    eval_tokens: int | None
    eval_batch_size: int
    prompt_tokens: int
    new_tokens: int
    large_batch: int
    cpu_large_batch: int
    warmup: int
    repeats: int
    fallback_size: str
    fallback_steps: int
    fallback_batch_size: int
    fallback_max_chars: int | None
    variants: tuple[str, ...] = VARIANTS
    devices: tuple[str, ...] | None = None   # None: "cpu", plus "cuda" when the machine has a GPU
    disabled: tuple[str, ...] = ()
    compile: bool = False
    checkpoint: str | None = None

    QUICK: ClassVar[dict[str, Any]] = dict(
        eval_tokens=8192, eval_batch_size=32, prompt_tokens=8, new_tokens=16,
        large_batch=16, cpu_large_batch=16, warmup=1, repeats=5,
        fallback_size="tiny", fallback_steps=100, fallback_batch_size=16,
        fallback_max_chars=200_000)
    FULL: ClassVar[dict[str, Any]] = dict(
        eval_tokens=65_536, eval_batch_size=32, prompt_tokens=32, new_tokens=64,
        large_batch=64, cpu_large_batch=8, warmup=2, repeats=7,
        fallback_size="small", fallback_steps=500, fallback_batch_size=32,
        fallback_max_chars=None)

    def validate(self) -> Settings:
        """Raise :class:`LabError` on a bad knob, before anything is measured."""
        for name in ("eval_batch_size", "prompt_tokens", "new_tokens", "large_batch", "cpu_large_batch",
                     "repeats", "fallback_steps", "fallback_batch_size"):
            check_positive_int(getattr(self, name), name)
        for name in ("eval_tokens", "fallback_max_chars"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise LabError(f"warmup must be a whole number of repetitions (0 or more), got {self.warmup!r}.")
        for group, values in (("variants", self.variants), ("disabled", self.disabled)):
            unknown = [v for v in values if v not in VARIANTS]
            if unknown:
                raise LabError(f"Unknown {group} {unknown}; use names from: {', '.join(VARIANTS)}.")
        if not self.variants:
            raise LabError("variants must not be empty; keep at least 'fp32' (the baseline).")
        for d in self.devices or ():
            if d not in ("cpu", "cuda"):
                raise LabError(f"Unknown device {d!r} in devices; use 'cpu' and/or 'cuda'.")
        return self

    def measure_key(self) -> dict[str, Any]:
        """The knobs a measured row depends on (part of its stored configuration; the worker's knobs)."""
        names = ("eval_tokens", "eval_batch_size", "prompt_tokens", "new_tokens", "large_batch",
                 "cpu_large_batch", "warmup", "repeats", "compile")
        return {k: getattr(self, k) for k in names}


profiles.register(Settings, "quantization")


# --------------------------------------------------------------------------- the model under test


def _fallback_path(profile: str) -> Path:
    """Where notebook 07 keeps the GPT it trains itself when notebook 06's checkpoint is absent."""
    return config.results_dir(profile) / "checkpoints" / "gpt_trained_in_07.pt"


def checkpoint_of(s: Settings, profile: str) -> Path:
    """The checkpoint notebook 07 quantizes: ``s.checkpoint``, else notebook 06's when it exists, else the
    fallback GPT's (:func:`model_checkpoint` trains it)."""
    if s.checkpoint is not None:
        return Path(s.checkpoint)
    path = checkpoint_path(profile)
    return path if path.exists() else _fallback_path(profile)


def plan_fallback(s: Settings, machine: Machine, profile: str) -> list[Run]:
    """The fallback GPT: ``fallback_steps`` steps of the GPT worker on one device (in this process on a
    CPU), saved to :func:`_fallback_path` (a job option)."""
    cfg = TrainConfig(device_type=machine.device, size=s.fallback_size, batch_size=s.fallback_batch_size,
                      max_steps=s.fallback_steps, steps_per_epoch=s.fallback_steps, val_batches=4,
                      probe_steps=0, breakdown_steps=0, corpus=resolve_corpus(None),
                      max_chars=s.fallback_max_chars).validate()
    return [Run("gpt_fallback", cfg.config(), gpt_train, device=machine.device, in_process=machine.gpus == 0,
                options={"save": str(_fallback_path(profile))}, label=f"fallback GPT {s.fallback_size}")]


FALLBACK_EXPERIMENT = Experiment("gpt_fallback", "07", Settings, plan_fallback,
                                 title="the GPT notebook 07 trains when notebook 06's checkpoint is absent")


def model_checkpoint(lab: Any, s: Settings) -> tuple[Path, str]:
    """The checkpoint to quantize and where it came from, in words. Without ``s.checkpoint`` and notebook
    06's, the fallback GPT is trained here (through :func:`lab_utils.engine.plan.measure`) and kept."""
    profile = session_for(lab).profile.name
    path = checkpoint_of(s, profile)
    if s.checkpoint is not None or path == checkpoint_path(profile):
        return path, f"notebook 06's checkpoint {path}" if s.checkpoint is None else f"the checkpoint {path}"
    if not path.exists():
        [rec, *_] = measure(lab, FALLBACK_EXPERIMENT, s, force=True)
        if rec.status != "ok" or not path.exists():
            raise LabError(f"Training the fallback GPT failed ({rec.reason}); run notebook 06 first so that "
                           "its checkpoint exists.")
    return path, (f"no checkpoint from notebook 06 at {checkpoint_path(profile)}: the '{s.fallback_size}' "
                  f"GPT trained here for {s.fallback_steps} steps ({path})")


def describe(mut: ModelUnderTest) -> dict[str, Any]:
    """A small summary of the model under test for the notebook to print."""
    cfg = getattr(mut.model, "config", None)
    return {"source": mut.source, "parameters": sum(p.numel() for p in mut.model.parameters()),
            "config": asdict(cfg) if cfg is not None else None,
            "held_out_tokens": int(mut.val_tokens.numel()),
            "dataset": mut.dataset, "synthetic": mut.synthetic, "cpu_threads": torch.get_num_threads(),
            "torchao": torchao_version(), "torch": torch.__version__,
            "quantized_engine": torch.backends.quantized.engine, "cpu_native_bf16": cpu_has_native_bf16()}


# --------------------------------------------------------------------------- the plan


def plan(s: Settings, machine: Machine, profile: str) -> list[Run]:
    """One run per (device, variant): ``s.devices`` (default the CPU, plus the GPU when the machine has
    one), each device's variants one ``together`` group (reused only whole, from one session). The key:
    the variant, device, weights (the checkpoint's SHA-256), knobs, torch/torchao versions and CPU threads,
    so a new torchao fills its rows in. Disabled variants are rows, not stored."""
    path = checkpoint_of(s, profile)
    model_id = file_sha256(path) if path.exists() else "no checkpoint yet"
    stack = {"torch": torch.__version__, "torchao": torchao_version()}
    runs = []
    for device in s.devices or ("cpu", *(("cuda",) if machine.gpus else ())):
        for v in s.variants:
            cfg = {"variant": v, "device": device, "model_id": model_id, "settings": s.measure_key(),
                   "stack": stack, **({"cpu_threads": torch.get_num_threads()} if device == "cpu" else {})}
            runs.append(Run(EXPERIMENT, cfg, quantize, device=device, group=f"{EXPERIMENT} {device}",
                            together=True, skip=DISABLED if v in s.disabled else None,
                            in_process=device == "cpu", label=f"{v} on {device}",
                            options={"checkpoint": str(path), "process_group": False}))
    return runs


def cost(run: Run) -> float:
    """Seconds of one variant on the budget's node: quantize, score the held-out tokens and time decoding,
    45 s on the CPU, 10 s on a GPU (an estimate, no GPU run yet)."""
    return 45.0 if run.device == "cpu" else 10.0


def doctor_settings(full: Settings) -> Settings:
    """The smallest full-profile configuration: every variant on every device, a few held-out windows, two
    decoded tokens once; the fallback GPT of two steps when no checkpoint is there."""
    return replace(full, eval_tokens=4 * 256 + 1, prompt_tokens=8, new_tokens=2, large_batch=2,
                   cpu_large_batch=2, warmup=0, repeats=1, fallback_steps=2, fallback_max_chars=20_000)


QUANTIZATION_EXPERIMENT = Experiment(EXPERIMENT, "07", Settings, plan, cost, doctor_settings,
                                     "int8 / bf16 inference variants of the GPT")


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (QUANTIZATION_EXPERIMENT,)
