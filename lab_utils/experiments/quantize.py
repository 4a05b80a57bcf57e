"""Int8 quantization of a trained language model for inference, measured honestly.

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

A variant that this stack cannot run (module missing, class missing, CPU-only kernel on a
GPU, disabled by configuration) becomes a row with status ``skipped`` and the reason;
one that fails while running becomes ``error`` (or ``oom``) with the first line of the
exception. No number is ever filled in for them.

What is measured per (variant, device), all on the same held-out tokens and prompts:

- ``size_bytes``: length of ``torch.save(model.state_dict())`` (:func:`serialized_size_bytes`;
  :func:`save_state_dict` writes the same bytes to a file), and ``payload_bytes``: the
  bytes of the tensor storages in it (:func:`payload_bytes`), so the container overhead
  is visible;
- ``val_loss`` (mean next-token cross-entropy, nats per token, computed in fp32 from the
  variant's logits) and ``perplexity = exp(val_loss)`` (:func:`evaluate_lm`);
- decoding speed (:func:`time_decode`): greedy generation of ``new_tokens`` tokens after a
  ``prompt_tokens`` prompt, ``warmup`` untimed repetitions then ``repeats`` timed ones,
  each bracketed by a device synchronize. ``ms_per_token`` = repetition seconds x 1000 /
  new tokens at batch 1 (latency); ``tokens_per_s`` = batch x new tokens / repetition
  seconds at the larger batch (throughput). Median, min and max over repetitions.
- speedups over fp32 *on the same device* (:func:`quantization_table`): fp32 latency /
  variant latency, variant tokens/s / fp32 tokens/s.

The GPT of this lab has no KV cache: every generated token re-runs the model over the
whole context (cropped to ``block_size``), so a decoding step multiplies each weight
matrix by ``batch x context`` rows. :func:`weight_flops_per_byte` turns that into the
arithmetic intensity against the weights (2 x rows / bytes per weight) that decides
whether a step is memory-bound (few rows: reading the weights dominates, fewer bytes per
weight helps) or compute-bound (many rows).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import io
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab_utils.core import profiles
from lab_utils.core.config import check_choice, check_positive_int
from lab_utils.core.errors import LabError
from lab_utils.core.loop import evaluate
from lab_utils.core.memory import free_device_memory, is_out_of_memory, oom_reason
from lab_utils.core.timing import synchronize

EXPERIMENT = "quantization"

VARIANTS: tuple[str, ...] = ("fp32", "bf16", "ao_dynamic_int8", "torchao_int8_weight_only",
                             "torchao_int8_dynamic")

#: torchao configuration class of each torchao variant (looked up by name at run time).
TORCHAO_CONFIGS = {
    "torchao_int8_weight_only": "Int8WeightOnlyConfig",
    "torchao_int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
}


@dataclass(frozen=True)
class VariantInfo:
    """How a variant stores weights and what it does to activations."""

    label: str
    method: str             # "float", "weight-only", "dynamic"
    bytes_per_weight: int   # bytes per Linear weight element as stored (scales not counted)


VARIANT_INFO: dict[str, VariantInfo] = {
    "fp32": VariantInfo("fp32 (baseline)", "float", 4),
    "bf16": VariantInfo("bf16", "float", 2),
    "ao_dynamic_int8": VariantInfo("int8 dynamic, torch.ao quantize_dynamic", "dynamic", 1),
    "torchao_int8_weight_only": VariantInfo("int8 weight-only, torchao Int8WeightOnlyConfig",
                                            "weight-only", 1),
    "torchao_int8_dynamic": VariantInfo("int8 dynamic act. + int8 weight, torchao "
                                        "Int8DynamicActivationInt8WeightConfig", "dynamic", 1),
}


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class QuantSettings:
    """Per-profile knobs of notebook 07.

    ``eval_tokens``: held-out tokens scored per variant (``None``: the whole validation
    split). ``prompt_tokens`` / ``new_tokens``: prompt length and tokens generated per
    timed repetition. ``large_batch`` / ``cpu_large_batch``: sequences decoded together for
    the throughput measurement on a GPU / on the CPU. ``disabled``: variants treated as
    unavailable (to see, or test, what an unavailable path looks like). ``compile``: wrap
    every variant (the fp32 baseline too) in ``torch.compile`` before measuring.
    ``fallback_*``: the GPT trained here when notebook 06's checkpoint is absent.
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
    devices: tuple[str, ...] | None = None   # None: "cpu", plus "cuda" when one is visible
    disabled: tuple[str, ...] = ()
    compile: bool = False

    def validate(self) -> QuantSettings:
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
        if self.devices is not None:
            for d in self.devices:
                if d not in ("cpu", "cuda"):
                    raise LabError(f"Unknown device {d!r} in devices; use 'cpu' and/or 'cuda'.")
        return self

    def measure_key(self) -> dict[str, Any]:
        """The knobs a measured row depends on (part of its stored configuration)."""
        names = ("eval_tokens", "eval_batch_size", "prompt_tokens", "new_tokens", "large_batch",
                 "cpu_large_batch", "warmup", "repeats", "compile")
        return {k: getattr(self, k) for k in names}


# Per-profile values: lab_utils.core.profiles (one table for every notebook).
QUANT_SETTINGS: dict[str, QuantSettings] = profiles.table(QuantSettings)


def settings_for(profile: str, **overrides: Any) -> QuantSettings:
    """The profile's :data:`QUANT_SETTINGS` with the non-``None`` ``overrides`` applied."""
    if profile not in QUANT_SETTINGS:
        raise LabError(f"No quantization settings for profile {profile!r}; use one of: "
                       f"{', '.join(QUANT_SETTINGS)}.")
    return profiles.override(QUANT_SETTINGS[profile], "quantization", **overrides)


# --------------------------------------------------------------------------- availability


@dataclass(frozen=True)
class Availability:
    """Whether a variant can run on a device here; ``kernel`` says what would run it."""

    ok: bool
    reason: str | None = None
    kernel: str = ""
    note: str | None = None


