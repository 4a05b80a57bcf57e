"""Notebook 07's quality and speed measurements of one model: :func:`evaluate_lm` (mean next-token
cross-entropy on held-out tokens, through the lab's one evaluation pass), :func:`greedy_decode`,
:func:`time_interleaved` (synchronized wall-clock decoding, repetitions of
several models interleaved) and the arithmetic intensity of a decoding step
(:func:`weight_flops_per_byte`). Seconds; losses in nats per token.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lab_utils.engine.hardware import peak_flops_per_s
from lab_utils.engine.memory import free_device_memory
from lab_utils.learn.errors import LabError
from lab_utils.learn.evaluation import evaluate
from lab_utils.learn.timing import synchronize


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


#: The roofline's reference GPU, an H100 SXM: HBM3 bandwidth (data sheet, 3.35 TB/s) and the dense int8
#: tensor-core peak (1,979 TOPS; 3,958 with sparsity); fp32 and bf16 peaks from lab_utils.engine.hardware.
H100_SXM = "NVIDIA H100 80GB HBM3"
H100_SXM_BYTES_PER_S = 3.35e12
H100_SXM_INT8_OPS_PER_S = 1979e12


def ridge_flops_per_byte(arithmetic: str) -> float:
    """The reference H100 SXM's ridge P / B for matmuls in ``arithmetic`` (``fp32``: 67e12 / 3.35e12 = 20,
    ``bf16``: 295, ``int8``: 591 FLOP/byte): a step whose intensity is above it is compute-bound there, below
    it memory-bound. Each precision has its own P, so its own ridge."""
    peak = H100_SXM_INT8_OPS_PER_S if arithmetic == "int8" else peak_flops_per_s(H100_SXM, arithmetic)
    if peak is None:
        raise LabError(f"No H100 SXM peak for {arithmetic!r} arithmetic; use fp32, bf16 or int8.")
    return peak / H100_SXM_BYTES_PER_S


@dataclass
class DecodeTiming:
    """Timed greedy decoding. ``seconds``: one entry per timed repetition (wall clock,
    synchronized, includes every forward pass, argmax and concatenation of the repetition)."""

    batch_size: int
    new_tokens: int
    seconds: list[float] = field(default_factory=list)

    @property
    def ms_per_token(self) -> list[float]:
        """Milliseconds per generated token, one per repetition."""
        return [s * 1000.0 / self.new_tokens for s in self.seconds]

    @property
    def tokens_per_s(self) -> list[float]:
        """Tokens generated per second over the whole batch, one per repetition."""
        return [self.batch_size * self.new_tokens / s for s in self.seconds]


def median_min_max(name: str, values: list[float]) -> dict[str, float]:
    """``{name: median, name_min: min, name_max: max}`` of ``values`` (repetitions)."""
    return {name: statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}


def make_prompts(tokens: torch.Tensor, batch_size: int, prompt_tokens: int) -> torch.Tensor:
    """``batch_size`` consecutive, distinct prompts of ``prompt_tokens`` tokens from ``tokens``."""
    need = batch_size * prompt_tokens
    if tokens.numel() < need:
        raise LabError(f"Need {need} tokens for {batch_size} prompts of {prompt_tokens}, have "
                       f"{tokens.numel()}; lower the batch or the prompt length.")
    return tokens[:need].view(batch_size, prompt_tokens).clone()


def time_interleaved(models: dict[str, nn.Module], prompts: torch.Tensor, new_tokens: int, block_size: int,
                     device: str | torch.device, warmup: int = 1, repeats: int = 5,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, DecodeTiming | Exception]:
    """Time :func:`greedy_decode` of ``new_tokens`` tokens after ``prompts`` (B, T0) for several models on
    ``device``, their repetitions interleaved. Seconds per repetition.

    ``warmup`` untimed repetitions per model first (allocator, caches, lazy kernels, compilation).
    The device is synchronized before starting and before stopping the clock of each repetition.
    Repetition ``r`` times every model once, in an order rotated by ``r``, so a change in
    machine load or clock speed during the measurement hits every model alike instead of whichever
    happened to be measured at the time (on a shared machine that matters more than the number of
    repetitions). A model whose decoding raises gets the exception instead of a timing.
    """
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
