"""A oneDNN defect on AVX2 CPUs that the lab steps around, and how.

On the CPU, PyTorch runs convolutions with oneDNN. Its AVX2 kernel for the *weight
gradient* of a 1x1 convolution (``jit_1x1:avx2``, ``backward_weights``) mishandles one
case: a channels-last (NHWC) input, a stride above 1, and fewer input channels than the
kernel's channel block (8 float32 values, one AVX2 register). The kernel first copies
the strided input into a dense workspace ("reduce to unit stride") and writes past the
end of it. What follows depends on what that memory held: the step never returns (both
OpenMP threads spin), the process crashes, or the weight gradients are silently wrong
(errors of 100x the gradient were seen). Reported upstream as uxlfoundation/oneDNN#6035
(open as of this writing). CPUs with AVX-512 take another kernel and are not affected;
the same gradients there match a float64 reference (checked while writing this).

The lab hits it with a narrow ResNet-18 (``width`` below 8: its strided 1x1 shortcuts then have
2 or 4 input channels) trained channels-last on a CPU (the fast path's ``channels_last`` step, or
``torch.compile``, whose CPU backend may choose channels-last). Reproduce it on any x86 CPU:
``ONEDNN_MAX_CPU_ISA=AVX2 python -m lab_utils bench train --profile quick --compile --width 2
--images 48 --batch-size 32 --steps spec,compile``.

The workaround: a 1x1 convolution with stride s and no padding equals a stride-1 1x1 convolution
of ``x[:, :, ::s, ::s]``, so :func:`apply_workaround` sets the stride to 1 and adds a forward
pre-hook taking that slice: same weights, outputs and gradients, no faulty kernel, and it survives
``torch.compile`` (switching oneDNN off does not: compiled graphs expect oneDNN's layouts). The
row of a model changed this way says so (:func:`apply_workaround` returns the sentence).
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN's AVX2 convolution kernels block channels by 8 float32 values (one 256-bit register).
AVX2_CHANNEL_BLOCK = 8
UPSTREAM_REPORT = "uxlfoundation/oneDNN#6035"


def affected_convs(model: nn.Module) -> list[str]:
    """Names of the model's convolutions the defect can hit: 1x1, stride > 1, < 8 input channels,
    unpadded (as all the lab's are: for those the workaround is exact)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and max(m.stride) > 1
            and m.padding in ((0, 0), "valid") and m.in_channels // m.groups < AVX2_CHANNEL_BLOCK]


def _subsample(stride: tuple[int, int]):
    """A forward pre-hook: the input rows and columns a 1x1 convolution of ``stride`` reads."""
    sh, sw = stride

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0][:, :, ::sh, ::sw],) + tuple(args[1:])

    return hook


def apply_workaround(model: nn.Module, device: torch.device | str, channels_last_possible: bool
                     ) -> str | None:
    """Rewrite ``model``'s affected convolutions (see the module docstring); return why, or ``None`` (left
    as it is: a GPU, channels-first eager training, no affected convolution). ``channels_last_possible``:
    trained channels-last, or compiled (whose CPU backend may choose channels-last by itself)."""
    on_onednn = torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
    if not on_onednn or not channels_last_possible:
        return None
    names = affected_convs(model)
    modules = dict(model.named_modules())
    for name in names:
        conv = modules[name]
        conv.register_forward_pre_hook(_subsample(tuple(conv.stride)))
        conv.stride = (1, 1)
    if not names:
        return None
    first = modules[names[0]]
    return (f"{len(names)} strided 1x1 convolution(s) with fewer than {AVX2_CHANNEL_BLOCK} input channels "
            f"(e.g. {names[0]}: {first.in_channels} -> {first.out_channels}) run as a subsample and a "
            f"stride-1 1x1 convolution (same result), because oneDNN's AVX2 kernel for their weight "
            f"gradient in channels-last hangs or computes wrong gradients ({UPSTREAM_REPORT})")