@contextlib.contextmanager
def _quiet_torchao_import():
    """torchao's import logs a pytree registration warning through torch's logger; hide it."""
    log = logging.getLogger("torch.utils._pytree")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def torchao_version() -> str | None:
    """The installed torchao's version, or ``None`` when it cannot be imported."""
    try:
        with _quiet_torchao_import():
            mod = importlib.import_module("torchao")
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def _torchao_config_class(variant: str):
    """``(class, None)`` or ``(None, reason)`` for a torchao variant's configuration class."""
    cls_name = TORCHAO_CONFIGS[variant]
    try:
        with _quiet_torchao_import():
            tq = importlib.import_module("torchao.quantization")
    except ImportError as e:
        return None, f"torchao is not installed ({e.__class__.__name__}); `pip install torchao` adds this row"
    cls = getattr(tq, cls_name, None)
    if cls is None or not hasattr(tq, "quantize_"):
        return None, (f"torchao {torchao_version()} has no torchao.quantization.{cls_name} / quantize_; "
                      "install the torchao release that requirements.txt names")
    return cls, None


def ao_dynamic_status() -> Availability:
    """Whether ``torch.ao.quantization.quantize_dynamic`` works here, and its deprecation.

    Probes it on a tiny Linear with all warnings recorded: a ``DeprecationWarning`` (or a
    warning that says "deprecated") becomes the row's note, quoting torch's first line.
    """
    try:
        aq = importlib.import_module("torch.ao.quantization")
    except ImportError as e:
        return Availability(False, f"torch {torch.__version__} has no torch.ao.quantization ({e}); "
                                   "it was removed upstream, use the torchao rows")
    fn = getattr(aq, "quantize_dynamic", None)
    if fn is None:
        return Availability(False, f"torch {torch.__version__} has no torch.ao.quantization.quantize_dynamic "
                                   "(removed upstream); use the torchao rows")
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    if not engines:
        return Availability(False, "this torch build has no quantized CPU engine (fbgemm, x86 or qnnpack)")
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            probe = fn(nn.Sequential(nn.Linear(8, 8)), {nn.Linear}, dtype=torch.qint8)
            with torch.no_grad():
                probe(torch.randn(2, 8))
        except Exception as e:  # a missing engine or kernel: the row says so
            return Availability(False, f"quantize_dynamic fails here: {e.__class__.__name__}: "
                                       f"{str(e).splitlines()[0][:160]}")
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)
           or "deprecated" in str(w.message).lower()]
    note = None
    if dep:
        first = str(dep[0].message).strip().splitlines()[0][:120]
        note = f"deprecated upstream: torch {torch.__version__} warns '{first}'"
    return Availability(True, kernel=f"torch.ao dynamic quantized Linear, '{engine}' engine int8 GEMM",
                        note=note)


