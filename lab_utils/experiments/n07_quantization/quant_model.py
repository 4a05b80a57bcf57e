"""How a variant of notebook 07 is made and sized: :func:`quantize_model` (a quantized copy of the
model; Linear layers torchao's int8 kernels cannot take are kept in float, :func:`float_layers`),
:func:`payload_bytes` (bytes of the tensor storages) and :func:`serialized_size_bytes` (bytes of
``torch.save``). Which variants can run here: :mod:`lab_utils.experiments.n07_quantization.quant_variants`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import io
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lab_utils.experiments.n07_quantization.quant_variants import (
    INT_MM_MIN_ROWS,
    check_variant,
    torchao_parts,
)
from lab_utils.learn.errors import LabError

#: torchao's int8 x int8 matmul on CUDA (``torchao.kernel.intmm.safe_int_mm``, used by
#: ``Int8DynamicActivationInt8WeightConfig`` through ``int_scaled_matmul``, torchao 0.18)
#: takes the cuBLAS ``torch._int_mm`` path only when K (``in_features``) and N
#: (``out_features``) are non-zero multiples of this; otherwise it copies both operands to
#: the CPU, multiplies them there in int32 and copies the result back, on every call.
#: The weight-only variant casts the int8 weight to the activation dtype and runs a float
#: matmul (no ``_int_mm``), and on the CPU ``_int_mm`` takes any shape, so neither needs this.
_INT8_MM_MULTIPLE = 8


def int8_mm_shape_problem(in_features: int, out_features: int) -> str | None:
    """Why a Linear of this shape cannot use torchao's cuBLAS int8 matmul, or ``None`` when it can.

    >>> int8_mm_shape_problem(384, 65)
    '(N=65) kept in fp32: int8 mm needs N % 8 == 0'
    """
    bad = [(dim, v) for dim, v in (("K", in_features), ("N", out_features))
           if v <= 0 or v % _INT8_MM_MULTIPLE]
    if not bad:
        return None
    shape = ", ".join(f"{dim}={v}" for dim, v in bad)
    need = " and ".join(f"{dim} % {_INT8_MM_MULTIPLE} == 0" for dim, _ in bad)
    return f"({shape}) kept in fp32: int8 mm needs {need}"


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
    tq, cls = torchao_parts(variant)
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


def _leaf_tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Plain tensors inside a state dict: tensor subclasses are opened up, containers walked."""
    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            for n in names:
                yield from _leaf_tensors(getattr(obj, n))
        else:
            yield obj
    elif isinstance(obj, dict | list | tuple):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _leaf_tensors(v)


def payload_bytes(state: Any) -> int:
    """Bytes of the distinct tensor storages in ``state`` (a state dict, or any nesting, or a model).

    A storage shared by several entries (tied weights) counts once, and a view counts its
    whole storage, as ``torch.save`` writes them. Quantized and torchao tensors count their
    int8 data, scales and zero points. Bytes.
    """
    if isinstance(state, nn.Module):  # a model (compiled or not): its state dict
        state = _state_dict(state)
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


def _serialized_state_dict(model: nn.Module) -> bytes:
    """The bytes of ``torch.save(model.state_dict())`` written to an in-memory buffer.

    (``torch.save`` to a *path* names the archive's top folder after the file, so its size
    varies by a few bytes with the file name; writing these bytes instead keeps the file
    and the count identical.)
    """
    buf = io.BytesIO()
    torch.save(_state_dict(model), buf)
    return buf.getvalue()


def serialized_size_bytes(model: nn.Module) -> int:
    """Length in bytes of :func:`_serialized_state_dict` (what a checkpoint file holds)."""
    return len(_serialized_state_dict(model))


def save_state_dict(model: nn.Module, path: str | Path) -> int:
    """Write :func:`_serialized_state_dict` to ``path`` (atomically); returns the file's size in bytes.

    The file loads back with ``torch.load`` like any ``torch.save`` file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(_serialized_state_dict(model))
    os.replace(tmp, path)
    return path.stat().st_size
