"""The quantization variants of notebook 07 and whether each can run here (module, class, kernel,
device): :func:`check_variant` never raises for a missing path, its :class:`Availability` says why.
How a variant is made and sized: :mod:`lab_utils.experiments.n07_quantization.quant_model`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lab_utils.engine.hardware import bf16_supported
from lab_utils.learn.errors import check_choice, error_line, first_line

#: torchao configuration class of each torchao variant (looked up by name at run time).
TORCHAO_CONFIGS = {
    "torchao_int8_weight_only": "Int8WeightOnlyConfig",
    "torchao_int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
}


@dataclass(frozen=True)
class _VariantInfo:
    """How a variant stores weights and what it does to activations."""

    label: str
    method: str             # "float", "weight-only", "dynamic"
    bytes_per_weight: int   # bytes per Linear weight element as stored (scales not counted)
    arithmetic: str         # what the matmul multiplies in: weight-only dequantizes to the fp32 activations


VARIANT_INFO: dict[str, _VariantInfo] = {
    "fp32": _VariantInfo("fp32 (baseline)", "float", 4, "fp32"),
    "bf16": _VariantInfo("bf16", "float", 2, "bf16"),
    "ao_dynamic_int8": _VariantInfo("int8 dynamic, torch.ao quantize_dynamic", "dynamic", 1, "int8"),
    "torchao_int8_weight_only": _VariantInfo("int8 weight-only, torchao Int8WeightOnlyConfig",
                                            "weight-only", 1, "fp32"),
    "torchao_int8_dynamic": _VariantInfo("int8 dynamic act. + int8 weight, torchao "
                                        "Int8DynamicActivationInt8WeightConfig", "dynamic", 1, "int8"),
}
VARIANTS: tuple[str, ...] = tuple(VARIANT_INFO)


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
    """The installed torchao's version, ``None`` without one (or with its import blocked).

    Read from the package's metadata, as torchao's own ``__version__`` is, not by importing it: the
    import loads ``torch._dynamo`` (about 2.8 s of CPU), and notebook 07's plan, which every notebook's
    time-budget cell builds, puts the version in its store key.
    """
    if "torchao" in sys.modules and sys.modules["torchao"] is None:  # blocked, as a missing module is
        return None
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


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
            return Availability(False, f"quantize_dynamic fails here: {error_line(e, 160)}")
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)
           or "deprecated" in str(w.message).lower()]
    note = None
    if dep:
        note = f"deprecated upstream: torch {torch.__version__} warns '{first_line(dep[0].message, 120)}'"
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
            if not bf16_supported("cuda"):  # not counting emulation: a V100 emulates bf16, slowly
                return Availability(False, f"{torch.cuda.get_device_name()} has no native bf16 "
                                           "(needs compute capability 8.0+; emulated bf16 is not measured)")
            return Availability(True, kernel="cuBLAS bf16 GEMM (tensor cores)")
        try:
            torch.ones(4, 4, dtype=torch.bfloat16) @ torch.ones(4, 4, dtype=torch.bfloat16)
        except RuntimeError as e:
            return Availability(False, f"bf16 matmul fails on this CPU build: {first_line(e, 120)}")
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
        failed = int_mm_probe(device)
        if failed is None:
            kernel = (f"torchao {ver} Int8Tensor, eager: int8 x int8 -> int32 via torch._int_mm (cuBLAS); "
                      f"{_INT_MM_PAD_NOTE}")
        else:
            kernel = (f"torchao {ver} Int8Tensor, eager: torch._int_mm fails on this GPU ({failed}), so "
                      "torchao's safe_int_mm multiplies in fp32: int8 weights, fp32 arithmetic")
    else:
        kernel = f"torchao {ver} Int8Tensor, eager: int8 x int8 -> int32 via its decomposed CPU path"
    return Availability(True, kernel=kernel)


#: ``torch._int_mm`` on CUDA needs more than 16 rows in its first operand (M > 16); with
#: fewer, torchao's ``safe_int_mm`` catches the error and multiplies in fp32 instead, while
#: the row would claim cuBLAS int8. Decoding at batch 1 after a short prompt has M <= 16.
INT_MM_MIN_ROWS = 17


#: ``torch._int_mm`` probed once per device: None when it multiplied exactly, else its error.
_INT_MM_PROBES: dict[str, str | None] = {}


def _int8_operands(device: str, k: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A 17 x k and a k x k int8 matrix (17 rows: what every int8 matmul is padded to), on ``device``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 8, (INT_MM_MIN_ROWS, k), dtype=torch.int8, generator=g)
    b = torch.randint(-8, 8, (k, k), dtype=torch.int8, generator=g)
    return a.to(device), b.to(device)


def int_mm_probe(device: str) -> str | None:
    """Whether ``torch._int_mm`` (cuBLAS int8) runs on ``device``: None when it gives the exact int32
    product, else why not (its error's first line), probed once per device. torchao's ``safe_int_mm``
    catches ANY ``_int_mm`` error and multiplies in fp32, so without this probe a row would claim int8
    arithmetic that never ran."""
    key = str(torch.device(device))
    if key not in _INT_MM_PROBES:
        try:
            a, b = _int8_operands(device)
            exact = torch.equal(torch._int_mm(a, b).cpu(), a.cpu().int() @ b.cpu().int())
            _INT_MM_PROBES[key] = None if exact else "it computed a wrong product"
        except Exception as e:  # the row says what ran instead
            _INT_MM_PROBES[key] = error_line(e, 120)
    return _INT_MM_PROBES[key]


_INT_MM_PAD_NOTE = (f"matmuls of <= 16 rows (batch-1 decoding) padded to {INT_MM_MIN_ROWS} rows, as "
                   "torch._int_mm needs M > 16 (else torchao silently falls back to fp32)")


def torchao_parts(variant: str):
    """``(torchao.quantization, the configuration class of variant)``, for a torchao variant that
    :func:`check_variant` found available
    (:func:`~lab_utils.experiments.n07_quantization.quant_model.quantize_model` checks)."""
    with _quiet_torchao_import():
        tq = importlib.import_module("torchao.quantization")
    return tq, getattr(tq, TORCHAO_CONFIGS[variant])