def cpu_has_native_bf16() -> bool:
    """True when the CPU flags list bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_variant(variant: str, device: str, disabled: Iterable[str] = ()) -> Availability:
    """Can ``variant`` run on ``device`` ("cpu" or "cuda") with this stack? Never raises for
    a missing path: the :class:`Availability` carries the reason."""
    check_choice(variant, VARIANTS, "variant")
    dev = torch.device(device).type
    if variant in tuple(disabled):
        return Availability(False, "disabled by configuration (the notebook's DISABLE parameter)")
    if dev == "cuda" and not torch.cuda.is_available():
        return Availability(False, "no CUDA device visible")
    if variant == "fp32":
        if dev == "cuda":
            mode = "(TF32 allowed)" if torch.backends.cuda.matmul.allow_tf32 else "(true fp32)"
            return Availability(True, kernel=f"cuBLAS fp32 GEMM {mode}")
        return Availability(True, kernel="aten fp32 GEMM (CPU BLAS)")
    if variant == "bf16":
        if dev == "cuda":
            from lab_utils.core.hardware import bf16_supported

            if not bf16_supported("cuda"):  # not counting emulation: a V100 emulates bf16, slowly
                return Availability(False, f"{torch.cuda.get_device_name()} has no native bf16 "
                                           "(needs compute capability 8.0+; emulated bf16 is not measured)")
            return Availability(True, kernel="cuBLAS bf16 GEMM (tensor cores)")
        try:
            torch.ones(4, 4, dtype=torch.bfloat16) @ torch.ones(4, 4, dtype=torch.bfloat16)
        except RuntimeError as e:
            return Availability(False, f"bf16 matmul fails on this CPU build: {str(e).splitlines()[0][:120]}")
        slow = ("this CPU lacks bf16 instructions (no avx512_bf16/amx_bf16): bf16 is converted to fp32 "
                "inside the kernels")
        return Availability(True, kernel="aten bf16 GEMM (CPU)", note=None if cpu_has_native_bf16() else slow)
    if variant == "ao_dynamic_int8":
        if dev == "cuda":
            return Availability(False, "CPU only: torch.ao dynamic quantized Linear has no CUDA kernels")
        return ao_dynamic_status()
    cls, reason = _torchao_config_class(variant)
    if cls is None:
        return Availability(False, reason)
    ver = torchao_version()
    if variant == "torchao_int8_weight_only":
        kernel = f"torchao {ver} Int8Tensor, eager: int8 weight cast to the activation dtype, then float mm"
    elif dev == "cuda":
        kernel = (f"torchao {ver} Int8Tensor, eager: int8 x int8 -> int32 via torch._int_mm (cuBLAS); "
                  f"{INT_MM_PAD_NOTE}")
    else:
        kernel = f"torchao {ver} Int8Tensor, eager: int8 x int8 -> int32 via its decomposed CPU path"
    return Availability(True, kernel=kernel)


# --------------------------------------------------------------------------- quantize

#: torchao's int8 x int8 matmul on CUDA (``torchao.kernel.intmm.safe_int_mm``, used by
#: ``Int8DynamicActivationInt8WeightConfig`` through ``int_scaled_matmul``, torchao 0.18)
#: takes the cuBLAS ``torch._int_mm`` path only when K (``in_features``) and N
#: (``out_features``) are non-zero multiples of this; otherwise it copies both operands to
#: the CPU, multiplies them there in int32 and copies the result back, on every call.
#: The weight-only variant casts the int8 weight to the activation dtype and runs a float
#: matmul (no ``_int_mm``), and on the CPU ``_int_mm`` takes any shape, so neither needs this.
INT8_MM_MULTIPLE = 8


def int8_mm_shape_problem(in_features: int, out_features: int) -> str | None:
    """Why a Linear of this shape cannot use torchao's cuBLAS int8 matmul, or ``None`` when it can.

    >>> int8_mm_shape_problem(384, 65)
    '(N=65) kept in fp32: int8 mm needs N % 8 == 0'
    """
    bad = [(dim, v) for dim, v in (("K", in_features), ("N", out_features))
           if v <= 0 or v % INT8_MM_MULTIPLE]
    if not bad:
        return None
    shape = ", ".join(f"{dim}={v}" for dim, v in bad)
    need = " and ".join(f"{dim} % {INT8_MM_MULTIPLE} == 0" for dim, _ in bad)
    return f"({shape}) kept in fp32: int8 mm needs {need}"


#: ``torch._int_mm`` on CUDA needs more than 16 rows in its first operand (M > 16); with
#: fewer, torchao's ``safe_int_mm`` catches the error and multiplies in fp32 instead, while
#: the row would claim cuBLAS int8. Decoding at batch 1 after a short prompt has M <= 16.
INT_MM_MIN_ROWS = 17
INT_MM_PAD_NOTE = (f"matmuls of <= 16 rows (batch-1 decoding) padded to {INT_MM_MIN_ROWS} rows, as "
                   "torch._int_mm needs M > 16 (else torchao silently falls back to fp32)")


def pad_int8_matmul_rows(model: nn.Module, variant: str, device: str | torch.device,
                         kept: Iterable[str] = ()) -> int:
    """Make every int8 ``nn.Linear`` of ``model`` see at least :data:`INT_MM_MIN_ROWS` rows.

    Only for ``torchao_int8_dynamic`` on CUDA (elsewhere nothing is changed, 0 returned).
    A forward pre-hook flattens the input to rows and repeats its last row up to 17 rows;
    the forward hook drops the extra rows and restores the shape. Repeating a real row
    (not zeros) leaves every quantization scale as it was (per-token and per-tensor alike),
    so the kept rows' results are unchanged. ``kept`` names layers left in float
    (:func:`float_layers`). Returns the number of layers hooked.
    """
    if variant != "torchao_int8_dynamic" or torch.device(device).type != "cuda":
        return 0
    kept = set(kept)
    hooked = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name not in kept:
            rows: list[int | None] = []
            mod.register_forward_pre_hook(functools.partial(_pad_rows, rows))
            mod.register_forward_hook(functools.partial(_unpad_rows, rows))
            hooked += 1
    return hooked


def _pad_rows(rows: list, module: nn.Module, args: tuple):
    x = args[0]
    n = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if n == 0 or n >= INT_MM_MIN_ROWS:
        rows.append(None)
        return None
    flat = x.reshape(n, x.shape[-1])
    rows.append((n, tuple(x.shape[:-1])))
    return (torch.cat([flat, flat[-1:].expand(INT_MM_MIN_ROWS - n, -1)]), *args[1:])


def _unpad_rows(rows: list, module: nn.Module, args: tuple, out: torch.Tensor):
    padded = rows.pop()
    if padded is None:
        return None
    n, lead = padded
    return out[:n].reshape(*lead, out.shape[-1])


def float_layers(model: nn.Module, variant: str, device: str | torch.device) -> dict[str, str]:
    """The ``nn.Linear`` layers ``variant`` leaves in fp32 on ``device``, each with the reason.

    Only ``torchao_int8_dynamic`` on CUDA leaves any: a layer whose shape fails
    :func:`int8_mm_shape_problem` (this GPT's ``lm_head``, N = the 65-character
    vocabulary) would make torchao fall back to a CPU int32 matmul and a device round
    trip every step, while the row claims cuBLAS. Keeping it in fp32 keeps the claim
    true; the row lists it (``kept_in_float``, and in its note).
    """
    if variant != "torchao_int8_dynamic" or torch.device(device).type != "cuda":
        return {}
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            problem = int8_mm_shape_problem(mod.in_features, mod.out_features)
            if problem is not None:
                out[name] = problem
    return out


def float_layers_note(kept: dict[str, str]) -> str | None:
    """``"lm_head (N=65) kept in fp32: int8 mm needs N % 8 == 0"`` for the row, or ``None``."""
    if not kept:
        return None
    return "; ".join(f"{name} {why}" for name, why in kept.items()) + \
        " (torchao would run it as a CPU int32 matmul)"


def quantize_model(model: nn.Module, variant: str, device: str | torch.device = "cpu") -> nn.Module:
    """A copy of ``model`` (eval mode) converted to ``variant`` on ``device``.

    The input model is not modified. ``ao_dynamic_int8`` is CPU only. Layers that
    :func:`float_layers` names stay in fp32; on CUDA the int8 layers of ``torchao_int8_dynamic``
    pad small matmuls to :data:`INT_MM_MIN_ROWS` rows (:func:`pad_int8_matmul_rows`). Raises
    :class:`LabError` when the variant is unavailable (see :func:`check_variant`).
    """
    dev = torch.device(device)
    avail = check_variant(variant, dev.type)
    if not avail.ok:
        raise LabError(f"Variant {variant!r} cannot run on {dev.type}: {avail.reason}.")
    m = copy.deepcopy(model).eval()
    if variant == "fp32":
        return m.to(device=dev, dtype=torch.float32)
    if variant == "bf16":
        return m.to(device=dev, dtype=torch.bfloat16)
    if variant == "ao_dynamic_int8":
        aq = importlib.import_module("torch.ao.quantization")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation is reported by ao_dynamic_status()
            return aq.quantize_dynamic(m.float().cpu(), {nn.Linear}, dtype=torch.qint8)
    cls, _ = _torchao_config_class(variant)
    with _quiet_torchao_import():
        tq = importlib.import_module("torchao.quantization")
    m = m.to(device=dev, dtype=torch.float32)
    kept = float_layers(m, variant, dev)
    extra = {"filter_fn": _quantize_filter(kept)} if kept else {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_(m, cls(), **extra)
    pad_int8_matmul_rows(m, variant, dev, kept)  # cuBLAS int8 needs M > 16 rows
    return m


def _quantize_filter(kept: dict[str, str]):
    """torchao's default choice of layers (every ``nn.Linear`` but MultiheadAttention's
    out-projection), less the layers named in ``kept``."""
    def quantize_this(mod: nn.Module, fqn: str) -> bool:
        return (isinstance(mod, nn.Linear) and fqn not in kept
                and not isinstance(mod, nn.modules.linear.NonDynamicallyQuantizableLinear))
    return quantize_this


# --------------------------------------------------------------------------- size accounting


def _leaf_tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Plain tensors inside a state dict: tensor subclasses are opened up, containers walked."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            for n in names:
                yield from _leaf_tensors(getattr(obj, n))
        else:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaf_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _leaf_tensors(v)


def payload_bytes(state: Any) -> int:
    """Bytes of the distinct tensor storages in ``state`` (a state dict, or any nesting).

    A storage shared by several entries (tied weights) counts once, and a view counts its
    whole storage, as ``torch.save`` writes them. Quantized and torchao tensors count their
    int8 data, scales and zero points. Bytes.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in _leaf_tensors(state):
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key in seen and st.data_ptr() != 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def _state_dict(model: nn.Module) -> dict[str, Any]:
    return getattr(model, "_orig_mod", model).state_dict()


def serialized_state_dict(model: nn.Module) -> bytes:
    """The bytes of ``torch.save(model.state_dict())`` written to an in-memory buffer.

    (``torch.save`` to a *path* names the archive's top folder after the file, so its size
    varies by a few bytes with the file name; writing these bytes instead keeps the file
    and the count identical.)
    """
    buf = io.BytesIO()
    torch.save(_state_dict(model), buf)
    return buf.getvalue()


def serialized_size_bytes(model: nn.Module) -> int:
    """Length in bytes of :func:`serialized_state_dict` (what a checkpoint file holds)."""
    return len(serialized_state_dict(model))


def save_state_dict(model: nn.Module, path: str | Path) -> int:
    """Write :func:`serialized_state_dict` to ``path`` (atomically); returns the file's size in bytes.

    The file loads back with ``torch.load`` like any ``torch.save`` file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(serialized_state_dict(model))
    os.replace(tmp, path)
    return path.stat().st_size


# --------------------------------------------------------------------------- quality


@dataclass
class EvalResult:
    """Mean next-token cross-entropy (nats per token) over ``tokens`` predicted positions."""

    loss: float
    perplexity: float
    tokens: int
    windows: int


def _logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return out[0] if isinstance(out, tuple) else out


def evaluate_lm(model: nn.Module, tokens: torch.Tensor, block_size: int, batch_size: int,
                device: str | torch.device, max_tokens: int | None = None) -> EvalResult:
    """Score ``model`` on non-overlapping windows of the 1-D token tensor ``tokens``.

    Windows of ``block_size + 1`` tokens start every ``block_size`` tokens within the first
    ``max_tokens`` tokens (all when ``None``); every position of a window is predicted.
    The loss is the sum of per-token cross-entropies (computed in fp32 from the logits)
    divided by the number of predicted tokens; perplexity is ``exp(loss)``.
    """
    check_positive_int(block_size, "block_size")
    check_positive_int(batch_size, "eval batch size")
    data = tokens if max_tokens is None else tokens[:max_tokens]
    n_win = (data.numel() - 1) // block_size
    if n_win < 1:
        raise LabError(f"{data.numel()} held-out tokens are fewer than block_size + 1 = {block_size + 1}; "
                       "evaluate on more tokens (eval_tokens) or use a smaller model.")
    windows = data[: n_win * block_size + 1]
    xs = windows[:-1].view(n_win, block_size)
    ys = windows[1:].view(n_win, block_size)
    batches = ((xs[i: i + batch_size], ys[i: i + batch_size]) for i in range(0, n_win, batch_size))
    # the lab's one evaluation pass (it counts every predicted token), on the logits in fp32
    ev = evaluate(_LogitsOf(model), batches, device, loss_fn=_token_loss_fp32, count_correct=False)
    return EvalResult(loss=ev.loss, perplexity=math.exp(ev.loss), tokens=ev.images, windows=n_win)


class _LogitsOf(nn.Module):
    """``model``'s logits alone (some language models return ``(logits, loss)``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.training = model.training  # so that evaluate restores the model's own mode

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _logits(self.model, idx)


def _token_loss_fp32(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per token, from the logits cast to fp32 (int8 and bf16 rows alike)."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


# --------------------------------------------------------------------------- speed


def greedy_decode(model: nn.Module, prompt: torch.Tensor, new_tokens: int, block_size: int) -> torch.Tensor:
    """Append ``new_tokens`` greedy (argmax) tokens to ``prompt`` (B, T0); returns (B, T0 + new).

    Each step runs the model on the last ``block_size`` tokens (no KV cache) and takes the
    last position's logits.
    """
    idx = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = _logits(model, idx[:, -block_size:])[:, -1, :]
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True).to(idx.dtype)], dim=1)
    return idx


def mean_context_tokens(prompt_tokens: int, new_tokens: int, block_size: int) -> float:
    """Mean tokens the model sees per decoding step: mean of min(prompt + i, block) over i < new."""
    return sum(min(prompt_tokens + i, block_size) for i in range(new_tokens)) / new_tokens


def weight_flops_per_byte(rows: float, bytes_per_weight: float) -> float:
    """Arithmetic intensity of ``y = x W^T`` against its weights: 2 x rows / bytes per weight.

    A (rows x K) by (K x N) product does 2 x rows x K x N FLOPs and reads K x N weights of
    ``bytes_per_weight`` bytes each (activations ignored). FLOP per byte.
    """
    if rows <= 0 or bytes_per_weight <= 0:
        raise LabError("rows and bytes_per_weight must be positive.")
    return 2.0 * rows / bytes_per_weight


@dataclass
class DecodeTiming:
    """Timed greedy decoding. ``seconds``: one entry per timed repetition (wall clock,
    synchronized, includes every forward pass, argmax and concatenation of the repetition)."""

    batch_size: int
    new_tokens: int
    seconds: list[float] = field(default_factory=list)

    def _ms_per_token(self) -> list[float]:
        return [s * 1000.0 / self.new_tokens for s in self.seconds]

    def _tokens_per_s(self) -> list[float]:
        return [self.batch_size * self.new_tokens / s for s in self.seconds]

    @property
    def ms_per_token_median(self) -> float:
        return statistics.median(self._ms_per_token())

    @property
    def ms_per_token_min(self) -> float:
        return min(self._ms_per_token())

    @property
    def ms_per_token_max(self) -> float:
        return max(self._ms_per_token())

    @property
    def tokens_per_s_median(self) -> float:
        return statistics.median(self._tokens_per_s())

    @property
    def tokens_per_s_min(self) -> float:
        return min(self._tokens_per_s())

    @property
    def tokens_per_s_max(self) -> float:
        return max(self._tokens_per_s())


def make_prompts(tokens: torch.Tensor, batch_size: int, prompt_tokens: int) -> torch.Tensor:
    """``batch_size`` consecutive, distinct prompts of ``prompt_tokens`` tokens from ``tokens``."""
    need = batch_size * prompt_tokens
    if tokens.numel() < need:
        raise LabError(f"Need {need} tokens for {batch_size} prompts of {prompt_tokens}, have "
                       f"{tokens.numel()}; lower the batch or the prompt length.")
    return tokens[:need].view(batch_size, prompt_tokens).clone()


def time_decode(model: nn.Module, prompts: torch.Tensor, new_tokens: int, block_size: int,
                device: str | torch.device, warmup: int = 1, repeats: int = 5,
                clock: Callable[[], float] = time.perf_counter) -> DecodeTiming:
    """Time :func:`greedy_decode` of ``new_tokens`` tokens after ``prompts`` (B, T0) on ``device``.

    ``warmup`` untimed repetitions first (allocator, caches, lazy kernels, compilation),
    then ``repeats`` timed ones; the device is synchronized before starting and before
    stopping the clock of each repetition. Seconds per repetition.
    """
    check_positive_int(new_tokens, "new_tokens")
    check_positive_int(repeats, "repeats")
    dev = torch.device(device)
    p = prompts.to(dev)
    for _ in range(warmup):
        greedy_decode(model, p, new_tokens, block_size)
    timing = DecodeTiming(batch_size=int(p.shape[0]), new_tokens=new_tokens)
    for _ in range(repeats):
        synchronize(dev)
        t0 = clock()
        greedy_decode(model, p, new_tokens, block_size)
        synchronize(dev)
        timing.seconds.append(clock() - t0)
    return timing


# --------------------------------------------------------------------------- one row


@dataclass
class ModelUnderTest:
    """The fp32 model to quantize and the held-out text it is scored on."""

    model: nn.Module
    val_tokens: torch.Tensor          # 1-D int64
    block_size: int
    model_id: str                     # identifies the weights (e.g. checkpoint SHA-256 prefix)
    dataset: str | None = None
    synthetic: bool | None = None
    source: str = ""                  # where the weights came from, in words


def devices_to_run(settings: QuantSettings) -> list[str]:
    """``settings.devices``, or the CPU plus CUDA when a GPU is visible."""
    if settings.devices is not None:
        return list(settings.devices)
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row_config(mut: ModelUnderTest, variant: str, device: str, settings: QuantSettings) -> dict[str, Any]:
    """The stored configuration of one row: what it measured and with which stack."""
    cfg: dict[str, Any] = {"variant": variant, "device": device, "model_id": mut.model_id,
                           "settings": settings.measure_key(),
                           "stack": {"torch": torch.__version__, "torchao": torchao_version()}}
    if device == "cpu":
        cfg["cpu_threads"] = torch.get_num_threads()
    return cfg


def time_interleaved(models: dict[str, nn.Module], prompts: torch.Tensor, new_tokens: int, block_size: int,
                     device: str | torch.device, warmup: int = 1, repeats: int = 5,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, DecodeTiming | Exception]:
    """:func:`time_decode` for several models, their repetitions interleaved.

    Repetition ``r`` times every model once, in an order rotated by ``r``, so a change in
    machine load or clock speed during the measurement hits every model alike instead of
    whichever happened to be measured at the time (on a shared machine that matters more
    than the number of repetitions). ``warmup`` untimed repetitions per model come first.
    A model whose decoding raises gets the exception instead of a timing. Seconds.
    """
    check_positive_int(new_tokens, "new_tokens")
    check_positive_int(repeats, "repeats")
    dev = torch.device(device)
    p = prompts.to(dev)
    out: dict[str, DecodeTiming | Exception] = {}
    for name, m in models.items():
        try:
            for _ in range(warmup):
                greedy_decode(m, p, new_tokens, block_size)
            out[name] = DecodeTiming(batch_size=int(p.shape[0]), new_tokens=new_tokens)
        except Exception as e:  # reported in the row; the other models carry on
            out[name] = e.with_traceback(None)  # without the frames (and tensors) of the failed call
    names = [n for n in models if isinstance(out[n], DecodeTiming)]
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)] if names else []
        for name in order:
            timing = out[name]
            if not isinstance(timing, DecodeTiming):
                continue
            try:
                synchronize(dev)
                t0 = clock()
                greedy_decode(models[name], p, new_tokens, block_size)
                synchronize(dev)
                timing.seconds.append(clock() - t0)
            except Exception as e:
                out[name] = e.with_traceback(None)
    if any(isinstance(v, Exception) for v in out.values()):
        free_device_memory(dev)  # after the except blocks: what the failed calls held is gone
    return out


def _failure(rec, e: BaseException):
    """Mark ``rec`` as ``oom`` (:func:`lab_utils.core.memory.is_out_of_memory`) or ``error``, with
    the exception's first line. Frees nothing: callers free memory after their ``except``."""
    if is_out_of_memory(e):
        rec.status, rec.reason = "oom", oom_reason(e, limit=200)
    else:  # a kernel missing on this machine: the row says which error
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        rec.status, rec.reason = "error", f"{e.__class__.__name__}: {first}"
    return rec


def measure_device(mut: ModelUnderTest, variants: Sequence[str], device: str, settings: QuantSettings,
                   show_progress: bool = False) -> list:
    """Measure ``variants`` on ``device`` in one session; returns one :class:`Record` each.

    For each available variant: quantize a copy, measure its size, score it on the held-out
    tokens. Then time all of them together with :func:`time_interleaved`, at batch 1 and at
    the large batch. Unavailable variants give ``skipped`` records, failures ``error``/``oom``.
    """
    from lab_utils.core.hardware import hardware_summary
    from lab_utils.core.progress import progress
    from lab_utils.store import Record

    dev = torch.device(device)
    big = settings.cpu_large_batch if dev.type == "cpu" else settings.large_batch
    ctx = mean_context_tokens(settings.prompt_tokens, settings.new_tokens, mut.block_size)
    records: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    for variant in (progress(variants, desc=f"quantize+score ({device})") if show_progress else variants):
        avail = check_variant(variant, device, settings.disabled)
        info = VARIANT_INFO[variant]
        rec = Record(experiment=EXPERIMENT, config={}, dataset=mut.dataset, synthetic=mut.synthetic,
                     hardware=hardware_summary(device, 1),
                     metrics={"label": info.label, "method": info.method, "kernel": avail.kernel,
                              "note": avail.note})
        records[variant] = rec
        if not avail.ok:
            rec.status, rec.reason = "skipped", avail.reason
            continue
        model = None
        kept = float_layers(mut.model, variant, dev)
        if kept:
            rec.metrics["kept_in_float"] = kept
            rec.metrics["note"] = "; ".join(x for x in (float_layers_note(kept), avail.note) if x)
        try:
            model = quantize_model(mut.model, variant, dev)
            rec.metrics.update(size_bytes=serialized_size_bytes(model),
                               payload_bytes=payload_bytes(_state_dict(model)))
            if settings.compile:
                model = torch.compile(model)
            ev = evaluate_lm(model, mut.val_tokens, mut.block_size, settings.eval_batch_size, dev,
                             settings.eval_tokens)
        except Exception as e:  # out of memory or a missing kernel: the row says which
            _failure(rec, e)
        if rec.status != "ok":  # outside the except block, so the failed call's tensors can go
            model = None
            free_device_memory(dev)
            continue
        bpw = info.bytes_per_weight
        rec.metrics.update(val_loss=ev.loss, perplexity=ev.perplexity, eval_tokens=ev.tokens,
                           mean_context_tokens=ctx, large_batch=big,
                           weight_flops_per_byte_b1=weight_flops_per_byte(ctx, bpw),
                           weight_flops_per_byte_large=weight_flops_per_byte(big * ctx, bpw))
        models[variant] = model
    if models:
        s = settings
        t1, tb = (time_interleaved(models, make_prompts(mut.val_tokens, batch, s.prompt_tokens), s.new_tokens,
                                   mut.block_size, dev, s.warmup, s.repeats) for batch in (1, big))
        for variant in models:
            rec, a, b = records[variant], t1[variant], tb[variant]
            if isinstance(a, Exception) or isinstance(b, Exception):  # freed in time_interleaved
                _failure(rec, a if isinstance(a, Exception) else b)
                continue
            rec.metrics.update({
                "ms_per_token_b1": a.ms_per_token_median, "ms_per_token_b1_min": a.ms_per_token_min,
                "ms_per_token_b1_max": a.ms_per_token_max, "tokens_per_s_b1": a.tokens_per_s_median,
                "tokens_per_s_large": b.tokens_per_s_median, "tokens_per_s_large_min": b.tokens_per_s_min,
                "tokens_per_s_large_max": b.tokens_per_s_max, "seconds_b1": a.seconds,
                "seconds_large": b.seconds,
            })
    return [records[v] for v in variants]


def run_quantization(store, mut: ModelUnderTest, settings: QuantSettings, force: bool = False,
                     show_progress: bool | None = None) -> list:
    """Measure every (device, variant) of ``settings`` into ``store`` (experiment ``quantization``).

    Per device, when every available variant already has an ``ok`` row stored for the same
    configuration (same weights, knobs, torch/torchao versions, CPU threads) the stored
    rows are reused, unless ``force``. Otherwise *all* available variants of that device
    are measured again in one session (:func:`measure_device`), so that their timings are
    interleaved and every speedup compares rows measured side by side. Unavailable rows are
    re-checked on every call, so installing torchao later fills its row in.
    Returns the current record of every (device, variant), devices in order.
    """
    from lab_utils.core.hardware import hardware_summary
    from lab_utils.core.progress import headless

    settings.validate()
    show = (not headless()) if show_progress is None else show_progress
    out = []
    for device in devices_to_run(settings):
        cfgs = {v: row_config(mut, v, device, settings) for v in settings.variants}
        avail = {v: check_variant(v, device, settings.disabled) for v in settings.variants}
        here = hardware_summary(device, 1)  # reuse only rows measured on this machine's device
        stored = {v: store.reusable(EXPERIMENT, cfgs[v], here) for v in settings.variants}
        reuse = not force and all(stored[v] is not None and stored[v].status == "ok"
                                  for v in settings.variants if avail[v].ok)
        if reuse:
            for v in settings.variants:
                if avail[v].ok:
                    out.append(stored[v])
                else:
                    rec = measure_device(mut, [v], device, settings)[0]
                    rec.config = cfgs[v]
                    out.append(store.append(rec))
            continue
        for v, rec in zip(settings.variants, measure_device(mut, settings.variants, device, settings, show)):
            rec.config = cfgs[v]
            out.append(store.append(rec))
    return out


# --------------------------------------------------------------------------- table and figure


def quantization_table(records: Sequence) -> Any:
    """One row per (device, variant) with speedups and loss increase over fp32 on the same device.

    Columns: sizes in bytes and as a fraction of fp32's file, val loss, its increase over
    fp32 (nats per token), perplexity, batch-1 latency (median ms per token and min-max),
    throughput at the large batch (median tokens/s and min-max), both speedups, status,
    and a note (kernel, deprecation, or the reason a row was not measured).
    """
    import pandas as pd

    base: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.config.get("variant") == "fp32" and r.status == "ok":
            base[r.config["device"]] = r.metrics
    rows = []
    for r in records:
        m, dev = r.metrics, r.config.get("device")
        b = base.get(dev)
        ok = r.status == "ok"

        def ratio(num, den):
            return num / den if (num is not None and den) else None

        note = r.reason if not ok else "; ".join(x for x in (m.get("kernel"), m.get("note")) if x)
        rows.append({
            "device": dev,
            "variant": r.config.get("variant"),
            "method": m.get("method"),
            "size_bytes": m.get("size_bytes") if ok else None,
            "payload_bytes": m.get("payload_bytes") if ok else None,   # the tensors alone (Exercise 07-a)
            "size_vs_fp32": ratio(m.get("size_bytes"), b and b.get("size_bytes")) if ok else None,
            "val_loss": m.get("val_loss") if ok else None,
            "loss_increase": (m["val_loss"] - b["val_loss"]) if ok and b else None,
            "perplexity": m.get("perplexity") if ok else None,
            "ms_per_token_b1": m.get("ms_per_token_b1") if ok else None,
            "b1_min_max_ms": f"{m['ms_per_token_b1_min']:.3g}-{m['ms_per_token_b1_max']:.3g}" if ok else "",
            "speedup_b1": ratio(b and b.get("ms_per_token_b1"), m.get("ms_per_token_b1")) if ok else None,
            "large_batch": m.get("large_batch") if ok else None,
            "tokens_per_s_large": m.get("tokens_per_s_large") if ok else None,
            "large_min_max_tok_s": (f"{m['tokens_per_s_large_min']:.4g}-{m['tokens_per_s_large_max']:.4g}"
                                    if ok else ""),
            "speedup_large": (ratio(m.get("tokens_per_s_large"), b and b.get("tokens_per_s_large"))
                              if ok else None),
            "status": r.status,
            "note": note or "",
        })
    df = pd.DataFrame(rows)
    # Whole numbers stay whole in the Markdown/CSV (missing values as empty cells).
    for col in ("size_bytes", "payload_bytes", "large_batch"):
        df[col] = df[col].astype("Int64").astype(object).where(df[col].notna(), "")
    return df


def table_notes(records: Sequence, settings: QuantSettings, block_size: int) -> list[str]:
    """Notes under the table: what each timing means, with this run's knobs."""
    ctx = mean_context_tokens(settings.prompt_tokens, settings.new_tokens, block_size)
    reps = f"{settings.warmup} warm-up + {settings.repeats} timed repetitions, median and min-max"
    notes = [
        f"val_loss: mean next-token cross-entropy (nats/token) on the same {settings.eval_tokens or 'all'} "
        "held-out tokens for every row; perplexity = exp(val_loss); loss_increase is over fp32 on the same "
        "device.",
        "size_bytes: length of torch.save(state_dict); size_vs_fp32 against fp32's file; payload_bytes: "
        "the tensors' bytes alone, each storage once (the file adds its zip container: data.pkl, headers, "
        "padding).",
        f"ms_per_token_b1: greedy decoding of {settings.new_tokens} tokens after a "
        f"{settings.prompt_tokens}-token prompt at batch 1, wall time / tokens ({reps}; device "
        "synchronized).",
        "tokens_per_s_large: the same decoding at the large batch (column large_batch): "
        "batch x tokens / time.",
        f"No KV cache: each step re-reads the whole context (mean {ctx:.1f} tokens), so a batch-B step "
        f"multiplies each weight by B x {ctx:.1f} rows.",
        "speedups are over fp32 on the same device and the same settings; a row without numbers says why.",
    ]
    if settings.compile:
        notes.append("Every row, fp32 included, ran under torch.compile (compile time is in the warm-up).")
    return notes


def plot_quality_vs_speed(df):
    """Two panels: perplexity against batch-1 latency and against large-batch throughput."""
    import matplotlib.pyplot as plt

    ok = df[df["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"cpu": "o", "cuda": "s"}
    for (dev, variant), g in ok.groupby(["device", "variant"], sort=False):
        for ax, col in zip(axes, ("ms_per_token_b1", "tokens_per_s_large")):
            x, y = float(g[col].iloc[0]), float(g["perplexity"].iloc[0])
            ax.scatter([x], [y], marker=markers.get(dev, "^"), s=50)
            ax.annotate(f"{variant} ({dev})", (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    axes[0].set_xlabel("latency at batch 1 (ms per generated token, median; lower is better)")
    big = ", ".join(sorted({str(v) for v in ok["large_batch"]})) if len(ok) else "?"
    axes[1].set_xlabel(f"throughput at batch {big} (tokens/s, median; higher is better)")
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    for ax in axes:
        ax.set_ylabel("validation perplexity (lower is better)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
    fig.suptitle("Quality against speed of each int8 / bf16 variant (o: CPU, s: GPU)")
    fig.tight_layout()
    return fig


def availability_frame(settings: QuantSettings):
    """What this stack offers: one row per (device, variant) with kernel, note or reason."""
    import pandas as pd

    rows = []
    for device in devices_to_run(settings):
        for variant in settings.variants:
            a = check_variant(variant, device, settings.disabled)
            rows.append({"device": device, "variant": variant, "method": VARIANT_INFO[variant].method,
                         "available": a.ok, "kernel / reason": a.kernel if a.ok else a.reason,
                         "note": a.note or ""})
    return pd.DataFrame(rows)


def intensity_frame(settings: QuantSettings, block_size: int):
    """Weight arithmetic intensity (FLOP per weight byte) of one decoding step, per storage format.

    Rows: batch 1 and the large batches of the CPU and the GPU; columns: fp32, bf16, int8.
    Uses the mean context of the timed decoding (no KV cache).
    """
    import pandas as pd

    ctx = mean_context_tokens(settings.prompt_tokens, settings.new_tokens, block_size)
    rows = []
    for what, batch in (("batch 1", 1), ("large batch, CPU", settings.cpu_large_batch),
                        ("large batch, GPU", settings.large_batch)):
        rows.append({"decoding step": what, "batch": batch, "rows per matmul": batch * ctx,
                     **{f"{fmt} FLOP/byte": weight_flops_per_byte(batch * ctx, b)
                        for fmt, b in (("fp32", 4), ("bf16", 2), ("int8", 1))}})
    return pd.DataFrame(rows)


def _fmt_x(v: float) -> str:
    return f"{v:.2f}x"


def findings(records: Sequence) -> list[str]:
    """Sentences that state what *these* measurements show (nothing is asserted unmeasured).

    Per device: each variant's size, loss increase and both speedups; the two int8
    *dynamic* implementations side by side (the same arithmetic, different kernels);
    the same variant on CPU and GPU; and a warning when repetitions varied a lot.
    """
    df = quantization_table(records)
    ok = df[df["status"] == "ok"]
    out: list[str] = []
    for dev, sub in ok.groupby("device", sort=False):
        if "fp32" not in set(sub["variant"]):
            out.append(f"On {dev} the fp32 baseline was not measured, so no speedups are stated.")
            continue
        for _, r in sub[sub["variant"] != "fp32"].iterrows():
            out.append(f"On {dev}, {r['variant']}: file {_fmt_x(r['size_vs_fp32'])} of fp32's, val loss "
                       f"{r['loss_increase']:+.4f} nats/token, batch-1 decoding {_fmt_x(r['speedup_b1'])} "
                       f"fp32's speed, batch-{r['large_batch']} throughput {_fmt_x(r['speedup_large'])}.")
        dyn = sub[sub["method"] == "dynamic"]
        if len(dyn) >= 2:
            parts = [f"{r['variant']} {_fmt_x(r['speedup_large'])} (batch {r['large_batch']}) and "
                     f"{_fmt_x(r['speedup_b1'])} (batch 1)" for _, r in dyn.iterrows()]
            faster = (dyn["speedup_large"] > 1).any() and (dyn["speedup_large"] < 1).any()
            out.append(f"Same scheme, different kernels, on {dev}: int8 dynamic activation + int8 weight "
                       "ran at " + "; ".join(parts) + " of fp32's speed"
                       + (": one implementation beats fp32, the other loses to it." if faster else "."))
    for variant, sub in ok.groupby("variant", sort=False):
        if variant != "fp32" and sub["device"].nunique() > 1:
            parts = [f"{_fmt_x(r['speedup_b1'])} at batch 1 and {_fmt_x(r['speedup_large'])} at batch "
                     f"{r['large_batch']} on {r['device']}" for _, r in sub.iterrows()]
            out.append(f"{variant} across devices: " + "; ".join(parts) + ".")
    spreads = []
    for r in records:
        if r.status == "ok" and r.metrics.get("ms_per_token_b1_min"):
            spreads.append(r.metrics["ms_per_token_b1_max"] / r.metrics["ms_per_token_b1_min"])
    if spreads and max(spreads) > 1.5:
        out.append(f"Repetitions varied by up to {max(spreads):.1f}x (slowest / fastest at batch 1): the "
                   "machine was busy or clocks changed; trust only differences well beyond that spread, and "
                   "re-run on an idle machine before drawing conclusions.")
    if not out:
        out.append("No variant was measured successfully; the table says why for each row.")
    return out


# --------------------------------------------------------------------------- the GPT to quantize


def file_sha256(path: str | Path, prefix: int = 16) -> str:
    """The first ``prefix`` hex digits of a file's SHA-256 (identifies the weights measured)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:prefix]


def corpus_kind(name: str) -> str:
    """The ``corpus=`` choice of :mod:`lab_utils.core.text_data` that produces the corpus ``name``."""
    if name == "tiny-shakespeare":
        return "shakespeare"
    if name.startswith("python-stdlib"):
        return "stdlib"
    raise LabError(f"Unknown corpus {name!r} in the checkpoint; re-run notebook 06 to write a fresh one.")


def held_out_tokens(payload: dict[str, Any]) -> tuple[torch.Tensor, str, bool, int]:
    """The validation text of the checkpoint's corpus, encoded with the checkpoint's vocabulary.

    The corpus is cut to ``metrics["max_chars"]`` when the checkpoint records it (the
    exact split it trained on), else taken whole: its last 10 % lies after any prefix's
    first 90 %, so it is held out either way. Characters absent from the vocabulary are
    dropped (counted). Returns ``(tokens, corpus name, synthetic, dropped characters)``.
    """
    from lab_utils.core.text_data import TRAIN_FRACTION, CharVocab, load_corpus

    max_chars = (payload.get("metrics") or {}).get("max_chars")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stand-in warning: the provenance label says it
        corpus = load_corpus(corpus_kind(payload["corpus"]), max_chars=max_chars)
    text = corpus.text[int(TRAIN_FRACTION * len(corpus.text)):]
    vocab = CharVocab(payload["vocab"])
    allowed = set(vocab.chars)
    kept = "".join(ch for ch in text if ch in allowed)
    return vocab.encode(kept), corpus.name, corpus.synthetic, len(text) - len(kept)


def fallback_checkpoint_path(profile: str) -> Path:
    """Where notebook 07 keeps the GPT it trains itself when notebook 06's checkpoint is absent."""
    from lab_utils.core import config

    return config.results_dir(profile) / "checkpoints" / "gpt_trained_in_07.pt"


def train_fallback(path: Path, settings: QuantSettings, device: str = "auto") -> Path:
    """Train the settings' fallback GPT briefly (one process) and save it to ``path``."""
    from lab_utils.workers.gpt_train import TrainConfig, run_training

    cfg = TrainConfig(size=settings.fallback_size, batch_size=settings.fallback_batch_size,
                      epochs=1, max_steps=settings.fallback_steps, steps_per_epoch=settings.fallback_steps,
                      max_chars=settings.fallback_max_chars, val_batches=4, probe_steps=0, device=device,
                      save=str(path))
    records = run_training(cfg)
    summary = records[-1]
    if summary.get("status") != "ok" or not Path(path).exists():
        raise LabError(f"Training the fallback GPT failed ({summary.get('reason')}); run notebook 06 first "
                       "so that its checkpoint exists.")
    return Path(path)


def load_model_under_test(profile: str, settings: QuantSettings, checkpoint: str | Path | None = None,
                          train_if_missing: bool = True) -> ModelUnderTest:
    """Notebook 06's GPT (``results/<profile>/checkpoints/gpt.pt``), or one trained here.

    ``checkpoint`` overrides the path. When the file is absent and ``train_if_missing``,
    the fallback GPT of ``settings`` is trained briefly (and kept, so a re-run reuses it);
    :attr:`ModelUnderTest.source` says which happened.
    """
    from lab_utils.models.gpt import checkpoint_path, load_checkpoint

    path = Path(checkpoint) if checkpoint is not None else checkpoint_path(profile)
    if path.exists():
        source = f"notebook 06's checkpoint {path}"
    elif checkpoint is not None:
        raise LabError(f"No checkpoint at {path}; give the path notebook 06 printed, or checkpoint=None.")
    else:
        fb = fallback_checkpoint_path(profile)
        if fb.exists():
            source = f"no checkpoint from notebook 06 at {path}: using the GPT trained here before ({fb})"
        elif train_if_missing:
            t0 = time.perf_counter()
            train_fallback(fb, settings)
            source = (f"no checkpoint from notebook 06 at {path}: trained the '{settings.fallback_size}' GPT "
                      f"here for {settings.fallback_steps} steps ({time.perf_counter() - t0:.0f} s), "
                      f"saved to {fb}")
        else:
            raise LabError(f"No checkpoint at {path}; run notebook 06 first (or allow training here).")
        path = fb
    model, payload = load_checkpoint(path, "cpu")
    model = model.float().eval()
    tokens, corpus, synthetic, dropped = held_out_tokens(payload)
    if dropped:
        source += f"; {dropped} held-out characters outside the model's vocabulary were dropped"
    return ModelUnderTest(model=model, val_tokens=tokens, block_size=model.config.block_size,
                          model_id=file_sha256(path), dataset=corpus, synthetic=synthetic, source=source)


def describe(mut: ModelUnderTest) -> dict[str, Any]:
    """A small summary of the model under test for the notebook to print."""
    n = sum(p.numel() for p in mut.model.parameters())
    cfg = getattr(mut.model, "config", None)
    return {"source": mut.source, "parameters": n, "config": asdict(cfg) if cfg is not None else None,
            "held_out_tokens": int(mut.val_tokens.numel()), "dataset": mut.dataset,
            "synthetic": mut.synthetic,
            "cpu_threads": torch.get_num_threads(), "torchao": torchao_version(), "torch": torch.__version__,
            "quantized_engine": torch.backends.quantized.engine, "cpu_native_bf16": cpu_has_native_bf16()}
